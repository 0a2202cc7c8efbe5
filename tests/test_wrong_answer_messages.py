"""The grader's messages for typical wrong answers stay plain (issue 21, learners' experience).

A few of the wrong answers of tests/grading/wrong_answers.py, single-process or quick ones,
are written into a copy of the solutions and graded by ``python -m minitrain.grade`` in a
subprocess, as a learner runs it; the message printed must contain the words listed there
(the function, the offending values, a hint). So a graded test whose message falls back to a
bare assert or a tensor dump fails here.
"""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "wrong_answers", Path(__file__).parent / "grading" / "wrong_answers.py"
)
wrong_answers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wrong_answers)

# (chapter, function): one each from six chapters, under 10 s of grading each
SAMPLE = [
    (1, "accumulate_gradients"),
    (2, "update"),
    (3, "backward"),
    (3, "choose_segments"),
    (8, "unsort"),
    (11, "axis_groups"),
]


def _answer(chapter, function):
    # the first entry of that function: issue 21's, the one SAMPLE was chosen for
    return next(
        a for a in wrong_answers.WRONG_ANSWERS if (a.chapter, a.function) == (chapter, function)
    )


def test_every_wrong_answer_applies_to_the_solutions():
    """Each entry's old text occurs exactly once in its solution file (else it tests nothing),
    and its new text differs from it; several entries may rewrite one function, so each is
    checked alone, not written in together."""
    texts = {}
    for a in wrong_answers.WRONG_ANSWERS:
        path = wrong_answers.solution_file(a.chapter)
        text = texts.setdefault(path, path.read_text())
        assert text.count(a.old) == 1, (
            f"chapter {a.chapter}, {a.function} ({a.mistake}): its old text occurs "
            f"{text.count(a.old)} times in {path.name}: {a.old!r}")
        assert a.new != a.old and a.words, f"{a.function} ({a.mistake}): nothing to grade"


def test_at_least_three_wrong_answers_per_exercise():
    """Issue 32: every graded exercise has three plausible wrong answers or more."""
    from minitrain.course.exercises import CHAPTERS, chapter_exercises

    few = []
    for chapter in CHAPTERS:
        for ex in chapter_exercises(chapter):
            n = sum(
                1 for a in wrong_answers.WRONG_ANSWERS
                if a.chapter == chapter and (a.function in (ex.qualname, ex.name)
                                             or ex.qualname.startswith(a.function + "."))
            )
            if n < 3:
                few.append(f"chapter {chapter}: {ex.qualname} has {n}")
    assert not few, f"exercises with fewer than 3 wrong answers: {few}"


@pytest.mark.parametrize("chapter,function", SAMPLE, ids=[f"ch{c}-{f}" for c, f in SAMPLE])
def test_the_grader_says_what_went_wrong(chapter, function):
    answer = _answer(chapter, function)
    printed = wrong_answers.grade([answer], chapter, timeout=60)
    messages = [line.strip() for line in printed.splitlines() if line.strip().startswith("->")]
    assert messages, f"grading {function} ({answer.mistake}) failed no test:\n{printed}"
    missing = [w for w in answer.words if not any(w.lower() in m.lower() for m in messages)]
    assert not missing, (
        f"chapter {chapter}, {function} ({answer.mistake}): the grader's messages lack "
        f"{missing}:\n" + "\n".join(messages)
    )


def test_bug_hunts_are_in_the_syllabus_and_the_failure_line():
    """Issue 32: the README's syllabus names each bug hunt's file, and a failing bug hunt's
    line in the grader's table says which file to fix."""
    from minitrain.course.bughunts import BUG_HUNTS
    from minitrain.course.grade import file_to_edit

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    syllabus = readme[readme.index("## Syllabus"):].split("\n## ")[0]
    for hunt in BUG_HUNTS:
        row = next(line for line in syllabus.splitlines() if line.startswith(f"| {hunt.chapter} |"))
        assert hunt.stem in row and hunt.qualname in row, f"{hunt.stem} is not in chapter {hunt.chapter}'s row"
        assert file_to_edit(f"bug hunt: {hunt.qualname}") == f"my_exercises/{hunt.stem}.py"
    assert file_to_edit("ring_all_reduce") is None


def test_a_mistake_costs_only_its_own_exercise(tmp_path):
    """Issue 32, blame on the right exercise: a wrong sort_by_expert fails sort_by_expert's
    test, while top_k_routing's test — whose expert-parallel layer also sorts — runs on the
    reference sort_by_expert and passes."""
    from minitrain.course.grade import run_tests

    (wrong,) = [a for a in wrong_answers.WRONG_ANSWERS
                if a.function == "sort_by_expert" and a.mistake == "returns the rows unpermuted"]
    wrong_answers.apply([wrong], tmp_path)
    results = run_tests([8], tmp_path, timeout=60, verbose=False)
    by_test = {r["test"]: r for r in results}
    assert not by_test["test_sort_by_expert"]["passed"]
    driven = by_test["test_your_functions_drive_expert_parallelism"]
    assert driven["passed"], f"top_k_routing lost points for sort_by_expert's mistake: {driven['message']}"
