"""The modeled link's wrappers of torch.distributed (issue 42; ``link.py`` describes the model,
``link_messages.py`` decides when each message completes).

While ``wrap(resolver)`` is in force, ``dist.X`` and ``distributed_c10d.X`` are this file's
wrappers for every name in ``WRAPPED`` (both names: ``P2POp`` and ``send_object_list`` & co.
look functions up in the latter). Each calls the function it replaced — torch's, or the
strict canary's (``strict_p2p.py``) — so the real messages still move and the communication
log and ``trace`` still see them; what a wrapper adds is *when* the call may complete. A
synchronous call returns after the real operation and a sleep up to its modeled finish; an
asynchronous one returns a ``ModeledWork``. A call made from inside another wrapped call
(``batch_isend_irecv`` calling ``isend``, torch composing one collective from another) passes
straight through: every message is modeled once. Groups ``resolver`` gives no link for, and
groups of one rank, are not modeled.
"""

from __future__ import annotations

import functools
import inspect
import threading

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from minitrain.runtime import link_costs, link_messages
from minitrain.runtime.link_messages import ModeledWork, Receive, nbytes, reserve, sleep_until


def _uneven_all_to_all_n(sent: int, received: int, world: int) -> float:
    """The n of the all-to-all formula that gives this rank's time when the splits are uneven:
    (N−1)α + max(bytes sent, bytes received)/β (each direction carries its own)."""
    return max(sent, received) * world / (world - 1)


def _a2a_single(a, world, rank):
    def to_others(t, splits):
        rows = t.shape[0] if t.dim() else 1
        own = (splits[rank] if splits else rows // world) * (nbytes(t) / rows if rows else 0)
        return nbytes(t) - own
    return _uneven_all_to_all_n(to_others(a["input"], a.get("input_split_sizes")),
                                to_others(a["output"], a.get("output_split_sizes")), world)


def _a2a_lists(a, world, rank):
    ins, outs = a["input_tensor_list"], a["output_tensor_list"]
    return _uneven_all_to_all_n(sum(map(nbytes, ins)) - nbytes(ins[rank]),
                                sum(map(nbytes, outs)) - nbytes(outs[rank]), world)


COLLECTIVES = {  # name -> (its formula in link_costs, the formula's n from the call's arguments)
    "all_reduce": ("all_reduce", lambda a, N, r: nbytes(a["tensor"])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, N, r: nbytes(a["input"])),
    "all_gather_into_tensor": ("all_gather", lambda a, N, r: nbytes(a["output_tensor"])),
    "all_gather": ("all_gather", lambda a, N, r: sum(map(nbytes, a["tensor_list"]))),
    "reduce_scatter": ("reduce_scatter", lambda a, N, r: sum(map(nbytes, a["input_list"]))),
    "all_to_all_single": ("all_to_all", _a2a_single),
    "all_to_all": ("all_to_all", _a2a_lists),
    "broadcast": ("broadcast", lambda a, N, r: nbytes(a["tensor"])),
    # torch 2.13's names for the two above (which call them; zero/ and fsdp/ use them)
    "reduce_scatter_single": ("reduce_scatter", lambda a, N, r: nbytes(a["input"])),
    "all_gather_single": ("all_gather", lambda a, N, r: nbytes(a["output_tensor"])),
}
COLLECTIVES = {name: v for name, v in COLLECTIVES.items() if hasattr(c10d, name)}
P2P = ("send", "recv", "isend", "irecv")
WRAPPED = (*P2P, "batch_isend_irecv", *COLLECTIVES)

_previous: dict = {}  # name -> the function its wrapper calls (what dist.<name> was)
_resolve = None  # group -> Link or None while wrapped; None: every wrapper passes through
_local = threading.local()  # .depth > 0: inside a wrapped call


def _plan(group):
    """(group, link, size) when a call on ``group`` is modeled now, else None."""
    resolve = _resolve
    if resolve is None or getattr(_local, "depth", 0) or group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    group = dist.group.WORLD if group is None else group
    link = resolve(group)
    size = dist.get_world_size(group) if link is not None else 1
    return (group, link, size) if size > 1 else None


def _call(name, args, kwargs):
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        return _previous[name](*args, **kwargs)
    finally:
        _local.depth -= 1


def _passing_through() -> bool:
    return _resolve is None or getattr(_local, "depth", 0) > 0


def _modeled(name, model):
    """torch's ``name`` wrapped: passed through while no link is on (or inside another wrapped
    call, or for a group the link does not cover); else ``model(arguments, plan, call)``, where
    ``call()`` runs torch's function once."""
    signature = inspect.signature(getattr(c10d, name))

    def wrapper(*args, **kwargs):
        if _passing_through():
            return _previous[name](*args, **kwargs)
        a = signature.bind(*args, **kwargs).arguments
        plan = _plan(a.get("group"))
        if plan is None:
            return _call(name, args, kwargs)
        return model(a, plan, lambda: _call(name, args, kwargs))

    return functools.wraps(getattr(c10d, name))(wrapper)


def _collective(name):
    kind, formula_bytes = COLLECTIVES[name]

    def model(a, plan, call):
        group, link, size = plan
        n = formula_bytes(a, size, dist.get_rank(group))
        finish = reserve(group, ("out", "in"), link_costs.collective_time(kind, n, size, link))
        result = call()
        if a.get("async_op"):
            return None if result is None else ModeledWork(result, [finish], None)
        sleep_until(finish)
        return result

    return _modeled(name, model)


def _point_to_point(name):
    sending, blocking = "send" in name, name in ("send", "recv")
    peer_keys = ("dst", "group_dst") if sending else ("src", "group_src")

    def model(a, plan, call):
        group, link, _ = plan
        tensor, tag = a["tensor"], a.get("tag", 0)
        peer, group_peer = a.get(peer_keys[0]), a.get(peer_keys[1])
        if group_peer is not None:
            peer = dist.get_global_rank(group, group_peer)
        part = (link_messages.send(group, link, tensor, peer, tag) if sending
                else Receive(group, link, tensor, peer, tag))
        result = call()
        if not blocking:
            return None if result is None else ModeledWork(result, [part], [tensor])
        if not sending and part.channel is None:  # from any source: the sender is known now
            part.attach(result)
        sleep_until(link_messages.finish_of([part]))
        return result

    return _modeled(name, model)


def _batch_isend_irecv(p2p_op_list):
    """One NCCL-style group: each of its operations modeled as its own send or receive."""
    if _passing_through() or not isinstance(p2p_op_list, list):
        return _call("batch_isend_irecv", (p2p_op_list,), {})
    parts = []
    for op in p2p_op_list:
        plan = _plan(getattr(op, "group", None))
        if plan is None:
            parts.append(None)
        elif "send" in getattr(op.op, "__name__", ""):
            parts.append(link_messages.send(plan[0], plan[1], op.tensor, op.peer, op.tag))
        else:
            parts.append(Receive(plan[0], plan[1], op.tensor, op.peer, op.tag))
    works = _call("batch_isend_irecv", (p2p_op_list,), {})
    modeled = [p for p in parts if p is not None]
    if not modeled:
        return works
    if len(works) == len(parts):
        return [w if p is None else ModeledWork(w, [p], [op.tensor])
                for w, p, op in zip(works, parts, p2p_op_list)]
    tensors = [op.tensor for op in p2p_op_list]  # coalesced (NCCL): one Work for the group
    return [ModeledWork(w, modeled, tensors) for w in works]


_WRAPPERS = {name: _point_to_point(name) for name in P2P}
_WRAPPERS["batch_isend_irecv"] = functools.wraps(c10d.batch_isend_irecv)(_batch_isend_irecv)
_WRAPPERS.update({name: _collective(name) for name in COLLECTIVES})


def wrap(resolver) -> None:
    """Model every call from now on, ``resolver(group)`` giving a group's link (None: not
    modeled). Already wrapped: only the resolver changes (a nested ``use_link``)."""
    global _resolve
    if _resolve is None:
        link_messages.reset()
        for name in WRAPPED:
            current = getattr(c10d, name)
            if current is not _WRAPPERS[name]:  # what dist.<name> is now: torch's, the canary's
                _previous[name] = current
            setattr(c10d, name, _WRAPPERS[name])
            setattr(dist, name, _WRAPPERS[name])
    _resolve = resolver


def unwrap() -> None:
    """Put back what ``wrap`` replaced; a wrapper someone kept a reference to passes through."""
    global _resolve
    _resolve = None
    for name, fn in _previous.items():
        for module in (c10d, dist):
            if getattr(module, name) is _WRAPPERS[name]:
                setattr(module, name, fn)


def wrapped() -> bool:
    """True while torch.distributed's functions are this module's wrappers."""
    return _resolve is not None
