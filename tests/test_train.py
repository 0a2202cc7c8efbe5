"""Chapter 11: the composed layouts against the single process, their collectives against the
formulas of chapters 4–7, their memory against the planner, and python -m minitrain.train
(torchrun one and two nodes, exact resume, bad layouts, corrupt checkpoints, Ctrl-C).

Launches are shared: one 8-rank, one 4-rank and one 2-rank launch run several layouts each.
"""

import contextlib
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from minitrain.model import GPTConfig
from minitrain.parallel import single_process_losses
from minitrain.runtime import launch
from minitrain.tensor_parallel.measure import layer_collectives
from minitrain.train import main

CFG = GPTConfig()  # the defaults of python -m minitrain.train
BATCH, LR, SEED = 8, 1e-3, 0
LONG, SHORT = 50, 12  # steps: the 8-rank layouts run the 50, the smaller ones fewer
COUNT_STEP = 1  # the step whose collectives are counted (step 0 also sends shape headers)

# --------------------------------------------------------------------------- instrumentation
KINDS = {  # torch.distributed function -> (logical kind, the argument whose bytes it moves)
    "all_reduce": ("all-reduce", "tensor"), "broadcast": ("broadcast", "tensor"),
    "all_gather": ("all-gather", "tensor"), "all_gather_into_tensor": ("all-gather", "output_tensor"),
    "reduce_scatter_tensor": ("reduce-scatter", "input"),
    "isend": ("send", "tensor"), "send": ("send", "tensor"),
    "irecv": ("recv", "tensor"), "recv": ("recv", "tensor"),
}


class CountCollectives:
    """Record every torch.distributed call (kind, group's global ranks, logical bytes) while
    active. Counted where the library calls torch, so gloo's emulations do not matter."""

    def __init__(self):
        self.calls, self._saved = [], []

    def _wrap(self, name, fn):
        kind, arg = KINDS[name]
        sig = inspect.signature(fn)

        def counted(*a, **k):
            bound = sig.bind(*a, **k)
            group = bound.arguments.get("group")
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else \
                tuple(range(dist.get_world_size()))
            t = bound.arguments[arg]
            nbytes = t.numel() * t.element_size() * (len(ranks) if name == "all_gather" else 1)
            self.calls.append((kind, ranks, nbytes))
            return fn(*a, **k)

        return counted

    def __enter__(self):
        import torch.distributed.distributed_c10d as c10d

        import minitrain.zero.optimizer as zopt

        for name in KINDS:
            self._saved.append((dist, name, getattr(dist, name)))
            setattr(dist, name, self._wrap(name, getattr(dist, name)))
            if name in ("isend", "irecv"):  # the pipeline's P2POps check their op against these
                self._saved.append((c10d, name, getattr(c10d, name)))
                setattr(c10d, name, getattr(dist, name))
        # ZeRO-1 binds its all-gather at import (minitrain.zero.buffers): count it there too
        self._saved.append((zopt, "all_gather_tensor", zopt.all_gather_tensor))
        zopt.all_gather_tensor = self._wrap("all_gather_into_tensor", zopt.all_gather_tensor)
        return self

    def __exit__(self, *exc):
        for obj, name, fn in reversed(self._saved):
            setattr(obj, name, fn)

    def by_axis(self, mesh) -> dict:
        axes = {tuple(mesh.ranks(a)): a for a in ("pp", "dp", "tp", "cp") if len(mesh.ranks(a)) > 1}
        out = {}
        for kind, ranks, nbytes in self.calls:
            out.setdefault(axes.get(ranks, str(ranks)), Counter())[(kind, nbytes)] += 1
        return out


def layout_id(layout):
    """A test id without spaces or quotes: dp2-tp2-pp2-microbatches2."""
    return "-".join(f"{k}{v}" for k, v in layout.items()) or "single"


def _run_layouts(layouts, steps):
    """On every rank: each layout for steps[i] steps; the losses, one step's collectives,
    the model-state bytes and the peak of saved activations."""
    from minitrain.memory import LiveSavedBytes
    from minitrain.parallel import ParallelGPT
    from minitrain.zero import dp_memory_bytes, optimizer_state_tensors, storage_bytes

    out = []
    for layout, n in zip(layouts, steps):
        sgd = layout.get("optimizer") == "sgd"
        try:  # a refused layout fails its own tests, not the whole module's
            job = ParallelGPT(CFG, layout, BATCH, SGD_LR if sgd else LR, SEED)
        except ValueError as exc:  # (refusals come before any collective: on every rank)
            out.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        losses, counter = [], CountCollectives()
        for step in range(n):
            # the memory test compares the last step's peak of saved activations: only that
            # step is tracked (the hooks cost Python work per saved tensor, on every rank)
            none = contextlib.nullcontext()
            if step == n - 1:
                live = LiveSavedBytes(exclude=list(job.model.parameters()))
            with live if step == n - 1 else none, counter if step == COUNT_STEP else none:
                losses.append(job.step(step))
        if sgd:  # (the model-state bytes are the AdamW runs')
            states = None
        elif isinstance(job.optimizer, torch.optim.AdamW):
            states = dp_memory_bytes(job.model, job.optimizer)
        elif job.stage is not None:  # ZeRO-1 under a pipeline: chapter 5's ShardedOptimizer
            states = dp_memory_bytes(job.model, job.optimizer)
            states["optimizer"] = storage_bytes(optimizer_state_tensors(job.optimizer.optimizer))
        else:
            states = job.wrapped.memory_bytes()
        out.append({"losses": losses, "coords": job.mesh.coords(), "counts": counter.by_axis(job.mesh),
                    "states": states, "activations": live.peak,
                    "largest": max(p.numel() for p in job.model.parameters())})
    return out


L8 = [dict(dp=2, tp=2, pp=2, microbatches=2), dict(dp=4, pp=2, microbatches=2),
      dict(dp=2, tp=2, pp=2, microbatches=2, zero=1, schedule="gpipe"),
      dict(tp=2, pp=2, cp=2, microbatches=2)]
L4 = [dict(dp=2, tp=2), dict(dp=2, tp=2, sequence_parallel=True, microbatches=2),
      dict(tp=2, cp=2, sequence_parallel=True, microbatches=2)]  # Megatron-Core's CP + SP
L2 = [dict(dp=2), dict(tp=2), dict(pp=2, microbatches=4), dict(dp=2, zero=1)]
# SGD with lr = 1 on every layout (and ZeRO-3, DP × CP, TP + SP, recomputation): a gradient
# off by a constant factor (a sum for a mean, a LayerNorm's counted t times) moves the next
# loss by about as much as the step itself; AdamW's m / sqrt(v) cancels such a factor
SGD_LR, SGD_STEPS = 1.0, 3
EXTRA = {8: [dict(dp=2, tp=2, cp=2, sequence_parallel=True, zero=3)],
         4: [dict(dp=2, cp=2, zero=3, checkpointing="full"), dict(dp=2, tp=2, sequence_parallel=True,
                                                                  checkpointing="full")],
         2: [dict(dp=2, zero=2), dict(dp=2, zero=3), dict(cp=2)]}
SGD = {world: [{**lo, "optimizer": "sgd"} for lo in layouts + EXTRA[world]]
       for world, layouts in ((8, L8), (4, L4), (2, L2))}


@pytest.fixture(scope="module")
def runs():
    out = {}
    for layouts, world, steps in ((L8, 8, LONG), (L4, 4, SHORT), (L2, 2, SHORT)):
        sgd = SGD[world]
        results = launch(_run_layouts, world, layouts + sgd,
                         [steps] * len(layouts) + [SGD_STEPS] * len(sgd), timeout=400)
        for i, layout in enumerate(layouts + sgd):
            out[str(layout)] = (layout, [r[i] for r in results])
    out["reference"] = single_process_losses(CFG, LONG, BATCH, LR, SEED)
    out["sgd reference"] = single_process_losses(CFG, SGD_STEPS, BATCH, SGD_LR, SEED,
                                                 optimizer="sgd")
    return out


ALL = L8 + L4 + L2
ALL_SGD = SGD[8] + SGD[4] + SGD[2]


@pytest.mark.parametrize("layout", ALL, ids=layout_id)
def test_loss_curve_equals_the_single_process(runs, layout):
    _, ranks = runs[str(layout)]
    ref = runs["reference"]
    for rank in ranks:  # every rank reports the same global loss
        assert "error" not in rank, f"{layout}: {rank.get('error')}"
        got = rank["losses"]
        delta = max(abs(a - b) for a, b in zip(got, ref))
        assert delta <= 1e-4, f"{layout}: max |Δloss| = {delta:.2e} over {len(got)} steps"
    assert ref[-1] < ref[0] - 0.5  # and it really trained


@pytest.mark.parametrize("layout", ALL_SGD, ids=layout_id)
def test_sgd_lr_1_losses_equal_the_single_process(runs, layout):
    _, ranks = runs[str(layout)]
    ref = runs["sgd reference"]
    for rank in ranks:
        assert "error" not in rank, f"{layout}: {rank.get('error')}"
        delta = max(abs(a - b) for a, b in zip(rank["losses"], ref))
        assert delta <= 1e-5, f"{layout}: max |Δloss| = {delta:.2e} with SGD, lr = 1"
    assert min(abs(x - y) for x, y in zip(ref, ref[1:])) > 0.05  # each step moves the loss


def _expected_counts(layout, coords):
    """One step's collectives per group from the chapters' formulas (no SP)."""
    lo = {"dp": 1, "tp": 1, "pp": 1, "zero": 0, "microbatches": 1, **layout}
    dp, tp, pp, m = lo["dp"], lo["tp"], lo["pp"], lo["microbatches"]
    mb, s, h = BATCH // dp // m, CFG.seq_len, CFG.d_model
    act = mb * s * h * 4
    first, last = coords.pp == 0, coords.pp == pp - 1
    out = {}
    if tp > 1:  # chapter 6: f/g per block, the vocab-parallel embedding and loss
        layers = ["attention", "mlp"] * (CFG.n_layer // pp)
        layers += ["embedding"] * first + ["head"] * last
        c = Counter()
        for layer in layers:
            fwd, bwd = layer_collectives(layer, mb, s, h, tp)
            for name, _, nbytes in fwd + bwd:
                c[(name, nbytes)] += m
        out["tp"] = c
    if pp > 1:  # chapter 7: an activation forward and its gradient back per micro-batch
        # the step's loss from the last stage, as float64: sent to each other stage (on any
        # back-end; only when its receive is posted differs)
        c = Counter({("send", 8): pp - 1} if last else {("recv", 8): 1})
        if not last:
            c[("send", act)] += m
            c[("recv", act)] += m
        if not first:
            c[("recv", act)] += m
            c[("send", act)] += m
        out["pp"] = c
    if dp > 1:  # chapter 4: one average of the gradients; + the logged loss (4 bytes)
        out["dp"] = Counter({("all-reduce", 4): 1})
    # the global gradient norm (logged every step): one fp32 sum of squares over the whole
    # mesh — named after the only axis when the mesh has one, else after its ranks
    axes = [axis for axis, size in (("tp", tp), ("pp", pp), ("dp", dp)) if size > 1]
    if len(axes) == 1:
        out[axes[0]][("all-reduce", 4)] += 1
    else:
        out[str(tuple(range(dp * tp * pp)))] = Counter({("all-reduce", 4): 1})
    return out


# SP's collectives are chapter 6's own tests; ZeroDataParallel (ZeRO without a pipeline)
# counts its reduce-scatters and gathers in chapter 5's tests; ring attention's sends are
# counted by chapter 10's tests
COUNTED = [lo for lo in ALL if not lo.get("sequence_parallel") and not lo.get("cp")
           and not (lo.get("zero") and lo.get("pp", 1) == 1)]


@pytest.mark.parametrize("layout", COUNTED, ids=layout_id)
def test_collectives_per_group_match_the_formulas(runs, layout):
    from minitrain.parallel import params_per_rank

    _, ranks = runs[str(layout)]
    dp, tp, pp = layout.get("dp", 1), layout.get("tp", 1), layout.get("pp", 1)
    for rank in ranks:
        got, want = rank["counts"], _expected_counts(layout, rank["coords"])
        assert set(got) == set(want), f"{layout} rank coords {rank['coords']}: groups {set(got)} != {set(want)}"
        for axis in ("tp", "pp"):
            if axis in want:
                assert got[axis] == want[axis], f"{layout} {rank['coords']} {axis}: {got[axis]} != {want[axis]}"
        if dp > 1:
            n = params_per_rank(CFG, tp, pp, rank["coords"].pp)
            grads = got["dp"].copy()
            # the logged loss (and, on a data-parallel-only mesh, the gradient norm)
            assert grads.pop(("all-reduce", 4)) == want["dp"][("all-reduce", 4)], got["dp"]
            if layout.get("zero") == 1:  # ZeRO-1: one all-gather of the updated shares
                gathers = [(k, v) for k, v in grads.items() if k[0] == "all-gather"]
                assert len(gathers) == 1 and gathers[0][1] == 1, got["dp"]
                nbytes = gathers[0][0][1]
                assert 4 * n <= nbytes <= 4 * n + dp * 4 * rank["largest"], (nbytes, n)
                del grads[gathers[0][0]]
            # one all-reduce of every gradient (DDP adds one "used" flag per parameter tensor)
            assert len(grads) == 1 and sum(grads.values()) == 1, got["dp"]
            (kind, nbytes), = grads
            flags = 0 if pp > 1 else 4 * _param_tensors()
            assert kind == "all-reduce" and nbytes == 4 * n + flags, (nbytes, 4 * n, flags)


def _param_tensors():
    from minitrain.model import GPT

    return len(list(GPT(CFG).parameters()))  # TP keeps every tensor (as a slice)


@pytest.mark.parametrize("layout", ALL, ids=layout_id)
def test_planner_memory_equals_measured(runs, layout):
    from minitrain.parallel import Layout, activation_bytes, params_per_rank
    from minitrain.zero import memory_formula

    _, ranks = runs[str(layout)]
    lo = Layout(**{k: v for k, v in layout.items()})
    for rank in ranks:
        stage = rank["coords"].pp
        n = params_per_rank(CFG, lo.tp, lo.pp, stage)
        want = memory_formula(n, lo.dp * lo.cp, lo.zero)
        for part in ("params", "grads"):
            assert rank["states"][part] == want[part], (layout, part, rank["states"], want)
        # ZeRO-1 partitions whole tensors: within the largest one of the ideal 1/N share
        slack = 8 * rank["largest"] if lo.zero == 1 else 0
        assert abs(rank["states"]["optimizer"] - want["optimizer"]) <= slack, (layout, rank["states"], want)
        if lo.cp > 1:  # ring attention saves flash attention's tensors, not the s×s scores:
            continue  # the planner's CP activations are an estimate (docs/ch11)
        predicted = activation_bytes(CFG, lo, CFG.seq_len, BATCH, stage)
        measured = rank["activations"]
        tolerance = 0 if lo.pp == 1 else 0.005 * predicted  # pipelines: see docs/ch11
        assert abs(measured - predicted) <= tolerance, (layout, stage, measured, predicted)


# --------------------------------------------------------------------------- the command
def _log(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


@pytest.mark.parametrize("layout", [["--dp", "2", "--zero", "2"],
                                    ["--pp", "2", "--microbatches", "2", "--zero", "1"]],
                         ids=["dp2-zero2", "pp2-zero1"])
def test_command_logs_and_resumes_bit_exactly(tmp_path, layout):
    common = ["--nproc", "2", *layout, "--no-progress"]
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    assert main([*common, "--steps", "4", "--log-file", str(full)]) == 0
    ck = tmp_path / "ck"
    assert main([*common, "--steps", "2", "--log-file", str(part), "--checkpoint-dir", str(ck),
                 "--checkpoint-every", "2"]) == 0
    assert main([*common, "--steps", "4", "--log-file", str(part), "--checkpoint-dir", str(ck),
                 "--resume"]) == 0
    a, b = _log(full), _log(part)
    assert [r["step"] for r in b] == list(range(4))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bit for bit, not approximately
    assert all(0 < r["mfu"] < 1 and r["tokens_per_s"] > 0 for r in a)
    ref = single_process_losses(CFG, 4, BATCH, LR, SEED)
    assert max(abs(r["loss"] - x) for r, x in zip(a, ref)) <= 1e-4
    assert sorted(os.listdir(ck)) == ["step_00000002", "step_00000004"]


TINY = ["--n-layer", "2", "--n-head", "2", "--d-model", "16", "--vocab-size", "16",
        "--seq-len", "8", "--batch-size", "4"]


@pytest.mark.parametrize("layout", [["--nproc", "2", "--dp", "2", "--zero", "3"],
                                    ["--nproc", "4", "--dp", "2", "--tp", "2", "--zero", "3"],
                                    ["--nproc", "4", "--dp", "2", "--tp", "2", "--zero", "3",
                                     "--sequence-parallel"]],
                         ids=["dp2-zero3", "dp2-tp2-zero3", "dp2-tp2-sp-zero3"])
def test_zero3_resumes_bit_exactly(tmp_path, layout):
    """Issue 26: under ZeRO-3 the module's parameters are views of freed storage; a checkpoint
    of model.state_dict() could not be read back. 2 steps + checkpoint + 2 resumed steps must
    log the very losses of 4 straight steps."""
    common = [*layout, *TINY, "--no-progress"]
    full, part, ck = tmp_path / "full.jsonl", tmp_path / "part.jsonl", tmp_path / "ck"
    assert main([*common, "--steps", "4", "--log-file", str(full)]) == 0
    assert main([*common, "--steps", "2", "--log-file", str(part), "--checkpoint-dir", str(ck)]) == 0
    assert main([*common, "--steps", "4", "--log-file", str(part), "--checkpoint-dir", str(ck),
                 "--resume"]) == 0
    a, b = _log(full), _log(part)
    assert [r["step"] for r in b] == list(range(4))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bit for bit
    tiny = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=16)
    ref = single_process_losses(tiny, 4, 4, LR, SEED)
    assert max(abs(r["loss"] - x) for r, x in zip(a, ref)) <= 1e-5


def test_corrupt_checkpoint_and_other_layout_are_clear_errors(tmp_path, capsys):
    ck = tmp_path / "ck"
    common = ["--nproc", "2", "--steps", "2", "--no-progress", "--checkpoint-dir", str(ck)]
    assert main([*common, "--dp", "2"]) == 0
    assert main([*common, "--tp", "2", "--resume"]) == 1
    err = capsys.readouterr().err
    assert "another layout: --dp 2 in the checkpoint, 1 now; --tp 1 in the checkpoint, 2 now" \
        in err, err  # issue 40: the flags that differ, not two whole dicts
    shard = ck / "step_00000002" / "rank_00001.pt"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    assert main([*common, "--dp", "2", "--resume"]) == 1
    err = capsys.readouterr().err
    assert "rank_00001.pt cannot be read" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--dp", "2", "--tp", "2", "--nproc", "2"],
     "impossible layout: dp=2 × tp=2 × pp=1 × cp=1 = 4 ranks, but --nproc is 2"),
    (["--tp", "3", "--n-head", "4", "--d-model", "48", "--vocab-size", "48"],
     "tensor parallel size 3 does not divide 4 attention heads"),
    (["--pp", "4"], "pipeline size 4 does not divide 2 layers"),
    (["--dp", "3", "--batch-size", "8"], "global batch 8 is not a multiple of dp=3"),
])
def test_impossible_layouts_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def _torchrun(args, train_args):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, "-m",
                             "minitrain.train", *train_args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_torchrun_one_node_and_two_nodes(tmp_path):
    steps = ["--steps", "4", "--no-progress", "--dp", "2"]
    ref = single_process_losses(CFG, 4, BATCH, LR, SEED)
    one = _torchrun(["--standalone", "--nproc-per-node=2"],
                    [*steps, "--log-file", str(tmp_path / "one.jsonl")])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=minitrain-train-test"]
    two = [_torchrun([*common, f"--node-rank={n}"],
                     [*steps, "--log-file", str(tmp_path / f"two{n}.jsonl")]) for n in (0, 1)]
    outs = []
    for p in [one, *two]:
        try:
            outs.append(p.communicate(timeout=240)[0])
        finally:
            p.kill()
    assert all(p.returncode == 0 for p in [one, *two]), outs
    logs = [tmp_path / "one.jsonl"] + [tmp_path / f"two{n}.jsonl" for n in (0, 1)]
    written = [_log(f) for f in logs if f.exists()]
    assert len(written) == 2, outs  # global rank 0 writes: one file per run
    for log in written:
        assert max(abs(r["loss"] - x) for r, x in zip(log, ref)) <= 1e-4


def test_ctrl_c_leaves_the_last_complete_checkpoint_intact(tmp_path):
    ck = tmp_path / "ck"
    args = [sys.executable, "-m", "minitrain.train", "--nproc", "2", "--dp", "2", "--steps",
            "100000", "--checkpoint-every", "1", "--checkpoint-dir", str(ck), "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(args, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done = [d for d in os.listdir(ck) if not d.endswith(".partial")] if ck.exists() else []
            if len(done) >= 3:
                break
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    from minitrain.parallel import latest_checkpoint

    last = latest_checkpoint(str(ck))
    assert last is not None
    step = int(last.rsplit("_", 1)[1])
    # the newest complete checkpoint loads, and the run continues from it
    assert main(["--nproc", "2", "--dp", "2", "--steps", str(step + 1), "--checkpoint-dir",
                 str(ck), "--resume", "--no-progress",
                 "--log-file", str(tmp_path / "r.jsonl")]) == 0
    assert [r["step"] for r in _log(tmp_path / "r.jsonl")] == [step]


def test_one_process_runs_here_and_equals_the_reference(tmp_path):
    log = tmp_path / "one.jsonl"
    assert main(["--steps", "3", "--no-progress", "--log-file", str(log)]) == 0
    ref = single_process_losses(CFG, 3, BATCH, LR, SEED)
    assert [r["loss"] for r in _log(log)] == ref  # the same model, batch and optimizer
    assert not dist.is_initialized()  # the one-process group is gone again
