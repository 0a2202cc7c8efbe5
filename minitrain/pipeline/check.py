"""Check and simulate a pipeline schedule: is it valid, does it deadlock, how long, how much memory.

Chapter 7, notebooks/07_pipeline_parallel.ipynb. ``simulate(schedule, costs)`` runs the
schedule on an idealised machine: each stage runs its actions in the given order, an action
starts as soon as its stage is free and its inputs exist (communication is free), and takes
``costs[kind]`` time units. It reports the makespan, the bubble fraction and the peak number
of micro-batches each stage holds activations for; it raises ``ScheduleError`` naming the
actions when a schedule is malformed or would deadlock. The executor calls it before running
anything, so a bad schedule fails on every rank at once instead of hanging.

Cost convention: a stage's forward F costs 1 and its backward B 1 (``UNIT``). With the
zero-bubble split (W actions present), F = B = W = 1: B is only the input gradient and W the
weight gradient, so a whole backward is B + W = 2 — compare 1F1B with ``{"F": 1, "B": 2}``.
An interleaved chunk holds 1/v of the stage, so its actions cost 1/v (``chunk_costs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

UNIT = {"F": 1, "B": 1, "W": 1}


class ScheduleError(ValueError):
    """A schedule that is malformed or cannot run to the end."""


@dataclass
class Simulation:
    makespan: Fraction
    busy: list  # per stage: time spent computing
    bubble_fraction: Fraction  # 1 - sum(busy) / (p * makespan)
    peak_in_flight: list  # per stage: most (micro-batch, chunk) pairs holding activations
    timeline: list  # per stage: (start, end, action) in order


def action_key(action) -> tuple[int, int]:
    """(micro-batch, chunk) of an action; chunk 0 when the action names none."""
    return action[1], (action[2] if len(action) > 2 else 0)


def validate(schedule, num_microbatches: int | None = None, num_chunks: int | None = None) -> None:
    """Each stage runs every (micro-batch, chunk) exactly once forward and once backward (and
    once W if the schedule splits the backward), forward before backward before W."""
    if not schedule:
        raise ScheduleError("a schedule needs at least one stage, got an empty list")
    actions = [a for stage in schedule for a in stage]
    kinds = {a[0] for a in actions}
    if not kinds <= {"F", "B", "W"}:
        raise ScheduleError(f"unknown action kinds {sorted(kinds - {'F', 'B', 'W'})}; use F, B, W")
    m = num_microbatches if num_microbatches is not None else 1 + max(a[1] for a in actions)
    v = num_chunks if num_chunks is not None else 1 + max(action_key(a)[1] for a in actions)
    want = ("F", "B", "W") if "W" in kinds else ("F", "B")
    case = f"schedule of p={len(schedule)} stages, m={m} micro-batches" + (f", v={v}" if v > 1 else "")
    for s, stage in enumerate(schedule):
        seen = {}
        for i, a in enumerate(stage):
            mb, c = action_key(a)
            if not (0 <= mb < m and 0 <= c < v):
                why = (f"micro-batch {mb} does not exist when m = {m} (they are 0..{m - 1})"
                       if not 0 <= mb < m else f"chunk {c} does not exist when v = {v}")
                raise ScheduleError(f"{case}: stage {s}'s action {a}: {why}")
            seen.setdefault((mb, c), []).append((a[0], i))
        for mb in range(m):
            for c in range(v):
                got = [k for k, _ in seen.get((mb, c), [])]
                if sorted(got, key="FBW".index) != list(want):
                    raise ScheduleError(
                        f"{case}: stage {s}: micro-batch {mb} chunk {c} has actions {got}, "
                        f"expected each of {list(want)} exactly once")
                if got != list(want):
                    raise ScheduleError(
                        f"{case}: stage {s}: micro-batch {mb} chunk {c} runs in the order {got}; "
                        f"it must be {list(want)} (a backward needs its forward first)")


def dependencies(action, stage: int, p: int, v: int):
    """(kind, mb, chunk, stage) that must finish before ``action`` can start on ``stage``."""
    kind, (mb, c) = action[0], action_key(action)
    virtual, last = c * p + stage, p * v - 1
    deps = []
    if kind == "F" and virtual > 0:
        prev = virtual - 1
        deps.append(("F", mb, prev // p, prev % p))
    if kind == "B":
        deps.append(("F", mb, c, stage))
        if virtual < last:
            nxt = virtual + 1
            deps.append(("B", mb, nxt // p, nxt % p))
    if kind == "W":
        deps.append(("B", mb, c, stage))
    return deps


def simulate(schedule, costs=None, num_microbatches=None, num_chunks=None,
             complete=True) -> Simulation:
    """Run ``schedule`` on the idealised machine; raise ScheduleError if it deadlocks.

    ``costs`` maps "F"/"B"/"W" to a duration (default UNIT); Fractions keep results exact.
    ``complete=False`` skips ``validate`` (a forward-only pass, as an evaluation runs).
    """
    if complete:
        validate(schedule, num_microbatches, num_chunks)
    costs = {k: Fraction(x) for k, x in {**UNIT, **(costs or {})}.items()}
    p = len(schedule)
    v = num_chunks if num_chunks is not None else 1 + max(action_key(a)[1] for st in schedule for a in st)
    splits = any(a[0] == "W" for st in schedule for a in st)
    finish = {}  # (kind, mb, chunk, stage) -> end time
    position, free_at = [0] * p, [Fraction(0)] * p
    in_flight, peak = [0] * p, [0] * p
    timeline = [[] for _ in range(p)]
    releases = [[] for _ in range(p)]  # (time, -1) when a B/W ends: activations freed
    while any(position[s] < len(schedule[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(schedule[s]):
                action = schedule[s][position[s]]
                deps = dependencies(action, s, p, v)
                if any(d not in finish for d in deps):
                    break
                start = max([free_at[s]] + [finish[d] for d in deps])
                end = start + costs[action[0]]
                mb, c = action_key(action)
                finish[(action[0], mb, c, s)] = end
                free_at[s] = end
                timeline[s].append((start, end, action))
                if action[0] == "F":  # activations are held from the start of F ...
                    releases[s].append((start, 1))
                elif action[0] == ("W" if splits else "B"):  # ... until the last use frees them
                    releases[s].append((end, -1))
                position[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: schedule[s][position[s]] for s in range(p) if position[s] < len(schedule[s])}
            raise ScheduleError(
                "the schedule deadlocks: every unfinished stage waits for an action that "
                f"never runs — next actions by stage: {stuck}")
    for s in range(p):  # peak in flight: frees at time t happen before starts at time t
        for _, delta in sorted(releases[s], key=lambda e: (e[0], e[1])):
            in_flight[s] += delta
            peak[s] = max(peak[s], in_flight[s])
    makespan = max(free_at)
    busy = [sum((e - b for b, e, _ in tl), Fraction(0)) for tl in timeline]
    bubble = 1 - sum(busy) / (p * makespan)
    return Simulation(makespan, busy, bubble, peak, timeline)


def chunk_costs(num_chunks: int, costs=None) -> dict:
    """Costs of one chunk's actions when a stage's are ``costs``: each chunk is 1/v of it."""
    return {k: Fraction(x) / num_chunks for k, x in {**UNIT, **(costs or {})}.items()}


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


def one_f_one_b_bubble_fraction(num_stages: int, num_microbatches: int) -> Fraction:
    """(p-1)/(m+p-1): GPipe's and 1F1B's bubble under unit costs (Huang et al. 2019)."""
    p, m = num_stages, num_microbatches
    return Fraction(p - 1, m + p - 1)


def interleaved_bubble_fraction(num_stages: int, num_microbatches: int, num_chunks: int) -> Fraction:
    """(p-1)/(v*m + p-1), exact when p divides m (Narayanan et al. 2021, section 2.2.1).

    Derivation, unit stage costs, so a chunk's F and B each cost 1/v: every stage computes
    m*v chunk-forwards and m*v chunk-backwards, 2m time units. With micro-batches in groups
    of p, the steady state never starves, so a stage idles only while the pipeline fills
    (stage s waits s chunk-forwards, and the last virtual stage's first backward comes
    p-1-s chunk-slots after stage s's warm-up ends) and drains, the same in reverse:
    (p-1) chunk-slots of 1/v for forward and (p-1) for backward, 2(p-1)/v in all. So the
    makespan is 2m + 2(p-1)/v and the bubble (2(p-1)/v) / (2m + 2(p-1)/v). v = 1 gives 1F1B's
    (p-1)/(m+p-1). When p does not divide m (or m < p) the last partial group waits more;
    ``simulate`` gives the exact number, never below this one.
    """
    p, m, v = num_stages, num_microbatches, num_chunks
    return Fraction(p - 1, v * m + p - 1)


def interleaved_peak_in_flight(num_stages: int, num_microbatches: int, num_chunks: int) -> list:
    """Chunks stage s holds at its peak under interleaved 1F1B, p dividing m: its warm-up
    forwards 2(p-s-1) + (v-1)p plus the steady state's one, at most all v*m (v = 1: 1F1B's
    min(p - s, m)). Each chunk's activations are 1/v of the stage's."""
    p, m, v = num_stages, num_microbatches, num_chunks
    if v == 1:
        return [min(p - s, m) for s in range(p)]
    return [min(2 * (p - s - 1) + (v - 1) * p + 1, v * m) for s in range(p)]


def zero_bubble_h1_makespan(num_stages: int, num_microbatches: int, costs=None) -> Fraction:
    """ZB-H1's makespan m(T_F+T_B+T_W) + (p-1)(T_F+T_B-T_W) (Qi et al. 2024, section 3.1)."""
    c = {k: Fraction(x) for k, x in {**UNIT, **(costs or {})}.items()}
    p, m = num_stages, num_microbatches
    return m * (c["F"] + c["B"] + c["W"]) + (p - 1) * (c["F"] + c["B"] - c["W"])
