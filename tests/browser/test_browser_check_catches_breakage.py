"""The browser check can fail, and for the right reason: a notebook with a working widget and
four broken ones (one that never updates, one whose callback raises, one the page cannot
render, a cell that raises) — each reported, the working one not."""

from __future__ import annotations

import pytest
from jupyter_browser import (
    ERROR_CELL,
    FROZEN_WIDGET,
    GOOD_WIDGET,
    RAISING_WIDGET,
    UNRENDERED_WIDGET,
    NotebookPage,
    tiny_notebook,
)


@pytest.mark.timeout(300)
def test_broken_widgets_and_errors_are_reported_and_a_working_widget_is_not(course, lab, browser):
    tiny_notebook(
        course / "selftest" / "broken_widgets.ipynb",
        GOOD_WIDGET, FROZEN_WIDGET, RAISING_WIDGET, UNRENDERED_WIDGET, ERROR_CELL,
    )  # fmt: skip
    page = NotebookPage(browser, lab, "selftest/broken_widgets.ipynb")
    try:
        page.open()
        page.run_all(120)
        report = page.check(settle=4)
    finally:
        page.close()
    problems = "\n".join(report.problems)
    assert report.widgets == 4, report
    working = [c for c in report.controls if c.startswith('widget 1: hslider "ranks" changed')]
    assert working, report  # the working one
    assert not any(p.startswith("widget 1:") for p in report.problems), problems
    assert 'widget 2: moving its hslider "frozen" (control 1) changed nothing' in problems
    assert 'widget 3: moving its hslider "raises" (control 1) changed nothing' in problems
    assert "widget 4 is not rendered" in problems
    assert len(report.errors) == 1 and "ZeroDivisionError" in report.errors[0], report.errors
