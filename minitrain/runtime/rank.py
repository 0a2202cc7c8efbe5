"""One rank's side of a distributed run: its backend, its device, and what it runs.

Used by minitrain.runtime (which re-exports these names) and by every chapter's rank
functions through ``get_device()``. A rank joins the default process group either from
``launch`` (``rank_main``: the store address, rank and world size come from the parent)
or from ``torchrun``'s environment (``init_from_env``), then runs the same function.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import io
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from minitrain.runtime import trace
from minitrain.runtime.link import install_from_environment as install_link_from_environment
from minitrain.runtime.strict_p2p import install_from_environment

HOST = "127.0.0.1"


# --------------------------------------------------------------------------- backend and device
def default_backend(world_size: int | None = None) -> str:
    """gloo on CPU; with a GPU per rank, gloo for CPU tensors *and* NCCL for CUDA tensors.

    ``"cpu:gloo,cuda:nccl"`` lets torch pick the backend by the tensor's device, so code
    (and tests) that send CPU tensors keep working on GPU machines. MINITRAIN_BACKEND overrides.
    """
    if os.environ.get("MINITRAIN_BACKEND"):
        return os.environ["MINITRAIN_BACKEND"]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and (world_size is None or gpus >= world_size):
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def get_device() -> torch.device:
    """The device this rank computes on: MINITRAIN_DEVICE, else its GPU under NCCL, else cpu."""
    if os.environ.get("MINITRAIN_DEVICE"):
        return torch.device(os.environ["MINITRAIN_DEVICE"])
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment; return (rank, world_size)."""
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"init_from_env: environment variables {missing} are not set — start the script "
            "with torchrun, or call minitrain.runtime.launch(fn, world_size) instead"
        )
    backend = backend or default_backend()
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(backend)
    install_from_environment()  # MINITRAIN_P2P=strict: NCCL's point-to-point semantics
    install_link_from_environment()  # MINITRAIN_LINK: the modeled interconnect (link.py)
    return dist.get_rank(), dist.get_world_size()


def running_under_torchrun() -> bool:
    return (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ
    )


# --------------------------------------------------------------------------- the worker side
def _leave_when_parent_goes(lifeline) -> None:
    """A daemon thread: when the launcher's end of ``lifeline`` closes (it finished, or it was
    killed, even by SIGKILL), this rank exits too. Ranks are children of the forkserver, not
    of the launcher, so without this a killed launcher leaves them running (issue 30)."""

    def watch():
        try:
            lifeline.recv()  # nothing is ever sent: returns (EOFError) when the parent's end closes
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="minitrain-lifeline", daemon=True).start()


def capture_file_descriptors(path: str) -> None:
    """Point this process's file descriptors 1 and 2 at ``path`` (created afresh)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def captured_descriptors(path: str) -> str:
    """What was written to file descriptors 1 and 2 so far (C's buffered stdout flushed first:
    a rank leaves with ``os._exit``, which would drop it)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to ask: nothing buffered to lose
        pass
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def rank_main(
    rank, world_size, port, backend, payload, conn, stack_file, initializers, threads, timeout,
    lifeline=None,
):
    """Entry point of one worker process (module level, so the forkserver can find it)."""
    # Ctrl-C reaches the whole process group: the launcher decides and stops every rank, so a
    # rank never dies of it halfway through a collective (its peers would wait for it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if lifeline is not None:
        _leave_when_parent_goes(lifeline)
    captured = io.StringIO()
    sys.stdout = sys.stderr = captured  # relayed to the parent, which prints "[rank r] ..."
    # what C and C++ code writes (c10d's and NCCL's warnings, a library's printf) goes to file
    # descriptors 1 and 2, past sys.stdout: into a file beside the stack file, relayed with
    # the Python output, so it never lands unlabelled in the caller's terminal or notebook cell
    descriptors_file = os.path.splitext(stack_file)[0] + ".out"
    capture_file_descriptors(descriptors_file)
    # On SIGUSR1 write the Python stack to a file: how the parent shows where a stuck rank waits.
    stack_fh = open(stack_file, "w")  # noqa: SIM115 — must stay open for the signal handler
    faulthandler.register(signal.SIGUSR1, file=stack_fh, all_threads=False)
    torch.set_num_threads(threads)  # ranks share the cores: don't oversubscribe them
    # What the forkserver imported (torch, torch._dynamo: ~10^6 objects) is never garbage:
    # freeze it, so the cyclic collector's full passes skip it (~10 % of a small test's CPU,
    # measured) and leave the pages shared with the forkserver unwritten (issue 33).
    gc.freeze()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    message = None
    try:
        for initialize in cloudpickle.loads(initializers):  # see launch.add_rank_initializer
            initialize()
        fn, args, kwargs = cloudpickle.loads(payload)
        if "nccl" in backend:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=max(timeout, 30)),
        )
        trace.reset()
        result = fn(*args, **kwargs)
        try:
            result_bytes = cloudpickle.dumps(result)
        except Exception as exc:
            raise TypeError(
                f"the value returned by {getattr(fn, '__name__', fn)!r} on rank {rank} "
                f"({type(result).__name__}) cannot be sent back to the parent: {exc}"
            ) from exc
        message = ("ok", rank, result_bytes, trace.events(),
                   captured.getvalue() + captured_descriptors(descriptors_file))
    except BaseException as exc:
        # when it failed (CLOCK_MONOTONIC is shared by the processes of a machine): the
        # parent tells the rank that failed first from peers that failed because of it; the
        # class and text let a command report an expected error in one line
        kind = (f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc))
        message = ("error", rank, traceback.format_exc(), [],
                   captured.getvalue() + captured_descriptors(descriptors_file),
                   time.monotonic(), kind)
    try:
        conn.send(message)
        if message[0] == "ok":
            # Stay connected until every rank is done: a peer still waiting for us should be
            # reported as stuck (with its stack), not fail on "connection closed by peer".
            try:
                conn.recv()
            except EOFError:
                pass
        conn.close()
    finally:
        if message[0] == "ok" and dist.is_initialized():
            dist.destroy_process_group()
        stack_fh.close()
        # Leave without running interpreter shutdown: torch 2.13 + gloo can abort there
        # after all work is done (a known race), which would look like a crash.
        os._exit(0)
