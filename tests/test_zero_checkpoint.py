"""Sharded checkpoints: bit-exact resume in new processes, resharding to another world size,
and a truncated or foreign shard → a clear error naming the file, the last good one intact."""

import os
import shutil

import pytest
import torch
import torch.distributed as dist
from test_zero import LR  # tests/ is on sys.path under pytest
from toy_models import Toy, toy_batch

from minitrain.runtime import LaunchError, launch


def _run(stage, steps, save_dir=None, save_at=(), load=None, offload=False, start=0):
    """Train steps [start, steps); optionally load first and save after given steps."""
    from minitrain.zero import ZeroDataParallel, load_checkpoint, save_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(123)  # a *different* init: loading must overwrite all of it
    z = ZeroDataParallel(
        Toy(), torch.optim.AdamW, stage, lr=LR, offload=offload, bucket_cap_mb=4e-4
    )
    extra = load_checkpoint(z, load) if load else {}
    start = extra.get("step", start)
    for s in range(start, steps):
        x, y = toy_batch(s, rank, world)
        z.zero_grad()
        ((z(x) - y) ** 2).mean().backward()
        z.step()
        if s + 1 in save_at:
            save_checkpoint(z, save_dir, s + 1, extra={"step": s + 1})
    return z.full_state_dict()


@pytest.mark.parametrize("stage,offload", [(1, False), (2, True), (3, False)])
def test_resume_in_new_processes_is_bit_exact(tmp_path, stage, offload):
    whole = launch(_run, 2, stage, 6, offload=offload, timeout=60)
    launch(_run, 2, stage, 3, save_dir=str(tmp_path), save_at=(3,), offload=offload, timeout=60)
    ckpt = os.path.join(tmp_path, "step_00000003")
    assert sorted(os.listdir(ckpt)) == ["meta.json", "shard_00000.pt", "shard_00001.pt"]
    resumed = launch(_run, 2, stage, 6, load=ckpt, offload=offload, timeout=60)
    for rank in range(2):
        for name, want in whole[rank].items():
            assert torch.equal(resumed[rank][name], want), f"stage {stage} rank {rank}: {name}"


@pytest.mark.parametrize("new_world,new_stage", [(3, 3), (1, 2)])
def test_load_on_another_world_size_reshards(tmp_path, new_world, new_stage):
    whole = launch(_run, 2, 3, 6, timeout=60)[0]
    launch(_run, 2, 3, 3, save_dir=str(tmp_path), save_at=(3,), timeout=60)
    ckpt = os.path.join(tmp_path, "step_00000003")
    resumed = launch(_run, new_world, new_stage, 6, load=ckpt, timeout=60)
    for name, want in whole.items():
        # same parameters and optimizer state, continued with a different reduction order
        err = (resumed[-1][name] - want).abs().max().item()
        assert err <= 2e-6, f"{name} after resharding 2 → {new_world} ranks is off by {err}"


def test_corrupt_or_foreign_shard_is_named_and_previous_checkpoint_survives(tmp_path):
    launch(_run, 2, 2, 6, save_dir=str(tmp_path), save_at=(3, 6), timeout=60)
    good = os.path.join(tmp_path, "step_00000003")
    bad = os.path.join(tmp_path, "step_00000006")
    before = {f: open(os.path.join(good, f), "rb").read() for f in os.listdir(good)}

    shard = os.path.join(bad, "shard_00001.pt")
    with open(shard, "r+b") as fh:  # truncate: a crash while copying, a full disk
        fh.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(LaunchError, match="shard_00001.pt cannot be read") as info:
        launch(_run, 2, 2, 6, load=bad, timeout=60)
    assert info.value.ranks in ([0], [1])  # every rank raised, none hung

    shutil.copy(os.path.join(good, "shard_00001.pt"), shard)  # a shard of another checkpoint
    with pytest.raises(LaunchError, match="shard_00001.pt does not belong"):
        launch(_run, 2, 2, 6, load=bad, timeout=60)

    after = {f: open(os.path.join(good, f), "rb").read() for f in os.listdir(good)}
    assert after == before, "the previous checkpoint must not change"
    from minitrain.zero import latest_checkpoint

    assert latest_checkpoint(str(tmp_path)) == bad
    whole = launch(_run, 2, 2, 6, timeout=60)[0]
    resumed = launch(_run, 2, 2, 6, load=good, timeout=60)[0]
    assert all(torch.equal(resumed[n], whole[n]) for n in whole)


def test_refuses_to_overwrite_and_leaves_no_partial_directory(tmp_path):
    launch(_run, 2, 1, 3, save_dir=str(tmp_path), save_at=(3,), timeout=60)
    with pytest.raises(LaunchError, match="already exists"):
        launch(_run, 2, 1, 3, save_dir=str(tmp_path), save_at=(3,), timeout=60)
    assert sorted(os.listdir(tmp_path)) == ["step_00000003"]
