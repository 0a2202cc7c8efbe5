"""Bug hunts (minitrain.course.bughunts): each learner's file differs from its solution by
exactly the one shipped line, names the function, and has a graded test."""

import difflib

import pytest

from minitrain.course import bughunts
from minitrain.course.exercises import ROOT


@pytest.mark.parametrize("hunt", bughunts.BUG_HUNTS, ids=lambda h: h.stem)
def test_bug_hunt_differs_from_its_fix_by_one_line(hunt):
    broken, fixed = bughunts.render(hunt, fixed=False), bughunts.render(hunt, fixed=True)
    compile(broken, hunt.stem, "exec")
    compile(fixed, hunt.stem, "exec")
    code = [
        line
        for line in difflib.ndiff(
            bughunts.function_source(hunt, fixed=False).splitlines(),
            bughunts.function_source(hunt, fixed=True).splitlines(),
        )
        if line[:1] in "+-"
    ]
    assert 1 <= len(code) <= 2, code  # one line changed (or one line missing)
    assert hunt.qualname in broken and str(hunt.chapter) in broken
    assert list((ROOT / "tests" / "grading").glob(f"test_ch{hunt.chapter:02d}_bughunt.py"))


def test_a_line_that_moved_fails_loudly():
    hunt = bughunts.BUG_HUNTS[0]
    moved = bughunts.BugHunt(**{**hunt.__dict__, "fixed": "no such line"})
    with pytest.raises(ValueError, match="not found exactly once"):
        bughunts.render(moved, fixed=False)
