"""A pipeline step's point-to-point messages: which, when, grouped as NCCL needs them.

Chapter 7, notebooks/07_pipeline_parallel.ipynb (issue 41). A schedule (``schedules.py``)
says what each stage computes; this module says what travels between the stages, so that
the same step runs on gloo (buffered sends, messages matched by tag) and on NCCL, which has
neither: a rank's sends and receives run one after another on one stream, a send finishes
only when its peer's stream reaches the matching receive, and two ranks' messages match in
the order they were posted, tags ignored (NCCL documentation, "Point-to-point
communication"). Posted where gloo allows, 1F1B's steady state deadlocks on NCCL (stage s
sends an activation to s+1, then waits for a gradient from s+1, which sends that gradient
before it waits for the activation: each send sits ahead of the receive the other needs),
and interleaved 1F1B with p = 2, m = 3 receives a gradient as an activation of the same
shape, silently wrong.

The rule, in lockstep as Megatron-LM's ``send_forward_recv_backward`` and torch's pipelining
schedules are: run the schedule on ``check.simulate``'s idealised clock (every action one
unit); a message leaves at the tick its action ends, and its sender and its receiver post
their halves in the *same* group, the group of that tick (one ``batch_isend_irecv``: its
operations progress independently). Every rank posts its groups in tick order, between the
actions the clock puts before and after them, so the n-th group of a pair always meets the
n-th group of the other: no deadlock, no reordering, whatever the schedule. A receive is
only posted early; the rank waits for it when the action that needs it starts.

``check_streams`` runs the groups as NCCL would (no buffering, per-pair order, no tags) and
raises ``ScheduleError`` where they would deadlock or mismatch: the test of this rule.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from minitrain.pipeline.check import ScheduleError, action_key, simulate
from minitrain.runtime import trace

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
HEADER = 8  # ints: ndim, dtype index, up to 6 sizes
HEADER_TAG = 1 << 20


class Message(NamedTuple):
    """An activation (``kind`` "F") or a gradient ("B") of micro-batch ``mb``, for the stage
    holding virtual stage ``to_virtual``."""

    kind: str
    mb: int
    to_virtual: int


def sent_by(action, stage: int, p: int, v: int) -> Message | None:
    """The message ``action`` of ``stage`` sends when it ends (None: it sends nothing)."""
    mb, c = action_key(action)
    virtual = c * p + stage
    if action[0] == "F" and virtual < p * v - 1:
        return Message("F", mb, virtual + 1)
    if action[0] == "B" and virtual > 0:
        return Message("B", mb, virtual - 1)
    return None


def message_plan(schedule, num_chunks: int = 1, complete: bool = True) -> list[list[tuple]]:
    """Per stage, in the order it runs them: ``("action", action)`` and ``("group", ops)``,
    ``ops`` a list of ``("send" | "recv", peer stage, Message)`` posted as one group. A message
    between two chunks of one stage never leaves the rank (no op). ``complete=False``: a
    forward-only schedule (an evaluation)."""
    p, v = len(schedule), num_chunks
    timeline = simulate(schedule, num_chunks=v, complete=complete).timeline
    groups = [{} for _ in range(p)]  # stage -> tick -> ops
    for s in range(p):
        for _, end, action in timeline[s]:
            message = sent_by(action, s, p, v)
            if message is not None and message.to_virtual % p != s:
                dst = message.to_virtual % p
                groups[s].setdefault(end, []).append(("send", dst, message))
                groups[dst].setdefault(end, []).append(("recv", s, message))
    plan = []
    for s in range(p):
        ticks, items = sorted(groups[s]), []
        for start, _, action in timeline[s]:
            while ticks and ticks[0] <= start:  # everything due before this action starts
                items.append(("group", groups[s][ticks.pop(0)]))
            items.append(("action", action))
        plan.append(items + [("group", groups[s][t]) for t in ticks])
    return plan


def check_streams(schedule, num_chunks: int = 1, plan=None) -> None:
    """Run ``plan``'s groups (default: ``message_plan``'s) as NCCL would: a stage's groups one after another; an
    operation completes once its counterpart — the send or receive of the same index between
    the same two stages, tags ignored — is in the peer's current group; a group ends when all
    its operations have. Raises ``ScheduleError`` naming each stage's stuck group on a
    deadlock, or the first pair whose n-th send and n-th receive are different messages."""
    p = len(schedule)
    streams = [[ops for kind, ops in items if kind == "group"]
               for items in plan or message_plan(schedule, num_chunks)]
    per_pair, counterpart = {}, {}  # (src, dst, op) -> [(where, message)]; where -> where
    for s, groups in enumerate(streams):
        for g, group in enumerate(groups):
            for i, (op, peer, message) in enumerate(group):
                pair = (s, peer, op) if op == "send" else (peer, s, op)
                per_pair.setdefault(pair, []).append(((s, g, i), message))
    for (src, dst, op), sends in per_pair.items():
        receives = per_pair.get((src, dst, "recv"), [])
        if op != "send":
            continue
        if len(receives) != len(sends):
            raise ScheduleError(f"stage {src} sends {len(sends)} messages to stage {dst}, "
                                f"which receives {len(receives)}")
        for n, ((here, message), (there, wanted)) in enumerate(zip(sends, receives)):
            if message != wanted:
                raise ScheduleError(
                    f"stage {src}'s send #{n} to stage {dst} is {message}, but stage {dst}'s "
                    f"receive #{n} from it expects {wanted}: NCCL matches them in order")
            counterpart[here], counterpart[there] = there, here
    at, matched = [0] * p, set()
    while any(at[s] < len(streams[s]) for s in range(p)):
        current = [s for s in range(p) if at[s] < len(streams[s])]
        for s in current:  # an operation matches while both sides' groups are current
            for i in range(len(streams[s][at[s]])):
                peer, g, _ = counterpart[(s, at[s], i)]
                if at[peer] == g:
                    matched.add((s, at[s], i))
        done = [s for s in current if all((s, at[s], i) in matched
                                          for i in range(len(streams[s][at[s]])))]
        if not done:
            raise ScheduleError("the schedule's messages deadlock under NCCL's semantics: "
                                f"stuck groups by stage {({s: streams[s][at[s]] for s in current})}")
        for s in done:
            at[s] += 1


# ---------------------------------------------------------------------- at run time
def tag(stage, message: Message) -> int:
    """One tag per message (gloo matches by tag; NCCL ignores it: the plan's order matches)."""
    return (message.mb * stage.num_stages * stage.num_chunks + message.to_virtual) * 2 + (
        message.kind == "B")


def post_group(stage, ops: list, state) -> None:
    """Post one group of ``message_plan`` for ``stage`` (a ``PipelineStage``): its sends take
    their tensors from ``state.outbox`` (put there by ``stage.send``); its receives get
    buffers — an activation's shape from the stage's known shapes or a header received first,
    a gradient's from the output it flows back into — waited for in ``stage.recv``. The first
    activation a link carries for a batch shape travels after a small header (ndim, dtype,
    shape), in a group of headers just before: a sequence-parallel stage receives its shard."""
    peer_rank = stage.rank_of
    headers, receiving = [], []
    for op, peer, message in ops:
        if message.kind != "F":
            continue
        if op == "send" and (message.to_virtual, state.key) not in stage.sent_shapes:
            tensor = state.outbox[message]
            header = torch.zeros(HEADER, dtype=torch.int64, device=tensor.device)
            header[0], header[1] = tensor.dim(), DTYPES.index(tensor.dtype)
            header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, device=tensor.device)
            headers.append(dist.P2POp(dist.isend, header, peer_rank(peer), stage.group,
                                      HEADER_TAG + message.to_virtual))
            stage.sent_shapes.add((message.to_virtual, state.key))
        if op == "recv" and (message.to_virtual, state.key) not in stage.known_shapes:
            header = torch.zeros(HEADER, dtype=torch.int64, device=state.device)
            headers.append(dist.P2POp(dist.irecv, header, peer_rank(peer), stage.group,
                                      HEADER_TAG + message.to_virtual))
            receiving.append((message, header))
    if headers:
        for work in dist.batch_isend_irecv(headers):  # first step only: inside its recv's wait
            work.wait()
        for message, header in receiving:
            ndim = int(header[0])
            stage.known_shapes[(message.to_virtual, state.key)] = (
                tuple(int(x) for x in header[2:2 + ndim]), DTYPES[int(header[1])])
    p2p, sent = [], []
    for op, peer, message in ops:
        if op == "send":
            tensor = state.outbox.pop(message)
            p2p.append(dist.P2POp(dist.isend, tensor, peer_rank(peer), stage.group,
                                  tag(stage, message)))
            sent.append(tensor)
        else:
            if message.kind == "F":
                shape, dtype = stage.known_shapes[(message.to_virtual, state.key)]
            else:  # the gradient of the output this stage's chunk sent
                out = state.saved[(message.mb, message.to_virtual // stage.num_stages)][1]
                shape, dtype = out.shape, out.dtype
            buffer = torch.empty(shape, dtype=dtype, device=state.device)
            p2p.append(dist.P2POp(dist.irecv, buffer, peer_rank(peer), stage.group,
                                  tag(stage, message)))
            sent.append(buffer)
    start = trace.now(state.device)
    works = dist.batch_isend_irecv(p2p)
    end = trace.now(state.device)
    for op, _, message in ops:  # a span per send (as a wait per receive, in stage.recv)
        if op == "send":
            trace.record(f"send {message.kind}{message.mb}", "communication", start, end)
    if len(works) != len(p2p):  # NCCL coalesces the group into one Work: it stands for each
        works = works * len(p2p)
    for (op, _, message), work, tensor in zip(ops, works, sent):
        if op == "send":
            state.sends.append((work, tensor))
        else:
            state.arrivals[message] = (work, tensor)
