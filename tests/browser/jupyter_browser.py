"""What a person sees in JupyterLab, checked in a real browser (issue 21).

``JupyterLab`` starts a server on 127.0.0.1 (a free port, a token) over a *copy* of the course
(JupyterLab autosaves: the committed notebooks must not be touched), with its own settings:
every cell kept in the page (no windowing), no news pop-up. ``NotebookPage`` drives one
notebook in headless Chromium through JupyterLab's own commands (``window.jupyterapp``,
exposed with ``--LabApp.expose_app_in_browser``): Run All, wait for the kernel, read every
cell's outputs from the notebook model, then move each ipywidgets control of every widget and
wait — bounded — for the widget's view to change.

Chromium: Debian's ``chromium`` package driven by Playwright through ``executable_path``
(Playwright's own browser download needs general internet). ``find_chromium()`` says where.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "browser-screenshots"  # git-ignored: for a person to look at
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
RENDER_TIMEOUT = 120  # s for a displayed widget's view to appear (a loaded machine: slow)

# every ipywidgets control the course's widgets use, and how a person moves it
CONTROLS = ", ".join(
    [
        ".widget-slider .noUi-handle",  # IntSlider, FloatSlider, SelectionSlider (noUiSlider)
        ".widget-dropdown select",
        ".widget-toggle-buttons button",
        ".widget-toggle-button",
        ".widget-checkbox input[type=checkbox]",
        ".widget-radio-box input[type=radio]",
        ".widget-text input[type=number]",  # IntText, FloatText
        ".widget-button",
    ]
)


def find_chromium() -> str | None:
    """A Chromium executable: MINITRAIN_CHROMIUM, else Debian's or Ubuntu's on the PATH."""
    chosen = os.environ.get("MINITRAIN_CHROMIUM")
    if chosen:
        return chosen if Path(chosen).exists() else None
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def course_copy(dest: Path, notebooks: list[Path] | None = None) -> Path:
    """A copy of notebooks/ next to links to the rest of the course (a notebook may read
    ``../solutions``); returns the copy's notebooks folder."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in ROOT.iterdir():
        if entry.name not in ("notebooks", ".git", ".venv") and not entry.name.startswith("."):
            (dest / entry.name).symlink_to(entry)
    folder = dest / "notebooks"
    folder.mkdir()
    for nb in notebooks if notebooks is not None else sorted((ROOT / "notebooks").glob("*.ipynb")):
        shutil.copyfile(nb, folder / nb.name)
    return folder


class JupyterLab:
    """A JupyterLab server on 127.0.0.1 with a token, serving ``root``; a context manager."""

    def __init__(self, root: Path, workdir: Path, startup_timeout: float = 90):
        self.root, self.workdir, self.timeout = root, workdir, startup_timeout
        self.token = secrets.token_hex(16)
        self.url = None
        self.proc = None

    def __enter__(self) -> JupyterLab:
        settings = self.workdir / "settings"
        for plugin, values in {
            "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
            "@jupyterlab/apputils-extension/notification": {
                "fetchNews": "false",
                "checkForUpdates": False,
            },
        }.items():
            path = settings / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(
            os.environ,
            JUPYTERLAB_SETTINGS_DIR=str(settings),
            JUPYTERLAB_WORKSPACES_DIR=str(self.workdir / "workspaces"),
            JUPYTER_RUNTIME_DIR=str(self.workdir / "runtime"),
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        )
        cmd = [
            sys.executable, "-m", "jupyterlab", "--no-browser",
            "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0",  # the OS picks a free port
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--LabApp.expose_app_in_browser=True",
        ]  # fmt: skip
        if hasattr(os, "getuid") and os.getuid() == 0:
            cmd.append("--allow-root")  # containers and CI run as root
        self.log = open(self.workdir / "jupyterlab.log", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            found = re.search(r"(http://127\.0\.0\.1:\d+)/lab", Path(self.log.name).read_text())
            if found:
                self.url = found[1]
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.3)
        self.__exit__()
        raise RuntimeError(
            f"JupyterLab did not start within {self.timeout:.0f} s:\n{Path(self.log.name).read_text()[-3000:]}"
        )

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()

    def page_url(self, path: str) -> str:
        return f"{self.url}/{path}?token={self.token}"


def launch_browser(playwright):
    return playwright.chromium.launch(
        executable_path=find_chromium(),
        headless=True,
        args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
    )


@dataclass
class NotebookReport:
    name: str
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)  # cells with an error output
    widgets: int = 0  # widget outputs the kernel displayed
    rendered: int = 0  # ... of which the page shows
    controls: list[str] = field(default_factory=list)  # "widget 1: dropdown → changed"
    problems: list[str] = field(default_factory=list)  # what a person would see go wrong
    screenshots: list[str] = field(default_factory=list)


# JavaScript run in the page (JupyterLab's own objects, see the module docstring)
_READY = """async (path) => {
  const app = window.jupyterapp;
  if (!app) return false;
  await app.restored;
  const panel = app.shell.currentWidget;
  if (!panel || !panel.sessionContext || !panel.content || !panel.content.widgets) return false;
  if (!panel.context || panel.context.path !== path) return false;  // still the one before
  if (!app.commands.hasCommand('notebook:run-all-cells')) return false;
  window.__minitrainPanel = panel;  // the shell's current widget follows focus; this does not
  await panel.context.ready; await panel.sessionContext.ready;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  return !!kernel && kernel.connectionStatus === 'connected' && kernel.status === 'idle';
}"""
_OPEN_NOTEBOOKS = """() => Array.from(window.jupyterapp.shell.widgets('main'))
  .filter(w => w.context && /[.]ipynb$/.test(w.context.path)).map(w => w.context.path)"""
_RUN_ALL = "async () => await window.jupyterapp.commands.execute('notebook:run-all-cells')"
_BUSY = """() => {
  const p = window.__minitrainPanel;
  const k = p.sessionContext.session.kernel;
  return k.status !== 'idle' || p.content.widgets.some(
    c => c.model.type === 'code' && /\\*/.test(c.node.querySelector('.jp-InputPrompt').textContent));
}"""
_OUTPUTS = """() => window.__minitrainPanel.content.widgets.map((c, i) => {
  if (c.model.type !== 'code') return null;
  const outs = c.model.outputs.toJSON();
  return {index: i, count: c.model.executionCount, source: c.model.sharedModel.getSource().slice(0, 80),
          errors: outs.filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue),
          widgets: outs.filter(o => o.data && o.data[MIME]).length};
})""".replace("MIME", repr(WIDGET_MIME))


# every code cell's outputs, as nbformat JSON (compared with the committed ones: outputs.py)
_CODE_OUTPUTS = """() => window.__minitrainPanel.content.widgets
  .filter(c => c.model.type === 'code').map(c => c.model.outputs.toJSON())"""


_DESCRIBE = """e => {
  const box = e.closest('.widget-inline-hbox, .widget-checkbox, .widget-button, .widget-toggle-button') || e;
  const kinds = ['dropdown', 'hslider', 'toggle-buttons', 'checkbox', 'text', 'toggle-button',
                 'button', 'radio-box'];
  const kind = kinds.find(k => box.classList.contains('widget-' + k)) || e.tagName.toLowerCase();
  const text = s => (s || '').replace(/\u200b/g, '').trim();  // ipywidgets pads labels with U+200B
  const label = text((box.querySelector('.widget-label') || {}).textContent)
    || (kind === 'checkbox' ? text(box.textContent) : '');
  const button = e.tagName === 'BUTTON' ? ' → ' + e.textContent.trim() : '';
  return kind + (label ? ' "' + label + '"' : '') + button;
}"""


# a disabled ipywidgets control: the element itself, or (a slider's handle) the slider around it
_DISABLED = "e => !!e.disabled || !!e.closest('[disabled]')"


# what a widget shows, without its controls (a slider's own read-out changes when it moves)
_SHOWN = """e => {
  const copy = e.cloneNode(true);
  copy.querySelectorAll('.widget-slider, .widget-hslider, .widget-vslider, .widget-dropdown,'
    + ' .widget-toggle-buttons, .widget-checkbox, .widget-text, .widget-button,'
    + ' .widget-toggle-button, .widget-radio-box').forEach(c => c.remove());
  return copy.innerHTML;
}"""


class LabTab:
    """One Chromium page that loads JupyterLab once; notebooks then open in it one after another.

    Loading JupyterLab costs Chromium about 4 CPU-seconds per page, opening a notebook in a
    loaded lab about 1 (measured here, a one-cell notebook, kernel start included): over
    make test's twelve notebooks, a minute of a 2-core machine. A notebook whose check raised
    leaves the page to be closed; the next one loads JupyterLab afresh."""

    def __init__(self, browser, viewport=(1280, 900)):
        self.browser, self.viewport = browser, viewport
        self.page, self.loaded = None, False

    def take(self):
        """The page, and whether JupyterLab is already loaded in it."""
        if self.page is None or self.page.is_closed():
            self.page = self.browser.new_page(
                viewport={"width": self.viewport[0], "height": self.viewport[1]})
            self.loaded = False
        return self.page, self.loaded

    def give_back(self, clean: bool) -> None:
        """``clean``: the notebook was closed (kernel shut down, panel disposed) without error."""
        self.loaded = clean
        if not clean:
            self.close()

    def close(self) -> None:
        if self.page is not None and not self.page.is_closed():
            self.page.close()
        self.page, self.loaded = None, False


class NotebookPage:
    """One notebook open in a Chromium page of ``lab``: a new page, or the next notebook of a
    ``LabTab``'s."""

    def __init__(self, browser, lab: JupyterLab, path: str, viewport=(1280, 900),
                 tab: LabTab | None = None):
        self.tab = tab
        if tab is None:
            self.page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            self._lab_loaded = False
        else:
            self.page, self._lab_loaded = tab.take()
        self.lab, self.path = lab, path
        self.name = Path(path).stem

    def open(self, timeout: float = 90) -> None:
        if self._lab_loaded:  # the tab's JupyterLab opens it, as a double-click would
            self.page.evaluate("async (path) => { await window.jupyterapp.commands.execute("
                               "'docmanager:open', {path}); }", self.path)
        else:
            # a workspace of its own: JupyterLab restores a workspace's earlier tabs, so in the
            # shared default one every page re-opened (and re-rendered, and started a kernel
            # for) each notebook checked before it
            workspace = f"{self.name}-{uuid.uuid4().hex[:8]}"
            url = self.lab.page_url(f"lab/workspaces/{workspace}/tree/{self.path}")
            self.page.goto(url, timeout=timeout * 1000)
        # (wait_for_function would take an async predicate's promise for a true value)
        deadline = time.monotonic() + timeout
        while not self.page.evaluate(_READY, self.path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path}: its kernel was not ready within {timeout:.0f} s")
            time.sleep(0.5)
        # this notebook alone: a page that restored a workspace's earlier tabs re-renders them
        # and starts kernels for them, on the cores the notebook under test needs
        others = [p for p in self.page.evaluate(_OPEN_NOTEBOOKS) if p != self.path]
        if others:
            raise RuntimeError(f"{self.path}: the page also has {', '.join(others)} open "
                               "(restored from a shared workspace: each page needs its own)")

    def run_all(self, timeout: float) -> None:
        """Run All, then wait until the kernel is idle and no cell is waiting ([*])."""
        self.page.evaluate(_RUN_ALL)
        self.page.wait_for_function(f"() => !({_BUSY})()", timeout=timeout * 1000, polling=500)

    def cells(self) -> list[dict]:
        return [c for c in self.page.evaluate(_OUTPUTS) if c is not None]

    def code_outputs(self) -> list[list[dict]]:
        """Every code cell's outputs as the kernel left them (before any widget is moved)."""
        return self.page.evaluate(_CODE_OUTPUTS)

    def widget_outputs(self):
        # a widget view's output carries no mime type (a renderer's does); top level only
        # this notebook's panel only: JupyterLab restores earlier notebooks as hidden tabs
        panel = self.page.evaluate("() => window.__minitrainPanel.id")
        return self.page.locator(
            f"[id='{panel}'] .jp-Cell-outputArea > .jp-OutputArea-child"
            " > .jp-OutputArea-output:not([data-mime-type])"
        )

    def check(self, settle: float = 30, shots: Path | None = None) -> NotebookReport:
        """Every code cell ran without an error output; every widget the kernel displayed is
        rendered; moving each of its controls changes what it shows within ``settle`` s."""
        report = NotebookReport(self.name)
        for c in self.cells():
            if c["count"] is None:
                report.errors.append(f"cell {c['index']} did not run: {c['source']!r}")
            for e in c["errors"]:
                report.errors.append(f"cell {c['index']} shows an error: {e[:300]}")
            report.widgets += c["widgets"]
        outputs = self.widget_outputs()
        report.rendered = outputs.count()
        if report.rendered != report.widgets:
            report.problems.append(
                f"the kernel displayed {report.widgets} widget(s), the page shows {report.rendered}"
            )
        for i in range(report.rendered):
            self._check_widget(outputs.nth(i), i + 1, settle, report, shots)
        return report

    def _check_widget(self, out, number: int, settle: float, report, shots) -> None:
        # JupyterLab skips rendering cells far off screen (CSS content-visibility), and Playwright
        # then calls their outputs "not visible" and waits for them in vain (seen once in a
        # fresh-clone run: two notebooks' first widgets): bring the cell on screen from the page
        # itself first, which works whatever Playwright thinks of it
        out.evaluate("e => (e.closest('.jp-Cell') || e).scrollIntoView({block: 'center'})")
        # a widget view renders after its output area exists; on a loaded machine (make test's
        # two lanes) that took longer than Playwright's 30 s for scroll_into_view_if_needed
        # ("element is not visible": an empty output area). Wait for the view, or for
        # JupyterLab's "Error displaying widget", up to RENDER_TIMEOUT; neither: not rendered.
        from playwright.sync_api import TimeoutError as PlaywrightTimeoutError  # (optional)

        view = out.locator(".jupyter-widgets").or_(out.get_by_text("Error displaying widget"))
        try:
            view.first.wait_for(state="visible", timeout=RENDER_TIMEOUT * 1000)
        except PlaywrightTimeoutError:
            report.problems.append(f"widget {number} is not rendered within {RENDER_TIMEOUT} s: "
                                   f"{out.inner_text()[:200]!r}")
            return
        out.scroll_into_view_if_needed()
        text = out.inner_text()
        if "Error displaying widget" in text or out.locator(".jupyter-widgets").count() == 0:
            report.problems.append(f"widget {number} is not rendered: {text[:200]!r}")
            return
        if shots is not None:
            report.screenshots.append(self._shot(out, shots / f"{self.name}-w{number}-before.jpg"))
        controls = out.locator(CONTROLS)
        unchanged: list[str] = []
        if controls.count() == 0:
            report.problems.append(f"widget {number} has no control to move")
        for k in range(controls.count()):
            control = controls.nth(k)
            if not control.is_visible() or control.evaluate(_DISABLED):
                continue  # a control the widget disabled: a person cannot move it either
            kind = control.evaluate(_DESCRIBE)
            if "mod-active" in (control.get_attribute("class") or ""):
                continue  # already pressed: pressing it again changes nothing
            before, t0 = out.evaluate(_SHOWN), time.monotonic()
            self._move(control)
            changed = self._wait_changed(out, before, settle)
            report.controls.append(
                f"widget {number}: {kind} {'changed' if changed else 'NO CHANGE'} "
                f"({time.monotonic() - t0:.1f} s)"
            )
            if not changed:
                unchanged.append(
                    f"widget {number}: moving its {kind} (control {k + 1}) changed nothing "
                    f"within {settle:.0f} s"
                )
            errors = out.locator('[data-mime-type="application/vnd.jupyter.stderr"]')
            if errors.count():
                report.problems.append(
                    f"widget {number}: shows an error after moving its {kind}: "
                    f"{errors.first.inner_text()[:300]!r}"
                )
        # every control a person can move must change what the widget shows: one that cannot
        # apply in the current setting is disabled or not offered (see docs/design.md)
        report.problems.extend(unchanged)
        if shots is not None:
            report.screenshots.append(self._shot(out, shots / f"{self.name}-w{number}-after.jpg"))

    def _move(self, control) -> None:
        tag = control.evaluate("e => e.tagName.toLowerCase() + ':' + (e.type || '')")
        if tag.startswith("select"):
            options = control.locator("option")
            current = control.evaluate("e => e.selectedIndex")
            control.select_option(index=(current + 1) % options.count())
        elif tag == "input:number":
            control.focus()
            control.press("ArrowUp")
            control.press("Enter")
        elif "noUi-handle" in (control.get_attribute("class") or ""):
            control.focus()
            at_max = control.get_attribute("aria-valuenow") == control.get_attribute(
                "aria-valuemax"
            )
            control.press("ArrowLeft" if at_max else "ArrowRight")
        else:
            control.click()

    def _wait_changed(self, out, before: str, settle: float) -> bool:
        """True once the widget's view differs from ``before`` and has stopped changing
        (a re-plot first clears, then draws); False after ``settle`` s without a change."""
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline:
            now = out.evaluate(_SHOWN)
            if now != before:
                time.sleep(0.3)
                while out.evaluate(_SHOWN) != now and time.monotonic() < deadline:
                    now = out.evaluate(_SHOWN)
                    time.sleep(0.3)
                self.page.wait_for_function(f"() => !({_BUSY})()", timeout=settle * 1000)
                return True
            time.sleep(0.2)
        return False

    def _shot(self, locator, path: Path) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        locator.screenshot(path=str(path), type="jpeg", quality=60)
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)

    def close(self) -> None:
        """Shut the kernel down (the next notebook gets the cores) and close the notebook; its
        own page is closed too, a ``LabTab``'s is kept for the next notebook."""
        clean = False
        try:
            self.page.evaluate(
                """async () => { const p = window.__minitrainPanel;
                   if (p) { await p.sessionContext.shutdown(); p.dispose(); }
                   window.__minitrainPanel = null; }"""
            )
            clean = True
        finally:
            if self.tab is None:
                self.page.close()
            else:
                self.tab.give_back(clean)


def tiny_notebook(path: Path, *code_cells: str, slides: bool = True) -> Path:
    """A small notebook for the browser checks' own tests: a title, then one ``##`` section per
    code cell, marked up for slides by the course's own tool."""
    import nbformat

    from minitrain.course.notebooks import KERNELSPEC, mark_slides

    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_markdown_cell(f"# {path.stem}"))
    for i, code in enumerate(code_cells):
        nb.cells.append(nbformat.v4.new_markdown_cell(f"## Part {i + 1}"))
        nb.cells.append(nbformat.v4.new_code_cell(code))
    nb.metadata["kernelspec"] = KERNELSPEC
    if slides:
        mark_slides(nb)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


# a widget as the course builds them: a control, and a status line recomputed when it moves
GOOD_WIDGET = """import ipywidgets as w
ranks = w.IntSlider(value=3, min=1, max=8, description="ranks")
messages = w.HTML()
def show(change=None):
    messages.value = f"<b>{ranks.value} ranks → {2 * (ranks.value - 1)} messages</b>"
ranks.observe(show, "value")
show()
w.VBox([ranks, messages])"""

# the browser check's own test: what each kind of broken widget must be reported as
FROZEN_WIDGET = """import ipywidgets as w
frozen = w.IntSlider(value=3, min=1, max=8, description="frozen")
frozen_status = w.HTML("<b>never updated</b>")  # forgot frozen.observe(...)
w.VBox([frozen, frozen_status])"""

RAISING_WIDGET = """import ipywidgets as w
bad = w.IntSlider(value=3, min=1, max=8, description="raises")
bad_status = w.HTML("<b>3</b>")
def replot(change):
    raise RuntimeError("the re-plot failed")
bad.observe(replot, "value")
w.VBox([bad, bad_status])"""

# one control works, the other was never connected: the dead one must be reported
PARTLY_DEAD_WIDGET = """import ipywidgets as w
alive = w.IntSlider(value=3, min=1, max=8, description="alive")
dead = w.IntSlider(value=3, min=1, max=8, description="dead")  # forgot dead.observe(...)
shown = w.HTML()
alive.observe(lambda change: setattr(shown, "value", f"<b>{alive.value}</b>"), "value")
w.VBox([alive, dead, shown])"""

# a control the widget disabled (it does not apply): a person cannot move it, nor does the check
DISABLED_CONTROL_WIDGET = """import ipywidgets as w
size = w.IntSlider(value=3, min=1, max=8, description="size")
unused = w.IntSlider(value=3, min=1, max=8, description="unused", disabled=True)
shown_size = w.HTML()
size.observe(lambda change: setattr(shown_size, "value", f"<b>{size.value}</b>"), "value")
w.VBox([size, unused, shown_size])"""

UNRENDERED_WIDGET = """from IPython.display import display
# a view of a widget model the page does not have: what a front-end/kernel mismatch looks like
display({"application/vnd.jupyter.widget-view+json":
         {"model_id": "0" * 32, "version_major": 2, "version_minor": 0}}, raw=True)"""

ERROR_CELL = "1 / 0"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
