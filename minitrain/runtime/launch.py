"""Run a function on several processes ("ranks") with torch.distributed initialised.

Used by every multi-process notebook from 00_getting_started on. Two ways in:

* ``launch(fn, world_size, *args)`` from a notebook, a test or a script: starts
  ``world_size`` worker processes on this machine, runs ``fn(*args)`` on each with
  the default process group initialised, and returns what each rank returned.
* ``torchrun --nproc-per-node=N script.py`` (one or several nodes): the
  environment already says who is who, so ``init_from_env()`` initialises the
  process group and the same rank function runs unchanged (see
  ``minitrain/runtime/hello.py``).

Why it is built this way (facts measured on a 2-core CPU machine, torch 2.13):

* Functions defined in a notebook cell cannot be pickled by reference, so ``fn``
  travels as cloudpickle bytes to a module-level entry point
  (``minitrain.runtime.rank.rank_main``, the worker's side).
* Workers come from a *forkserver* that has already imported torch: a warm launch
  costs ~0.1 s instead of the ~3 s of *spawn*, and, unlike plain *fork*, it never
  inherits a notebook kernel's thread pools (which deadlocks children).
* The rendezvous store lives in the parent on an OS-chosen free port, so launches
  can run side by side and never race for a fixed port.
* The store listens on 127.0.0.1 only: ``TCPStore(HOST, 0)`` alone would listen on every
  interface (an unauthenticated store), so the parent binds a loopback socket and hands it over.
* Nothing hangs: a rank that raises, dies or is stuck past ``timeout`` becomes a
  ``LaunchError`` naming the rank (with its traceback, or the stack it is stuck
  in), and every other rank is killed.
* Nothing is left behind: SIGINT, SIGTERM or SIGHUP to this process stop every rank before
  ``Interrupted`` (a ``KeyboardInterrupt``) leaves ``launch``, and a rank whose launcher is gone
  (even killed with SIGKILL) exits on its own (its "lifeline" pipe closed).

Scripts that call ``launch`` need ``if __name__ == "__main__":`` around the call: the
forkserver imports the script's main module in every worker, and an unguarded call there would
launch again from each worker.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time

import cloudpickle
import torch
import torch.distributed as dist

# waiting for the ranks and naming the one that failed: its own file (launch_errors.py)
from minitrain.runtime.launch_errors import LaunchError, wait_for_ranks  # noqa: F401 — API too
from minitrain.runtime.link import install as install_link
from minitrain.runtime.link import rank_initializers as link_initializers
from minitrain.runtime.rank import (  # noqa: F401 — part of this module's API too
    HOST,
    default_backend,
    get_device,
    init_from_env,
    rank_main,
    running_under_torchrun,
)
from minitrain.runtime.rank_initializers import (  # noqa: F401 — add_rank_initializer: API too
    add_rank_initializer,
    registered_initializers,
)

# stop signals, and the forkserver started and stopped around them: stopping.py
from minitrain.runtime.stopping import (  # noqa: F401 — Interrupted is part of the API
    Interrupted,
    signals_deferred,
    signals_interrupt,
    start_helpers,
    stop_forkserver,
)
from minitrain.runtime.strict_p2p import rank_initializers as strict_p2p_initializers

# Imported once by the forkserver, so a rank (a fork of it) starts with them loaded. Only
# modules no learner edits: a rank imports minitrain's techniques afresh, so a changed
# exercise file is the one that runs. torch._dynamo is here because every torch optimizer's
# __init__ imports it on first use (torch._compile._disable_dynamo): 1.3 CPU-seconds and
# ~800 modules (sympy, triton) per rank otherwise, most of a small test's cost (issue 33).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "cloudpickle",
            "minitrain.runtime.launch", "minitrain.runtime.rank"]


class RankResults(list):
    """The per-rank return values (a plain list, rank order) plus what was measured.

    ``.traces[r]`` is rank r's list of ``minitrain.runtime.trace.Event``; ``.output[r]``
    the text rank r printed.
    """

    traces: list
    output: list


# --------------------------------------------------------------------------- the parent side
_context = None
def _forkserver():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    start_helpers()
    return _context


def launch(
    fn,
    world_size: int,
    *args,
    timeout: float = 120.0,
    backend: str | None = None,
    print_output: bool = True,
    link=None,
    **kwargs,
) -> RankResults:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their return values.

    Each rank has the default process group initialised (``backend``: gloo on CPU,
    NCCL when every rank has a GPU; ``MINITRAIN_BACKEND`` overrides). Whatever a rank
    prints is shown afterwards by the parent, prefixed ``[rank r]`` (``print_output``).
    Raises ``LaunchError`` naming the rank when a rank raises, dies or does not finish
    within ``timeout`` seconds; the other ranks are then killed. SIGINT, SIGTERM or SIGHUP
    meanwhile stop every rank, then raise ``Interrupted`` (a ``KeyboardInterrupt``).

    ``link`` (a ``minitrain.runtime.link.Link``, a dict axis → Link, or a preset name): every
    message between the ranks takes its modeled time; default: the link in force here
    (``use_link``), else ``MINITRAIN_LINK``, else none (``minitrain/runtime/link.py``).

    In a script, call it under ``if __name__ == "__main__":`` — each rank imports the script's
    main module, and an unguarded call would run again there.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"launch: world_size must be a whole number ≥ 1, got {world_size!r}")
    if not callable(fn):
        raise TypeError(f"launch: fn must be callable, got {type(fn).__name__}")
    if timeout is None or timeout <= 0:
        raise ValueError(f"launch: timeout must be a positive number of seconds, got {timeout!r}")
    if os.environ.get("MINITRAIN_MAX_LAUNCH_TIMEOUT"):  # graders cap every launch's wait
        timeout = min(timeout, float(os.environ["MINITRAIN_MAX_LAUNCH_TIMEOUT"]))
    backend = backend or default_backend(world_size)
    if "nccl" in backend and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"launch: backend nccl needs one GPU per rank; world_size {world_size} > "
            f"{torch.cuda.device_count()} GPUs (use backend='gloo')"
        )
    try:
        payload = cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"launch: cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the "
            f"worker processes ({type(exc).__name__}: {exc})"
        ) from exc

    # MINITRAIN_P2P=strict and MINITRAIN_LINK, read now: ranks come from a forkserver started
    # before (strict_p2p.py, link.py); the link last, so that it wraps the canary
    initializers = cloudpickle.dumps(registered_initializers() + strict_p2p_initializers(timeout)
                                     + link_initializers(link))
    threads = max(1, (os.cpu_count() or 1) // world_size)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: no DNS, no real NIC
    ctx = _forkserver()
    with signals_interrupt():  # a signal now stops the ranks (the finally below), then raises
        try:
            return _run_ranks(ctx, fn, world_size, backend, payload, initializers, threads,
                              timeout, print_output)
        except KeyboardInterrupt:
            with signals_deferred():
                stop_forkserver()
            raise


def loopback_store() -> dist.TCPStore:
    """A rendezvous TCPStore listening on 127.0.0.1 only.

    ``TCPStore(HOST, 0, is_master=True)`` binds every interface whatever ``HOST`` says; a
    socket bound to the loopback address and handed over (``master_listen_fd``) keeps it local.
    The store owns the socket from then on (it closes it).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((HOST, 0))
        sock.listen(128)
        store = dist.TCPStore(HOST, sock.getsockname()[1], is_master=True,
                              wait_for_workers=False, use_libuv=True,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes the descriptor, not this object
    return store


def _run_ranks(ctx, fn, world_size, backend, payload, initializers, threads, timeout,
               print_output) -> RankResults:
    store = loopback_store()
    stack_dir = tempfile.mkdtemp(prefix="minitrain-launch-")
    procs, conns, lifelines, finished = [], [], [], False
    try:
        for rank in range(world_size):
            # the rank's end of a pipe nobody writes to: it reads EOF once this process is gone
            rank_life, parent_life = ctx.Pipe(duplex=False)
            lifelines.append(parent_life)
            parent_end, child_end = ctx.Pipe(duplex=True)
            stack_file = os.path.join(stack_dir, f"rank{rank}.stack")
            p = ctx.Process(
                target=rank_main,
                args=(
                    rank,
                    world_size,
                    store.port,
                    backend,
                    payload,
                    child_end,
                    stack_file,
                    initializers,
                    threads,
                    timeout,
                    rank_life,
                ),
                name=f"minitrain-rank{rank}",
                daemon=True,
            )
            p.start()
            child_end.close()
            rank_life.close()
            procs.append(p)
            conns.append(parent_end)
        messages = wait_for_ranks(procs, conns, timeout, stack_dir)
        finished = True
        for c in conns:
            c.send("exit")
    finally:
        with signals_deferred():  # a second Ctrl-C must not cut the clean-up short
            _stop_all(procs, grace=5.0 if finished else 0.0)
            for c in conns + lifelines:
                c.close()
            for name in os.listdir(stack_dir):
                os.unlink(os.path.join(stack_dir, name))
            os.rmdir(stack_dir)
            del store

    results = RankResults(cloudpickle.loads(messages[r][2]) for r in range(world_size))
    results.traces = [messages[r][3] for r in range(world_size)]
    results.output = [messages[r][4] for r in range(world_size)]
    if print_output:
        _print_rank_output(results.output)
    return results


def _stop_all(procs, grace: float):
    """Give finished ranks ``grace`` seconds to exit, then terminate, then kill; reap all."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=1.0)
        if p.is_alive():
            p.kill()
            p.join()


def _print_rank_output(outputs):
    for rank, text in enumerate(outputs):
        for line in text.splitlines():
            print(f"[rank {rank}] {line}")


def run(fn, world_size: int, *args, **kwargs):
    """Run ``fn`` as a script would: under torchrun in this process, otherwise via ``launch``.

    Under torchrun each process returns its own rank's value; otherwise the list of all.
    """
    if running_under_torchrun():
        init_from_env(kwargs.pop("backend", None))
        kwargs.pop("timeout", None)
        link = kwargs.pop("link", None)
        if link is not None:
            install_link(link)
        try:
            return fn(*args, **kwargs)
        finally:
            dist.destroy_process_group()
    return launch(fn, world_size, *args, **kwargs)
