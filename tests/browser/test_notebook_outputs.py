"""The browser pass's output check (notebook_outputs.py) fails for an output that differs from
the committed one, and only then: nbval's markers, stream joining and sanitizing apply."""

from __future__ import annotations

import nbformat
from notebook_outputs import differing_outputs


def _stream(text):
    return {"output_type": "stream", "name": "stdout", "text": text}


def _committed(tmp_path, *cells):
    nb = nbformat.v4.new_notebook()
    for source, outputs in cells:
        cell = nbformat.v4.new_code_cell(source)
        cell.outputs = [nbformat.from_dict(o) for o in outputs]
        nb.cells.append(cell)
    path = tmp_path / "committed.ipynb"
    nbformat.write(nb, path)
    return path


def test_a_different_number_is_reported_naming_the_cell(tmp_path):
    path = _committed(tmp_path, ("print(1)", [_stream("1\n")]), ("print(0.848)", [_stream("0.848 %\n")]))
    problems = differing_outputs(path, [[_stream("1\n")], [_stream("0.846 %\n")]])
    assert len(problems) == 1 and problems[0].startswith("code cell 1: its stdout differs"), problems
    assert problems[0].endswith("line 1 committed '0.848 %', this run '0.846 %'"), problems


def test_markers_split_streams_sanitized_text_and_images_are_not_reported(tmp_path):
    figure = {"output_type": "display_data", "metadata": {},
              "data": {"text/plain": "<Figure size 640x480 with 1 Axes>", "image/png": "AAAA"}}
    path = _committed(
        tmp_path,
        ("# NBVAL_IGNORE_OUTPUT\nprint(time())", [_stream("3.2 s\n")]),
        ("print('a'); print('b')", [_stream("a\n"), _stream("b\n")]),
        ("print(obj)", [_stream("<object at 0x7f00aa11bb22>\n")]),
        ("plot()", [figure]),
    )
    run = [[_stream("2.9 s\n")], [_stream("a\nb\n")], [_stream("<object at 0x5555deadbeef>\n")],
           [dict(figure, data={**figure["data"], "image/png": "BBBB"})]]
    assert differing_outputs(path, run) == []


def test_a_missing_output_or_cell_is_reported(tmp_path):
    path = _committed(tmp_path, ("print(1)", [_stream("1\n")]), ("x = 1", []))
    assert differing_outputs(path, [[], []])[0].startswith("code cell 0: its stdout differs")
    assert differing_outputs(path, [[_stream("1\n")]]) == [
        "1 code cells ran, the committed notebook has 2"]
