"""Interactive figures for lectures: one module per chapter (``chNN_<topic>.py``).

Each widget is two parts: a pure ``compute_*``/``measure_*`` function that produces
what is shown (unit tested), and a ``build_*_widget()`` that wires ipywidgets
controls to it and re-draws on every change. They plot real measurements or exact
models, never drawings.

Every builder is made the same way: an ``ipywidgets.HTML`` for the numbers, an
``ipywidgets.Image`` for the picture (``plot_png``: a figure drawn off screen, as PNG
bytes), and ``live(controls, render)`` to re-render when a control moves. An Image is
replaced in place, so a re-plot does not flicker as clearing an ``Output`` area does,
it needs no inline matplotlib backend in the kernel, and a test can read what it shows.
"""

import io


def live(controls, render, *, now: bool = True):
    """Call ``render()`` whenever the ``value`` of any of ``controls`` changes, and once now
    (``now=False``: only on changes, for controls added after the first render).

    The one place a widget connects its controls to what it shows; returns ``render``."""
    for control in controls:
        control.observe(lambda _change: render(), names="value")
    if now:
        render()
    return render


def figure_png(fig, dpi: int = 80) -> bytes:
    """``fig`` as PNG bytes: what a widget's ``ipywidgets.Image`` shows (replacing its value
    re-draws in place, without the flicker of clearing an Output area)."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def offscreen_figure(figsize):
    """A figure of ``figsize`` inches drawn off screen: matplotlib's ``Figure`` itself, not
    pyplot's, so a widget never opens a window nor switches the notebook's own backend
    (``matplotlib.use("Agg")`` would, and later cells' plots would no longer show)."""
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def plot_png(draw, figsize, dpi: int = 80, **subplots) -> bytes:
    """An ``offscreen_figure`` with ``subplots(**subplots)``'s axes, filled by ``draw(axes)``,
    as PNG bytes (``figure_png``)."""
    fig = offscreen_figure(figsize)
    draw(fig.subplots(**subplots))
    return figure_png(fig, dpi)
