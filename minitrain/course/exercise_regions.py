"""Finding the exercises: the functions of the library that carry solution markers.

One source of truth: the reference answer of an exercise is the code between
``### BEGIN SOLUTION`` and ``### END SOLUTION`` inside a function of ``minitrain/``. This
file reads those regions (with ``ast``, from the modules' source) into ``Exercise``
records: the stub a learner gets (docstring and contract checks, no solution) and the worked
solution. Hints are not in the source: ``python -m minitrain.hint`` gives them on request
(``hints.py``); a ``# HINT`` comment left in a solution is refused.
Used by ``python -m minitrain.exercises build|check`` (``exercise_files.py``), by grading
(``patching.py``: which functions to take from a learner's file) and by
``python -m minitrain.course.notebooks`` (notebooks must not print an answer).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from dataclasses import dataclass

from minitrain.course.chapters import CHAPTERS

BEGIN, END, HINT = "### BEGIN SOLUTION", "### END SOLUTION", "# HINT"


@dataclass
class Exercise:
    module: str  # "minitrain.collectives"
    qualname: str  # "ring_all_reduce" or "DataParallel._on_grad_ready"
    stub: str  # source of the function with the solution removed
    solution: str  # source of the function with the solution
    names_used: set[str]  # global names its body reads

    @property
    def class_name(self) -> str | None:
        return self.qualname.split(".")[0] if "." in self.qualname else None

    @property
    def name(self) -> str:
        return self.qualname.split(".")[-1]


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
            if any(line.strip().startswith(HINT) for line in body):
                raise ValueError(
                    f"{module.__name__}.{qual}: a {HINT} comment in the source gives the answer "
                    "away unasked; hints go in minitrain/course/hints/chNN.toml"
                )
            message = (f'raise NotImplementedError("exercise: write {qual} (its docstring says '
                       f'what; stuck? python -m minitrain.hint)")')
            stub = body[:b] + [indent + message] + body[e + 1 :]
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
