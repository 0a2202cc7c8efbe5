"""The browser check can fail, and for the right reason: a notebook with working widgets and
broken ones (one that never updates, one whose callback raises, one the page cannot render, one
with a control never connected, a cell that raises) — each reported, the working ones not (nor
a control the widget disabled)."""

from __future__ import annotations

import time

import pytest
from jupyter_browser import (
    DISABLED_CONTROL_WIDGET,
    ERROR_CELL,
    FROZEN_WIDGET,
    GOOD_WIDGET,
    PARTLY_DEAD_WIDGET,
    RAISING_WIDGET,
    UNRENDERED_WIDGET,
    NotebookPage,
    tiny_notebook,
)


@pytest.mark.timeout(300)
def test_broken_widgets_and_errors_are_reported_and_a_working_widget_is_not(course, lab, browser):
    tiny_notebook(
        course / "selftest" / "broken_widgets.ipynb",
        GOOD_WIDGET, FROZEN_WIDGET, RAISING_WIDGET, UNRENDERED_WIDGET, PARTLY_DEAD_WIDGET,
        DISABLED_CONTROL_WIDGET, ERROR_CELL,
    )  # fmt: skip
    page = NotebookPage(browser, lab, "selftest/broken_widgets.ipynb")
    try:
        page.open()
        page.run_all(120)
        report = page.check(settle=4)
    finally:
        page.close()
    problems = "\n".join(report.problems)
    assert report.widgets == 6, report
    working = [c for c in report.controls if c.startswith('widget 1: hslider "ranks" changed')]
    assert working, report  # the working one
    assert not any(p.startswith("widget 1:") for p in report.problems), problems
    assert 'widget 2: moving its hslider "frozen" (control 1) changed nothing' in problems
    assert 'widget 3: moving its hslider "raises" (control 1) changed nothing' in problems
    assert "widget 4 is not rendered" in problems
    assert 'widget 5: moving its hslider "dead" (control 2) changed nothing' in problems
    assert not any('"alive"' in p for p in report.problems), problems
    assert not any(p.startswith("widget 6:") for p in report.problems), problems
    assert not any('"unused"' in c for c in report.controls), report.controls  # not moved
    assert len(report.errors) == 1 and "ZeroDivisionError" in report.errors[0], report.errors


@pytest.mark.timeout(300)
def test_a_new_page_opens_its_notebook_alone(course, lab, browser):
    """A page restores its workspace's tabs: in a shared one, a second page would re-open,
    re-render and start a kernel for the first page's notebook too (issue 33: in make test's
    browser pass every notebook did so for the ones before it). ``open`` refuses that."""
    first, second = course / "selftest" / "alone_1.ipynb", course / "selftest" / "alone_2.ipynb"
    tiny_notebook(first, "print(1)")
    tiny_notebook(second, "print(2)")
    page = NotebookPage(browser, lab, str(first.relative_to(course)))
    try:
        page.open()
        time.sleep(3)  # JupyterLab saves the workspace's layout, with the first notebook in it
        other = NotebookPage(browser, lab, str(second.relative_to(course)))
        try:
            other.open()  # raises when the first notebook came back with this page
        finally:
            other.close()
    finally:
        page.close()
