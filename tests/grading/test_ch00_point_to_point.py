"""Graded tests of chapter 0: point-to-point messages, checked against torch's collectives.

The exercises say "send/recv only": a call of one of torch's collectives inside the
learner's function is recorded (and still run, so nothing hangs) and fails the test,
as does a byte count other than the algorithm's.
"""

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from minitrain.runtime import launch

_COLLECTIVES = (
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
)  # fmt: skip


@contextmanager
def _record_calls():
    """Inside: torch.distributed's collectives note their names in ``calls["collectives"]``
    and sends add their bytes to ``calls["bytes_sent"]``; both still do their work."""
    calls = {"collectives": [], "bytes_sent": 0}

    def wrap(name, fn):
        def recorded(*args, **kwargs):
            if name in ("send", "isend"):
                tensor = kwargs.get("tensor", args[0] if args else None)
                calls["bytes_sent"] += tensor.numel() * tensor.element_size()
            else:
                calls["collectives"].append(f"dist.{name}")
            return fn(*args, **kwargs)

        return recorded

    originals = {n: getattr(dist, n) for n in _COLLECTIVES + ("send", "isend") if hasattr(dist, n)}
    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _only_send_recv(exercise, calls):
    return (
        f"{exercise} must use only dist.send and dist.recv, but it called "
        f"{', '.join(sorted(set(calls['collectives'])))} — torch's collective does the work "
        "the exercise asks you to write"
    )


def _token_vs_all_reduce(shape):
    from minitrain.runtime.point_to_point import pass_the_token

    token = torch.arange(float(torch.tensor(shape).prod())).reshape(shape)
    before = token.clone()
    with _record_calls() as calls:
        mine = pass_the_token(token)
    # Reference: torch's all_reduce of (rank + 1), added to the token.
    ref = torch.tensor(float(dist.get_rank() + 1))
    dist.all_reduce(ref)
    expected_rank0 = before + ref
    # rank r > 0 last held token + 1 + 2 + ... + (r + 1)
    partial = before + sum(range(1, dist.get_rank() + 2))
    return mine, expected_rank0, partial, torch.equal(token, before), calls


@pytest.mark.exercise("pass_the_token", points=2)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_pass_the_token(world_size):
    results = launch(_token_vs_all_reduce, world_size, (2, 3), timeout=30)
    for rank, (mine, expected_rank0, partial, untouched, calls) in enumerate(results):
        assert not calls["collectives"], _only_send_recv("pass_the_token", calls)
        assert untouched, f"rank {rank}: pass_the_token changed its input tensor"
        want = expected_rank0 if rank == 0 else partial
        assert mine.shape == want.shape, (
            f"rank {rank}: returned a tensor of shape {tuple(mine.shape)}, expected {tuple(want.shape)}"
        )
        assert torch.equal(mine, want), (
            f"pass_the_token with {world_size} ranks: rank {rank} returned "
            f"{mine.flatten()[:3].tolist()}…, expected {want.flatten()[:3].tolist()}… "
            f"(rank r adds r + 1; rank 0 returns the token after its trip round the ring)"
        )


def _token_in_a_group():
    from minitrain.runtime.point_to_point import pass_the_token

    group = dist.new_group([1, 2])  # every rank takes part in creating it
    held = None
    if dist.get_rank() in (1, 2):
        with _record_calls() as calls:
            held = pass_the_token(torch.zeros(2), group=group).tolist()
        assert not calls["collectives"], _only_send_recv("pass_the_token", calls)
    dist.barrier()
    return held


@pytest.mark.exercise("pass_the_token", points=1)
def test_pass_the_token_goes_round_the_group():
    from minitrain.runtime import LaunchError

    try:
        results = launch(_token_in_a_group, 3, timeout=60)
    except LaunchError as exc:
        if "NotImplementedError" in str(exc):
            raise
        raise AssertionError(
            f"pass_the_token(group=[ranks 1, 2]) on 3 ranks did not finish: "
            f"{str(exc).splitlines()[0]} — does a rank wait for rank 0, which is not in the "
            f"group? The ring is the group's ranks (ring_neighbours(group), "
            f"dist.get_rank(group))") from None
    for rank, want in ((1, [3.0, 3.0]), (2, [3.0, 3.0])):
        assert results[rank] == want, (
            f"pass_the_token(group=[ranks 1, 2]) on 3 ranks: global rank {rank} returned "
            f"{results[rank]}, expected {want} — the ring is the group's ranks (rank 1 is the "
            f"group's rank 0 and adds 1, rank 2 adds 2), and send/recv take global ranks")


def _broadcast_vs_torch(src, dtype):
    from minitrain.runtime.point_to_point import broadcast

    rank = dist.get_rank()
    mine = torch.full((5,), float(rank * 10 + 1), dtype=dtype)
    ref = mine.clone()
    with _record_calls() as calls:
        try:
            returned = broadcast(mine, src=src)
        except NotImplementedError:  # the untouched stub: "not written yet", not a send's fault
            raise
        except RuntimeError as exc:  # gloo's words ("Pair is not connected") say little
            raise RuntimeError(
                f"rank {rank}: broadcast(src={src}) failed in a send or recv — does a rank send to "
                f"or receive from itself, or from a rank other than src? torch says: "
                f"{str(exc).splitlines()[0].split('] ')[-1][:100]}"
            ) from None
    dist.broadcast(ref, src=src)
    return mine, ref, returned is mine, calls


@pytest.mark.exercise("broadcast", points=2)
@pytest.mark.parametrize("world_size,src", [(2, 0), (3, 2), (4, 1)])
def test_broadcast_matches_torch(world_size, src):
    results = launch(_broadcast_vs_torch, world_size, src, torch.float32, timeout=30)
    for rank, (mine, ref, same_object, calls) in enumerate(results):
        assert not calls["collectives"], _only_send_recv("broadcast", calls)
        assert torch.equal(mine, ref), (
            f"broadcast from rank {src} with {world_size} ranks: rank {rank} holds "
            f"{mine.tolist()}, torch's broadcast gives {ref.tolist()}"
        )
        assert same_object, f"rank {rank}: broadcast must fill the tensor in place and return it"
    # every rank but the root receives the tensor (5 float32, 20 bytes) exactly once
    sent = [calls["bytes_sent"] for *_, calls in results]
    assert sum(sent) == (world_size - 1) * 20, (
        f"broadcast from rank {src} with {world_size} ranks: the ranks sent {sent} bytes; "
        f"each of the {world_size - 1} other ranks needs the 20-byte tensor once, "
        f"{(world_size - 1) * 20} bytes in all"
    )


@pytest.mark.exercise("broadcast", points=1)
def test_broadcast_integer_tensor():
    results = launch(_broadcast_vs_torch, 3, 1, torch.int64, timeout=30)
    for rank, (mine, ref, _, calls) in enumerate(results):
        assert not calls["collectives"], _only_send_recv("broadcast", calls)
        assert torch.equal(mine, ref), f"int64 broadcast: rank {rank} holds {mine.tolist()}"


def _broadcast_edge_cases():
    from minitrain.runtime.point_to_point import broadcast

    rank = dist.get_rank()
    outside = None
    real = {n: getattr(dist, n) for n in ("send", "recv")}

    def guarded(name):  # gloo kills the process (signal 11) on a peer that does not exist
        def call(tensor, peer, *args, **kwargs):
            if not 0 <= peer < dist.get_world_size():
                raise RuntimeError(f"it called dist.{name} with rank {peer}, which does not exist")
            return real[name](tensor, peer, *args, **kwargs)
        return call

    try:  # rank 5 is not among the 3
        dist.send, dist.recv = guarded("send"), guarded("recv")
        broadcast(torch.zeros(2), src=5)
    except ValueError as exc:
        outside = ("ValueError", str(exc))
    except Exception as exc:  # noqa: BLE001 — what a learner's version raised instead
        outside = (type(exc).__name__, str(exc).splitlines()[0][:80] if str(exc) else "")
    finally:
        dist.send, dist.recv = real["send"], real["recv"]
    dist.barrier()
    group = dist.new_group([1, 2])  # every rank takes part in creating it
    held = None
    if rank in (1, 2):
        t = torch.full((3,), float(rank))
        broadcast(t, src=2, group=group)  # src is a global rank: rank 2
        held = t.tolist()
    dist.barrier()
    return outside, held


@pytest.mark.exercise("broadcast", points=1)
def test_broadcast_checks_src_and_respects_the_group():
    results = launch(_broadcast_edge_cases, 3, timeout=30)
    for rank, (outside, held) in enumerate(results):
        assert outside is not None and outside[0] == "ValueError", (
            f"rank {rank}: broadcast(src=5) with 3 ranks should raise ValueError naming the "
            f"source (rank 5 is in no group of 3 ranks); "
            f"{'it returned' if outside is None else f'it raised {outside[0]}: {outside[1]}'}")
        if rank in (1, 2):
            assert held == [2.0, 2.0, 2.0], (
                f"broadcast(src=2, group=[ranks 1, 2]) on 3 ranks: rank {rank} holds {held}, "
                f"expected rank 2's [2.0, 2.0, 2.0] — src and the members are global ranks: "
                f"turn the group's ranks into global ones (dist.get_global_rank)")
