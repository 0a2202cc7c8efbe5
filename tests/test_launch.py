"""minitrain.runtime: results, errors naming the rank, timeouts, nothing left behind."""

import os
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from minitrain.runtime import LaunchError, launch, trace


def _rank_and_sum(offset, scale=1):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank() + offset, dist.get_world_size(), t.item() * scale


def _rank_processes():
    """Live worker processes of ours (the forkserver itself and the resource tracker stay)."""
    kids = psutil.Process().children(recursive=True)
    return [
        p
        for p in kids
        if p.is_running()
        and p.status() != psutil.STATUS_ZOMBIE
        and "forkserver" not in " ".join(p.cmdline())
        and "resource_tracker" not in " ".join(p.cmdline())
    ]


def _what_a_rank_starts_with():
    techniques = sorted(m for m in sys.modules if m.startswith("minitrain.")
                        and not m.startswith(("minitrain.runtime", "minitrain.course")))
    import gc

    return "torch._dynamo" in sys.modules, techniques, gc.get_freeze_count()


def test_ranks_start_with_torch_dynamo_loaded_and_import_techniques_afresh():
    """Every torch optimizer imports torch._dynamo on first use (1.3 CPU-seconds, ~800
    modules): the forkserver loads it once, so a rank does not (issue 33: most of a small
    launch's cost). Technique modules are not preloaded: a learner's edited file must be the
    one a rank runs. What was imported before the rank's function is frozen (gc.freeze): the
    cyclic collector's full passes do not walk torch's million objects again and again."""
    for dynamo_loaded, techniques, frozen in launch(_what_a_rank_starts_with, 2):
        assert dynamo_loaded
        assert techniques == []
        assert frozen > 100_000


def test_returns_values_in_rank_order_and_matches_torch_all_reduce():
    out = launch(_rank_and_sum, 3, 10, scale=2)
    assert list(out) == [(10, 3, 6.0), (11, 3, 6.0), (12, 3, 6.0)]


def test_single_rank():
    assert launch(_rank_and_sum, 1, 0) == [(0, 1, 0.0)]


def test_function_defined_in_a_notebook_or_main_is_shipped_by_value():
    # A function whose module cannot be imported by the workers (as in a notebook cell).
    namespace = {"__name__": "__not_importable__"}
    exec(
        textwrap.dedent("""
        import torch.distributed as dist
        SECRET = 41
        def from_a_cell(x):
            return dist.get_rank() * 100 + SECRET + x
    """),
        namespace,
    )
    assert launch(namespace["from_a_cell"], 2, 1) == [42, 142]


def _raise_on_rank_2():
    if dist.get_rank() == 2:
        raise ValueError("rank two is unhappy")
    t = torch.zeros(1)
    dist.recv(t, 2)  # the others wait for rank 2 forever


def test_a_rank_that_raises_is_named_with_its_traceback_quickly():
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_raise_on_rank_2, 4, timeout=60)
    assert time.monotonic() - t0 < 5
    assert info.value.ranks == [2]
    message = str(info.value)
    assert "rank 2" in message and "ValueError: rank two is unhappy" in message
    assert "_raise_on_rank_2" in message  # the traceback points into the user's function
    assert _rank_processes() == []


def _rank0_waits_for_nobody():
    if dist.get_rank() == 0:
        t = torch.zeros(1)
        dist.recv(t, 1)  # rank 1 never sends
    return dist.get_rank()


def test_a_stuck_rank_is_named_within_the_timeout_with_its_stack():
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_rank0_waits_for_nobody, 3, timeout=3)
    assert time.monotonic() - t0 < 3 + 5
    assert info.value.ranks == [0]
    assert "did not finish within the 3 s timeout" in str(info.value)
    assert "_rank0_waits_for_nobody" in str(info.value)  # where it was stuck
    assert _rank_processes() == []


def _die_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(30)


def test_a_rank_that_dies_is_named():
    with pytest.raises(LaunchError, match=r"rank 1 died \(exit code 3\)"):
        launch(_die_on_rank_1, 2, timeout=20)
    assert _rank_processes() == []


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True])
def test_bad_world_size_is_refused(bad):
    with pytest.raises(ValueError, match="world_size must be a whole number"):
        launch(_rank_and_sum, bad, 0)


def test_unpicklable_function_is_refused_clearly():
    import threading

    lock = threading.Lock()

    def holds_a_lock():
        return lock.locked()

    with pytest.raises(TypeError, match="cannot send 'holds_a_lock'"):
        launch(holds_a_lock, 2)


def _return_a_lock():
    import threading

    return threading.Lock()


def test_unpicklable_return_value_is_reported_with_the_rank():
    with pytest.raises(LaunchError, match="rank 0 .*cannot be sent back"):
        launch(_return_a_lock, 2)


def _print_and_trace():
    print(f"hello from {dist.get_rank()}")
    with trace.span("work", "compute"):
        time.sleep(0.01)
    return None


def test_prints_are_relayed_and_traces_returned(capsys):
    out = launch(_print_and_trace, 2)
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["[rank 0] hello from 0", "[rank 1] hello from 1"]
    assert [[e.name for e in evs] for evs in out.traces] == [["work"], ["work"]]
    assert all(evs[0].duration >= 0.01 for evs in out.traces)


def _write_to_descriptors():
    os.write(2, f"fd 2 of rank {dist.get_rank()}\n".encode())  # as C code writes: past sys.stderr
    os.write(1, f"fd 1 of rank {dist.get_rank()}\n".encode())
    if dist.get_rank() == 1:
        os.write(2, b"last words\n")
        os._exit(3)
    time.sleep(30)


def test_what_a_rank_writes_to_its_file_descriptors_is_relayed_with_its_rank(capfd):
    """Issue 41: c10d's and NCCL's warnings are written by C++ to file descriptor 2, which
    sys.stderr's redirection does not see: they reached the caller's stream unlabelled (in a
    notebook, a cell nbval compares). Now relayed like prints, and shown when a rank dies."""
    out = launch(_print_and_write, 2)
    printed = capfd.readouterr().out.splitlines()
    assert printed == ["[rank 0] print of rank 0", "[rank 0] fd 2 of rank 0",
                       "[rank 1] print of rank 1", "[rank 1] fd 2 of rank 1"]
    assert out.output == ["print of rank 0\nfd 2 of rank 0\n", "print of rank 1\nfd 2 of rank 1\n"]
    with pytest.raises(LaunchError, match=r"(?s)rank 1 died \(exit code 3\).*\n\[rank 1\] last words"):
        launch(_write_to_descriptors, 2, timeout=20)


def _print_and_write():
    print(f"print of rank {dist.get_rank()}")
    os.write(2, f"fd 2 of rank {dist.get_rank()}\n".encode())


def test_fifty_launches_leave_no_process_port_or_file_behind(tmp_path, monkeypatch):
    launch(_rank_and_sum, 2, 0)  # start the forkserver first
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where launch keeps its files
    me = psutil.Process()
    fds_before = me.num_fds()
    for i in range(50):
        assert launch(_rank_and_sum, 2, i, print_output=False)[1][0] == i + 1
    assert _rank_processes() == []
    assert me.num_fds() <= fds_before + 2
    listening = [c for c in me.net_connections() if c.status == psutil.CONN_LISTEN]
    assert listening == []
    assert list(tmp_path.iterdir()) == []


def test_lambdas_and_tensor_results():
    out = launch(lambda: {"t": torch.arange(3) * dist.get_rank()}, 2)
    assert torch.equal(out[0]["t"], torch.zeros(3, dtype=torch.long))
    assert torch.equal(out[1]["t"], torch.tensor([0, 1, 2]))


def _torchrun(args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args, "-m", "minitrain.runtime.hello"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_same_rank_function_runs_under_torchrun_standalone():
    proc = _torchrun(["--standalone", "--nproc-per-node=2"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert out.count("sum of ranks = 1 ✓") == 2, out


def test_two_torchrun_nodes_rendezvous_over_c10d():
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=minitrain-test",
    ]
    nodes = [_torchrun([*common, f"--node-rank={n}"]) for n in (0, 1)]
    outs = []
    for p in nodes:
        try:
            outs.append(p.communicate(timeout=150)[0])
        finally:
            p.kill()
    assert all(p.returncode == 0 for p in nodes), outs
    assert sum(o.count("sum of ranks = 6 ✓") for o in outs) == 4, outs


def test_backend_choice(monkeypatch):
    from minitrain.runtime import rank as L

    monkeypatch.delenv("MINITRAIN_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert L.default_backend(4) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert L.default_backend(2) == "cpu:gloo,cuda:nccl"  # a GPU per rank; CPU tensors still work
    assert L.default_backend(4) == "gloo"  # not enough GPUs for every rank
    monkeypatch.setenv("MINITRAIN_BACKEND", "gloo")
    assert L.default_backend(2) == "gloo"
    with pytest.raises(ValueError, match="needs one GPU per rank; world_size 4 > 2 GPUs"):
        launch(_rank_and_sum, 4, 0, backend="nccl")
