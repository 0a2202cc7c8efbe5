"""Insert notebook 05's section "FSDP: ZeRO-3 as frameworks ship it" before its summary.

    python tools_nb05_fsdp.py [notebooks/05_zero.ipynb]

Idempotent: the section's cells carry the metadata tag "fsdp-section"; a second run replaces
them (so an edited section can be re-applied) and leaves every other cell as it is. The cells
are inserted unexecuted: run the notebook afterwards
(``OMP_NUM_THREADS=1 python -m minitrain.course.notebooks run notebooks/05_zero.ipynb``).
Issue 14; not part of the minitrain package.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

TAG = "fsdp-section"
SUMMARY = "## Summary"

CELLS = [
    (
        "markdown",
        """## FSDP: ZeRO-3 as frameworks ship it

`minitrain.fsdp.FullyShardedDataParallel` is stage 3 with the interface of PyTorch's FSDP (Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel"): the wrapper is an `nn.Module` whose `parameters()` *are* this rank's fp32 shards, so an ordinary `torch.optim.AdamW(fsdp.parameters())` steps them and the training loop is the usual one. Underneath it runs the schedule of section 8 — it is built on the same `minitrain.zero.ShardedUnits`: per unit, gather before forward, free after, gather again for backward, reduce-scatter the gradients as the unit's backward ends (strictly in unit order), prefetch the next unit.

**What you will see**
- FSDP on 2 ranks trains like one process, in fp32 and in bf16 (`compute_dtype`: gathers and compute in bf16; shards, gradients and optimizer in fp32);
- the bytes a rank keeps equal ZeRO-3's formula; the most it ever holds gathered is a few units, not the model;
- the bytes it sends per step: 3Ψ·(N−1)/N elements, the two gathers halved in bf16;
- the timeline: prefetch and reduce-scatter overlapping compute.

Three exercises: the per-unit forward hooks and the reduction of a unit's gradients.""",
    ),
    (
        "code",
        """from minitrain.course.notebooks import exercise_stub
from minitrain.fsdp import FullyShardedDataParallel

for fn in (
    FullyShardedDataParallel._pre_forward,
    FullyShardedDataParallel._post_forward,
    FullyShardedDataParallel._launch_reduce_scatter,
):
    print(exercise_stub(fn))""",
    ),
    (
        "markdown",
        """A 4-block GPT, 3 AdamW steps, each of 2 ranks on half of every batch, against one process on the whole batch. With `compute_dtype=torch.bfloat16` (and fp16) the reference is one process doing the same casts: fp32 weights, a bf16 copy for each half-batch, the gradients cast to fp32 and averaged. Both sides run on one thread, so the low-precision matrix products round alike.""",
    ),
    (
        "code",
        """import torch
import torch.distributed as dist

from minitrain.data import get_batch
from minitrain.fsdp.measure import one_process_reference
from minitrain.launch import launch
from minitrain.model import GPT, GPTConfig, lm_loss

FSDP_CONFIG = dict(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32, bias=False)
FSDP_STEPS, FSDP_BATCH, FSDP_LR = 3, 8, 1e-3


def fsdp_batches():
    return [(*get_batch(s, FSDP_BATCH, vocab_size=64, seq_len=16), lm_loss) for s in range(FSDP_STEPS)]


def fsdp_train(dtype):
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    fsdp = FullyShardedDataParallel(GPT(GPTConfig(**FSDP_CONFIG)), compute_dtype=dtype)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=FSDP_LR)
    b = FSDP_BATCH // world
    for x, y, loss_fn in fsdp_batches():
        opt.zero_grad()
        loss_fn(fsdp(x[rank * b : (rank + 1) * b]), y[rank * b : (rank + 1) * b]).backward()
        fsdp.finish_gradient_synchronization()
        opt.step()
    return fsdp.full_state_dict()


def fsdp_reference(dtype):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**FSDP_CONFIG))
    return one_process_reference(model, fsdp_batches(), dtype, lr=FSDP_LR, world=2)[-1]


def max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in b)


fp32_ref = launch(fsdp_reference, 1, None)[0]
for name, dtype, tol in (("fp32", None, 1e-6), ("bf16", torch.bfloat16, 1e-5), ("fp16", torch.float16, 1e-5)):
    ref = fp32_ref if dtype is None else launch(fsdp_reference, 1, dtype)[0]
    states = launch(fsdp_train, 2, dtype)
    print(f"{name}: every rank's full_state_dict is fp32: {all(t.dtype == torch.float32 for s in states for t in s.values())}; "
          f"vs one process (same casts) max |Δ| ≤ {tol:g}: {max(max_diff(s, ref) for s in states) <= tol}")
    if dtype is not None:
        print(f"      and vs the fp32 run: max |Δ| ≤ 1e-2: {max_diff(states[0], fp32_ref) <= 1e-2} "
              f"(bf16 keeps 8 bits of mantissa, fp16 11: the runs part by rounding)")""",
    ),
    (
        "markdown",
        """### Bytes per rank, peak gathered bytes, bytes sent — against the formulas

`minitrain.fsdp.measure.gpt_step_report` runs one step and counts: the bytes of the tensors the rank keeps (shards, their `.grad`, AdamW's moments, the fp32 masters under bf16), the most bytes of gathered units held at one time (`fsdp.peak_gathered_bytes`), and the bytes sent (chapter 5's `count_sent`). Ψ is the padded number of elements (every unit rounded up to a multiple of N). Predicted peak: the root unit (embeddings, final norm, head — gathered throughout, since its layers bracket the blocks) plus the two largest neighbouring blocks (the one computing, the one prefetched).""",
    ),
    (
        "code",
        """from minitrain.fsdp.measure import gpt_step_report
from minitrain.zero import communication_formula, memory_formula


def fsdp_measure(dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    fsdp = FullyShardedDataParallel(GPT(GPTConfig(**FSDP_CONFIG)), compute_dtype=dtype)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=FSDP_LR)
    x, y = get_batch(0, FSDP_BATCH, rank, world, vocab_size=64, seq_len=16)
    gpt_step_report(fsdp, opt, x, y)  # the first step creates AdamW's moments
    return gpt_step_report(fsdp, opt, x, y)


for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
    r = launch(fsdp_measure, 2, dtype)[0]
    psi, got, want = r["padded_numel"], r["bytes"], r["formula"]
    print(f"{name}, N = 2, Ψ = {psi:,} (padded)")
    print(f"  bytes per rank   {got['total']:>9,}  formula {int(want['total']):>9,}  equal: {got['total'] == want['total']}"
          + (f"  (= ZeRO-3's 16Ψ/N: {got['total'] == memory_formula(psi, 2, 3)['total']})" if dtype is None else
             "  (2Ψ/N bf16 shard + 4Ψ/N fp32 grads + 12Ψ/N fp32 master and moments)"))
    print(f"  peak gathered    {r['peak_gathered']:>9,}  predicted {r['predicted_peak']:>7,}  equal: {r['peak_gathered'] == r['predicted_peak']}"
          f"  (the whole model gathered: {r['model_bytes']:,})")
    print(f"  sent per step    {r['sent']['total']:>9,}  formula {int(want['sent']):>9,}  equal: {r['sent']['total'] == want['sent']}"
          + (f"  (= 3Ψ·4·(N−1)/N: {r['sent']['total'] == communication_formula(psi, 2, 3)})" if dtype is None else
             f"  (gathers {r['sent']['all_gather']:,} = 2·2Ψ·½, reduce-scatter {r['sent']['reduce_scatter']:,} = 4Ψ·½)"))""",
    ),
    (
        "markdown",
        """### The timeline

One step on 2 ranks (the second; the first creates AdamW's state). As in section 8: unit i+1's gather (orange) starts while unit i computes (blue); in backward the order reverses, and each unit's reduce-scatter is launched as soon as its backward is done, while earlier units still compute.""",
    ),
    (
        "code",
        """def fsdp_timeline():
    from minitrain import trace

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    fsdp = FullyShardedDataParallel(GPT(GPTConfig(**dict(FSDP_CONFIG, d_model=64))))
    opt = torch.optim.AdamW(fsdp.parameters(), lr=FSDP_LR)
    x, y = get_batch(0, FSDP_BATCH, rank, world, vocab_size=64, seq_len=16)
    for _ in range(2):  # the second step is recorded
        trace.reset()
        opt.zero_grad()
        lm_loss(fsdp(x), y).backward()
        opt.step()
    return trace.events()


FSDP_RUN = launch(fsdp_timeline, 2)
first = {}
for e in FSDP_RUN.traces[0]:
    first.setdefault(e.name, e)
print("unit i+1's gather launched before unit i's forward ended:",
      all(first[f"gather block {i + 1}"].start < first[f"forward block {i}"].end for i in range(3)))
print("the last unit's reduce-scatter launched before the first unit's backward ended:",
      first["reduce-scatter block 3"].start < first["backward block 0"].end)""",
    ),
    (
        "code",
        """# NBVAL_IGNORE_OUTPUT
import matplotlib.pyplot as plt
from IPython.display import display

from minitrain import trace

ax = trace.plot_timeline(FSDP_RUN.traces, title="FSDP: gather → compute → free, reduce-scatter as each unit's backward ends")
display(ax.figure)  # (shown explicitly: the widget above switched matplotlib to a file backend)
plt.close(ax.figure)""",
    ),
    (
        "markdown",
        """### The calculator, with FSDP

The widget's last line is FSDP for the same Ψ and N: pick the compute dtype. In bf16 a rank keeps 18 bytes per parameter / N (the 2-byte shard, and an fp32 master beside AdamW's moments: 2 more than fp32's 16/N) and sends 8Ψ·(N−1)/N bytes per step instead of 12Ψ·(N−1)/N — two thirds of fp32's, as much as DP's fp32 all-reduce.""",
    ),
    (
        "code",
        """from minitrain.widgets.ch05_zero import compute_fsdp, describe_fsdp

for dtype in ("fp32", "bf16"):
    print(describe_fsdp(compute_fsdp(7_500_000_000, 64, dtype)).replace("<b>", "").replace("</b>", ""))""",
    ),
    (
        "code",
        """# NBVAL_IGNORE_OUTPUT
from minitrain.widgets.ch05_zero import build_zero_memory_widget

build_zero_memory_widget(traces=FSDP_RUN.traces)""",
    ),
    (
        "markdown",
        """**FSDP in short.** The same sharding and schedule as stage 3, with the optimizer outside: `parameters()` are the shards, `finish_gradient_synchronization()` runs by itself at the end of backward (call it anyway before stepping, as with chapter 4's DDP), `clip_grad_norm_` sums squares over the shards with one all-reduce, `full_state_dict()` gathers fp32 weights on every rank, and `minitrain.zero.save_checkpoint(fsdp, dir, step, optimizer=opt)` writes the sharded checkpoint of section 10. Exercises `FullyShardedDataParallel._pre_forward`, `_post_forward` and `_launch_reduce_scatter` are in `my_exercises/ex05_zero.py` (`python -m minitrain.grade 5`).""",
    ),
]


def apply(path: Path) -> int:
    nb = nbformat.read(path, as_version=4)
    kept = [c for c in nb.cells if TAG not in c.get("metadata", {}).get("tags", [])]
    at = next(
        (i for i, c in enumerate(kept) if c.cell_type == "markdown" and c.source.startswith(SUMMARY)),
        None,
    )
    if at is None:
        raise SystemExit(f"{path}: no markdown cell starting with {SUMMARY!r}")
    new = []
    for k, (kind, source) in enumerate(CELLS):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        cell = make(source)
        cell.metadata["tags"] = [TAG]
        cell.id = f"fsdp-{k:02d}"  # stable ids: a second run changes nothing
        new.append(cell)
    nb.cells = kept[:at] + new + kept[at:]
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return len(new)


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "notebooks/05_zero.ipynb")
    print(f"{target}: {apply(target)} FSDP cells before the summary")
