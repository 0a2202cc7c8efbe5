"""Every technique's state on the rank's GPU, and its communication through NCCL.

Each technique's step from tests/device_canary/cases.py (the steps the CPU canary checks)
runs on 2 ranks with a GPU each (backend ``cpu:gloo,cuda:nccl``, ``get_device()`` =
``cuda:rank``); then every parameter, gradient, buffer and optimizer state tensor it left
must be on ``cuda:rank`` — and the profiler must show NCCL kernels on the GPU, i.e. the
collectives really went through NCCL and not gloo.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from cases import CASES

from minitrain.runtime import launch


def _on_gpu(name):
    import cases
    from torch.profiler import ProfilerActivity, profile

    # in the rank: the forkserver's environment was fixed when it started
    os.environ.pop("MINITRAIN_DEVICE", None)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        numbers = cases.CASES[name][0]()
        torch.cuda.synchronize()
    kernels = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    rank = dist.get_rank()
    return {"rank": rank, "device": str(torch.device("cuda", torch.cuda.current_device())),
            "places": sorted(set().union(*cases.PLACES.values())), "numbers": numbers,
            "nccl": sorted(k for k in kernels if "nccl" in k.lower())}


@pytest.fixture(autouse=True)
def _gpu_env(monkeypatch):
    # the backend is chosen in this process: NCCL for CUDA tensors when each rank has a GPU
    monkeypatch.delenv("MINITRAIN_BACKEND", raising=False)


TWO_RANKS = [n for n, (_, ranks) in CASES.items() if ranks == 2]


@pytest.mark.parametrize("name", list(CASES))
def test_state_lives_on_the_ranks_gpu(name):
    ranks = CASES[name][1]
    for r in launch(_on_gpu, ranks, name, timeout=300):
        assert r["device"] == f"cuda:{r['rank']}", r
        assert r["places"] == [r["device"]], (
            f"{name}, rank {r['rank']}: state found on {r['places']}, expected only {r['device']}")


@pytest.mark.parametrize("name", TWO_RANKS)
def test_collectives_run_as_nccl_kernels(name):
    for r in launch(_on_gpu, 2, name, timeout=300):
        assert r["nccl"], f"{name}, rank {r['rank']}: no NCCL kernel ran on the GPU"


def test_gpu_numbers_follow_the_cpu_numbers():
    """The same step on the GPUs (TF32 off) and on the CPU: equal within float rounding."""
    gpu = launch(_on_gpu, 2, "DataParallel", timeout=300)
    cpu = launch(_cpu_numbers, 2, "DataParallel", backend="gloo", timeout=300)
    for g, c in zip(gpu, cpu):
        assert g["numbers"] == pytest.approx(c, rel=1e-4, abs=1e-5)


def _cpu_numbers(name):
    import cases

    os.environ["MINITRAIN_DEVICE"] = "cpu"  # in the rank: the forkserver's environment is fixed
    return cases.CASES[name][0]()
