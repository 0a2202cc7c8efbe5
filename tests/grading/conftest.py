"""Grading set-up: patch the learner's functions in, and record results for the score table.

``python -m minitrain.grade`` runs pytest on this folder with three environment variables:
MINITRAIN_EXERCISES (the folder of exNN_*.py files to grade), MINITRAIN_GRADE_CHAPTERS (the
chapters graded: only their functions are patched in, so an unfinished earlier chapter costs
no points in a later one) and MINITRAIN_GRADE_REPORT (where to write the results as JSON).
Without them, the graded tests simply test the library's own reference solutions.
Each test runs with the learner's version of its own exercise only (its ``exercise`` marker)
and the reference of every other (``patching.select``), so a mistake costs the points of the
exercise that has it and no other's (issue 32).
"""

from __future__ import annotations

import json
import os

import pytest

_results: list[dict] = []
_patch_error: str | None = None


def pytest_configure(config):
    global _patch_error
    folder = os.environ.get("MINITRAIN_EXERCISES")
    if folder:
        from minitrain.course import patching

        chosen = os.environ.get("MINITRAIN_GRADE_CHAPTERS")
        chapters = [int(c) for c in chosen.split(",")] if chosen else None
        try:
            patching.apply_patches(folder, chapters)
        except Exception as exc:  # e.g. a SyntaxError in the learner's file
            _patch_error = f"your exercise file could not be loaded: {type(exc).__name__}: {exc}"


def pytest_runtest_setup(item):
    if _patch_error:
        pytest.fail(_patch_error, pytrace=False)
    if os.environ.get("MINITRAIN_EXERCISES"):
        from minitrain.course import patching

        marker = item.get_closest_marker("exercise")
        name = marker.args[0] if marker and marker.args else None
        patching.select(name.removeprefix("bug hunt: ") if name else None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and report.failed):
        marker = item.get_closest_marker("exercise")
        name = marker.args[0] if marker and marker.args else "?"
        points = marker.kwargs.get("points", 1) if marker else 1
        message = ""
        if report.failed:
            from minitrain.course.grade import plain_words

            message = plain_words(call.excinfo) if call.excinfo else report.longreprtext[-500:]
        _results.append(
            {
                "test": item.name,
                "file": item.fspath.basename,
                "exercise": name,
                "points": points,
                "passed": report.passed,
                "message": message,
                "seconds": round(report.duration, 2),
            }
        )


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("MINITRAIN_GRADE_REPORT")
    if path:
        with open(path, "w") as fh:
            json.dump(_results, fh)
