"""Grade your exercises: ``python -m minitrain.grade [chapter ...]``.

Runs the graded tests of the chapters (``tests/grading/test_chNN_*.py``) with your
functions from ``my_exercises/`` patched into the library, and prints a score
table: points per test, pass or fail, the first problem in plain words, the highest
hint level you asked for (``python -m minitrain.hint``), the time taken. Every test has a time limit, so a deadlock is reported, not waited on.

    python -m minitrain.grade            # every chapter you have started
    python -m minitrain.grade 4          # chapter 4 only
    python -m minitrain.grade --verify   # course authors/CI: stubs score 0, solutions full marks
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from minitrain.course.exercises import CHAPTERS, ROOT
from minitrain.course.hints import HintError, learner_folder, levels_used

GRADING_DIR = ROOT / "tests" / "grading"


def test_files(chapter: int) -> list[Path]:
    return sorted(GRADING_DIR.glob(f"test_ch{chapter:02d}_*.py"))


def plain_words(excinfo) -> str:
    """The first thing that went wrong, said simply (no pytest internals)."""
    exc, kind = excinfo.value, excinfo.typename
    text = str(exc)
    # a bare pytest.raises in a graded test: its jargon said plainly (graded tests should
    # still say what the learner's function returned, as tests/grading/test_ch03 does)
    if kind == "Failed" and text.startswith("DID NOT RAISE"):
        wanted = text.removeprefix("DID NOT RAISE").strip()
        return f"expected a {wanted} to be raised; your function returned without one"
    found = re.search(r"Expected regex: (.*)\n\s*Actual message: (.*)", text)
    if kind == "AssertionError" and text.startswith("Regex pattern did not match") and found:
        return f"the error's message should match {found[1]}; it was {found[2]}"[:300]
    if kind == "AssertionError":
        return (text.split("\nassert ")[0].strip() or "an assertion failed").splitlines()[0][:300]
    if kind == "NotImplementedError":
        return f"not written yet ({text})" if text else "not written yet"
    if kind == "LaunchError":
        first = text.splitlines()[0]
        if "NotImplementedError" in text:
            found = re.findall(r"NotImplementedError: (.*)", text)
            return f"not written yet ({found[-1] if found else first})"
        if "died (signal" in first:  # gloo aborts (SIGABRT) on a recv whose size differs
            return (
                first + " — did each recv expect the size its matching send sent? gloo stops "
                "a process when they differ (e.g. an off-by-one chunk index)"
            )
        if "did not finish" in first:
            return (
                first + " — a send without a matching recv, or ranks calling in different orders?"
            )
        last = [line for line in text.splitlines() if line.strip()][-1]
        return f"{first.rstrip(':')} — {last.strip()}"[:300]
    if kind == "Failed" and "Timeout" in text:
        return f"took too long ({text.strip()}): is it stuck waiting for a message?"
    return f"{kind}: {text.splitlines()[0] if text else ''}"[:300]


def run_tests(chapters: list[int], source: Path, timeout: float, verbose: bool) -> list[dict]:
    files = [str(f) for c in chapters for f in test_files(c)]
    if not files:
        return []
    with tempfile.TemporaryDirectory(prefix="minitrain-grade-") as tmp:
        report = Path(tmp) / "report.json"
        env = dict(
            os.environ,
            MINITRAIN_EXERCISES=str(source),
            MINITRAIN_GRADE_CHAPTERS=",".join(map(str, chapters)),  # only these are patched in
            MINITRAIN_GRADE_REPORT=str(report),
        )
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *files,
            "-q",
            "-p",
            "no:cacheprovider",
            f"--timeout={timeout:g}",
            "--rootdir",
            str(ROOT),
        ]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=not verbose, text=True)
        if not report.exists():
            raise SystemExit(f"the graded tests could not run:\n{proc.stdout}\n{proc.stderr}")
        return json.loads(report.read_text())


def file_to_edit(exercise: str, folder: str = "my_exercises") -> str | None:
    """For a bug hunt's result (exercise "bug hunt: <qualname>"), the learner's file to fix."""
    from minitrain.course.bughunts import BUG_HUNTS

    if not exercise.startswith("bug hunt: "):
        return None
    qualname = exercise.removeprefix("bug hunt: ")
    stems = [h.stem for h in BUG_HUNTS if h.qualname == qualname]
    return f"{folder}/{stems[0]}.py" if stems else None


def print_table(
    results: list[dict], title: str, folder: str = "my_exercises", hints: dict | None = None
) -> tuple[int, int]:
    """One row per graded test; ``hints``: {exercise: highest hint level shown}
    (``python -m minitrain.hint``), printed beside each score, 0 when none was asked for."""
    from minitrain.course.hints import hint_key

    hints = hints or {}
    print(f"\n{title}")
    width = max([len(r["test"]) for r in results] + [4])
    print(f"  {'exercise':<24} {'test':<{width}}  points  result  hints  time")
    got = total = 0
    for r in results:
        earned = r["points"] if r["passed"] else 0
        got, total = got + earned, total + r["points"]
        mark = "pass" if r["passed"] else "FAIL"
        level = hints.get(hint_key(r["exercise"] or ""), 0)
        print(
            f"  {r['exercise']:<24} {r['test']:<{width}}  {earned:>2}/{r['points']:<3}  {mark:<6}"
            f"  {level}/3    {r['seconds']:.1f}s"
        )
        if not r["passed"]:
            where = file_to_edit(r["exercise"], folder)
            fix = f" (a bug hunt: find the broken line and fix it in {where})" if where else ""
            print(f"      -> {r['message']}{fix}")
    print(f"  score: {got}/{total}")
    return got, total


def _chapters_with_tests() -> list[int]:
    return [c for c in CHAPTERS if test_files(c)]


def verify(timeout: float, chapters: list[int] | None = None) -> int:
    """Every graded test fails on the unsolved stubs and passes on the solutions.

    The two runs are independent pytest processes, so they run at the same time: while one
    waits (a launch starting, a rank at a barrier, a deadlock waiting for its time limit) the
    other computes — on two cores about 1.6x faster than one after the other."""
    from concurrent.futures import ThreadPoolExecutor

    chapters = chapters or _chapters_with_tests()
    sides = (("solutions", True), ("exercises", False))

    def timed_run(folder: str) -> tuple[list[dict], float]:
        t0 = time.perf_counter()
        return run_tests(chapters, ROOT / folder, timeout, verbose=False), time.perf_counter() - t0

    with ThreadPoolExecutor(len(sides)) as pool:
        runs = list(pool.map(timed_run, [folder for folder, _ in sides]))
    bad = []
    for (folder, should_pass), (results, seconds) in zip(sides, runs):
        wrong = [r for r in results if r["passed"] != should_pass]
        print(
            f"{folder}: {len(results)} graded tests, {len(results) - len(wrong)} "
            f"{'passed' if should_pass else 'failed'} as they must ({seconds:.0f} s)"
        )
        for r in wrong:
            verdict = "fails on the solutions" if should_pass else "passes on the unsolved stubs"
            bad.append(f"  {r['file']}::{r['test']} {verdict}: {r['message']}")
        if not results:
            bad.append(f"  no graded tests ran against {folder}/")
    print("\n".join(bad) if bad else "every graded test can fail, and passes when solved")
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minitrain.grade",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("chapters", nargs="*", type=int, help="chapter numbers (default: all)")
    parser.add_argument(
        "--source",
        default="my_exercises",
        help="folder with your exNN_*.py files (default: my_exercises)",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per test")
    parser.add_argument("--verify", action="store_true", help="check stubs fail, solutions pass")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's own output")
    args = parser.parse_args(argv)
    if args.verify:
        return verify(args.timeout, args.chapters)
    for c in args.chapters:
        if c not in CHAPTERS:
            parser.error(f"there is no chapter {c}; chapters are {min(CHAPTERS)}–{max(CHAPTERS)}")
    source = learner_folder(args.source)  # relative to where you are, else to the course
    if not source.is_dir():
        print(
            f"{source} does not exist yet. Run `python -m minitrain.exercises start` to get "
            "your own copy of the exercises, fill them in, then grade again."
        )
        return 2
    chapters = args.chapters or [
        c for c in _chapters_with_tests() if (source / f"{CHAPTERS[c][0]}.py").exists()
    ]
    try:
        hint_levels = levels_used(source)
    except HintError as exc:  # a damaged record of hints must not stop the grading
        print(f"(hint levels not shown: {exc})")
        hint_levels = {}
    got = total = 0
    for c in chapters:
        stem = CHAPTERS[c][0]
        if not test_files(c):
            print(f"\nchapter {c}: no graded exercises yet")
            continue
        if not (source / f"{stem}.py").exists():
            print(
                f"\nchapter {c}: {source.name}/{stem}.py is missing — run "
                "`python -m minitrain.exercises start`"
            )
            continue
        t0 = time.perf_counter()
        results = run_tests([c], source, args.timeout, args.verbose)
        g, t = print_table(
            results,
            f"chapter {c} — {source.name}/{stem}.py ({time.perf_counter() - t0:.0f} s)",
            source.name,
            hint_levels.get(str(c)),
        )
        got, total = got + g, total + t
    if total:
        print(f"\ntotal: {got}/{total} points")
    return 0 if total and got == total else 1


if __name__ == "__main__":
    sys.exit(main())
