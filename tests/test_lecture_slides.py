"""Lecture mode: every notebook is marked up for slides (standard ``slideshow`` cell metadata,
read by Voilà's reveal template), exactly as ``python -m minitrain.course.notebooks slides``
writes it — so a new or edited notebook fails here until the tool is run on it. And the
GPU workflow is a valid GitHub Actions file that runs ``make test-gpu`` on a GPU runner."""

import json

import pytest

from minitrain.course.notebooks import ROOT, mark_slides, slide_type

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_slide_types_follow_the_structure():
    def md(text):
        return {"cell_type": "markdown", "source": text, "metadata": {}}

    assert slide_type(md("# 04 · Title"), 0) == "slide"
    assert slide_type(md("## 2. A section"), 5) == "slide"
    assert slide_type(md("### A detail"), 6) == "subslide"
    assert slide_type(md("Prose under the section"), 7) == "fragment"
    assert slide_type({"cell_type": "code", "source": "x = 1", "metadata": {}}, 8) == "-"
    kept = md("## set-up")
    kept["metadata"] = {"slideshow": {"slide_type": "skip"}}  # an author's choice stays
    assert slide_type(kept, 3) == "skip"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_marked_up_for_slides(path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    assert not mark_slides(nb), (
        f"{path.name} lacks slide markup: run `python -m minitrain.course.notebooks slides`"
    )
    sections = [
        c for c in nb.cells if c.cell_type == "markdown" and c.source.lstrip().startswith("## ")
    ]
    assert sections, f"{path.name} has no ## section to make a slide of"
    assert all(c.metadata["slideshow"]["slide_type"] == "slide" for c in sections)


def test_slides_tool_is_idempotent(tmp_path):
    import nbformat

    nb = nbformat.read(NOTEBOOKS[0], as_version=4)
    for cell in nb.cells:
        cell.metadata.pop("slideshow", None)
    assert mark_slides(nb) and not mark_slides(nb)


def test_gpu_workflow_runs_make_test_gpu_on_a_gpu_runner():
    yaml = pytest.importorskip("yaml")
    flow = yaml.safe_load((ROOT / ".github" / "workflows" / "gpu.yml").read_text())
    (job,) = flow["jobs"].values()
    assert job["runs-on"] == ["self-hosted", "gpu"]
    assert any(step.get("run", "").strip() == "make test-gpu" for step in job["steps"])
    assert json.dumps(flow)  # plain data: nothing left unparsed
