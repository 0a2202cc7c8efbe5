"""Stop signals in the launcher: every rank stops, whatever moment the signal comes (issue 30).

Used by ``minitrain/runtime/launch.py`` (every multi-process notebook from 00_getting_started
on) and by ``python -m minitrain.train`` (``minitrain/parallel/command_errors.py``).

A supervisor (systemd, Slurm, a notebook's interrupt) signals the main process only; Ctrl-C
signals the whole process group. ``signals_interrupt()`` turns SIGINT, SIGTERM and SIGHUP in the
main process into ``Interrupted`` (a ``KeyboardInterrupt``), so the launcher's ``finally`` stops
every rank, under ``signals_deferred()`` so that a second Ctrl-C cannot cut it short. Ranks
ignore SIGINT (the parent decides: a rank dying of it mid-collective would strand its peers).
The forkserver and resource tracker start with SIGINT ignored (``start_helpers``), and after
an interrupt the forkserver is killed (``stop_forkserver``) rather than left finishing its
imports with the command's stdout open.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading


class Interrupted(KeyboardInterrupt):
    """The main process got a signal (SIGINT, SIGTERM, SIGHUP); ``.signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_interrupt():
    """Within the block, SIGINT/SIGTERM/SIGHUP raise ``Interrupted`` in the main thread (a
    KeyboardInterrupt, which a notebook shows as an interrupt); outside it, the old handlers.
    Elsewhere than the main thread Python cannot set handlers: the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def signals_deferred():
    """Within the block (the launcher's clean-up), a stop signal is remembered, not raised: the
    clean-up that stops the ranks must not itself be cut short. Raised when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got = []
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if got:
        raise Interrupted(got[0])


def start_helpers() -> None:
    """Start the forkserver and the resource tracker with SIGINT ignored (no-op when running).

    Ctrl-C signals the whole process group, helpers included; one that is still importing torch
    would die of it with a traceback on the command's stderr (seen in 2 of 40 tries under
    load). An ignored signal stays ignored across exec, and Python then leaves it so. Here it
    is blocked meanwhile: on Linux a blocked signal stays pending even while ignored, and is
    delivered to the launcher once its handler and the mask are back.
    """
    from multiprocessing import forkserver, resource_tracker

    if not hasattr(signal, "pthread_sigmask"):
        return
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    main = threading.current_thread() is threading.main_thread()
    old_handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        resource_tracker.ensure_running()
        forkserver.ensure_running()
    finally:
        if main:
            signal.signal(signal.SIGINT, old_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def stop_forkserver() -> None:
    """Kill the forkserver after an interrupt (the next launch starts a new one, ~1 s).

    Left alone it exits only once it notices its clients are gone — after it has finished
    importing torch if the signal came while it started, ~10 s on a busy machine — and it holds
    the command's stdout meanwhile. Python offers no public way to stop it: ``_stop`` is what
    CPython's own tests use; where it is missing, the server is left to exit by itself.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if not pid:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        server._stop()  # closes its pipe, reaps it, forgets it
    except Exception:  # noqa: BLE001 — best effort: it would exit by itself anyway
        pass
