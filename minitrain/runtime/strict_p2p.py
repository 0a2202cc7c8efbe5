"""The strict point-to-point canary: NCCL's send/receive semantics on the CPU (issue 41).

On with ``MINITRAIN_P2P=strict`` in the environment of the process that calls ``launch`` (read
at each call and handed to the ranks as an initializer: ranks are forked from a forkserver
started earlier and never see a later change of the environment) or of a ``torchrun`` process
(``init_from_env``). Off, nothing is installed: zero cost. On, ``install`` replaces
torch.distributed's ``send``, ``recv``, ``isend``, ``irecv`` and ``batch_isend_irecv`` in
this process (a per-process wrapper, like the device canary of tests/device_canary/), so a
technique's calls and a rank function's own behave as they would on NCCL, where gloo is lenient:

* **One stream per rank, in issue order.** NCCL enqueues a rank's operations on a CUDA stream
  and runs them one after the other: ``ncclSend``/``ncclRecv`` are "blocking for the GPU", and
  operations that "need to progress concurrently to complete ... must be fused within a
  ncclGroupStart()/ncclGroupEnd() section" (NCCL documentation, "Point To Point
  Communication Functions"). Here a helper thread per rank (``Stream``, ``strict_stream.py``)
  runs them so: a receive blocks every operation issued after it until its data arrives.
* **No buffering.** A send completes only once the peer's stream has *reached* the matching
  receive: the stream posts gloo's receive only when it gets there, and gloo completes no send
  before its receive is posted (a rendezvous, measured down to 4 bytes; ``strict_stream.py``).
* **Tags ignored.** NCCL has no tags: messages between a pair match in issue order. Every
  message of a pair travels on one data tag, so gloo matches them in that order too.
* **Groups.** The operations of one ``batch_isend_irecv`` call are one NCCL group: "calls
  within a group can be seen as progressing independently, hence should never block each
  other" (NCCL documentation, "Point-to-point communication"). They are posted together, then
  all completed, so a paired exchange cannot deadlock. Megatron-LM pairs its pipeline messages
  this way (``megatron/core/pipeline_parallel/p2p_communication.py``, ``_batched_p2p_ops``).

A deadlock does not hang: ``Work.wait()`` (and the blocking ``send``/``recv``) gives up after
the strict timeout and raises ``StrictP2PTimeout`` naming the rank, the operation, its peer,
where it was issued and where this rank's stream is stuck; its stack is the caller's, so the
launcher's stuck-rank report (its timeout comes later) shows the call site too. The model is
stricter than NCCL in one way: every process group shares the rank's one stream (NCCL gives
each communicator its own), as NCCL's lazily created per-pair communicators, whose
initialisation blocks in issue order, behave when several ranks first meet.
"""

from __future__ import annotations

import functools
import os

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from minitrain.runtime.strict_stream import Operation, Stream, StrictP2PTimeout

__all__ = ["ENV", "TIMEOUT_ENV", "StrictP2PTimeout", "enabled_by_environment", "install",
           "install_from_environment", "installed", "rank_initializers"]

ENV, TIMEOUT_ENV = "MINITRAIN_P2P", "MINITRAIN_P2P_TIMEOUT"
DEFAULT_TIMEOUT = 120.0  # seconds a Work waits under torchrun (launch: half its own timeout)
WRAPPED = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


def enabled_by_environment(environ=None) -> bool:
    """True when ``MINITRAIN_P2P=strict``; unset, empty or "off" is off, anything else an error
    (a typo must not silently run without the canary)."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip().lower()
    if value in ("", "off", "0"):
        return False
    if value == "strict":
        return True
    raise ValueError(f"{ENV}={value!r}: expected 'strict' (or unset / 'off')")


def _timeout_from_environment(default: float) -> float:
    value = os.environ.get(TIMEOUT_ENV)
    seconds = float(value) if value else default
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV}={value!r}: expected a positive number of seconds")
    return seconds


def rank_initializers(launch_timeout: float) -> list:
    """What ``launch`` adds to its rank initializers: ``[install]`` under MINITRAIN_P2P=strict,
    with the strict timeout (MINITRAIN_P2P_TIMEOUT, else half the launch's: the named error
    comes before the launcher's stuck-rank report), else nothing."""
    if not enabled_by_environment():
        return []
    return [functools.partial(install, _timeout_from_environment(launch_timeout / 2))]


def install_from_environment() -> None:
    """Under torchrun (``init_from_env``): install when this process's environment says so."""
    if enabled_by_environment():
        install(_timeout_from_environment(DEFAULT_TIMEOUT))


_state: dict = {}  # the one installed stream and the functions it replaced (per process)


def installed() -> bool:
    return "stream" in _state


def install(timeout: float = DEFAULT_TIMEOUT) -> None:
    """Replace torch.distributed's point-to-point functions in this process (idempotent).

    Both ``torch.distributed.X`` and ``distributed_c10d.X`` are replaced: ``P2POp`` checks its
    ``op`` against the latter, and ``send_object_list`` & co. call them by that name."""
    os.environ[ENV] = "strict"  # what this process runs under, for code and children that ask
    if installed():
        _state["stream"].timeout = timeout
        return
    originals = {name: getattr(c10d, name) for name in WRAPPED}
    stream = Stream(originals["isend"], originals["irecv"], timeout)
    _state.update(stream=stream, originals=originals)
    replacements = {
        "send": functools.wraps(originals["send"])(functools.partial(_send, stream, True)),
        "isend": functools.wraps(originals["isend"])(functools.partial(_send, stream, False)),
        "recv": functools.wraps(originals["recv"])(functools.partial(_recv, stream, True)),
        "irecv": functools.wraps(originals["irecv"])(functools.partial(_recv, stream, False)),
        "batch_isend_irecv": functools.wraps(originals["batch_isend_irecv"])(
            functools.partial(_batch, stream)),
    }
    for name, fn in replacements.items():
        setattr(c10d, name, fn)
        setattr(dist, name, fn)


def _peer(kind: str, group, peer, group_peer) -> int:
    """The peer as a global rank, from ``dst``/``src`` (global) or ``group_dst``/``group_src``."""
    if peer is None and group_peer is None:
        raise ValueError(f"strict point-to-point ({ENV}=strict): a {kind} from any source "
                         "does not exist on NCCL; name the peer rank")
    if group_peer is None:
        return peer
    if peer is not None:
        raise ValueError(f"{kind}: give the peer either as a global rank or a group rank, not both")
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_peer)


def _send(stream, blocking, tensor, dst=None, group=None, tag=0, group_dst=None):
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return None  # torch's own answer for a rank outside the group
    op = Operation("send", tensor, _peer("send", group, dst, group_dst), group,
                   "send" if blocking else "isend")
    work = stream.submit([op])[0]
    if blocking:
        work.wait()
        return None
    return work


def _recv(stream, blocking, tensor, src=None, group=None, tag=0, group_src=None):
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return -1 if blocking else None
    op = Operation("recv", tensor, _peer("recv", group, src, group_src), group,
                   "recv" if blocking else "irecv")
    work = stream.submit([op])[0]
    if blocking:
        work.wait()
        return op.peer
    return work


def _batch(stream, p2p_op_list):
    """``batch_isend_irecv``: the list's operations as one group (one Work per operation)."""
    if not isinstance(p2p_op_list, list) or not all(isinstance(p, dist.P2POp)
                                                    for p in p2p_op_list):
        raise ValueError("Invalid ``p2p_op_list``. Each op is expected to "
                         "to be of type ``torch.distributed.P2POp``.")
    if not all(p.group == p2p_op_list[0].group for p in p2p_op_list):
        raise ValueError("All ops need to use the same group.")
    sends = (_state["originals"]["isend"], c10d.isend)
    ops = [Operation("send" if p.op in sends else "recv", p.tensor, p.peer, p.group,
                     "batch_isend_irecv " + ("isend" if p.op in sends else "irecv"))
           for p in p2p_op_list]
    return stream.submit(ops)
