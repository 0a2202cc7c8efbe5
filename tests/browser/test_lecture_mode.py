"""Lecture mode in the browser: the command ``make lecture`` runs (Voilà, reveal.js template)
serves a notebook as slides built from its ``slideshow`` metadata, with the widgets live."""

from __future__ import annotations

import re
import subprocess
import time

import pytest
from jupyter_browser import GOOD_WIDGET, free_port, tiny_notebook

from minitrain.course.notebooks import ROOT, lecture_command, lecture_url


@pytest.mark.timeout(240)
def test_lecture_mode_shows_slides_with_a_live_widget(browser, shots, tmp_path):
    # inside the course (Voilà serves the slides' stylesheet from it), in a git-ignored folder
    notebook = tiny_notebook(shots / "lecture-selftest.ipynb", GOOD_WIDGET, "print(6 * 7)")
    port, token = free_port(), "lecture-test-token"
    log = open(tmp_path / "voila.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        lecture_command(token, port),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    try:
        deadline = time.monotonic() + 60
        while f"127.0.0.1:{port}" not in (tmp_path / "voila.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "voila.log"
            ).read_text()
            time.sleep(0.3)
        page.goto(lecture_url(notebook, token, port), timeout=120_000)
        page.wait_for_selector(".reveal .slides > section", timeout=120_000)
        # the title and one slide per "##" section (tiny_notebook: two sections)
        assert page.locator(".reveal .slides > section").count() == 3
        # one slide at a time (the stylesheet of docs/lecture/ is served and applied)
        assert page.locator(".reveal .slides > section:visible").count() == 1
        page.keyboard.press("ArrowRight")
        slide = page.locator(".reveal .slides > section.present")
        handle = slide.locator(".noUi-handle")
        handle.wait_for(timeout=60_000)  # the widget is rendered, not its text repr
        assert "3 ranks → 4 messages" in slide.inner_text()
        # drag the handle to the right, as a person does (arrow keys belong to reveal.js here)
        box, track = handle.bounding_box(), slide.locator(".noUi-target").bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.mouse.down()
        page.mouse.move(track["x"] + 0.9 * track["width"], box["y"] + box["height"] / 2, steps=8)
        page.mouse.up()
        page.wait_for_function(
            "() => !document.querySelector('.reveal .slides > section.present').innerText"
            ".includes('3 ranks → 4 messages')",
            timeout=30_000,
        )
        ranks, messages = map(
            int, re.search(r"(\d+) ranks → (\d+) messages", slide.inner_text()).groups()
        )
        assert ranks > 3 and messages == 2 * (ranks - 1), slide.inner_text()  # the kernel answered
        page.screenshot(path=str(shots / "lecture-selftest.jpg"), type="jpeg", quality=60)
        page.keyboard.press("ArrowRight")
        assert re.search(r"\b42\b", page.locator(".reveal .slides > section.present").inner_text())
    finally:
        page.close()
        proc.terminate()
        proc.wait(20)
        log.close()


# a course notebook, as an instructor presents it: notebook 04 (its widget re-plots measured
# timelines; Voilà runs the whole notebook first, about 25 s here)
_WIDGET_SHOWN = """() => {
  const h = document.querySelector('.reveal .slides > section.present .noUi-handle');
  const f = h && h.closest('.fragment');
  return !!h && (!f || f.classList.contains('visible'));
}"""


@pytest.mark.timeout(300)
def test_lecture_mode_presents_notebook_04_with_its_widget_live(browser, shots, tmp_path):
    notebook = ROOT / "notebooks" / "04_collectives_and_data_parallel.ipynb"
    port, token = free_port(), "lecture-test-token"
    log = open(tmp_path / "voila.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen(lecture_command(token, port), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    try:
        deadline = time.monotonic() + 60
        while f"127.0.0.1:{port}" not in (tmp_path / "voila.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "voila.log"
            ).read_text()
            time.sleep(0.3)
        page.goto(lecture_url(notebook, token, port), timeout=240_000)
        page.wait_for_selector(".reveal .slides > section", timeout=240_000)
        # forward, as the presenter does (slides and fragments), until the widget is shown
        presses = 0
        while not page.evaluate(_WIDGET_SHOWN) and presses < 80:
            page.keyboard.press("ArrowRight")
            presses += 1
            time.sleep(0.2)
        assert page.evaluate(_WIDGET_SHOWN), f"no widget shown after {presses} presses of →"
        slide = page.locator(".reveal .slides > section.present")
        handle = slide.locator(".noUi-handle").first
        page.mouse.move(640, 400)
        for _ in range(40):  # a tall slide scrolls: the wheel brings the slider on screen
            box = handle.bounding_box()
            if box and 100 < box["y"] < 700:
                break
            page.mouse.wheel(0, 300)
            time.sleep(0.2)
        before = slide.inner_text()
        box, track = handle.bounding_box(), slide.locator(".noUi-target").first.bounding_box()
        to_left = box["x"] - track["x"] > track["width"] / 2
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.mouse.down()
        page.mouse.move(track["x"] + (0.05 if to_left else 0.95) * track["width"],
                        box["y"] + box["height"] / 2, steps=8)  # fmt: skip
        page.mouse.up()
        deadline = time.monotonic() + 30
        while slide.inner_text() == before and time.monotonic() < deadline:
            time.sleep(0.3)
        assert slide.inner_text() != before, "moving the bucket-size slider changed nothing"
        assert "buckets" in slide.inner_text()
        page.screenshot(path=str(shots / "lecture-04-widget.jpg"), type="jpeg", quality=60)
    finally:
        page.close()
        proc.terminate()
        proc.wait(20)
        log.close()
