"""The exercises: generated from the library itself, and patched back into it for grading.

One source of truth: the reference answer of an exercise is the code between
``### BEGIN SOLUTION`` and ``### END SOLUTION`` inside a function of ``minitrain/``.

    python -m minitrain.exercises build    # course authors: write exercises/ and solutions/
    python -m minitrain.exercises check    # CI: fail if either folder is out of date
    python -m minitrain.exercises start    # learners: copy the stubs to my_exercises/ and the
                                           # notebooks to my_notebooks/ (new ones only)

Grading (``python -m minitrain.grade``) then puts the learner's functions in place of
the library's: ``minitrain.course.patching``.

Files by role (this one is the command line and re-exports their names):
``chapters.py`` holds CHAPTERS, each chapter's exercise modules (edit it when a chapter's
exercises move); ``exercise_regions.py`` finds the marked functions; ``exercise_files.py``
renders, builds, checks and copies the files.
"""

from __future__ import annotations

import argparse
import sys

# the public face: every name below was importable from here before the split
from minitrain.course.chapters import CHAPTERS, ROOT
from minitrain.course.exercise_files import (
    HASH_PREFIX,
    build,
    check,
    generated_files,
    is_pristine,
    render,
    start,
)
from minitrain.course.exercise_regions import (
    BEGIN,
    END,
    HINT,
    Exercise,
    chapter_exercises,
    exercises_of,
)

__all__ = [
    "BEGIN",
    "CHAPTERS",
    "END",
    "HASH_PREFIX",
    "HINT",
    "ROOT",
    "Exercise",
    "build",
    "chapter_exercises",
    "check",
    "exercises_of",
    "generated_files",
    "is_pristine",
    "main",
    "render",
    "start",
]


# --------------------------------------------------------------------------- command line
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minitrain.exercises",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write exercises/ and solutions/ from minitrain/")
    b.add_argument("--force", action="store_true", help="overwrite edited exercise files")
    sub.add_parser("check", help="fail if exercises/ or solutions/ are out of date")
    sub.add_parser("start", help="copy the exercise stubs you don't have yet to my_exercises/")
    args = parser.parse_args(argv)
    if args.command == "build":
        written = build(force=args.force)
        print("\n".join(f"wrote {p.relative_to(ROOT)}" for p in written) or "already up to date")
    elif args.command == "check":
        problems = check()
        print("\n".join(problems) or "exercises/ and solutions/ are up to date")
        return 1 if problems else 0
    elif args.command == "start":
        copied = start()
        for p in copied:
            print(f"created {p.relative_to(ROOT)}")
        print(
            "Your files are in my_exercises/ and my_notebooks/ (yours: never overwritten by "
            "the course). Grade a chapter with `python -m minitrain.grade N`."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
