"""Interactive figures for lectures: one module per chapter (``chNN_<topic>.py``).

Each widget is two parts: a pure ``compute_*``/``measure_*`` function that produces
what is shown (unit tested), and a ``build_*_widget()`` that wires ipywidgets
controls to it and re-draws on every change. They plot real measurements or exact
models, never drawings.
"""

import io


def offscreen_pyplot():
    """``matplotlib.pyplot``, drawing with Agg when no backend was chosen yet (a widget's
    callback may run before the notebook's first plot, and must not open a window)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def figure_png(fig, dpi: int = 80) -> bytes:
    """``fig`` as PNG bytes, then closed. Widgets show these in an ``ipywidgets.Image``:
    replacing its value re-draws in place, without the flicker of clearing an Output area."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    offscreen_pyplot().close(fig)
    return buf.getvalue()
