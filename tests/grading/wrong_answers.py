"""Plausible wrong answers per exercise, and what its grading message must say (issues 21, 32).

Each entry is a mistake a learner really makes (an off-by-one, a sum instead of a mean, a
forgotten rescale or division by the world size), written as an exact replacement of ``old``
by ``new`` in the solution file of its chapter (``solutions/exNN_*.py``; ``old`` occurs there
exactly once), and the words the grader's message for that function must contain — the
function's name and the offending values, so a learner can act on it without pytest's
internals. ``tests/test_wrong_answer_messages.py`` grades a few of them (SAMPLE) on every run,
so the messages cannot silently regress; ``python tests/grading/wrong_answers.py N`` grades
every wrong answer of chapter N and prints the messages, for reading them as a learner does;
``python tests/grading/wrong_answers.py N check`` grades them in rounds (the r-th wrong answer
of every function of the chapter written in together: the grader blames each test's own
exercise only, so they do not disturb each other) and says, per wrong answer, whether it cost
its function points with a message holding its words. Issue 32's entries (at least three
per exercise with these) live in wrong_answers_issue32.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]


class WrongAnswer(NamedTuple):
    chapter: int
    function: str
    mistake: str  # in the words of the table of issue 21's report
    old: str
    new: str
    words: tuple[str, ...]  # the grading message must contain each (case-insensitive);
    # () where the graded tests do not catch the mistake (said why, next to the entry)


W = WrongAnswer
WRONG_ANSWERS = [
    # chapter 0: point to point
    W(0, "pass_the_token", "adds rank instead of rank + 1",
      "held += rank + 1", "held += rank", ("pass_the_token with 2 ranks: rank 0 returned",)),
    W(0, "broadcast", "receives from rank 0 instead of src",
      "dist.recv(tensor, src, group=group)", "dist.recv(tensor, 0, group=group)",
      ("rank 0: broadcast(src=2) failed", "receive from itself")),
    # chapter 1: single device
    W(1, "gpt_num_params", "forgets the position embeddings",
      "embeddings = v * h + s * h", "embeddings = v * h", ("gpt_num_params gives 108288", "the model has 110336")),
    W(1, "estimate_training_memory", "total counts the weights only",
      'parts["total"] = sum(parts.values())', 'parts["total"] = 4 * num_params',
      ("estimate_training_memory for 1B parameters in fp32: total 4 GB", "16 GB")),
    W(1, "block_activation_bytes", "forgets the attention scores (a*s*s*b)",
      "(8 * s * b * h + 2 * s * b * f + a * s * s * b) * e", "(8 * s * b * h + 2 * s * b * f) * e",
      ("block_activation_bytes(b=2, s=16", "= 131584", "autograd saves 139776")),
    W(1, "accumulate_gradients", "sums the micro-batch losses instead of weighting them",
      "loss = loss_fn(model(x), y) * (y.numel() / total)", "loss = loss_fn(model(x), y)",
      ("accumulate_gradients returned loss 12.467809", "mean loss", "4.155936")),
    # chapter 2: precision
    W(2, "round_significand", "rounds half up instead of half to even",
      "round_up = (remainder > half) | ((remainder == half) & ((q & 1) == 1))",
      "round_up = remainder >= half", ("round_significand(", "expected")),
    W(2, "decode", "subnormal exponent off by one",
      "math.ldexp(mantissa, 1 - self.bias - m_bits)", "math.ldexp(mantissa, -self.bias - m_bits)",
      ("FP16.decode(0x0001) gave 2.98", "torch reads")),
    W(2, "update", "grows the scale one step late",
      "self._growth_tracker == self.growth_interval", "self._growth_tracker > self.growth_interval",
      ("after step 2 your scale is 256.0", "GradScaler has 512.0")),
    W(2, "step", "forgets to copy the master weights back to the model",
      "p.copy_(m)", "pass", ("model parameter 0 is not its master copy",)),
    # chapter 3: checkpointing
    W(3, "forward", "does not save the RNG state",
      "ctx.rng_state = get_rng_state(_accelerators(tensors)) if preserve_rng_state else None",
      "ctx.rng_state = None", ("dropout mask", "RNG state")),
    W(3, "backward", "returns no gradient slot for preserve_rng_state",
      "return (None, None, *input_grads)", "return (None, *input_grads)",
      ("CheckpointFunction.backward", "one gradient per argument", "expected 5, got 4")),
    W(3, "choose_segments", "counts k saved inputs instead of k - 1",
      "k: (k - 1) * input_bytes", "k: k * input_bytes", ("choose_segments(64, 10, 10, budget_bytes=640) returned 2",)),
    # chapter 4: collectives and DDP
    W(4, "ring_reduce_scatter", "accumulates the wrong chunk (off by one)",
      "c = (rank - step - 2) % world", "c = (rank - step - 1) % world",
      ("ring_reduce_scatter", "rank")),
    W(4, "ring_all_gather", "forgets to place its own chunk",
      "chunks[rank].copy_(flat_in)", "pass", ("ring_all_gather", "rank")),
    W(4, "ring_all_reduce", "reduce-scatters but never all-gathers",
      "ring_all_gather(flat, mine, group)", "pass", ("ring_all_reduce", "rank")),
    W(4, "assign_buckets", "buckets in forward order, not the order gradients arrive",
      "current_bytes = [], [], 0\n    for i in reversed(range(len(params))):",
      "current_bytes = [], [], 0\n    for i in range(len(params)):",
      ("assign_buckets",)),
    W(4, "DataParallel._on_grad_ready", "sums the gradients but forgets to divide by the world size",
      "torch.div(param.grad.reshape(-1), self.world_size, out=bucket.view(k))",
      "bucket.view(k).copy_(param.grad.reshape(-1))", ("rank",)),
    # chapter 5: ZeRO and FSDP
    W(5, "partition_parameters", "round-robin instead of the least-loaded rank",
      "r = min(range(world_size), key=lambda r: (loads[r], r))", "r = i % world_size",
      ("sizes [4, 3, 3, 2, 2] on 2 ranks", "you gave [[0, 2, 4], [1, 3]]")),
    W(5, "ShardedOptimizer.step", "forgets to advance the offset in the gathered buffer",
      "                    offset += n", "                    offset += 0",
      ("ShardedOptimizer steps on 2 ranks, rank 0's", "did every rank receive")),
    W(5, "ZeroDataParallel._pre_forward", "ZeRO-3: forgets to prefetch the next block",
      "            self._start_gather(self.units[index + 1])", "            pass",
      ("ZeRO-3 rank 0", "launched per block 0, 1: [False, False]")),
    W(5, "ZeroDataParallel._post_forward", "ZeRO-3: keeps the gathered block after its forward",
      "self._free(self.units[index])\n        if torch.is_grad_enabled()",
      "if torch.is_grad_enabled()", ("ZeRO-3 rank 0", "freed per block: [False, False, False]")),
    W(5, "FullyShardedDataParallel._pre_forward", "FSDP: never frees the earlier units",
      "for earlier in self.units[:index]:\n            self._free(earlier)",
      "for earlier in self.units[:index]:\n            pass",
      ("FSDP rank 0", "block 1 was skipped", "freed per block: [True, False, True]")),
    W(5, "FullyShardedDataParallel._post_forward", "FSDP: keeps the unit gathered after its forward",
      "self._free(self.units[index])\n        for t in", "for t in",
      ("FSDP rank 0", "freed per block: [True, True, False]")),
    W(5, "FullyShardedDataParallel._launch_reduce_scatter", "counts elements, not bytes",
      "count_sent(kind, u.padded * buf.element_size(), self.world_size)",
      "count_sent(kind, u.padded, self.world_size)",
      ("should count 548 bytes of reduce-scatter", "counted 137", "elements, not bytes")),
    # chapter 6: tensor parallelism
    W(6, "CopyToParallelRegion", "copy to the region: all-reduces in forward too (f confused with g)",
      "return x.view_as(x)", "return all_reduce(x.clone(), group)",
      ("CopyToParallelRegion (f): forward must return its input unchanged; rank 0 got",)),
    W(6, "CopyToParallelRegion", "copy to the region: forgets the all-reduce of the gradient",
      "return all_reduce(grad.contiguous().clone(), ctx.group), None", "return grad.clone(), None",
      ("CopyToParallelRegion (f): backward must sum the gradient over the ranks: rank 0",)),
    W(6, "ReduceFromParallelRegion", "reduce from the region: forgets the all-reduce",
      "return all_reduce(x.contiguous().clone(), group)", "return x.clone()",
      ("ReduceFromParallelRegion (g): forward must return the sum over ranks: rank 0 got",)),
    W(6, "ReduceFromParallelRegion", "reduce from the region: all-reduces the gradient again",
      "        return grad, None", "        return all_reduce(grad.clone(), None), None",
      ("ReduceFromParallelRegion (g): backward must pass the gradient through unchanged",)),
    W(6, "ColumnParallelLinear.forward", "column-parallel: forgets f (no all-reduce of the input gradient)",
      "x = copy_to_parallel_region(x, self.group)", "pass",
      ("ColumnParallelLinear {}: rank 0's input gradient differs from the dense layer's",)),
    W(6, "RowParallelLinear.forward", "row-parallel: adds the bias on every rank before the sum",
      "partial = F.linear(x, self.weight)", "partial = F.linear(x, self.weight, self.bias)",
      ("RowParallelLinear {}: rank 0's output differs from the dense layer's",)),
    W(6, "VocabParallelCrossEntropy.forward", "vocab-parallel cross-entropy: local max instead of the global one",
      "m = all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)",
      "m = z.max(dim=-1).values",
      ("VocabParallelCrossEntropy.forward, logits of size ~10000: rank 0's loss is 15539.86",)),
    W(6, "VocabParallelCrossEntropy.backward", "vocab-parallel cross-entropy: gradient not divided by the token count",
      "grad *= grad_loss / mine.numel()", "grad *= grad_loss",
      ("VocabParallelCrossEntropy.backward", "differs from F.cross_entropy's by up to",
       "mean over 24 tokens")),
    # chapter 7: pipeline parallelism
    W(7, "one_f_one_b_schedule", "one warm-up forward too many",
      "warmup = min(p - s - 1, m)", "warmup = min(p - s, m)", ("one_f_one_b_schedule(3, 4) for stage 0 should be", "got [('F', 0), ('F', 1), ('F', 2), ('F', 3)")),
    W(7, "run_action", "the received activation does not require grad",
      'x = stage.recv("F", mb, v - 1, state).requires_grad_()',
      'x = stage.recv("F", mb, v - 1, state)',
      ("rank 1", "your run_action raised AttributeError", "requires_grad_()")),
    W(7, "bubble_fraction", "returns the busy fraction instead of the idle one",
      "return 1 - busy / (p * max(free))", "return busy / (p * max(free))",
      ("bubble_fraction of GPipe p=1, m=1: got 1", "expected (p-1)/(m+p-1) = 0")),
    # chapter 8: mixture of experts
    W(8, "top_k_routing", "does not renormalise the top-k weights",
      "weights = chosen / chosen.sum(dim=-1, keepdim=True)", "weights = chosen",
      ("top_k_routing, top-1: token", "they sum to", "divided by their sum")),
    W(8, "sort_by_expert", "bincount without minlength (an expert with no rows is dropped)",
      "torch.bincount(expert_of_row, minlength=num_experts)", "torch.bincount(expert_of_row)",
      ("counts should be [4, 0, 3, 3, 0]", "got [4, 0, 3, 3]")),
    W(8, "unsort", "applies the permutation again instead of its inverse",
      "return out.index_copy(0, order, sorted_rows)", "return sorted_rows[order]",
      ("unsort(rows[order], order) should give the rows back", "got [[3.0")),
    W(8, "load_balancing_loss", "forgets to multiply by the number of experts",
      "return num_experts * (f * p).sum()", "return (f * p).sum()", ("load_balancing_loss: perfectly uniform", "got 0.25")),
    # chapter 9: flash attention
    W(9, "online_softmax_update", "forgets to rescale the accumulator",
      "acc_new = alpha[..., None] * acc +", "acc_new = acc +", ("online_softmax_update",)),
    W(9, "forward_query_block", "forgets the final division by the row sum",
      "return acc / row_sum[..., None], m + torch.log(row_sum)",
      "return acc, m + torch.log(row_sum)", ("forward_query_block",)),
    W(9, "block_backward", "forgets the softmax scale in dK",
      "dk_j = tile_matmul(ds.to(q_i.dtype).transpose(-2, -1), q_i, acc_dtype) * scale",
      "dk_j = tile_matmul(ds.to(q_i.dtype).transpose(-2, -1), q_i, acc_dtype)", ("block_backward: dk of one whole tile", "the reference")),
    # issue 40: a bf16 matmul returns bf16, so the scores (or P v) are rounded to 8 bits
    W(9, "forward_query_block", "computes the scores of bf16 tiles in bf16, then casts them",
      "s = tile_matmul(q_i, k_j.transpose(-2, -1), acc_dtype) * scale\n        mask",
      "s = (q_i @ k_j.transpose(-2, -1)).to(acc_dtype) * scale\n        mask",
      ("forward_query_block with bf16 q, k, v", "scores were rounded to bf16")),
    W(9, "block_backward", "computes the scores of bf16 tiles in bf16, then casts them",
      "s = tile_matmul(q_i, k_j.transpose(-2, -1), acc_dtype) * scale\n    p = torch.exp(",
      "s = (q_i @ k_j.transpose(-2, -1)).to(acc_dtype) * scale\n    p = torch.exp(",
      ("block_backward with bf16 q, k, v, dO", "rounded to bf16")),
    W(9, "online_softmax_update", "rounds the product P v to bf16 before adding it in fp32",
      "tile_matmul(p.to(v.dtype), v, acc.dtype)", "(p.to(v.dtype) @ v).to(acc.dtype)",
      ("online_softmax_update with bf16 v", "was rounded to bf16")),
    # chapter 10: context parallelism
    W(10, "merge_attention", "keeps the larger log-sum-exp instead of adding the two",
      "lse = m + torch.log(total)", "lse = m", ("merge_attention (", "the merged logsumexp differs", "yours is")),
    W(10, "ring_step", "overwrites the partial result instead of merging",
      "outs[i], lses[i] = merge_attention(outs[i], lses[i], out, lse)",
      "outs[i], lses[i] = out, lse", ("ring attention with your ring_step differs", "merge_attention")),
    # chapter 11: putting it together
    W(11, "rank_coords", "splits the rank's digits in the wrong axis order",
      "for axis in reversed(AXES):", "for axis in AXES:", ("rank_coords",)),
    W(11, "axis_groups", "forgets the stride: consecutive ranks in every group",
      "groups.append([start + i * stride for i in range(sizes[axis])])",
      "groups.append([start + i for i in range(sizes[axis])])", ("axis_groups",)),
    W(11, "params_per_rank", "forgets to split the embedding over tp",
      "total += v * h // t + config.seq_len * h", "total += v * h + config.seq_len * h",
      ("params_per_rank",)),
]


def _more() -> list[WrongAnswer]:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "wrong_answers_issue32", Path(__file__).with_name("wrong_answers_issue32.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [WrongAnswer(*entry) for entry in module.MORE]


WRONG_ANSWERS += _more()


def solution_file(chapter: int) -> Path:
    from minitrain.course.exercises import CHAPTERS

    return ROOT / "solutions" / f"{CHAPTERS[chapter][0]}.py"


def apply(answers: list[WrongAnswer], folder: Path) -> None:
    """Copy solutions/ to folder and write the wrong answers into the copy."""
    shutil.copytree(ROOT / "solutions", folder, dirs_exist_ok=True)
    for a in answers:
        path = folder / solution_file(a.chapter).name
        text = path.read_text()
        if text.count(a.old) != 1:
            raise ValueError(
                f"wrong answer for {a.function} (chapter {a.chapter}): its old text occurs "
                f"{text.count(a.old)} times in {path.name}, not once: {a.old!r}"
            )
        path.write_text(text.replace(a.old, a.new))


def grade(answers: list[WrongAnswer], chapter: int, timeout: float = 120) -> str:
    """The grader's printed table for chapter, with the wrong answers written in."""
    with tempfile.TemporaryDirectory(prefix="minitrain-wrong-") as tmp:
        apply(answers, Path(tmp))
        cmd = [sys.executable, "-m", "minitrain.grade", str(chapter), "--source", tmp,
               f"--timeout={timeout:g}"]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True).stdout


def belongs(answer: WrongAnswer, exercise: str) -> bool:
    """Whether a graded test of ``exercise`` (its marker's name) grades answer's function."""
    f = answer.function
    return exercise == f or exercise.endswith("." + f) or f.startswith(exercise + ".")


def check(chapter: int, timeout: float = 120, only: list[str] | None = None) -> list[str]:
    """Grade chapter's wrong answers in rounds (``only``: those whose mistake contains one of
    these texts); return one line per wrong answer not caught (no failing test of its
    function, or a message lacking its words)."""
    from minitrain.course.grade import run_tests

    mine = [a for a in WRONG_ANSWERS if a.chapter == chapter
            and (not only or any(o in a.mistake for o in only))]
    rounds: list[list[WrongAnswer]] = []
    for a in mine:  # the first round without a wrong answer of the same function
        slot = next((r for r in rounds if all(b.function != a.function for b in r)), None)
        if slot is None:
            rounds.append(slot := [])
        slot.append(a)
    problems = []
    for answers in rounds:
        with tempfile.TemporaryDirectory(prefix="minitrain-wrong-") as tmp:
            apply(answers, Path(tmp))
            results = run_tests([chapter], Path(tmp), timeout, verbose=False)
        for a in answers:
            failed = [r for r in results if not r["passed"] and belongs(a, r["exercise"])]
            messages = [r["message"] for r in failed]
            missing = [w for w in a.words if not any(w.lower() in m.lower() for m in messages)]
            verdict = "NOT CAUGHT" if not failed else f"lacks {missing}" if missing else "caught"
            print(f"[{verdict}] ch{chapter} {a.function}: {a.mistake}")
            for m in messages[:2]:
                print(f"      -> {m}")
            if verdict != "caught":
                problems.append(f"ch{chapter} {a.function} ({a.mistake}): {verdict}")
    return problems


if __name__ == "__main__":
    # python tests/grading/wrong_answers.py N [index | all]: each wrong answer of chapter N
    # graded alone (or the one at index; or all of them written in together, one run)
    chapter = int(sys.argv[1])
    mine = [a for a in WRONG_ANSWERS if a.chapter == chapter]
    which = sys.argv[2] if len(sys.argv) > 2 else None
    if which == "check":  # ... N check ["text in the mistake" ...]
        sys.exit(1 if check(chapter, only=sys.argv[3:]) else 0)
    if which == "all":
        print(grade(mine, chapter))
    for a in [] if which == "all" else [mine[int(which)]] if which else mine:
        print(f"=== {a.function}: {a.mistake}")
        print(grade([a], chapter))
