"""No notebook gives an exercise's answer away: not in its cells, not in their outputs.

A notebook may show a stub's signature and docstring, or the library code *around* an
exercise (``inspect.getsource(f).split("### BEGIN")[0]``), never the solution. This reads
every notebook's sources and text outputs and fails, naming the notebook, cell and
exercise, if it finds a solution marker or a line of a solution.
"""

import json
from pathlib import Path

import pytest

from minitrain.course.exercises import BEGIN, CHAPTERS, END, HINT, chapter_exercises

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
# a solution line counts as "shown" when it is long enough to be distinctive: short lines
# such as `return loss` or `loss = None` also occur in code that is not an answer
MIN_LENGTH = 30


def _solution_lines() -> dict[str, str]:
    """Distinctive line of a solution -> the exercise it comes from."""
    lines = {}
    for chapter in CHAPTERS:
        for ex in chapter_exercises(chapter):
            body = ex.solution.splitlines()
            marks = [i for i, line in enumerate(body) if line.strip() in (BEGIN, END)]
            for line in body[marks[0] + 1 : marks[1]]:
                text = line.strip()
                if len(text) >= MIN_LENGTH and not text.startswith(("#", HINT)):
                    lines[text] = f"{ex.module}.{ex.qualname}"
    return lines


def _cell_texts(cell) -> list[tuple[str, str]]:
    texts = [("source", "".join(cell.get("source", [])))]
    for out in cell.get("outputs", []):
        if "text" in out:
            texts.append(("output", "".join(out["text"])))
        for mime, data in out.get("data", {}).items():
            if mime.startswith("text/"):
                texts.append(("output", "".join(data) if isinstance(data, list) else data))
    return texts


def find_answers(notebook: Path, solution_lines: dict[str, str]) -> list[str]:
    """Every place in ``notebook`` that shows a solution marker or a solution's line."""
    found = []
    cells = json.loads(notebook.read_text())["cells"]
    for index, cell in enumerate(cells):
        for where, text in _cell_texts(cell):
            for marker in (BEGIN, END):
                if marker in text:
                    found.append(f"{notebook.name} cell {index} {where}: shows {marker!r}")
            shown = {line.strip() for line in text.splitlines()}
            for line in sorted(shown & solution_lines.keys()):
                found.append(
                    f"{notebook.name} cell {index} {where}: shows a line of the answer to "
                    f"{solution_lines[line]}: {line!r}"
                )
    return found


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_shows_no_answer(notebook):
    found = find_answers(notebook, _solution_lines())
    assert not found, "a notebook gives answers away:\n" + "\n".join(found)


def test_the_check_finds_an_answer_shown(tmp_path):
    """The check itself can fail: a notebook printing a solution is caught."""
    lines = _solution_lines()
    answer = next(iter(lines))
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "source": ["print(inspect.getsource(f))"],
                "outputs": [
                    {"output_type": "stream", "name": "stdout", "text": [f"    {answer}\n"]}
                ],
            },
            {"cell_type": "markdown", "source": [f"    {BEGIN}\n"]},
        ]
    }
    path = tmp_path / "99_leaky.ipynb"
    path.write_text(json.dumps(nb))
    found = find_answers(path, lines)
    assert len(found) == 2 and "cell 0 output" in found[0] and "cell 1 source" in found[1], found
