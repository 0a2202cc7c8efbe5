"""The exercise machinery: stubs and solutions from the markers, edit protection, grading."""

import re
import subprocess
import sys
import textwrap
import types

import pytest

from minitrain.course import exercises, patching
from minitrain.course.exercises import ROOT
from minitrain.runtime import point_to_point


def test_stub_keeps_signature_and_docstring_not_the_solution_and_hints_live_apart():
    from minitrain.course.hints import hints_of

    (token, bcast) = exercises.exercises_of(point_to_point)
    assert token.qualname == "pass_the_token" and bcast.qualname == "broadcast"
    assert token.stub.startswith(
        "def pass_the_token(token: torch.Tensor, group: ProcessGroup | None = None)")
    assert '"""Pass a token once around the ring' in token.stub
    assert "# HINT" not in token.stub  # hints are asked for: python -m minitrain.hint 0 ...
    idea, structure, recipe = hints_of(0)["pass_the_token"]
    assert "Rank 0 must send before it receives" in recipe
    assert "raise NotImplementedError" in token.stub
    assert "dist.send" not in token.stub.split('"""')[-1]  # the code after the docstring
    assert "dist.send(held, next_rank" in token.solution


def test_rendered_files_are_valid_python_and_import_what_they_use():
    for chapter in exercises.CHAPTERS:
        for solved in (False, True):
            text = exercises.render(chapter, solved)
            if text is not None:
                compile(text, f"ch{chapter}", "exec")
    namespace: dict = {}
    exec(exercises.render(0, solved=False), namespace)
    assert namespace["ring_neighbours"] is point_to_point.ring_neighbours
    with pytest.raises(NotImplementedError, match="exercise: write broadcast"):
        namespace["broadcast"](None)


def test_build_writes_both_folders_and_check_notices_staleness(tmp_path):
    written = exercises.build(root=tmp_path)
    assert tmp_path / "exercises" / "ex00_point_to_point.py" in written
    assert tmp_path / "solutions" / "ex00_point_to_point.py" in written
    assert exercises.check(root=tmp_path) == []
    (tmp_path / "solutions" / "ex00_point_to_point.py").write_text("# stale\n")
    assert any("out of date" in p for p in exercises.check(root=tmp_path))


def test_build_refuses_to_overwrite_an_edited_exercise_unless_forced(tmp_path):
    exercises.build(root=tmp_path)
    stub = tmp_path / "exercises" / "ex00_point_to_point.py"
    assert exercises.is_pristine(stub)
    stub.write_text(stub.read_text().replace("raise NotImplementedError", "return 1  # mine", 1))
    assert not exercises.is_pristine(stub)
    (tmp_path / "solutions" / "ex00_point_to_point.py").write_text("old")
    with pytest.raises(SystemExit, match="refusing to overwrite"):
        exercises.build(root=tmp_path)
    exercises.build(root=tmp_path, force=True)
    assert exercises.is_pristine(stub)


def test_start_copies_stubs_once_and_never_overwrites(tmp_path):
    exercises.build(root=tmp_path)
    copied = exercises.start(root=tmp_path)
    mine = tmp_path / "my_exercises" / "ex00_point_to_point.py"
    assert mine in copied
    mine.write_text("# my work\n")
    assert exercises.start(root=tmp_path) == []
    assert mine.read_text() == "# my work\n"


def test_start_gives_learners_their_own_notebooks_and_keeps_them(tmp_path):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "00_a.ipynb").write_text("{}")
    copied = exercises.start(root=tmp_path)
    mine = tmp_path / "my_notebooks" / "00_a.ipynb"
    assert mine in copied and mine.read_text() == "{}"
    mine.write_text('{"executed": "by the learner"}')
    (tmp_path / "notebooks" / "01_b.ipynb").write_text("{}")  # a course update adds a chapter
    assert exercises.start(root=tmp_path) == [tmp_path / "my_notebooks" / "01_b.ipynb"]
    assert mine.read_text() == '{"executed": "by the learner"}'


LEARNER = """
import torch.distributed as dist

def my_helper(x):
    return x * 3

def pass_the_token(token, group=None):
    return my_helper(token) + len(ring_neighbours())   # ring_neighbours: the library's

def broadcast(tensor, src=0, group=None):
    return "learner"
"""


def test_patching_rebinds_learner_code_into_the_library(tmp_path):
    (tmp_path / "ex00_point_to_point.py").write_text(LEARNER)
    script = textwrap.dedent(f"""
        import torch
        from minitrain.runtime import point_to_point
        from minitrain.course import patching
        from minitrain.runtime.point_to_point import broadcast as imported_before
        patching.apply_patches({str(tmp_path)!r})
        assert point_to_point.broadcast(None) == "learner"
        assert imported_before is not point_to_point.broadcast   # old reference stays a copy
        assert patching.active_patches() == {str(tmp_path)!r}
        print(point_to_point.pass_the_token(torch.tensor(1.0)).item())
    """)
    # ring_neighbours needs a process group: give it a one-rank gloo group
    setup = "import torch.distributed as dist; dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
    out = subprocess.run(
        [sys.executable, "-c", setup + script], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "5.0"


def test_missing_learner_function_is_not_graded_on_the_references_behalf(tmp_path):
    (tmp_path / "ex00_point_to_point.py").write_text(
        "def broadcast(t, src=0, group=None):\n    return t\n"
    )
    script = textwrap.dedent(f"""
        from minitrain.runtime import point_to_point
        from minitrain.course import patching
        patching.apply_patches({str(tmp_path)!r})
        try:
            point_to_point.pass_the_token(None)
        except NotImplementedError as e:
            print(e)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert "pass_the_token is missing from ex00_point_to_point.py" in out.stdout, out.stderr


DEADLOCK = '''
import torch.distributed as dist

def pass_the_token(token, group=None):
    held = token.clone()
    dist.recv(held, (dist.get_rank() - 1) % dist.get_world_size())  # everyone waits: deadlock
    return held

def broadcast(tensor, src=0, group=None):
    """Wrong: rank src keeps its value but the others get zeros."""
    if dist.get_rank() != src:
        tensor.zero_()
    return tensor
'''


def test_grade_reports_a_deadlock_and_a_wrong_answer_in_plain_words(tmp_path):
    (tmp_path / "ex00_point_to_point.py").write_text(DEADLOCK)
    env = dict(__import__("os").environ, MINITRAIN_MAX_LAUNCH_TIMEOUT="4")
    out = subprocess.run(
        [sys.executable, "-m", "minitrain.grade", "0", "--source", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env=env,
    )
    assert out.returncode == 1
    assert "did not finish within the 4 s timeout" in out.stdout, out.stdout
    assert "broadcast from rank 0 with 2 ranks: rank 1 holds [0.0, 0.0" in out.stdout, out.stdout
    assert re.search(r"score: 0/\d+\n", out.stdout), out.stdout  # no point for either answer


def test_grade_explains_how_to_start_when_there_is_nothing_to_grade(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "minitrain.grade", "--source", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2 and "python -m minitrain.exercises start" in out.stdout


def test_plain_words():
    from minitrain.course.grade import plain_words

    def info(exc):
        return types.SimpleNamespace(value=exc, typename=type(exc).__name__)

    assert plain_words(info(AssertionError("rank 1 is off\nassert False"))) == "rank 1 is off"
    assert plain_words(info(NotImplementedError("x"))) == "not written yet (x)"
    # pytest.raises' jargon (as this pinned pytest words it) in plain words
    with pytest.raises(BaseException) as no_raise:
        with pytest.raises(ValueError):
            pass
    assert plain_words(no_raise) == (
        "expected a ValueError to be raised; your function returned without one"
    )
    with pytest.raises(AssertionError) as no_match:
        with pytest.raises(ValueError, match="budget"):
            raise ValueError("nothing fits")
    assert plain_words(no_match) == (
        "the error's message should match 'budget'; it was 'nothing fits'"
    )


DEMO_LIBRARY = '''
SCALE = 10

def helper(x):
    return x + 1

class Counter:
    def __init__(self):
        self.n = 0

    def bump(self, k):
        """Add k * SCALE."""
        ### BEGIN SOLUTION
        self.n += k * SCALE
        ### END SOLUTION
        return self.n

    @staticmethod
    def double(x):
        ### BEGIN SOLUTION
        return 2 * helper(x) - 2
        ### END SOLUTION
'''

DEMO_LEARNER = '''
class Counter:
    def bump(self, k):
        self.n += k * SCALE + 1   # off by one, on purpose
        return self.n

    @staticmethod
    def double(x):
        return helper(x) * 100
'''


def test_methods_and_staticmethods_are_extracted_and_patched(tmp_path, monkeypatch):
    import importlib

    (tmp_path / "demo_library.py").write_text(DEMO_LIBRARY)
    (tmp_path / "demo_learner.py").write_text(DEMO_LEARNER)
    monkeypatch.syspath_prepend(str(tmp_path))
    lib = importlib.import_module("demo_library")
    learner = importlib.import_module("demo_learner")
    found = exercises.exercises_of(lib)
    assert [e.qualname for e in found] == ["Counter.bump", "Counter.double"]
    assert "raise NotImplementedError" in found[0].stub and "self.n +=" not in found[0].stub
    assert found[0].stub.rstrip().endswith("return self.n")  # code after the region is kept
    for ex in found:
        patching._patch_one(ex, learner, tmp_path / "demo_learner.py")
    c = lib.Counter()
    assert c.bump(2) == 21  # the learner's code, reading the library's SCALE
    assert lib.Counter.double(1) == 200  # staticmethod stays static, uses the library's helper
