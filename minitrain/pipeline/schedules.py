"""Pipeline schedules as pure data: which action each stage runs, in which order.

Chapter 7, notebooks/07_pipeline_parallel.ipynb. A schedule is a list with one entry per
stage; entry s is the ordered list of actions stage s runs in one training step:

- ``("F", mb)`` forward of micro-batch ``mb``; ``("B", mb)`` its backward;
- interleaved: ``("F", mb, chunk)`` / ``("B", mb, chunk)``; model chunk c of stage s holds
  virtual stage ``c * num_stages + s`` (Narayanan et al. 2021, section 2.2);
- zero bubble: ``("B", mb)`` is the backward for the *input* gradient only and
  ``("W", mb)`` the *weight* gradient (Qi et al. 2024, "Zero Bubble Pipeline Parallelism").

Nothing here runs a model: ``minitrain.pipeline.check`` simulates a schedule (makespan,
bubble, memory) and ``minitrain.pipeline.executor`` runs it over send/recv, after
``resolve_schedule`` turned a name or a function into the data and checked it.
"""

from __future__ import annotations

from minitrain.pipeline.check import ScheduleError, simulate


def check_sizes(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                        ("num_chunks", num_chunks)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def gpipe_schedule(num_stages: int, num_microbatches: int) -> list[list[tuple]]:
    """GPipe (Huang et al. 2019, section 2.3): every forward, then every backward.

    Each stage holds the activations of all m micro-batches at once (peak in-flight m);
    under unit costs the bubble is (p-1)/(m+p-1). Backwards run in reverse order, so the
    last micro-batch's gradient, the first to arrive, is consumed first.
    """
    check_sizes(num_stages, num_microbatches)
    m = num_microbatches
    order = [("F", mb) for mb in range(m)] + [("B", mb) for mb in reversed(range(m))]
    return [list(order) for _ in range(num_stages)]


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


def interleaved_one_f_one_b_schedule(
    num_stages: int, num_microbatches: int, num_chunks: int
) -> list[list[tuple]]:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2, Figure 4, bottom).

    Each stage holds ``v = num_chunks`` model chunks; chunk c of stage s is virtual stage
    c*p + s. Micro-batches go through in groups of p: a stage runs the forwards of one group
    on chunk 0, then on chunk 1, ... (backwards in the reverse chunk order). Stage s starts
    with ``2(p - s - 1) + (v - 1) * g`` warm-up forwards (g = min(p, m), the group size;
    Megatron-LM's count), then alternates, then drains. Each chunk's forward costs 1/v of
    a stage's, so under unit stage costs the bubble shrinks to (p-1)/(v*m + p-1) when p
    divides m (``check.interleaved_bubble_fraction`` derives it), at the price of more
    activations: stage s holds up to min(2(p-s-1) + (v-1)p + 1, v*m) chunks, each 1/v of
    the stage (``check.interleaved_peak_in_flight``). v = 1 is plain 1F1B.
    """
    check_sizes(num_stages, num_microbatches, num_chunks)
    p, m, v = num_stages, num_microbatches, num_chunks
    g = min(p, m)

    def order(reverse_chunks: bool) -> list[tuple[int, int]]:
        out = []
        for start in range(0, m, g):  # groups of g micro-batches
            group = range(start, min(start + g, m))
            for c in (reversed(range(v)) if reverse_chunks else range(v)):
                out += [(mb, c) for mb in group]
        return out

    forwards, backwards = order(False), order(True)

    def build(extra: int) -> list[list[tuple]]:
        schedule = []
        for s in range(p):
            if v == 1:  # plain 1F1B
                warmup = p - s - 1
            else:
                warmup = 2 * (p - s - 1) + (v - 1) * g + extra
            warmup = min(warmup, m * v)
            actions = [("F", *a) for a in forwards[:warmup]]
            for i in range(m * v - warmup):
                actions += [("F", *forwards[warmup + i]), ("B", *backwards[i])]
            actions += [("B", *b) for b in backwards[m * v - warmup:]]
            schedule.append(actions)
        return schedule

    # When p does not divide m, Megatron-LM's warm-up can leave the last partial group
    # waiting on a backward that waits on it (e.g. p=4, m=5, v=3): add warm-up forwards
    # until it runs. With every forward first (GPipe's order) it always runs.
    for extra in range(m * v + 1):
        schedule = build(extra)
        try:
            simulate(schedule, num_microbatches=m, num_chunks=v)
            return schedule
        except ScheduleError:
            continue
    return schedule  # unreachable: extra = m*v is the all-forwards-first order


def zero_bubble_schedule(num_stages: int, num_microbatches: int) -> list[list[tuple]]:
    """ZB-H1 (Qi et al. 2024, section 3.1, Figure 3): 1F1B with the weight gradient split off.

    The backward becomes B (gradient of the stage's input: on the critical path, sent to the
    previous stage at once) and W (gradient of the weights: nobody downstream needs it, so
    it can wait and fill bubbles). ZB-H1 keeps 1F1B's peak memory — p micro-batches in
    flight, 1F1B's first stage, now the limit of every stage, counted until W frees the
    activations — and with T_F = T_B = T_W cuts the bubble time from 1F1B's
    (p-1)(T_F+T_B+T_W) to (p-1)(T_F+T_B-T_W) when m >= p.

    Built by list scheduling under unit costs (F = B = W = 1): each stage keeps 1F1B's order
    of F and B; whenever its next F or B cannot start yet (its input has not arrived, or a
    new F would put more than p micro-batches in flight) it runs its oldest pending W.
    """
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    order = one_f_one_b_schedule(p, m)
    done: dict[tuple, int] = {}  # (kind, mb, stage) -> finish time
    schedule: list[list[tuple]] = [[] for _ in range(p)]
    position, pending_w, in_flight, time = [0] * p, [[] for _ in range(p)], [0] * p, 0

    def finished(kind, mb, stage):
        return done.get((kind, mb, stage), time + 1) <= time

    while any(len(actions) < 3 * m for actions in schedule):
        busy = []
        for s in range(p):
            action = order[s][position[s]] if position[s] < m * 2 else None
            if action is not None:
                kind, mb = action
                if kind == "F":  # needs the previous stage's output and room in memory
                    ready = (s == 0 or finished("F", mb, s - 1)) and in_flight[s] < p
                else:  # needs the next stage's input gradient (the last stage: nothing more)
                    ready = s == p - 1 or finished("B", mb, s + 1)
                if not ready:
                    action = None
            if action is None and pending_w[s]:
                action = ("W", pending_w[s].pop(0))
            if action is None:
                continue  # idle: a bubble
            if action[0] == "W":
                in_flight[s] -= 1
            else:
                position[s] += 1
                in_flight[s] += action[0] == "F"
                if action[0] == "B":
                    pending_w[s].append(action[1])
            schedule[s].append(action)
            busy.append((action[0], action[1], s))
        for key in busy:  # every action takes one unit: visible to the others next step
            done[key] = time + 1
        time += 1
    return schedule


SCHEDULES = {
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
    "interleaved": interleaved_one_f_one_b_schedule,
    "zero_bubble": zero_bubble_schedule,
}


def make_schedule(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1):
    """The schedule called ``name`` (a key of SCHEDULES) for these sizes."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if name == "interleaved":
        return interleaved_one_f_one_b_schedule(num_stages, num_microbatches, num_chunks)
    if num_chunks != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per stage, got num_chunks={num_chunks}")
    return SCHEDULES[name](num_stages, num_microbatches)


def resolve_schedule(schedule, num_stages: int, num_microbatches: int, num_chunks: int = 1):
    """The schedule ``PipelineStage.train_step`` runs, given as data, as a name in
    ``SCHEDULES`` or as a function ``(p, m)`` / ``(p, m, v)`` returning it; checked on every
    rank before anything runs (``check.simulate`` raises ``ScheduleError`` where the schedule
    would deadlock or leave work undone), so a bad schedule raises instead of hanging."""
    p, m, v = num_stages, num_microbatches, num_chunks
    if isinstance(schedule, str):
        schedule = make_schedule(schedule, p, m, v)
    elif callable(schedule):
        schedule = schedule(p, m, v) if v > 1 else schedule(p, m)
    if len(schedule) != p:
        raise ValueError(f"the schedule has {len(schedule)} stages, the pipeline {p}")
    widths = {len(a) for stage in schedule for a in stage}
    if v > 1 and widths != {3}:
        raise ValueError(f"with num_chunks={v} every action must be (kind, mb, chunk)")
    simulate(schedule, num_microbatches=m, num_chunks=v)  # raises ScheduleError: no hang
    return schedule
