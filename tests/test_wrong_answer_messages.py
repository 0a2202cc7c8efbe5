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
    (found,) = [
        a for a in wrong_answers.WRONG_ANSWERS if (a.chapter, a.function) == (chapter, function)
    ]
    return found


def test_every_wrong_answer_applies_to_the_solutions(tmp_path):
    """Each entry's old text occurs exactly once in its solution file (else it tests nothing)."""
    wrong_answers.apply(wrong_answers.WRONG_ANSWERS, tmp_path)
    for a in wrong_answers.WRONG_ANSWERS:
        assert a.new in (tmp_path / wrong_answers.solution_file(a.chapter).name).read_text()


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
