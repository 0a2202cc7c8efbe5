"""Chapter 7 solutions — generated from minitrain.pipeline.schedules, minitrain.pipeline.executor, minitrain.pipeline.check.

The worked answers. Look one up when you are stuck; the library has them too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from contextlib import nullcontext
from dataclasses import dataclass
from fractions import Fraction
from torch import nn
from torch.distributed import ProcessGroup
from minitrain.checkpointing import set_checkpointing
from minitrain.pipeline.check import ScheduleError, dependencies, simulate
from minitrain.pipeline.executor import PipelineStage
from minitrain.pipeline.messages import Message, message_plan, post_group
from minitrain.pipeline.partition import StageChunk, split_blocks
from minitrain.pipeline.schedules import check_sizes, resolve_schedule
from minitrain.pipeline.step_messages import LOSS_TAG, average_gradients, post_loss_receive, share_loss
from minitrain.pipeline.step_state import StepState
from minitrain.pipeline.weight_grad import LinearCalls, backward_input, w_parameters
from minitrain.runtime import trace


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> list[list[tuple]]:
    """1F1B, PipeDream-Flush (Narayanan et al. 2021, section 2.2, Figure 4, top).

    Stage s runs ``p - s - 1`` warm-up forwards (capped at m), then alternates one forward
    and one backward, then drains the remaining backwards. It finishes as early as GPipe
    (bubble (p-1)/(m+p-1) under unit costs) but holds at most ``p - s`` micro-batches'
    activations on stage s instead of m.
    """
    check_sizes(num_stages, num_microbatches)
    ### BEGIN SOLUTION
    p, m = num_stages, num_microbatches
    schedule = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [("F", mb) for mb in range(warmup)]
        for i in range(m - warmup):  # steady state: one forward, one backward
            actions += [("F", warmup + i), ("B", i)]
        actions += [("B", mb) for mb in range(m - warmup, m)]  # cool-down
        schedule.append(actions)
    return schedule
    ### END SOLUTION


def run_action(stage: PipelineStage, action: tuple, state: StepState) -> None:
    """Run one action of ``stage``'s schedule: receive what it needs, compute, send.

    - ``("F", mb[, c])``: the input is micro-batch ``mb``'s tokens on the first virtual stage,
      else the activation received from virtual stage ``v - 1`` (made a leaf that requires
      grad, so backward yields its gradient); ``stage.forward`` returns (input activation,
      output); keep both in ``state.saved``; send the output to ``v + 1`` unless last.
    - ``("B", mb[, c])``: the output gradient comes from virtual stage ``v + 1`` (none on the
      last: the output is the loss); send the input's gradient to ``v - 1`` unless this is
      the first; the saved pair is no longer needed. With ``state.split_backward`` (zero
      bubble) B computes the input's gradient and leaves the weight GEMMs to W
      (``stage.backward_input``: it parks W's work in ``state.pending_w``); otherwise
      (``stage.backward``) it computes every gradient.
    - ``("W", mb[, c])``: the weight gradients B parked for it (``stage.backward_weights``).
      When the backward was not split (``state.split_backward`` False: a schedule with W run
      with checkpointing, as notebook 07 does) B did all the work and W does nothing.

    Returns nothing; everything lives in ``state`` (``inputs``, ``saved``, ``pending_w``,
    ``split_backward``). May use: ``stage.virtual_stage(c)``, ``stage.is_first(c)``,
    ``stage.is_last(c)``, ``stage.forward(c, mb, x, state)``, ``stage.backward(name, out,
    grad)``, ``stage.backward_input(name, c, mb, out, grad, x, state)`` (returns the input's
    gradient, None on the first virtual stage), ``stage.backward_weights(name, c, work)``,
    ``stage.send(kind, mb, tensor, to_virtual, state)``, ``stage.recv(kind, mb,
    from_virtual, state, like=None)``. Why the received activation must require grad: backward
    stops at leaves that do not, and the previous stage waits for that input's gradient.
    """
    ### BEGIN SOLUTION
    kind, mb = action[0], action[1]
    c = action[2] if len(action) > 2 else 0
    v, key = stage.virtual_stage(c), (mb, c)
    name = f"{kind}{mb}" + (f".{c}" if stage.num_chunks > 1 else "")
    if kind == "F":
        if stage.is_first(c):
            x = state.inputs[mb]
        else:
            x = stage.recv("F", mb, v - 1, state).requires_grad_()
        x, out = stage.forward(c, mb, x, state)
        state.saved[key] = (x, out)
        if not stage.is_last(c):
            stage.send("F", mb, out, v + 1, state)
    elif kind == "B":
        x, out = state.saved.pop(key)
        grad = None if stage.is_last(c) else stage.recv("B", mb, v + 1, state, like=out)
        if state.split_backward:  # the input gradient only: W's GEMMs are parked
            x_grad = stage.backward_input(name, c, mb, out, grad, x, state)
        else:
            stage.backward(name, out, grad)
            x_grad = None if stage.is_first(c) else x.grad
        if not stage.is_first(c):
            stage.send("B", mb, x_grad, v - 1, state)
    elif kind == "W" and key in state.pending_w:
        stage.backward_weights(name, c, state.pending_w.pop(key))
    ### END SOLUTION


def bubble_fraction(schedule, num_chunks: int = 1) -> Fraction:
    """The idle fraction of ``schedule`` under unit stage costs, as an exact ``Fraction``.

    ``schedule``: one list of actions per stage (``("F", mb)``, ``("B", mb)``, ``("W", mb)``,
    or with a chunk index for interleaved schedules, ``num_chunks`` = v chunks per stage).
    Every action costs 1 (a chunk's action 1/v). The rules of time: a stage runs its own
    actions in the listed order, one at a time; an action can start only once every action
    it depends on has finished — ``dependencies(action, stage, p, v)`` lists them as keys
    ``(kind, mb, chunk, stage)``. The bubble is the share of the p x makespan stage-time
    that no action fills (Narayanan et al. 2021, section 2.2). A schedule in which no stage
    can go on deadlocks: raise ``ScheduleError`` saying so.

    Requirements and why: compute it by running the schedule (not by p and m — the formulas
    (p-1)/(m+p-1) only hold for GPipe and 1F1B, and this must also judge zero bubble and
    interleaved schedules, and schedules a learner writes); exact fractions so a bubble of
    1/7 compares equal to 1/7.
    """
    ### BEGIN SOLUTION
    p, cost = len(schedule), Fraction(1, num_chunks)
    finish, free, position = {}, [Fraction(0)] * p, [0] * p
    while any(position[s] < len(schedule[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(schedule[s]):
                action = schedule[s][position[s]]
                deps = dependencies(action, s, p, num_chunks)
                if any(d not in finish for d in deps):
                    break
                free[s] = max([free[s]] + [finish[d] for d in deps]) + cost
                chunk = action[2] if len(action) > 2 else 0
                finish[(action[0], action[1], chunk, s)] = free[s]
                position[s] += 1
                progressed = True
        if not progressed:
            raise ScheduleError(f"the schedule deadlocks at actions {position} of each stage")
    busy = cost * sum(len(stage) for stage in schedule)
    return 1 - busy / (p * max(free))
    ### END SOLUTION

# minitrain-exercises-hash: 6af3c4c268147707
