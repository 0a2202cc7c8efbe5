"""Hints on request: ``python -m minitrain.hint CHAPTER [EXERCISE]`` prints the next one.

Every chapter's exercises; the command lives in minitrain/hint.py. A stub's docstring states
the contract (inputs, outputs, invariants, what the grader counts) and never the algorithm:
deriving it is the exercise. A learner who is stuck asks for a hint, one level at a time —

1. **the idea**: the question whose answer is the algorithm, or the fact it rests on;
2. **the structure**: the shape of a solution (what loops over what, what is sent or kept);
3. **the recipe**: the steps, nearly the code.

The level reached is remembered in the learner's folder (``my_exercises/.hints.json``) and
``python -m minitrain.grade`` prints it beside each score, so the learner — and an instructor
reading a report — sees how the points were earned. The texts live in ``hints/chNN.toml``,
one table per exercise named as the grader names it (``ring_all_reduce``,
``DataParallel._on_grad_ready``; a chapter's bug hunt is ``"bug hunt"``), with the keys
``idea``, ``structure`` and ``recipe``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI (requirements.txt)
    import tomli as tomllib

from minitrain.course.chapters import CHAPTERS, ROOT

LEVELS = ("idea", "structure", "recipe")
HINTS_DIR = Path(__file__).resolve().parent / "hints"
STATE_FILE = ".hints.json"  # in the learner's folder: {"4": {"ring_all_reduce": 2}}
BUG_HUNT = "bug hunt"


class HintError(Exception):
    """An expected failure of the command: one line, no traceback."""


def hint_key(exercise: str) -> str:
    """The hints' name of a graded exercise: a bug hunt's ("bug hunt: X.y") is "bug hunt"."""
    return BUG_HUNT if exercise.startswith(BUG_HUNT) else exercise


def exercises_of(chapter: int) -> list[str]:
    """The exercises of ``chapter`` as the grader names them, in the file's order, then the
    chapter's bug hunt (if it has one)."""
    from minitrain.course.bughunts import BUG_HUNTS
    from minitrain.course.exercise_regions import chapter_exercises

    names = [ex.qualname for ex in chapter_exercises(chapter)]
    return names + [BUG_HUNT for hunt in BUG_HUNTS if hunt.chapter == chapter]


def hints_of(chapter: int) -> dict[str, tuple[str, str, str]]:
    """{exercise: (idea, structure, recipe)} of ``chapter`` (empty if it has no hints file)."""
    path = HINTS_DIR / f"ch{chapter:02d}.toml"
    if not path.exists():
        return {}
    with open(path, "rb") as fh:
        tables = tomllib.load(fh)
    out = {}
    for name, table in tables.items():
        missing = [level for level in LEVELS if not str(table.get(level, "")).strip()]
        if missing or set(table) - set(LEVELS):
            raise HintError(f"{path.name} [{name}]: needs exactly the keys {', '.join(LEVELS)}")
        out[name] = tuple(table[level].strip() for level in LEVELS)
    return out


def resolve_exercise(chapter: int, name: str) -> str:
    """``name`` as the grader names it: the exact name, or a method's name alone when only one
    exercise of the chapter has it ("_on_grad_ready"), or "bughunt"/"bug-hunt"."""
    names = exercises_of(chapter)
    spelled = name.strip().lower().replace("-", " ").replace("_", " ")
    wanted = BUG_HUNT if spelled in ("bughunt", BUG_HUNT) else name.strip()
    if wanted in names:
        return wanted
    matches = [n for n in names if n.split(".")[-1] == wanted]
    if len(matches) == 1:
        return matches[0]
    listed = ", ".join(names) or "none"
    raise HintError(f"chapter {chapter} has no exercise {name!r}; its exercises: {listed}")


def learner_folder(folder: str) -> Path:
    """The learner's folder: relative to where you are if it exists there, else to the course."""
    path = Path(folder)
    if path.is_absolute():
        return path
    return Path.cwd() / path if (Path.cwd() / path).is_dir() else ROOT / path


def levels_used(folder: Path) -> dict[str, dict[str, int]]:
    """{chapter (as a string): {exercise: highest level shown}} recorded in ``folder``."""
    path = folder / STATE_FILE
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict):
            raise ValueError("not a table")
    except ValueError as exc:
        raise HintError(f"{path} is damaged ({exc}): fix it or delete it to start over") from exc
    return state


def record_level(folder: Path, chapter: int, exercise: str, level: int) -> None:
    """Remember that ``level`` of ``exercise`` was shown (the highest one counts); written to a
    temporary file and renamed over the old one, so an interrupted write loses nothing."""
    state = levels_used(folder)
    chapter_state = state.setdefault(str(chapter), {})
    chapter_state[exercise] = max(level, chapter_state.get(exercise, 0))
    tmp = folder / f"{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, folder / STATE_FILE)


def show(chapter: int, exercise: str, level: int, text: str) -> str:
    paragraphs = [textwrap.fill(p, 92) for p in text.split("\n\n")]
    head = f"chapter {chapter} · {exercise} · hint {level} of {len(LEVELS)}: {LEVELS[level - 1]}"
    return head + "\n\n" + "\n\n".join(paragraphs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minitrain.hint",
        description="The next hint for an exercise (1: the idea, 2: the structure, 3: the recipe).",
    )
    parser.add_argument("chapter", type=int, help="chapter number")
    parser.add_argument("exercise", nargs="?", help="the exercise (without it: the chapter's list)")
    parser.add_argument("--level", type=int, choices=(1, 2, 3), help="show this level again")
    parser.add_argument("--folder", default="my_exercises",
                        help="your exercises' folder, where the levels used are kept")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except HintError as exc:
        print(f"hint: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.chapter not in CHAPTERS:
        raise HintError(f"there is no chapter {args.chapter}; chapters are {min(CHAPTERS)}–{max(CHAPTERS)}")
    folder = learner_folder(args.folder)
    used = levels_used(folder).get(str(args.chapter), {}) if folder.is_dir() else {}
    hints = hints_of(args.chapter)
    if args.exercise is None:
        print(f"chapter {args.chapter}: hints shown so far (of {len(LEVELS)} per exercise)")
        for name in exercises_of(args.chapter):
            available = "" if name in hints else "  (no hints written yet)"
            print(f"  {name:<40} {used.get(name, 0)}{available}")
        print(f"\nnext hint: python -m minitrain.hint {args.chapter} EXERCISE")
        return 0
    exercise = resolve_exercise(args.chapter, args.exercise)
    if exercise not in hints:
        raise HintError(f"chapter {args.chapter}'s {exercise} has no hints yet")
    reached = used.get(exercise, 0)
    level = args.level or min(reached + 1, len(LEVELS))
    if level > reached + 1:
        raise HintError(f"level {level} comes after level {reached + 1}: ask for that one first")
    print(show(args.chapter, exercise, level, hints[exercise][level - 1]))
    if not folder.is_dir():
        print(f"\n({folder} does not exist yet — `python -m minitrain.exercises start` — so this "
              "hint is not recorded)")
    else:
        record_level(folder, args.chapter, exercise, level)
    if level < len(LEVELS):
        again = "bughunt" if exercise == BUG_HUNT else exercise
        print(f"\nstill stuck? python -m minitrain.hint {args.chapter} {again}  (level {level + 1}: "
              f"the {LEVELS[level]})")
    else:
        print("\nthat was the last level; the graded test's message says what your code got wrong")
    return 0
