"""Notebook helpers: re-execute the committed notebooks, and show an exercise without its answer.

``python -m minitrain.course.notebooks run [paths...]``: notebooks are committed *with* their
outputs, and ``make test`` checks with nbval that re-running each one reproduces them. After
changing a notebook (or the code it shows), re-execute it in place, then commit it.

``exercise_stub(fn)``: what a notebook prints where it introduces an exercise — the signature,
docstring and hints a learner's file holds, never the solution
(tests/test_notebooks_show_no_answers.py checks every notebook for answers).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from minitrain.course.exercises import exercises_of

ROOT = Path(__file__).resolve().parents[2]  # the course repository
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def exercise_stub(fn) -> str:
    """The exercise ``fn`` as the learner's file holds it: signature, docstring, hints and
    ``raise NotImplementedError`` in place of the answer."""
    module = sys.modules[fn.__module__]
    for ex in exercises_of(module):
        if ex.qualname == fn.__qualname__:
            return ex.stub
    raise ValueError(f"{fn.__module__}.{fn.__qualname__} is not an exercise (no solution markers)")


def execute(path: Path, timeout: int = 600) -> float:
    """Execute a notebook in place from its own folder; return the seconds it took."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # no OpenMP banner from torchrun cells
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    t0 = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - t0
    for cell in nb.cells:  # execution timestamps would make every run a diff
        cell.get("metadata", {}).pop("execution", None)
    # what JupyterLab itself writes: opening the notebook then leaves it unmodified
    nb.metadata["kernelspec"] = KERNELSPEC
    nbformat.write(nb, path)
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minitrain.course.notebooks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute notebooks in place (default: all of notebooks/)")
    run.add_argument("paths", nargs="*", type=Path)
    args = parser.parse_args(argv)
    paths = args.paths or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        print(f"executing {path} ...", flush=True)
        print(f"  done in {execute(path.resolve()):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
