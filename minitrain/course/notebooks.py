"""Notebook helpers: re-execute the committed notebooks, and show an exercise without its answer.

``python -m minitrain.course.notebooks run [paths...]``: notebooks are committed *with* their
outputs, and ``make test`` checks with nbval that re-running each one reproduces them. After
changing a notebook (or the code it shows), re-execute it in place, then commit it.

``python -m minitrain.course.notebooks slides [paths...]``: mark every notebook up for lecture
mode (standard ``{"slideshow": {"slide_type": ...}}`` cell metadata, read by RISE) from its
structure — idempotent, so it is re-run after adding or editing a notebook.

``python -m minitrain.course.notebooks lecture 04``: present a notebook as slides with its widgets
live (Voilà's reveal.js template: it runs the notebook in a kernel, then shows the slides with
every widget connected; ``make lecture NB=04``).

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


# an author's own choice for a cell ("skip" a set-up cell, speaker "notes") is kept
KEPT_SLIDE_TYPES = ("skip", "notes")


def slide_type(cell: dict, index: int) -> str:
    """Where a cell goes in lecture mode, from the notebook's structure: the title cell and each
    ``##`` section start a slide, a ``###`` heading a sub-slide (RISE: down), other prose appears
    as a fragment of the current slide, and code (with its output: the measurement, the widget)
    stays with the prose above it."""
    kept = cell.get("metadata", {}).get("slideshow", {}).get("slide_type")
    if kept in KEPT_SLIDE_TYPES:
        return kept
    if index == 0:
        return "slide"
    if cell["cell_type"] != "markdown":
        return "-"
    source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    first = source.lstrip().split("\n", 1)[0]
    if first.startswith(("# ", "## ")):
        return "slide"
    if first.startswith("### "):
        return "subslide"
    return "fragment"


def mark_slides(nb) -> bool:
    """Set every cell's ``slideshow.slide_type`` (see ``slide_type``); True if anything changed."""
    changed = False
    for i, cell in enumerate(nb.cells):
        wanted = slide_type(cell, i)
        if cell.metadata.get("slideshow", {}).get("slide_type") != wanted:
            cell.metadata["slideshow"] = {"slide_type": wanted}
            changed = True
    return changed


def find_notebook(chapter: str, folder: Path | None = None) -> Path:
    """``notebooks/04_*.ipynb`` from "04" or "4" (or a path as it is)."""
    folder = folder or ROOT / "notebooks"
    if Path(chapter).suffix == ".ipynb":
        return Path(chapter)
    found = sorted(folder.glob(f"{int(chapter):02d}_*.ipynb")) if chapter.isdigit() else []
    if not found:
        names = ", ".join(p.stem for p in sorted(folder.glob("*.ipynb")))
        raise SystemExit(f"no notebook {chapter!r} in {folder}; there are: {names}")
    return found[0]


def lecture_command(token: str, port: int = 8866) -> list[str]:
    """The Voilà server of lecture mode, run from the course folder: 127.0.0.1 only, a token,
    the reveal.js template (slides from the cells' ``slideshow`` metadata; a slide taller than
    the screen scrolls). A notebook is then at ``lecture_url(...)``. Voilà rather than
    jupyterlab-rise: RISE 0.43.1 shows ipywidgets 8 as text ("VBox(children=...)") in its
    slides, measured in Chromium with JupyterLab 4.6.6."""
    return [
        sys.executable, "-W", "ignore::DeprecationWarning", "-m", "voila",
        "--template=reveal", "--no-browser",
        "--Voila.ip=127.0.0.1", f"--port={port}", f"--Voila.token={token}",
        # reveal.js's layout from docs/lecture/ (the template's default is a CDN: no lecture
        # without internet); a slide taller than the screen scrolls
        "--VoilaConfiguration.resources={'reveal': {'scroll': True, 'transition': 'none',"
        " 'url_prefix': '/voila/files/docs/lecture'}}",
        "--VoilaConfiguration.file_allowlist", r"docs/lecture/.*\.css",
        "--VoilaConfiguration.file_allowlist", r".*\.(png|jpg|svg)",
    ]  # fmt: skip


def lecture_url(notebook: Path, token: str, port: int = 8866) -> str:
    path = Path(notebook).resolve().relative_to(ROOT).as_posix()
    return f"http://127.0.0.1:{port}/voila/render/{path}?token={token}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minitrain.course.notebooks", description=__doc__
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute notebooks in place (default: all of notebooks/)")
    run.add_argument("paths", nargs="*", type=Path)
    slides = sub.add_parser("slides", help="add lecture-mode slide markup (default: all notebooks)")
    slides.add_argument("paths", nargs="*", type=Path)
    lecture = sub.add_parser("lecture", help="present a notebook as slides, widgets live (Voilà)")
    lecture.add_argument("notebook", help='a chapter number ("04") or a notebook path')
    lecture.add_argument("--port", type=int, default=8866)
    args = parser.parse_args(argv)
    if args.command == "lecture":
        import secrets

        token = secrets.token_hex(16)
        url = lecture_url(find_notebook(args.notebook), token, args.port)
        print(
            f"lecture mode: open {url}\n(the notebook runs first; then arrows move between "
            "slides and the widgets are live; Ctrl-C stops)\n",
            flush=True,
        )
        cmd = lecture_command(token, args.port)
        os.chdir(ROOT)  # Voilà serves files (the slides' stylesheet) relative to where it runs
        os.execv(cmd[0], cmd)
    paths = args.paths or sorted((ROOT / "notebooks").glob("*.ipynb"))
    if args.command == "slides":
        import nbformat

        for path in paths:
            nb = nbformat.read(path, as_version=4)
            if mark_slides(nb):
                nbformat.write(nb, path)
                print(f"marked up {path} for slides")
            else:
                print(f"{path}: slide markup already up to date")
        return 0
    for path in paths:
        print(f"executing {path} ...", flush=True)
        print(f"  done in {execute(path.resolve()):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
