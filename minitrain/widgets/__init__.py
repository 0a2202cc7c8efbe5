"""Interactive figures for lectures: one module per chapter (``chNN_<topic>.py``).

Each widget is two parts: a pure ``compute_*``/``measure_*`` function that produces
what is shown (unit tested), and a ``build_*_widget()`` that wires ipywidgets
controls to it and re-draws on every change. They plot real measurements or exact
models, never drawings.
"""
