"""Browser tests: skipped, saying why, when no Chromium or Playwright is installed.

``make browser`` (part of ``make test``) runs them when a Chromium is present; ``.ci/run``
installs Debian's ``chromium`` first when it can, so CI always runs them. One JupyterLab
server and one headless Chromium serve each pytest process (``make browser`` runs two,
with pytest-xdist: while one notebook's kernel waits or computes on one core, another
notebook runs).
"""

from __future__ import annotations

import time

import pytest
from jupyter_browser import (
    SCREENSHOTS,
    JupyterLab,
    LabTab,
    course_copy,
    find_chromium,
    launch_browser,
)


def pytest_collection_modifyitems(config, items):
    reason = None
    if find_chromium() is None:
        reason = "no Chromium found: apt-get install chromium (or set MINITRAIN_CHROMIUM)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            reason = "playwright is not installed (pip install -r requirements.txt)"
    if reason:
        for item in items:
            if "browser" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=f"browser tests skipped: {reason}"))


@pytest.fixture(scope="session")
def course(tmp_path_factory):
    """A copy of the course (notebooks copied, the rest linked): JupyterLab autosaves."""
    root = tmp_path_factory.mktemp("course")
    course_copy(root)
    return root


@pytest.fixture(scope="session")
def lab(course, tmp_path_factory):
    with JupyterLab(course, tmp_path_factory.mktemp("jupyterlab")) as server:
        yield server


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = launch_browser(pw)
        yield chromium
        chromium.close()


@pytest.fixture(scope="session")
def lab_tab(browser):
    """One page per pytest process in which the course's notebooks open one after another
    (JupyterLab loaded once: ``LabTab``)."""
    tab = LabTab(browser)
    yield tab
    tab.close()


@pytest.fixture(scope="session")
def shots():
    SCREENSHOTS.mkdir(exist_ok=True)
    return SCREENSHOTS


def pytest_sessionstart(session):
    session.config._browser_t0 = time.perf_counter()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The pass's time, and per notebook: its time, Run All's, each control moved, the
    screenshots (from the tests' ``record_property("browser", ...)``)."""
    rows = sorted(
        (value for outcome in ("passed", "failed") for rep in terminalreporter.stats.get(outcome, [])
         if rep.when == "call" for name, value in rep.user_properties if name == "browser"),
        key=lambda row: row["notebook"],
    )  # fmt: skip
    if not rows:
        return
    write = terminalreporter.write_line
    write(f"browser pass: {time.perf_counter() - config._browser_t0:.0f} s in all")
    for row in rows:
        write(f"  {row['notebook']}: {row['seconds']:.0f} s (Run All {row['run_all']:.0f} s); "
              f"screenshots: {', '.join(row['screenshots']) or 'none'}")
        for control in row["controls"]:
            write(f"      {control}")
