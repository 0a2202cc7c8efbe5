"""Hints on request (issue 44): every exercise has three levels, the command gives them in
order and remembers the level reached, ``grade`` prints it, and no hint sits in a stub."""

import importlib
import json
import subprocess
import sys

import pytest

from minitrain.course import hints
from minitrain.course.chapters import CHAPTERS, ROOT
from minitrain.course.exercise_regions import exercises_of
from minitrain.course.grade import print_table


@pytest.mark.parametrize("chapter", sorted(CHAPTERS))
def test_every_exercise_has_three_levels_and_nothing_else(chapter):
    written = hints.hints_of(chapter)
    expected = hints.exercises_of(chapter)
    assert sorted(written) == sorted(expected), (
        f"chapter {chapter}: missing {sorted(set(expected) - set(written))}, "
        f"extra {sorted(set(written) - set(expected))}")
    for name, levels in written.items():
        assert len(levels) == 3 and all(len(text) > 20 for text in levels), name
        assert len(set(levels)) == 3, f"{name}: three different levels"


def test_no_stub_carries_a_hint():
    for path in (ROOT / "exercises").glob("*.py"):
        assert "# HINT" not in path.read_text(), path.name


def test_a_hint_comment_in_the_library_is_refused(tmp_path, monkeypatch):
    (tmp_path / "fake_chapter.py").write_text(
        'def f():\n    """Contract."""\n    ### BEGIN SOLUTION\n'
        '    # HINT: the answer, unasked\n    return 1\n    ### END SOLUTION\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("fake_chapter")
    with pytest.raises(ValueError, match="gives the answer away"):
        exercises_of(module)


def _hint(*args, folder):
    return subprocess.run([sys.executable, "-m", "minitrain.hint", *map(str, args), "--folder",
                           str(folder)], capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_levels_come_in_order_and_are_remembered(tmp_path):
    levels = hints.hints_of(4)["ring_all_reduce"]
    for level in (1, 2, 3, 3):  # after the last level, the last again
        out = _hint(4, "ring_all_reduce", folder=tmp_path)
        assert out.returncode == 0, out.stderr
        assert f"hint {level} of 3" in out.stdout
        assert levels[level - 1].split()[0] in out.stdout
        state = json.loads((tmp_path / hints.STATE_FILE).read_text())
        assert state == {"4": {"ring_all_reduce": level}}
    assert not list(tmp_path.glob("*.tmp")), "the state is written by a rename"
    listing = _hint(4, folder=tmp_path)
    assert "ring_all_reduce" in listing.stdout and "bug hunt" in listing.stdout


def test_a_level_cannot_be_skipped_and_errors_are_one_line(tmp_path):
    skipped = _hint(4, "ring_all_gather", "--level", 3, folder=tmp_path)
    assert skipped.returncode == 2 and "ask for that one first" in skipped.stderr
    unknown = _hint(4, "ring_all_sum", folder=tmp_path)
    assert unknown.returncode == 2 and "ring_all_reduce" in unknown.stderr  # lists the names
    (tmp_path / hints.STATE_FILE).write_text("{not json")
    damaged = _hint(4, "ring_all_gather", folder=tmp_path)
    assert damaged.returncode == 2 and "damaged" in damaged.stderr
    for out in (skipped, unknown, damaged):
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_a_method_name_and_bughunt_resolve():
    assert hints.resolve_exercise(4, "_on_grad_ready") == "DataParallel._on_grad_ready"
    assert hints.resolve_exercise(4, "bughunt") == hints.BUG_HUNT
    assert hints.hint_key("bug hunt: DataParallel.no_sync") == hints.BUG_HUNT


def test_grade_prints_the_level_used(capsys):
    results = [dict(exercise="ring_all_reduce", test="t1", points=3, passed=True, seconds=1.0,
                    message=""),
               dict(exercise="bug hunt: DataParallel.no_sync", test="t2", points=2, passed=True,
                    seconds=1.0, message=""),
               dict(exercise="assign_buckets", test="t3", points=2, passed=True, seconds=1.0,
                    message="")]
    print_table(results, "chapter 4", hints={"ring_all_reduce": 2, hints.BUG_HUNT: 1})
    rows = capsys.readouterr().out.splitlines()
    assert "hints" in rows[2]
    assert " 2/3 " in rows[3] and " 1/3 " in rows[4] and " 0/3 " in rows[5]
