"""Every notebook, as a person meets it in JupyterLab: Run All in headless Chromium, no cell
shows an error, every output nbval compares equals the committed one (at this pass's thread
count: notebook_outputs.py), every widget the kernel displays is rendered, and moving each of its controls
changes what it shows. Notebooks are found (notebooks/*.ipynb), not listed, so a new chapter is
covered when it lands. Screenshots of each widget before and after: browser-screenshots/."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from jupyter_browser import ROOT, WIDGET_MIME, NotebookPage
from notebook_outputs import differing_outputs

# MINITRAIN_BROWSER_NOTEBOOKS: comma-separated name prefixes (`make browser BROWSER_NOTEBOOKS=05_`
# runs one notebook); empty, as in make test: every notebook
_CHOSEN = [p for p in os.environ.get("MINITRAIN_BROWSER_NOTEBOOKS", "").split(",") if p]
NOTEBOOKS = [
    p for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
    if not _CHOSEN or any(p.name.startswith(c) for c in _CHOSEN)
]
RUN_TIMEOUT = 240  # s per notebook: the course's target is under 60 s here, nbval's runs it
SETTLE = 30  # s for a widget to re-plot after a control moves (some re-measure with launch)


def committed_widgets(path: Path) -> int:
    cells = json.loads(path.read_text())["cells"]
    return sum(1 for c in cells for o in c.get("outputs", []) if WIDGET_MIME in o.get("data", {}))


@pytest.mark.timeout(RUN_TIMEOUT + 300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_every_widget_responds(path, lab, browser, lab_tab, shots,
                                                 record_property):
    t0 = time.perf_counter()
    page = NotebookPage(browser, lab, f"notebooks/{path.name}", tab=lab_tab)
    try:
        page.open()
        page.run_all(RUN_TIMEOUT)
        ran = time.perf_counter() - t0
        # nbval's comparison, at this pass's thread count (make browser: 2; notebook_outputs.py)
        differing = differing_outputs(path, page.code_outputs())
        report = page.check(settle=SETTLE, shots=shots)
    finally:
        page.close()
    # for the summary conftest.py prints (a property reaches it from a pytest-xdist worker too)
    record_property("browser", dict(
        notebook=path.stem, seconds=time.perf_counter() - t0, run_all=ran,
        controls=report.controls, screenshots=report.screenshots,
    ))  # fmt: skip
    assert not report.errors, f"{path.name}: " + "; ".join(report.errors)
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    assert not differing, (
        f"{path.name}, run with OMP_NUM_THREADS={threads}: " + "; ".join(differing))
    assert report.widgets >= max(1, committed_widgets(path)), (
        f"{path.name}: the committed notebook displays {committed_widgets(path)} widget(s), "
        f"running it in JupyterLab displayed {report.widgets}"
    )
    assert not report.problems, f"{path.name}: " + "; ".join(report.problems)
    assert report.controls, f"{path.name}: no widget control was moved"
