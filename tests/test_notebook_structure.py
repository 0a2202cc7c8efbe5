"""Notebooks as a learner meets them (issue 31): questions before answers, no fix on show,
a way on, and outputs that validate on any machine.

For every notebook 01-11: at least three questions whose answers are folded in
``<details><summary>...</summary>...</details>``; the last markdown cell names the next notebook
("Next: `05_zero.ipynb` ...", chapter 11 what to read next). For chapters with a bug hunt
(``minitrain.course.bughunts``): its file and its grading command are named in the chapter's
notebook, and no notebook shows the line that fixes any bug hunt (in sources or text
outputs). For every notebook: nbval compares at least 70 % of the code cells (a cell is
excluded by ``# NBVAL_IGNORE_OUTPUT`` / ``# NBVAL_SKIP`` or an ``nbval-*`` tag).
"""

import json
import re
from pathlib import Path

import pytest

from minitrain.course.bughunts import BUG_HUNTS

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
COURSE = [p for p in NOTEBOOKS if 1 <= int(p.name[:2]) <= 12]
MIN_DETAILS, MIN_COMPARED = 3, 0.70
EXCLUDED = ("NBVAL_IGNORE_OUTPUT", "NBVAL_SKIP", "NBVAL_RAISES_EXCEPTION")


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _texts(cell: dict) -> list[str]:
    """A cell's source and the text of its outputs."""
    texts = [_source(cell)]
    for out in cell.get("outputs", []):
        if "text" in out:
            texts.append("".join(out["text"]))
        for mime, data in out.get("data", {}).items():
            if mime.startswith("text/"):
                texts.append("".join(data) if isinstance(data, list) else data)
    return texts


def fix_lines(hunt) -> list[str]:
    """The lines that make the library's version the fix: those of ``fixed`` that the shipped
    version does not have (all of them when the bug was a missing line)."""
    shipped = {line.strip() for line in hunt.shipped.splitlines()}
    return [line.strip() for line in hunt.fixed.splitlines() if line.strip() and line.strip() not in shipped]


def fixes_shown(path: Path) -> list[str]:
    found = []
    for index, cell in enumerate(_cells(path)):
        lines = {line.strip() for text in _texts(cell) for line in text.splitlines()}
        for hunt in BUG_HUNTS:
            for line in fix_lines(hunt):
                if line in lines:
                    found.append(f"{path.name} cell {index} shows {hunt.stem}'s fix: {line!r}")
    return found


def folded_answers(path: Path) -> int:
    """``<details>`` blocks with a ``<summary>`` in the notebook's markdown cells."""
    return sum(len(re.findall(r"<details>\s*<summary>.+?</summary>.+?</details>", _source(c), re.S))
               for c in _cells(path) if c["cell_type"] == "markdown")


def names_next(path: Path) -> bool:
    markdown = [_source(c) for c in _cells(path) if c["cell_type"] == "markdown"]
    last = markdown[-1] if markdown else ""
    number = int(path.name[:2])
    following = [p.stem for p in NOTEBOOKS if int(p.name[:2]) == number + 1]
    if not following:  # the last chapter: what to read next
        return "Next" in last and "read" in last.lower()
    return "Next" in last and following[0] in last


def is_compared(cell: dict) -> bool:
    tags = cell.get("metadata", {}).get("tags", [])
    return not any(marker in _source(cell) for marker in EXCLUDED) and \
        not any(tag.startswith("nbval-") or tag == "raises-exception" for tag in tags)


def compared_share(path: Path) -> float:
    code = [c for c in _cells(path) if c["cell_type"] == "code"]
    return sum(map(is_compared, code)) / len(code) if code else 1.0


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_bug_hunt_fix_on_show(notebook):
    found = fixes_shown(notebook)
    assert not found, "a notebook shows a bug hunt's answer:\n" + "\n".join(found)


@pytest.mark.parametrize("notebook", COURSE, ids=lambda p: p.stem)
def test_questions_before_answers(notebook):
    n = folded_answers(notebook)
    assert n >= MIN_DETAILS, f"{notebook.name}: {n} folded answers (<details><summary>), want {MIN_DETAILS}"


@pytest.mark.parametrize("notebook", COURSE, ids=lambda p: p.stem)
def test_last_text_names_the_next_notebook(notebook):
    assert names_next(notebook), f"{notebook.name}: the last markdown cell does not say 'Next' and name the next notebook"


@pytest.mark.parametrize("hunt", BUG_HUNTS, ids=lambda h: h.stem)
def test_bug_hunt_introduced_in_its_chapter(hunt):
    notebook, = [p for p in NOTEBOOKS if int(p.name[:2]) == hunt.chapter]
    text = "\n".join(t for c in _cells(notebook) if c["cell_type"] == "markdown" for t in _texts(c))
    assert hunt.stem in text, f"{notebook.name} never names its bug hunt {hunt.stem}"
    command = f"python -m minitrain.grade {hunt.chapter}"
    assert command in text, f"{notebook.name} does not say how to run {hunt.stem}: {command!r}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_nbval_compares_most_code_cells(notebook):
    share = compared_share(notebook)
    assert share >= MIN_COMPARED, f"{notebook.name}: nbval compares {share:.0%} of its code cells, want ≥ 70 %"


def test_the_checks_can_fail(tmp_path):
    """Each check catches a notebook that breaks it."""
    hunt = BUG_HUNTS[0]
    cells = [
        {"cell_type": "markdown", "source": "# 01 · x\n<details><summary>A</summary>\n\nb\n\n</details>"},
        {"cell_type": "code", "source": "    " + fix_lines(hunt)[0], "outputs": []},
        {"cell_type": "code", "source": "# NBVAL_IGNORE_OUTPUT\nx = 1", "outputs": []},
        {"cell_type": "markdown", "source": "## Summary\n\nNext: chapter 2."},
    ]
    path = tmp_path / "01_x.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    assert fixes_shown(path)
    assert folded_answers(path) == 1
    assert not names_next(path)  # names a chapter, not the notebook 02_...
    assert compared_share(path) == 0.5


def test_moe_widget_starts_where_notebook_08_trains():
    """Issue 31: the widget defaulted to top-1 while the balancing runs above it train top-2."""
    import inspect

    from minitrain.widgets.ch08_moe import build_moe_widget

    default = inspect.signature(build_moe_widget).parameters["top_k"].default
    assert default == 2, f"build_moe_widget starts at top-{default}; notebook 08's balancing runs use top-2"
    moe = [p for p in NOTEBOOKS if p.name.startswith("08_")]
    if moe:  # (tests/mutations.py copies no notebooks: there the default alone is checked)
        text = "\n".join(_source(c) for c in _cells(moe[0]))
        ks = set(re.findall(r"train_load_history\([^)]*top_k=(\d+)", text))
        assert ks == {str(default)}, f"notebook 08 trains with top_k {ks}, the widget starts at {default}"
