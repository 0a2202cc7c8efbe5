"""minitrain: how large language models are trained efficiently, built from scratch.

One module per technique; each notebook in ``notebooks/`` teaches one of them.
Modules are imported on demand (``from minitrain.runtime import launch``) so that
importing the package stays cheap in every worker process.
"""

__version__ = "0.1.0"
