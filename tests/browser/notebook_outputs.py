"""The browser pass checks outputs as nbval does, at another thread count (issue 33).

``make nbval`` executes every notebook once, with one thread, and compares each cell's outputs
with the committed ones. ``make browser`` executes every notebook again anyway (Run All in
JupyterLab, to drive its widgets) — with ``OMP_NUM_THREADS=2`` — and then compares *those*
outputs with the committed ones by nbval's own rules: an output that depends on the thread
count (a reduction order, a BLAS kernel) fails here instead of on a learner's laptop, without
a third execution of every notebook.

nbval's rules, reused from nbval itself (``nbval.plugin``): cells marked ``# NBVAL_IGNORE_OUTPUT``
or ``# NBVAL_SKIP`` (or tagged so) are not compared; streams of one name are joined;
every output field and MIME type is compared except the ones nbval skips (images, metadata,
tracebacks, execution counts, widget model ids), each after the substitutions of
``tests/nbval_sanitize.cfg``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import nbformat
from nbval.plugin import (
    coalesce_streams,
    find_comment_markers,
    find_metadata_tags,
    get_sanitize_patterns,
    transform_streams_for_comparison,
)

ROOT = Path(__file__).resolve().parents[2]
SANITIZE = ROOT / "tests" / "nbval_sanitize.cfg"  # the file `make nbval` passes to nbval
SKIP = ("metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
        "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg")  # nbval's


def compared_cells(notebook: Path) -> list[tuple[int, object | None]]:
    """(code cell index, its committed outputs or None when nbval would not compare them)."""
    nb = nbformat.read(str(notebook), as_version=4)
    out = []
    for index, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        options = dict(find_metadata_tags(cell.metadata))
        options.update(find_comment_markers(cell.source))
        compared = options.get("check", True) and not options.get("skip", False)
        out.append((index, cell.outputs if compared else None))
    return out


def _fields(outputs, patterns) -> dict[str, list]:
    """nbval's view of a cell's outputs: {field or MIME type: [sanitized values]}."""
    nodes = [nbformat.from_dict(o) for o in outputs]
    for node in nodes:
        if node.get("output_type") == "stream" and isinstance(node.get("text"), list):
            node.text = "".join(node.text)
        for mime, value in node.get("data", {}).items():
            if isinstance(value, list):
                node.data[mime] = "".join(value)
    fields = defaultdict(list)
    for output in transform_streams_for_comparison(coalesce_streams(nodes)):
        for key, value in output.items():
            if key in SKIP:
                continue
            items = value.items() if key == "data" else [(key, value)]
            for field, v in items:
                if field not in SKIP:
                    fields[field].append(_sanitize(v, patterns))
    return dict(fields)


def _sanitize(value, patterns):
    if not isinstance(value, str):
        return value
    for regex, replace in patterns:
        value = re.sub(regex, replace, value)
    return value


def _first_difference(want: list | None, got: list | None) -> str:
    """Where two lists of output values first differ, said in a line (the first differing
    line of text, not the whole output)."""
    want_text, got_text = "".join(map(str, want or [])), "".join(map(str, got or []))
    if want is None or got is None:
        return "committed " + ("nothing" if want is None else repr(want_text[:120])) + \
            ", this run " + ("nothing" if got is None else repr(got_text[:120]))
    want_lines, got_lines = want_text.splitlines(), got_text.splitlines()
    for number, (a, b) in enumerate(zip(want_lines, got_lines), 1):
        if a != b:
            return f"line {number} committed {a[:150]!r}, this run {b[:150]!r}"
    return (f"the committed output has {len(want_lines)} lines, this run {len(got_lines)} "
            f"(from line {min(len(want_lines), len(got_lines)) + 1} on)")


def differing_outputs(notebook: Path, run_outputs: list[list[dict]]) -> list[str]:
    """The code cells whose outputs in ``run_outputs`` (per code cell, as JupyterLab's
    ``outputs.toJSON()`` gives them) differ from the committed ones by nbval's rules."""
    patterns = get_sanitize_patterns(SANITIZE.read_text())
    committed = compared_cells(notebook)
    if len(committed) != len(run_outputs):
        return [f"{len(run_outputs)} code cells ran, the committed notebook has {len(committed)}"]
    problems = []
    for (index, want), got in zip(committed, run_outputs):
        if want is None:
            continue
        want_fields, got_fields = _fields(want, patterns), _fields(got, patterns)
        if want_fields != got_fields:
            key = next(k for k in sorted(set(want_fields) | set(got_fields))
                       if want_fields.get(k) != got_fields.get(k))
            problems.append(f"code cell {index}: its {key} differs from the committed output: "
                            + _first_difference(want_fields.get(key), got_fields.get(key)))
    return problems
