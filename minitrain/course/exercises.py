"""The exercises: generated from the library itself, and patched back into it for grading.

One source of truth: the reference answer of an exercise is the code between
``### BEGIN SOLUTION`` and ``### END SOLUTION`` inside a function of ``minitrain/``.

    python -m minitrain.exercises build    # course authors: write exercises/ and solutions/
    python -m minitrain.exercises check    # CI: fail if either folder is out of date
    python -m minitrain.exercises start    # learners: copy the stubs to my_exercises/ and the
                                           # notebooks to my_notebooks/ (new ones only)

Grading (``python -m minitrain.grade``) then puts the learner's functions in place of
the library's: ``minitrain.course.patching``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import importlib.util
import inspect
import shutil
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

BEGIN, END, HINT = "### BEGIN SOLUTION", "### END SOLUTION", "# HINT"
HASH_PREFIX = "# minitrain-exercises-hash: "
ROOT = Path(__file__).resolve().parents[2]  # the course repository

# chapter -> (exercise file stem, modules whose marked functions it contains)
CHAPTERS: dict[int, tuple[str, list[str]]] = {
    0: ("ex00_point_to_point", ["minitrain.point_to_point"]),
    1: (
        "ex01_single_device",
        ["minitrain.model", "minitrain.data", "minitrain.memory", "minitrain.train_step"],
    ),
    2: (
        "ex02_precision",
        [
            "minitrain.precision.formats",
            "minitrain.precision.loss_scaling",
            "minitrain.precision.master_weights",
        ],
    ),
    3: ("ex03_checkpointing", ["minitrain.checkpointing.function", "minitrain.checkpointing.cost"]),
    4: (
        "ex04_collectives_and_ddp",
        ["minitrain.collectives_ring", "minitrain.ddp.bucketing", "minitrain.ddp.data_parallel"],
    ),
    5: (
        "ex05_zero",
        [
            "minitrain.zero.partition",
            "minitrain.zero.optimizer",
            "minitrain.zero.data_parallel",
            "minitrain.fsdp.wrapper",
        ],
    ),
    # later chapters: their authors list the modules (files of their packages) here
    6: (
        "ex06_tensor_parallel",
        [
            "minitrain.tensor_parallel.mappings",
            "minitrain.tensor_parallel.layers",
            "minitrain.tensor_parallel.cross_entropy",
        ],
    ),
    7: (
        "ex07_pipeline_parallel",
        [
            "minitrain.pipeline.schedules",
            "minitrain.pipeline.executor",
            "minitrain.pipeline.check",
        ],
    ),
    8: (
        "ex08_mixture_of_experts",
        ["minitrain.moe.router", "minitrain.moe.dispatch", "minitrain.moe.losses"],
    ),
    9: ("ex09_flash_attention", ["minitrain.flash_attention.tiles"]),
    10: (
        "ex10_context_parallel",
        ["minitrain.context_parallel.merge", "minitrain.context_parallel.ring"],
    ),
    11: ("ex11_putting_it_together", ["minitrain.mesh", "minitrain.planner", "minitrain.train"]),
}


@dataclass
class Exercise:
    module: str  # "minitrain.collectives"
    qualname: str  # "ring_all_reduce" or "DataParallel._on_grad_ready"
    stub: str  # source of the function with the solution removed (hints kept)
    solution: str  # source of the function with the solution
    names_used: set[str]  # global names its body reads

    @property
    def class_name(self) -> str | None:
        return self.qualname.split(".")[0] if "." in self.qualname else None

    @property
    def name(self) -> str:
        return self.qualname.split(".")[-1]


# --------------------------------------------------------------------------- finding exercises
def _load_module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:  # the chapter's module is not written yet
            return None
        raise


def exercises_of(module) -> list[Exercise]:
    """Every function (or method of a top-level class) of ``module`` with solution markers."""
    source = inspect.getsource(module)
    lines = source.splitlines()
    tree = ast.parse(source)
    found = []
    for node in tree.body:
        members = [(node, None)] if isinstance(node, ast.FunctionDef) else []
        if isinstance(node, ast.ClassDef):
            members = [(m, node.name) for m in node.body if isinstance(m, ast.FunctionDef)]
        for fn, cls in members:
            start = (fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno) - 1
            end = fn.end_lineno  # ast ends at the last statement: take trailing comments too
            def_indent = len(lines[fn.lineno - 1]) - len(lines[fn.lineno - 1].lstrip())
            while (
                end < len(lines)
                and lines[end].strip().startswith("#")
                and (len(lines[end]) - len(lines[end].lstrip()) > def_indent)
            ):
                end += 1
            body = lines[start:end]
            marks = [i for i, line in enumerate(body) if line.strip() in (BEGIN, END)]
            if not marks:
                continue
            qual = f"{cls}.{fn.name}" if cls else fn.name
            if len(marks) != 2 or body[marks[0]].strip() != BEGIN:
                raise ValueError(
                    f"{module.__name__}.{qual}: needs exactly one {BEGIN} … {END} pair"
                )
            b, e = marks
            indent = body[b][: len(body[b]) - len(body[b].lstrip())]
            hints = [line for line in body[b + 1 : e] if line.strip().startswith(HINT)]
            message = f'raise NotImplementedError("exercise: write {qual} (see its docstring)")'
            stub = body[:b] + hints + [indent + message] + body[e + 1 :]
            used = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
            found.append(
                Exercise(
                    module.__name__,
                    qual,
                    textwrap.dedent("\n".join(stub)),
                    textwrap.dedent("\n".join(body)),
                    used,
                )
            )
    return found


def chapter_exercises(chapter: int) -> list[Exercise]:
    _, modules = CHAPTERS[chapter]
    out = []
    for name in modules:
        module = _load_module(name)
        if module is not None:
            out.extend(exercises_of(module))
    return out


# --------------------------------------------------------------------------- writing the files
def render(chapter: int, solved: bool) -> str | None:
    """The text of exercises/exNN_*.py (``solved=False``) or solutions/exNN_*.py; None if none."""
    stem, _ = CHAPTERS[chapter]
    exs = chapter_exercises(chapter)
    if not exs:
        return None
    plain: set[str] = set()  # "import torch", "import torch.distributed as dist"
    froms: dict[str, set[str]] = {}  # module -> {"name", "name as alias"}
    for mod_name in dict.fromkeys(e.module for e in exs):
        tree = ast.parse(inspect.getsource(sys.modules[mod_name]))
        defined = set()
        for node in tree.body:
            if isinstance(node, ast.Import):
                plain |= {
                    f"import {a.name}" + (f" as {a.asname}" if a.asname else "") for a in node.names
                }
            elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
                froms.setdefault(node.module, set()).update(
                    a.name + (f" as {a.asname}" if a.asname else "") for a in node.names
                )
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined |= {t.id for t in targets if isinstance(t, ast.Name)}
        own = {e.class_name or e.name for e in exs if e.module == mod_name}
        used = set().union(*(e.names_used for e in exs if e.module == mod_name))
        if used & defined - own:
            froms.setdefault(mod_name, set()).update(used & defined - own)
    # the exercises' own classes and functions are defined below (as stubs): don't import them
    below = {e.class_name or e.name for e in exs}
    froms = {m: names - below for m, names in froms.items() if names - below}
    # standard library and third party first, then minitrain; each group sorted
    header_imports = sorted(plain, key=lambda line: (line.startswith("import minitrain"), line))
    header_imports += [
        f"from {m} import {', '.join(sorted(froms[m]))}"
        for m in sorted(froms, key=lambda m: (m.startswith("minitrain"), m))
    ]
    kind = "SOLUTIONS" if solved else "EXERCISES"
    modules = ", ".join(dict.fromkeys(e.module for e in exs))
    parts = [
        f'"""Chapter {chapter} {kind.lower()} — generated from {modules}.\n\n'
        + (
            "The worked answers. Look one up when you are stuck; the library has them too.\n"
            if solved
            else "Do not edit this file: run `python -m minitrain.exercises start` and edit the copy\n"
            f"in my_exercises/{stem}.py, then grade it with `python -m minitrain.grade {chapter}`.\n"
            "Replace each `raise NotImplementedError` with your code; the docstrings say what to\n"
            "compute and the HINT comments how to start. Names of the library are imported\n"
            "above your functions, so you can call its helpers.\n"
        )
        + '"""\n\nfrom __future__ import annotations\n',
        "\n".join(dict.fromkeys(header_imports)) + "\n",
    ]
    by_class: dict[str | None, list[Exercise]] = {}
    for e in exs:
        by_class.setdefault(e.class_name and f"{e.module}:{e.class_name}", []).append(e)
    for key, group in by_class.items():
        if key is None:
            parts += ["\n" + (e.solution if solved else e.stub) + "\n" for e in group]
        else:
            cls = key.split(":")[1]
            methods = "\n\n".join(
                textwrap.indent(e.solution if solved else e.stub, "    ") for e in group
            )
            parts.append(
                f"\nclass {cls}:\n    # Only the methods you write; the rest of the class "
                f"is in {key.split(':')[0]}.\n\n{methods}\n"
            )
    body = "\n".join(parts).rstrip() + "\n"
    body = body.replace("\n\n\n\n", "\n\n\n")
    return body + "\n" + HASH_PREFIX + _digest(body) + "\n"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_pristine(path: Path) -> bool:
    """True if the file is exactly what a build wrote (its recorded hash matches its body)."""
    text = path.read_text()
    body, _, last = text.rstrip("\n").rpartition("\n")
    return last.startswith(HASH_PREFIX) and last[len(HASH_PREFIX) :] == _digest(
        body.rstrip("\n") + "\n"
    )


def generated_files() -> list[tuple[str, str, bool, str | None]]:
    """(folder, file stem, solved, text) of every file build writes: each chapter's exercises
    and solutions, and each bug hunt's shipped bug and fix (minitrain.course.bughunts)."""
    from minitrain.course import bughunts

    files = []
    for chapter, (stem, _) in CHAPTERS.items():
        for folder, solved in (("exercises", False), ("solutions", True)):
            files.append((folder, stem, solved, render(chapter, solved)))
    for hunt in bughunts.BUG_HUNTS:
        for folder, solved in (("exercises", False), ("solutions", True)):
            body = bughunts.render(hunt, fixed=solved)
            files.append((folder, hunt.stem, solved, body + "\n" + HASH_PREFIX + _digest(body) + "\n"))
    return files


def build(force: bool = False, root: Path = ROOT) -> list[Path]:
    """Write exercises/ and solutions/ from the library; refuse to overwrite an edited file."""
    written = []
    for folder, stem, _solved, text in generated_files():
        path = root / folder / f"{stem}.py"
        if text is None:
            continue
        if path.exists() and not force and not is_pristine(path):
            raise SystemExit(
                f"refusing to overwrite {path}: it was edited after the last build "
                "(a learner's work?). Move it away or pass --force."
            )
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
            written.append(path)
    return written


def check(root: Path = ROOT) -> list[str]:
    """Problems that make exercises/ or solutions/ differ from what build would write."""
    problems = []
    for folder, stem, _solved, text in generated_files():
        path = root / folder / f"{stem}.py"
        if text is None and path.exists():
            problems.append(f"{path} exists but its chapter has no marked exercises")
        elif text is not None and (not path.exists() or path.read_text() != text):
            problems.append(f"{path} is out of date: run `python -m minitrain.exercises build`")
    return problems


def start(
    root: Path = ROOT, target: str = "my_exercises", notebooks: str = "my_notebooks"
) -> list[Path]:
    """Copy what a learner does not have yet: the exercise stubs into my_exercises/, the
    notebooks into my_notebooks/ (both git-ignored). Never overwrite a file: a learner's
    code and a learner's executed notebook are theirs, and `git pull` cannot conflict
    with them. Instructors and `make test` use the tracked notebooks/."""
    copied = []
    for folder, pattern, dest in (
        ("exercises", "ex*.py", root / target),
        ("exercises", "bughunt*.py", root / target),
        ("notebooks", "*.ipynb", root / notebooks),
    ):
        dest.mkdir(exist_ok=True)
        for src in sorted((root / folder).glob(pattern)):
            if not (dest / src.name).exists():
                shutil.copyfile(src, dest / src.name)
                copied.append(dest / src.name)
    return copied


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
