"""Bug hunts: one graded "find the bug" exercise per chapter, from bugs real frameworks shipped.

A bug hunt is one function of the library, copied into ``exercises/bughuntNN_<slug>.py`` with
one line changed to the version that shipped broken; ``solutions/`` holds the function as the
library has it. The learner reads the symptoms (the file's docstring; the graded test's
message says what the broken run measured), uses the chapter's tools — traces, byte counts,
parity against one process — to find the line, and fixes it in ``my_exercises/``.
``python -m minitrain.grade N`` patches the function in (``minitrain.course.patching``, in
every rank too) and runs ``tests/grading/test_chNN_bughunt.py``, which re-runs the scenario
against an independent reference. ``python -m minitrain.exercises build`` writes both files;
``check`` and ``grade --verify`` cover them like any exercise (the shipped bug must fail the
test, the library's line must pass it).

Chapters 4–8 have one each; adding one is one ``BugHunt`` below and one graded test file. Each bug is also a named mutation in
tests/mutations.py, so the unit tests are known to catch it.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from dataclasses import dataclass
from importlib import import_module


@dataclass(frozen=True)
class BugHunt:
    chapter: int
    slug: str  # bughunt04_<slug>.py
    module: str  # where the function lives
    qualname: str  # "Class.method" or "function"
    fixed: str  # the line as the library has it (found exactly once in the function)
    shipped: str  # the same line as it shipped broken
    story: str  # what went wrong, and where such a bug shipped
    symptoms: str  # what the learner sees when running it
    tools: str  # the chapter's tools that find it

    @property
    def stem(self) -> str:
        return f"bughunt{self.chapter:02d}_{self.slug}"

    @property
    def class_name(self) -> str | None:
        return self.qualname.split(".")[0] if "." in self.qualname else None

    @property
    def name(self) -> str:
        return self.qualname.split(".")[-1]


BUG_HUNTS: list[BugHunt] = [
    BugHunt(
        4,
        "accumulation",
        "minitrain.ddp.data_parallel",
        "DataParallel.no_sync",
        "previous, self._sync_enabled = self._sync_enabled, False",
        "previous = self._sync_enabled",
        "Gradient accumulation over DDP: micro-batches inside `no_sync()` should only add up "
        "local gradients, and one all-reduce at the last micro-batch averages the sum. "
        "Training loops and wrappers over DDP have shipped accumulation that synchronised on "
        "every micro-batch: the loss curve is perfect, the job is just k times chattier.",
        "Accumulating 4 micro-batches on 2 ranks gives exactly the right gradients, but the "
        "timeline shows an all-reduce after every micro-batch, and 4x the bytes of one step.",
        "notebook 04's timeline (`launch(...).traces`, `minitrain.runtime.trace.plot_timeline`): count "
        "the 'all-reduce bucket' spans per step; chapter 4's formula for the bytes of one step.",
    ),
    BugHunt(
        5,
        "loss_scaler",
        "minitrain.zero.data_parallel",
        "ZeroDataParallel._scaled_step",
        "        scaler.all_reduce_found_inf(self.optimizer, self.group)"
        "  # inf anywhere → inf everywhere\n",
        "",
        "fp16 training with ZeRO: each rank checks only its own shard of the gradients for "
        "inf/NaN. Sharded and model-parallel trainers have shipped loss scalers that decided "
        "to skip a step from the local check alone, so one rank skipped while the others "
        "stepped — and the replicas silently drifted apart.",
        "An overflow in one rank's shard: that rank halves its loss scale and skips; the other "
        "rank steps and keeps its scale. After a few steps the ranks' scales differ from "
        "torch.amp.GradScaler's and their weights are no longer one model.",
        "notebook 05's parity check (full_state_dict on every rank against one process), "
        "`scaler.get_scale()` per rank, and torch.amp.GradScaler as the reference.",
    ),
    BugHunt(
        6,
        "sequence_parallel_norm",
        "minitrain.tensor_parallel.apply",
        "SequenceParallelLayerNorm.forward",
        "weight = copy_to_parallel_region(self.weight, self.group)",
        "weight = self.weight",
        "Sequence parallelism splits the LayerNorms' tokens over the tensor-parallel ranks, so "
        "each rank's LayerNorm-gain gradient covers only its tokens and must be summed over "
        "the group. Megatron-style trainers have shipped sequence parallelism with these "
        "gradients left unsummed: every rank updates a different LayerNorm.",
        "Loss and most gradients match the dense model; the LayerNorm gains' gradients differ "
        "between tensor-parallel ranks and from the dense model's, by about one rank's share.",
        "notebook 06's parity check: every gradient of the tensor-parallel GPT against the "
        "dense model (gather each rank's shards), and the logged collectives (mappings).",
    ),
    BugHunt(
        7,
        "interleaved_warmup",
        "minitrain.pipeline.schedules",
        "interleaved_one_f_one_b_schedule",
        "            warmup = min(warmup, m * v)\n",
        "",
        "Interleaved 1F1B gives stage s a warm-up of 2(p - s - 1) + (v - 1)·g forwards "
        "before it alternates; with few micro-batches that count can exceed the m·v forwards "
        "the stage has at all, and it must be capped at that total. PyTorch's PiPPy shipped "
        "interleaved 1F1B without the cap (fixed by adding a min: pytorch/PiPPy#1081, 2024); "
        "torchtitan users saw pipelines hang with fewer micro-batches than stages "
        "(pytorch/torchtitan#775); AMD's Primus 1F1B schedulers crashed for the missing clamp "
        "(AMD-AGI/Primus#1003). Few micro-batches is the case nobody benchmarks.",
        "On 2 ranks with 3 chunks each, m = 2 trains like one process, but m = 1 does not run: "
        "every rank stops before the first action with a ScheduleError (this executor checks a "
        "schedule before running it; one without the check waits forever on a receive).",
        "notebook 07's schedule checker (`simulate`, and `plot_schedule` to see each stage's "
        "actions): count each stage's F and B per (micro-batch, chunk); parity of "
        "`PipelineStage.train_step` with one process.",
    ),
    BugHunt(
        8,
        "router_gradient",
        "minitrain.moe.expert_parallel",
        "ExpertParallelMoE.finish_gradient_synchronization",
        "                dist.all_reduce(p.grad, group=self.group)\n"
        "                p.grad /= self.world\n",
        "                dist.all_reduce(p.grad, group=self.group)\n",
        "Expert parallelism replicates the router on every rank, like data parallelism: its "
        "gradient must be averaged over the expert-parallel group — summed, then divided by "
        "its size. MoE trainers have shipped these gradients reduced with the wrong divisor "
        "or not at all (DeepSpeed's expert gradients divided by the wrong world size, "
        "deepspeedai/DeepSpeed#6546; a missing router all-reduce, pytorch/torchtitan#2416; "
        "a wrong router gradient under EP, huggingface/transformers#48687). The loss is "
        "right, so nothing in the run looks off. Here: summed but not averaged — the ranks "
        "agree with each other, and the router learns P times too fast.",
        "On 2 ranks, outputs, input gradients and expert gradients equal the local layer's; "
        "the router's gradient is identical on both ranks but exactly twice the local layer's "
        "(4 times on 4 ranks).",
        "notebook 08's parity check (expert-parallel layer against the local MoELayer on the "
        "mean of the ranks' losses), the ratio of gradient norms, and the logged collectives.",
    ),
]


def hunts_of(chapter: int) -> list[BugHunt]:
    return [h for h in BUG_HUNTS if h.chapter == chapter]


def function_source(hunt: BugHunt, fixed: bool = True) -> str:
    """The function as the library has it (decorators included), or with the shipped bug;
    dedented. ``fixed`` is replaced by ``shipped`` as exact text, indentation included."""
    module = import_module(hunt.module)
    owner = getattr(module, hunt.class_name) if hunt.class_name else module
    fn = inspect.getattr_static(owner, hunt.name)
    fn = getattr(fn, "__func__", fn)
    fn = getattr(fn, "__wrapped__", fn)  # contextmanager keeps the written function here
    source = inspect.getsource(fn)
    if source.count(hunt.fixed) != 1:
        raise ValueError(
            f"bug hunt {hunt.stem}: the line {hunt.fixed.strip()!r} is not found exactly once "
            f"in {hunt.module}.{hunt.qualname} — update BUG_HUNTS"
        )
    return textwrap.dedent(source if fixed else source.replace(hunt.fixed, hunt.shipped))


def render(hunt: BugHunt, fixed: bool) -> str:
    """The text of exercises/ (``fixed=False``: the shipped bug) or solutions/ (the fix)."""
    source = function_source(hunt, fixed)
    if hunt.class_name:
        source = (
            f"class {hunt.class_name}:\n    # Only the method with the bug; the rest of the class "
            f"is in {hunt.module}.\n\n" + textwrap.indent(source, "    ")
        )
    what = "the fix, as the library has it" if fixed else "the bug as it shipped"
    doc = "\n\n".join(
        textwrap.fill(part, 92)
        for part in (
            f"Chapter {hunt.chapter} bug hunt — {hunt.module}.{hunt.qualname} ({what}).",
            hunt.story,
            "What you see: " + hunt.symptoms,
            "Your tools: " + hunt.tools,
            "One line of the function below is wrong or missing. Fix it in my_exercises/"
            f"{hunt.stem}.py (run `python -m minitrain.exercises start` once), then "
            f"`python -m minitrain.grade {hunt.chapter}` re-runs the broken scenario.",
        )
    )
    return (
        f'"""{doc}\n"""\n\n'
        "# ruff: noqa: F405 (the library module's names come from the star import)\n"
        "from __future__ import annotations\n\n"
        f"from {hunt.module} import *  # noqa: F403 — the module's names, as the library sees them\n"
        f"\n\n{source.rstrip()}\n"
    )


def main() -> int:  # pragma: no cover - a listing for authors
    for hunt in BUG_HUNTS:
        print(f"chapter {hunt.chapter}: {hunt.stem} — {hunt.module}.{hunt.qualname}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
