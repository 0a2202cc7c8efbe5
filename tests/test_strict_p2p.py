"""The strict point-to-point canary (``MINITRAIN_P2P=strict``, minitrain/runtime/strict_p2p.py):
NCCL's semantics on the CPU, and the collectives that must pass under it (issue 41).

Under the canary a rank's point-to-point operations run one at a time in issue order, a send
completes only once the peer's stream has *reached* the matching receive, tags are ignored
and one ``batch_isend_irecv`` is one group. So the pattern gloo forgives — ``irecv`` then
``isend`` to the same peer — fails (bounded, named) instead of passing, and everything the
course builds on send/recv must still equal torch's collectives. Few launches: each does a lot.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

from minitrain.runtime import LaunchError, get_device, launch, strict_p2p


@pytest.fixture
def strict(monkeypatch):
    """MINITRAIN_P2P=strict for the launches of this test (read at each launch)."""
    monkeypatch.setenv("MINITRAIN_P2P", "strict")
    monkeypatch.setenv("MINITRAIN_P2P_TIMEOUT", "20")
    return monkeypatch


def test_the_switch_is_read_from_the_environment(monkeypatch):
    assert strict_p2p.enabled_by_environment({"MINITRAIN_P2P": "strict"})
    assert not strict_p2p.enabled_by_environment({})
    assert not strict_p2p.enabled_by_environment({"MINITRAIN_P2P": "off"})
    with pytest.raises(ValueError, match="MINITRAIN_P2P"):  # a typo must not run unguarded
        strict_p2p.enabled_by_environment({"MINITRAIN_P2P": "stric"})
    monkeypatch.delenv("MINITRAIN_P2P", raising=False)
    monkeypatch.delenv("MINITRAIN_P2P_TIMEOUT", raising=False)
    assert strict_p2p.rank_initializers(60.0) == []  # off: nothing installed, zero cost
    monkeypatch.setenv("MINITRAIN_P2P", "strict")
    (install,) = strict_p2p.rank_initializers(60.0)
    assert install.args == (30.0,)  # half the launch's timeout: the named error comes first
    monkeypatch.setenv("MINITRAIN_P2P_TIMEOUT", "7")
    assert strict_p2p.rank_initializers(60.0)[0].args == (7.0,)


def _irecv_then_isend():
    """What ``collectives.exchange`` did before issue 41: post the receive, then the send."""
    rank, world = dist.get_rank(), dist.get_world_size()
    prev_rank, next_rank = (rank - 1) % world, (rank + 1) % world
    got = torch.empty(3, device=get_device())
    recv = dist.irecv(got, prev_rank)
    send = dist.isend(torch.full((3,), float(rank), device=get_device()), next_rank)
    recv.wait()
    send.wait()
    return got.tolist()


def _semantics():
    """Run on 3 ranks: what NCCL's semantics mean, measured; returns rank-specific facts."""
    rank, dev = dist.get_rank(), get_device()
    out = {"installed": strict_p2p.installed()}
    # a send completes when the receiver's *stream reaches* its receive: rank 2 receives from
    # rank 0 (which sends late) before it receives from rank 1, so rank 1's send waits
    if rank == 0:
        time.sleep(0.5)
        dist.send(torch.zeros(1, device=dev), 2)
    elif rank == 1:
        start = time.perf_counter()
        dist.isend(torch.ones(1, device=dev), 2).wait()
        out["send_waited"] = time.perf_counter() - start
    else:
        late, early = torch.empty(1, device=dev), torch.empty(1, device=dev)
        works = [dist.irecv(late, 0), dist.irecv(early, 1)]
        for work in works:
            work.wait()
    # tags: rank 0 sends a (tag 1) then b (tag 2); rank 1 receives with the tags swapped
    if rank == 0:
        for value, tag in ((10.0, 1), (20.0, 2)):
            dist.isend(torch.full((2,), value, device=dev), 1, tag=tag).wait()
    elif rank == 1:
        first, second = torch.empty(2, device=dev), torch.empty(2, device=dev)
        works = [dist.irecv(first, 0, tag=2), dist.irecv(second, 0, tag=1)]
        for work in works:
            work.wait()
        out["swapped_tags"] = (first[0].item(), second[0].item())
    # a paired exchange through one group, around the ring (group ranks, a P2POp's group)
    world = dist.get_world_size()
    group = dist.new_group(list(range(world)))
    mine, theirs = torch.full((4,), float(rank), device=dev), torch.empty(4, device=dev)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.irecv, theirs, group=group, group_peer=(rank - 1) % world),
        dist.P2POp(dist.isend, mine, (rank + 1) % world, group),
    ])
    for work in works:
        work.wait()
    if strict_p2p.installed():  # the canary's Work: torch's methods
        out["futures"] = [w.get_future().wait()[0].shape == (4,) for w in works]
        out["completed"] = all(w.is_completed() for w in works)
    out["paired"] = theirs[0].item()
    return out


def test_nccl_semantics_under_the_canary_and_gloo_without(strict):
    on = launch(_semantics, 3, timeout=120)
    assert all(r["installed"] for r in on)
    assert on[1]["send_waited"] > 0.4, "a send completed before its receiver's stream reached it"
    assert on[1]["swapped_tags"] == (10.0, 20.0), "tags must be ignored: issue order matches"
    assert [r["paired"] for r in on] == [2.0, 0.0, 1.0]
    assert all(r["completed"] and all(r["futures"]) for r in on)
    strict.delenv("MINITRAIN_P2P")
    off = launch(_semantics, 3, timeout=120)
    assert not any(r["installed"] for r in off)
    assert off[1]["send_waited"] < 0.4  # gloo: a *posted* receive is enough
    assert off[1]["swapped_tags"] == (20.0, 10.0)  # gloo matches by tag
    assert [r["paired"] for r in off] == [2.0, 0.0, 1.0]
    assert list(launch(_irecv_then_isend, 2, timeout=60)) == [[1.0] * 3, [0.0] * 3]


def test_irecv_then_isend_fails_bounded_and_named_under_the_canary(strict):
    strict.setenv("MINITRAIN_P2P_TIMEOUT", "3")
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        launch(_irecv_then_isend, 2, timeout=60)
    assert time.monotonic() - start < 30
    message = str(caught.value)
    assert "StrictP2PTimeout" in message and "MINITRAIN_P2P=strict" in message
    # op, peer, site: whichever rank's wait gives up first is reported (rank 0 or rank 1)
    assert re.search(r"irecv from rank [01]\b", message) and "_irecv_then_isend" in message
    assert "batch_isend_irecv" in message  # and how to fix it


def _init_from_env_installs():
    import os

    from minitrain.runtime import init_from_env

    before = strict_p2p.installed()
    os.environ.update(MINITRAIN_P2P="strict", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    init_from_env()  # torchrun's way in: the process group exists already, the canary not yet
    return before, strict_p2p.installed()


def test_torchrun_path_installs_from_its_own_environment(monkeypatch):
    monkeypatch.delenv("MINITRAIN_P2P", raising=False)
    assert list(launch(_init_from_env_installs, 1, timeout=60)) == [(False, True)]


# ------------------------------------------------------------------ the course under the canary
def _integers(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(1000 * rank + n)
    return torch.randint(-8, 9, (n,), generator=g, device="cpu").float().to(get_device())


def _collectives_under_the_canary(with_ddp: bool) -> list[str]:
    """Every send/recv-built collective of chapters 0 and 4 against torch's (small integers:
    exact in any order, so equality is the test); DataParallel's ring and auto too."""
    from minitrain import collectives as C
    from minitrain.runtime.point_to_point import broadcast, pass_the_token

    assert strict_p2p.installed()
    rank, world = dist.get_rank(), dist.get_world_size()
    fails = []
    for n in (0, 1, 5, 1001):
        x = _integers(rank, n)
        oracle = x.clone()
        dist.all_reduce(oracle)
        runs = {algo: lambda t, a=algo: C.all_reduce(t, a) for algo in (*C.ALGORITHMS, "auto")}
        for seg in (4, 64):  # several segments per chunk, some of them empty
            runs[f"pipelined/{seg}"] = lambda t, s=seg: C.ring_all_reduce_pipelined(t, None, s)
        for name, run in runs.items():
            got = x.clone()
            run(got)
            if not torch.equal(got, oracle):
                fails.append(f"{name} n={n} rank {rank}: differs from torch's all_reduce")
    token = pass_the_token(torch.zeros(1, device=get_device()))
    if rank == 0 and token.item() != world * (world + 1) / 2:
        fails.append(f"pass_the_token: {token.item()}")
    sent = broadcast(_integers(rank, 7), src=world - 1)
    if not torch.equal(sent, _integers(world - 1, 7)):
        fails.append(f"broadcast rank {rank}: not rank {world - 1}'s tensor")
    if with_ddp:
        fails += _ddp_under_the_canary()
    return fails


def _ddp_under_the_canary() -> list[str]:
    from minitrain.ddp import DataParallel

    rank, world, fails = dist.get_rank(), dist.get_world_size(), []
    x = _integers(rank, 24).view(3, 8)
    for communication in ("ring", "auto"):
        torch.manual_seed(0)
        with torch.device(get_device()):
            local, replica = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
        replica.load_state_dict(local.state_dict())
        model = DataParallel(replica, bucket_cap_mb=0.0001, communication=communication)
        model(x).square().sum().backward()
        local(x).square().sum().backward()
        for mine, theirs in zip(local.parameters(), replica.parameters()):
            average = mine.grad.clone()
            dist.all_reduce(average)
            if not torch.allclose(theirs.grad, average / world, rtol=1e-6, atol=1e-5):
                fails.append(f"DataParallel({communication!r}) rank {rank}: not the average")
    return fails


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_and_ddp_equal_torch_under_the_canary(strict, world):
    failures = launch(_collectives_under_the_canary, world, world == 2, timeout=180)
    assert not [f for per_rank in failures for f in per_rank], failures


def _gloo_style_plan(schedule, num_chunks=1):
    """How the executor posted before issue 41: each receive alone when its action starts,
    each send alone when its action ends (a message between a stage's own chunks: none)."""
    from minitrain.pipeline.messages import sent_by

    p, v, plan = len(schedule), num_chunks, []
    for s, actions in enumerate(schedule):
        items = []
        for action in actions:
            mb, c = action[1], (action[2] if len(action) > 2 else 0)
            virtual = c * p + s
            sender = virtual - 1 if action[0] == "F" else virtual + 1
            if action[0] in "FB" and 0 <= sender < p * v and sender % p != s:
                kind = action[0]
                items.append(("group", [("recv", sender % p, (kind, mb, virtual))]))
            items.append(("action", action))
            sent = sent_by(action, s, p, v)
            if sent is not None and sent.to_virtual % p != s:
                items.append(("group", [("send", sent.to_virtual % p, tuple(sent))]))
        plan.append(items)
    return plan


def test_the_pipeline_plan_runs_under_nccl_semantics_and_gloo_style_posting_does_not():
    """The executor's message plan (pipeline/messages.py) never deadlocks or mismatches under
    NCCL's rules, for every schedule up to p = 4, m = 8, v = 3; posting as gloo allows (before
    issue 41) deadlocks 1F1B's steady state and reorders interleaved 1F1B at p = 2, m = 3."""
    from minitrain.pipeline import ScheduleError, make_schedule
    from minitrain.pipeline.messages import check_streams

    for name in ("gpipe", "1f1b", "zero_bubble", "interleaved"):
        for p in (1, 2, 3, 4):
            for m in range(1, 9):
                for v in ((1, 2, 3) if name == "interleaved" else (1,)):
                    check_streams(make_schedule(name, p, m, v), v)
    one_f_one_b = make_schedule("1f1b", 2, 4)
    with pytest.raises(ScheduleError, match="deadlock"):
        check_streams(one_f_one_b, 1, _gloo_style_plan(one_f_one_b))
    interleaved = make_schedule("interleaved", 2, 3, 2)
    with pytest.raises(ScheduleError, match="NCCL matches them in order"):
        check_streams(interleaved, 2, _gloo_style_plan(interleaved, 2))


def test_every_schedule_equals_one_process_under_the_canary(strict):
    """GPipe, 1F1B, interleaved 1F1B (p = 2, m = 3 included: the tag-order case) and ZB-H1
    on 2 stages, and 1F1B and interleaved on 3, with NCCL's semantics: loss and every gradient
    equal one process's (tests/test_pipeline.py's matrix, run under the canary)."""
    from test_pipeline import _matrix  # tests/ is on sys.path under pytest

    cases = {2: [("gpipe", 2, 1, None), ("1f1b", 4, 1, None), ("interleaved", 3, 2, None),
                 ("interleaved", 4, 2, "selective"), ("zero_bubble", 3, 1, None)],
             3: [("1f1b", 3, 1, None), ("interleaved", 3, 2, None)]}
    for p, runs in cases.items():
        for rank, rows in enumerate(launch(_matrix, p, runs, 12, timeout=180)):
            for case, dloss, dgrad in rows:
                assert dloss < 1e-6 and dgrad < 1e-6, (p, rank, case, dloss, dgrad)


def _gpipe_on_two_stages() -> list[str]:
    """A GPipe step of the GPT on 2 stages against one process (chapter 7 under the canary:
    issue 41)."""
    from minitrain.model import GPTConfig
    from minitrain.parallel import ParallelGPT, single_process_losses

    cfg = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=16)
    job = ParallelGPT(cfg, dict(pp=2, microbatches=2, schedule="gpipe", optimizer="sgd"),
                      4, 0.5, 0)
    losses = [job.step(s) for s in range(2)]
    ref = single_process_losses(cfg, 2, 4, 0.5, 0, optimizer="sgd")
    if max(abs(a - b) for a, b in zip(losses, ref)) > 1e-5:
        return [f"GPipe on 2 stages: {losses} against one process's {ref}"]
    return []


def test_gpipe_under_the_canary(strict):
    """The pipeline's loss receive, posted before the step's first action, sat at the head of
    every stage's stream and hung under the canary; posted late there, GPipe equals one
    process. (1F1B's steady state still sends and receives apart: not yet.)"""
    assert launch(_gpipe_on_two_stages, 2, timeout=120) == [[], []]


def _layouts_on_four_ranks() -> list[str]:
    """The capstone's layouts that send point to point, against one process (issue 41)."""
    from minitrain.model import GPTConfig
    from minitrain.parallel import ParallelGPT, single_process_losses

    cfg = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=16)
    ref, fails = single_process_losses(cfg, 2, 4, 0.5, 0, optimizer="sgd"), []
    for layout in (dict(dp=2, tp=2), dict(tp=2, pp=2, microbatches=2),
                   dict(cp=2, pp=2, microbatches=2, schedule="gpipe")):
        job = ParallelGPT(cfg, {**layout, "optimizer": "sgd"}, 4, 0.5, 0)
        losses = [job.step(s) for s in range(2)]
        if max(abs(a - b) for a, b in zip(losses, ref)) > 1e-5:
            fails.append(f"{layout}: {losses} against one process's {ref}")
    return fails


def test_the_capstone_layouts_under_the_canary(strict):
    """dp2×tp2, tp2×pp2 (1F1B) and cp2×pp2 (GPipe, ring attention inside each stage) with
    NCCL's semantics: the losses of one process."""
    assert launch(_layouts_on_four_ranks, 4, timeout=240) == [[]] * 4


def _ring_attention() -> list[str]:
    """Ring attention (contiguous and zigzag, causal), forward and backward, against one
    rank's full attention (chapter 10 under the canary: issue 41)."""
    from minitrain.context_parallel import gather_sequence, ring_attention, shard_sequence
    from minitrain.model import naive_attention

    bad = []
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 16, 8, generator=g).to(get_device()) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out = naive_attention(*full, causal=True)
    want_out.backward(do)
    for layout in ("contiguous", "zigzag"):
        mine = [shard_sequence(t, layout=layout).clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*mine, causal=True, layout=layout)
        out.backward(shard_sequence(do, layout=layout))
        got = [gather_sequence(t, layout=layout) for t in (out.detach(), *(t.grad for t in mine))]
        want = [want_out.detach(), *(t.grad for t in full)]
        for name, a, b in zip(("output", "dq", "dk", "dv"), got, want):
            if not torch.allclose(a, b, atol=1e-5):
                bad.append(f"ring attention ({layout}): {name} differs by "
                           f"{(a - b).abs().max().item():.3g}")
    return bad


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_under_the_canary(strict, world):
    """Ring attention's exchange sent and received as two calls, a cycle round the ring on
    NCCL's in-order streams, hung under the canary; paired in one group it equals one rank's
    full attention."""
    assert launch(_ring_attention, world, timeout=120) == [[]] * world
