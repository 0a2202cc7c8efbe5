"""Browser tests: skipped, saying why, when no Chromium or Playwright is installed.

``make browser`` (part of ``make test``) runs them when a Chromium is present; ``.ci/run``
installs Debian's ``chromium`` first when it can, so CI always runs them. One JupyterLab
server and one headless Chromium serve the whole session.
"""

from __future__ import annotations

import time

import pytest
from jupyter_browser import SCREENSHOTS, JupyterLab, course_copy, find_chromium, launch_browser

_timings: list[tuple[str, float, list[str]]] = []


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
def shots():
    SCREENSHOTS.mkdir(exist_ok=True)
    return SCREENSHOTS


def record(name: str, seconds: float, screenshots: list[str]) -> None:
    _timings.append((name, seconds, screenshots))


def pytest_sessionstart(session):
    session.config._browser_t0 = time.perf_counter()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _timings:
        return
    write = terminalreporter.write_line
    write(f"browser pass: {time.perf_counter() - config._browser_t0:.0f} s in all")
    for name, seconds, screenshots in _timings:
        write(f"  {name}: {seconds:.0f} s; screenshots: {', '.join(screenshots) or 'none'}")
