"""Grading: put the functions a learner wrote in place of the library's.

Used by ``python -m minitrain.grade`` (through tests/grading/conftest.py). The same patches
are made again in every rank ``minitrain.runtime`` starts, through the launcher's general
hook ``add_rank_initializer`` (the runtime knows nothing of grading). Each
function is re-bound to the *library module's* globals (``types.FunctionType(code,
vars(module))``), so the learner's code can call the module's helpers and every caller
inside the library — chapter 4's DDP calling ``ring_all_reduce`` — runs the learner's version.

Blame on the right exercise (issue 32): each graded test names its exercise, and
``select(name)`` keeps the learner's version of that exercise only, the library's reference
for every other one — so a wrong ``merge_attention`` costs ``merge_attention``'s points, not
``ring_step``'s too. The selection travels to the ranks with the rank initializer, taken at
each ``launch``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import types
from pathlib import Path

from minitrain.course.bughunts import BUG_HUNTS, BugHunt
from minitrain.course.exercises import CHAPTERS, Exercise, chapter_exercises
from minitrain.runtime import add_rank_initializer

_active: str | None = None
# every patch made: (owner, name, reference attribute, learner's attribute, qualname,
# module-level function or None) — what select() swaps between
_patches: list[tuple] = []
_selected: list[str | None] = [None]  # the exercise under test (None: every learner version)


def active_patches() -> str | None:
    """The exercise folder currently patched into the library, if any."""
    return _active


def apply_patches(
    folder: str | os.PathLike, chapters=None, in_every_rank: bool = True
) -> list[str]:
    """Put the functions written in ``folder``/exNN_*.py in place of the library's.

    ``chapters``: only these chapters' files (default: every chapter). Returns the
    qualified names patched. A function missing from the learner's file is replaced by one
    that says so, so nothing is graded on the reference's behalf. ``in_every_rank``: also
    make the same patches in every rank ``minitrain.runtime`` starts from now on.
    """
    global _active
    folder = Path(folder).resolve()
    patched = []
    for chapter, (stem, _) in CHAPTERS.items():
        if chapters is not None and chapter not in chapters:
            continue
        path = folder / f"{stem}.py"
        exs = chapter_exercises(chapter)
        if not exs or not path.exists():
            continue
        spec = importlib.util.spec_from_file_location(f"_minitrain_learner_{stem}", path)
        learner = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(learner)  # a SyntaxError here names the learner's file and line
        _add_learners_names(learner, exs)
        for ex in exs:
            _patch_one(ex, learner, path)
            patched.append(f"{ex.module}.{ex.qualname}")
    for hunt in BUG_HUNTS:  # a bug hunt: one function of the library, as the learner fixed it
        path = folder / f"{hunt.stem}.py"
        if (chapters is not None and hunt.chapter not in chapters) or not path.exists():
            continue
        spec = importlib.util.spec_from_file_location(f"_minitrain_learner_{hunt.stem}", path)
        learner = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(learner)
        importlib.import_module(hunt.module)
        _patch_one(hunt, learner, path)
        patched.append(f"{hunt.module}.{hunt.qualname}")
    if in_every_rank and _active is None:
        chosen = None if chapters is None else sorted(chapters)
        add_rank_initializer(_RankPatches(str(folder), chosen))
    _active = str(folder)
    return patched


def _matches(qualname: str, exercise: str | None) -> bool:
    return exercise is None or qualname == exercise or qualname.startswith(exercise + ".")


def select(exercise: str | None) -> None:
    """Keep the learner's version of ``exercise`` (a qualname as the graded tests' marker
    names it, or a class: all its methods) and the library's reference for every other
    patched function; ``None``: the learner's versions everywhere."""
    _selected[0] = exercise
    for owner, name, reference, learners, qualname, module_fns in _patches:
        use = learners if _matches(qualname, exercise) else reference
        setattr(owner, name, use)
        if module_fns is not None:  # modules that did `from x import f` hold either one
            old_fn, new_fn = module_fns
            want, other = (new_fn, old_fn) if use is learners else (old_fn, new_fn)
            for mod_name, mod in list(sys.modules.items()):
                if mod_name.startswith("minitrain") and mod is not None:
                    for attr, value in list(vars(mod).items()):
                        if value is other:
                            setattr(mod, attr, want)


class _RankPatches:
    """The rank initializer: the same patches in a rank, and the selection made when the rank
    was launched (pickled with it, since ranks come from a forkserver started earlier)."""

    def __init__(self, folder: str, chapters):
        self.folder, self.chapters = folder, chapters

    def __getstate__(self):
        return {"folder": self.folder, "chapters": self.chapters, "selected": _selected[0]}

    def __setstate__(self, state):
        self.folder, self.chapters = state["folder"], state["chapters"]
        self.selected = state["selected"]

    def __call__(self):
        apply_patches(self.folder, self.chapters, in_every_rank=False)
        select(getattr(self, "selected", None))


def _add_learners_names(learner, exs: list[Exercise]) -> None:
    """Names the learner's file defines that the library lacks (their own helpers, an extra
    import) are added to the library modules, so the re-bound code finds them. The file's
    exercise stubs (e.g. a class holding only the methods to write) are not."""
    stubs = {e.class_name or e.name for e in exs}
    for module_name in {e.module for e in exs}:
        target = vars(sys.modules[module_name])
        for name, value in vars(learner).items():
            if not name.startswith("__") and name not in stubs and name not in target:
                target[name] = value


def _patch_one(ex: Exercise | BugHunt, learner, path: Path) -> None:
    target_module = sys.modules[ex.module]
    owner = getattr(target_module, ex.class_name) if ex.class_name else target_module
    original = inspect.getattr_static(owner, ex.name)
    is_static = isinstance(original, staticmethod)
    original_fn = original.__func__ if is_static else original
    source = getattr(learner, ex.class_name, None) if ex.class_name else learner
    written = inspect.getattr_static(source, ex.name, None) if source is not None else None
    if isinstance(written, staticmethod):
        written = written.__func__
    if not isinstance(written, types.FunctionType):

        def written(*args, _q=ex.qualname, _p=path.name, **kwargs):
            raise NotImplementedError(f"{_q} is missing from {_p}")

    if written.__code__.co_freevars:
        new = written  # a closure cannot be re-bound; it keeps the learner file's globals
    else:
        new = types.FunctionType(
            written.__code__, vars(target_module), ex.name, written.__defaults__
        )
        new.__kwdefaults__ = written.__kwdefaults__
        new.__doc__ = original_fn.__doc__
    new.__qualname__ = original_fn.__qualname__
    new.__module__ = ex.module
    learners = staticmethod(new) if is_static else new
    setattr(owner, ex.name, learners)
    module_fns = None
    if ex.class_name is None:  # modules that did `from x import f` hold the old function
        module_fns = (original_fn, new)
        for name, mod in list(sys.modules.items()):
            if name.startswith("minitrain") and mod is not None:
                for attr, value in list(vars(mod).items()):
                    if value is original_fn:
                        setattr(mod, attr, new)
    _patches.append((owner, ex.name, original, learners, ex.qualname, module_fns))
