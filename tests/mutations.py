"""Named mutations: known bugs, each with the tests that must catch it (`make mutants`).

A test suite can pass while testing nothing (issue 12: `no_sync` made a no-op, fp8's clamp
removed — every test still passed). Each entry of MUTATIONS below is one such bug, written
as an exact text replacement in one file, and the pytest node ids (or files) that must fail
once it is applied. For each mutation this script

1. copies minitrain/, tests/, exercises/, solutions/ and pyproject.toml to a temp dir,
2. replaces `old` by `new` in `file` there — `old` must occur exactly once, so an entry
   whose code has moved fails loudly instead of silently testing nothing,
3. checks that the copy's minitrain is the one imported (in pytest's process and in a
   rank started by `launch`), not the editable install,
4. runs the named tests in the copy: caught if *each* of them fails (a node id of a
   parametrized test or a file counts as failing if one of its tests fails), NOT CAUGHT
   if any passes — so a grader and a unit test named together must both catch the bug.

The named tests are first run once on an unmutated copy: they must pass there, or a
"caught" would mean nothing. Exit status 1 if any mutation is NOT CAUGHT or BROKEN (its
old text not found once, the copy not the one imported, pytest unable to collect a test).

Rule: every bug a later chapter finds in an earlier one becomes an entry here, with the
test written to catch it. To add one, append a Mutation(...) to MUTATIONS.

    python tests/mutations.py            # all
    python tests/mutations.py "no_sync"  # those whose name contains the text
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("minitrain", "tests", "exercises", "solutions", "notebooks", "pyproject.toml")


class Mutation(NamedTuple):
    name: str
    file: str  # relative to the repository root
    old: str  # must occur exactly once in file
    new: str
    tests: list[str]  # pytest node ids or files, relative to the root; each must fail


DDP, FP8 = "minitrain/ddp/data_parallel.py", "minitrain/precision/fp8.py"
# issue 30: checkpoint checksums and clean-up; the command's refusals and one-line errors
ZERO_CKPT, COMMAND_ERRORS = "minitrain/zero/checkpoint_files.py", "minitrain/parallel/command_errors.py"
DDP_BUCKETS = "minitrain/ddp/gradient_bucket.py"  # a bucket's flat buffer, all-reduce and write-back
ZERO, COMPOSE = "minitrain/zero/data_parallel.py", "tests/test_composition.py"
# issue 14: stage 3's gather/free hooks and ordered reductions moved here, shared with FSDP
SHARED, FSDP = "minitrain/zero/sharded_units.py", "minitrain/fsdp/wrapper.py"
READINESS_ORDER = (
    "        while self._to_reduce:\n"
    "            u = self._to_reduce[0]\n"
    "            if u.ready < len(u.params):\n"
    "                return  # a later unit may be complete, but it must wait for this one\n"
    "            self._launch_reduce_scatter(self._to_reduce.pop(0))\n",
    "        for u in [u for u in self._to_reduce if u.ready == len(u.params)]:\n"
    "            self._to_reduce.remove(u)  # whichever unit this rank completed first\n"
    "            self._launch_reduce_scatter(u)\n",
)
TP_APPLY, TP_LAYERS = "minitrain/tensor_parallel/apply.py", "minitrain/tensor_parallel/layers.py"
TP_TESTS = "tests/test_tensor_parallel.py"
CP_TESTS = "tests/test_context_parallel.py"
CP_GRADED = "tests/grading/test_ch10_context_parallel.py"
GRAD_NORM, TRAINER = "minitrain/parallel/grad_norm.py", "minitrain/parallel/trainer.py"
CLIPPING, PRECISION_TESTS = "tests/test_train_clipping.py", "tests/test_train_precision.py"
G = "tests/grading/"  # issue 32: the graded tests of each chapter
G4, G5 = G + "test_ch04_collectives_and_ddp.py", G + "test_ch05_zero.py"
G7, G9 = G + "test_ch07_pipeline_parallel.py", G + "test_ch09_flash_attention.py"
DROP = "tests/test_dropout_layouts.py::test_dropout_losses_equal_one_process"  # issue 40
MUTATIONS = [
    Mutation(
        "no_sync no-op",
        DDP,
        "        previous, self._sync_enabled = self._sync_enabled, False\n"
        "        try:\n            yield\n        finally:\n            self._sync_enabled = previous\n",
        "        yield\n",
        ["tests/test_ddp.py::test_no_sync_leaves_local_gradients_then_averages_their_sum"],
    ),
    Mutation(
        "missing fp8 clamp",
        FP8,
        "y = (x.float() * scale).clamp(-fmt.max, fmt.max)",
        "y = x.float() * scale",
        [
            "tests/test_loss_scaling.py::test_stale_delayed_scale_saturates_instead_of_overflowing",
            "tests/test_loss_scaling.py::test_quantized_linear_gradient_saturates_when_its_amax_jumps",
        ],
    ),
    Mutation(
        "gradient not divided by the world size",
        DDP,
        "torch.div(param.grad.reshape(-1), self.world_size, out=bucket.view(k))",
        "bucket.view(k).copy_(param.grad.reshape(-1))",
        [
            "tests/test_ddp.py::test_rank_without_backward_does_not_hang",
            "tests/grading/test_ch04_collectives_and_ddp.py::test_data_parallel_matches_one_process",
        ],
    ),
    Mutation(
        "ring all-reduce skips the all-gather phase",
        "minitrain/collectives/ring.py",
        "    ring_all_gather(flat, mine, group)\n",
        "",
        ["tests/grading/test_ch04_collectives_and_ddp.py::test_ring_all_reduce"],
    ),
    Mutation(
        "ZeRO-1 ownership: ties go to the highest rank",
        "minitrain/zero/partition.py",
        "r = min(range(world_size), key=lambda r: (loads[r], r))",
        "r = min(range(world_size), key=lambda r: (loads[r], -r))",
        [
            "tests/test_zero.py::test_partition_parameters",
            "tests/grading/test_ch05_zero.py::test_partition_parameters",
        ],
    ),
    Mutation(
        "ZeRO-1 ownership: equal sizes visited highest index first",
        "minitrain/zero/partition.py",
        "key=lambda i: (-sizes[i], i)",
        "key=lambda i: (-sizes[i], -i)",
        ["tests/test_zero.py::test_partition_parameters"],
    ),
    Mutation(
        "choose_segments: ties pick the most segments",
        "minitrain/checkpointing/cost.py",
        "key=lambda k: (peaks[k], k))",
        "key=lambda k: (peaks[k], -k))",
        [
            "tests/test_checkpointing.py::test_choose_segments_is_the_smallest_k_of_least_peak",
            "tests/grading/test_ch03_checkpointing.py::test_choose_segments_breaks_ties_with_fewer_segments",
        ],
    ),
    # issue 12: techniques compose (tests/test_composition.py)
    Mutation(
        "ZeRO: readiness-order reduce-scatter",
        SHARED,
        *READINESS_ORDER,
        [
            f"{COMPOSE}::test_zero_ranks_using_different_parameters_match_one_process[2-2]",
            f"{COMPOSE}::test_zero_ranks_using_different_parameters_match_one_process[3-3]",
        ],
    ),
    Mutation(
        "DDP: unused parameter given a zero gradient",
        DDP_BUCKETS,
        "            if used[k] == 0:",
        "            if False:",
        [f"{COMPOSE}::test_ddp_unused_parameters_match_torch_ddp[2-torch]"],
    ),
    Mutation(
        "master copy before the average",
        "minitrain/precision/master_weights.py",
        'averaged_hook = getattr(model, "register_averaged_grad_hook", None)',
        "averaged_hook = None",
        [f"{COMPOSE}::test_master_weights_under_ddp_match_fp32_master_loop[2]"],
    ),
    Mutation(
        "loss scaler deciding per rank",
        ZERO,
        "        scaler.all_reduce_found_inf(self.optimizer, self.group)  # inf anywhere → inf everywhere\n",
        "",
        [f"{COMPOSE}::test_zero_fp16_overflow_on_one_rank_skips_everywhere[2]"],
    ),
    Mutation(
        "ZeRO stage 3: gathers share the reduce-scatters' group",
        SHARED,
        "group=self._gather_group, async_op=True",
        "group=self.group, async_op=True",
        [f"{COMPOSE}::test_zero_ranks_using_different_parameters_match_one_process[2-3]"],
    ),
    # issue 14: FSDP (minitrain/fsdp/), built on the same shared units
    Mutation(
        "FSDP reduce-scatter in readiness order",
        SHARED,
        *READINESS_ORDER,
        ["tests/test_fsdp.py::test_unused_parameters_and_replicated_params_match_one_process"],
    ),
    Mutation(
        "FSDP gathers not freed after forward",
        FSDP,
        "        self._free(self.units[index])\n        for t in",
        "        for t in",
        [
            "tests/test_fsdp_course.py::test_bytes_peak_and_communication_equal_their_formulas",
            "tests/grading/test_ch05_zero.py::test_fsdp_post_forward_frees_and_regathers_for_backward",
        ],
    ),
    Mutation(
        "FSDP unit no rank used gets a zero gradient (AdamW decays it)",
        FSDP,
        "        if id(u) in self._unused:\n            return",
        "        pass",
        ["tests/test_fsdp.py::test_unused_parameters_and_replicated_params_match_one_process"],
    ),
    Mutation(
        "FSDP gathers launched per unit, not in order (ranks skipping blocks pair wrong ones)",
        FSDP,
        "        self._gather_in_order(index + 1)\n",
        "        self._start_gather(self.units[index])\n"
        "        self._start_gather(self.units[min(index + 1, len(self.blocks) - 1)])\n",
        ["tests/test_fsdp_course.py::test_ranks_skipping_different_blocks_match_one_process"],
    ),
    Mutation(
        "FSDP replicated gradients counted N times in the clipping norm",
        "minitrain/fsdp/clipping.py",
        "        if not u.keep_full:\n",
        "        if True:\n",
        ["tests/test_fsdp_course.py::test_clip_with_replicated_params_equals_torch"],
    ),
    # issue 15: tensor parallelism (tests/test_tensor_parallel.py, the chapter 6 grader)
    Mutation(
        "tensor parallel: sequence-parallel LayerNorm gradients not summed",
        TP_APPLY,
        "        weight = copy_to_parallel_region(self.weight, self.group)\n",
        "        weight = self.weight  # each rank keeps its shard's partial gradient\n",
        [f"{TP_TESTS}::test_forward_loss_and_every_gradient_match_dense[tp+sp-2]"],
    ),
    Mutation(
        "tensor parallel: row-parallel bias added on every rank",
        TP_LAYERS,
        "partial = F.linear(x, self.weight)  # this rank's share of the sum; no bias yet",
        "partial = F.linear(x, self.weight, self.bias)  # the bias joins the sum, t times",
        [
            f"{TP_TESTS}::test_forward_loss_and_every_gradient_match_dense[tp-2]",
            "tests/grading/test_ch06_tensor_parallel.py::test_row_parallel_forward[parallel-input]",
        ],
    ),
    Mutation(
        "tensor parallel: sequence-parallel row bias gradient not summed",
        TP_LAYERS,
        "bias = copy_to_parallel_region(self.bias, self.group) if self.sequence_parallel else self.bias",
        "bias = self.bias",
        [
            f"{TP_TESTS}::test_forward_loss_and_every_gradient_match_dense[tp+sp-4]",
            "tests/grading/test_ch06_tensor_parallel.py::test_row_parallel_forward[sequence_parallel]",
        ],
    ),
    Mutation(
        "tensor parallel: vocab-parallel loss with each rank's own max",
        "minitrain/tensor_parallel/cross_entropy.py",
        "m = all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)",
        "m = z.max(dim=-1).values",
        [
            f"{TP_TESTS}::test_vocab_parallel_cross_entropy_equals_torch[unit]",
            "tests/grading/test_ch06_tensor_parallel.py::test_vocab_parallel_cross_entropy_value[logits~1]",
        ],
    ),
    Mutation(
        "tensor parallel: f's backward not all-reduced",
        "minitrain/tensor_parallel/mappings.py",
        "return all_reduce(grad.contiguous().clone(), ctx.group), None",
        "return grad, None",
        [
            f"{TP_TESTS}::test_forward_loss_and_every_gradient_match_dense[tp-4]",
            "tests/grading/test_ch06_tensor_parallel.py::test_f_is_identity_forward_and_all_reduce_backward",
        ],
    ),    # the bug hunts' shipped bugs (minitrain/course/bughunts.py), caught by their graded tests
    Mutation(
        "bug hunt 4: no_sync leaves synchronisation on",
        DDP,
        "previous, self._sync_enabled = self._sync_enabled, False",
        "previous = self._sync_enabled",
        ["tests/grading/test_ch04_bughunt.py"],
    ),
    Mutation(
        "bug hunt 5: loss scaler deciding per rank",
        ZERO,
        "        scaler.all_reduce_found_inf(self.optimizer, self.group)  # inf anywhere → inf everywhere\n",
        "",
        ["tests/grading/test_ch05_bughunt.py"],
    ),
    Mutation(
        "bug hunt 6: sequence-parallel LayerNorm gains not summed",
        TP_APPLY,
        "weight = copy_to_parallel_region(self.weight, self.group)",
        "weight = self.weight",
        ["tests/grading/test_ch06_bughunt.py"],
    ),
    Mutation(
        "flash: running sum not rescaled when the max changes",
        "minitrain/flash_attention/tiles.py",
        "sum_new = alpha * row_sum + p.sum(dim=-1)",
        "sum_new = row_sum + p.sum(dim=-1)",
        [
            "tests/test_flash_attention.py::test_matches_sdpa_fp32",
            "tests/grading/test_ch09_flash_attention.py::test_a_larger_max_later_rescales_what_was_summed",
        ],
    ),
    Mutation(
        "flash: causal tile skip off by one",
        "minitrain/flash_attention/tile_grid.py",
        "        if causal and j0 > i1 - 1:\n",
        "        if causal and j0 >= i1 - 1:\n",
        [
            "tests/test_flash_attention.py::test_matches_sdpa_fp32",
            "tests/grading/test_ch09_flash_attention.py::test_forward_of_a_query_block_matches_softmax_attention",
        ],
    ),
    Mutation(
        "flash: D computed from the block's own output, not the given (global) one",
        "minitrain/flash_attention/tiles.py",
        "delta = (do.to(acc) * o.to(acc)).sum(dim=-1)",
        "delta = (do.to(acc) * flash_attention_forward(q, k, v, causal, block_q, block_k)[0]"
        ".reshape(qg.shape).to(acc)).sum(dim=-1)",
        ["tests/test_flash_attention.py::test_backward_with_global_out_and_lse_gives_each_key_blocks_share"],
    ),
    Mutation(
        "flash: logsumexp saved without the running max",
        "minitrain/flash_attention/tiles.py",
        "return acc / row_sum[..., None], m + torch.log(row_sum)",
        "return acc / row_sum[..., None], torch.log(row_sum)",
        [
            "tests/test_flash_attention.py::test_saved_tensors_hold_one_logsumexp_of_shape_batch_n",
            "tests/grading/test_ch09_flash_attention.py::test_forward_of_a_query_block_matches_softmax_attention",
        ],
    ),
    Mutation(
        "flash: GQA k/v gradients taken from one query head, not summed over the group",
        "minitrain/flash_attention/tiles.py",
        "dk_j, dv_j = dk_j.sum(dim=-3), dv_j.sum(dim=-3)",
        "dk_j, dv_j = dk_j[..., 0, :, :], dv_j[..., 0, :, :]",
        ["tests/test_flash_attention.py::test_matches_sdpa_fp32"],
    ),
    Mutation(
        "flash triton: causal mask dropped in the backward's tile recomputation",
        "minitrain/flash_attention/triton_kernels.py",
        "p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)  # P rebuilt from L",
        "p = tl.where((rows < n_q)[:, None] & (keys < n_k)[None, :], tl.exp(s - lse[:, None]), 0.0)"
        "  # P rebuilt from L",
        ["tests/test_flash_attention_triton.py::test_triton_equals_tiles_and_sdpa"],
    ),
    Mutation(
        "context parallel: merge without max-subtraction (exp of a logsumexp overflows)",
        "minitrain/context_parallel/merge.py",
        "    m = torch.maximum(lse_a, lse_b)\n",
        "    m = torch.zeros_like(lse_a)\n",
        [f"{CP_GRADED}::test_merge_equals_attention_over_the_union"],
    ),
    Mutation(
        "context parallel: merge keeps the max as the logsumexp",
        "minitrain/context_parallel/merge.py",
        "    lse = m + torch.log(total)\n",
        "    lse = m\n",
        [f"{CP_TESTS}::test_outputs_and_gradients_equal_full_attention[2]",
         f"{CP_GRADED}::test_merge_equals_attention_over_the_union"],
    ),
    Mutation(
        "context parallel: zigzag second chunk index wrong (P + r, not 2P - 1 - r)",
        "minitrain/context_parallel/layout.py",
        "return [rank, 2 * world_size - 1 - rank]",
        "return [rank, world_size + rank]",
        [f"{CP_TESTS}::test_outputs_and_gradients_equal_full_attention",
         f"{CP_TESTS}::test_bytes_and_forward_flops_equal_the_formulas"],
    ),
    Mutation(
        "context parallel: dK/dV not sent home (the last block's kept)",
        "minitrain/context_parallel/ring.py",
        "    home = pending.wait()",
        "    pending.wait()\n    home = dkv",
        [f"{CP_TESTS}::test_outputs_and_gradients_equal_full_attention"],
    ),
    Mutation(
        "context parallel: future key blocks not skipped under the causal mask",
        "minitrain/context_parallel/ring.py",
        "            if causal and kc > qc:\n                continue\n",
        "",
        [f"{CP_TESTS}::test_outputs_and_gradients_equal_full_attention[2]"],
    ),
    Mutation(
        "context parallel: positions not offset per shard",
        "minitrain/context_parallel/model.py",
        "pos = shard_positions(seq_len, self.rank, self.world_size, self.layout, device=idx.device)",
        "pos = torch.arange(idx.shape[1], device=idx.device)",
        [f"{CP_TESTS}::test_gpt_loss_curve_equals_one_process[2-zigzag-50]"],
    ),
    Mutation(
        "mesh: pipeline the fastest axis (TP ranks not adjacent)",
        "minitrain/parallel/mesh.py",
        "    for axis in reversed(AXES):  # tp, cp, dp, pp\n",
        "    for axis in AXES:\n",
        ["tests/test_mesh.py::test_coordinates_enumerate_the_grid_tp_fastest_pp_slowest[dp2-tp2-pp2]"],
    ),
    Mutation(
        "compose: logged loss summed, not averaged, over data-parallel ranks",
        "minitrain/parallel/trainer.py",
        "            t /= self.replicas",
        "            t /= 1",
        ["tests/test_train.py::test_loss_curve_equals_the_single_process[dp2]"],
    ),
    Mutation(
        "compose: gradients averaged over DP only, not over DP x CP",
        "minitrain/parallel/parallelize.py",
        'mesh.group("dp_cp"), mesh.group("tp")',
        'mesh.group("dp"), mesh.group("tp")',
        ["tests/test_train.py::test_loss_curve_equals_the_single_process[tp2-pp2-cp2-microbatches2]"],
    ),
    Mutation(
        "compose: ZeRO optimizer state not restored on resume",
        "minitrain/parallel/trainer.py",
        '            self.wrapped.optimizer.load_state_dict(state["optimizer"])\n',
        "            pass\n",
        ["tests/test_train.py::test_command_logs_and_resumes_bit_exactly[dp2-zero2]"],
    ),
    Mutation(
        "planner: a 1F1B stage holds all m micro-batches",
        "minitrain/parallel/planner.py",
        "    return min(layout.microbatches, layout.pp - stage)",
        "    return layout.microbatches",
        ["tests/test_train.py::test_planner_memory_equals_measured[pp2-microbatches4]"],
    ),
    Mutation(
        "pipeline: 1F1B warm-up one forward too many",
        "minitrain/pipeline/schedules.py",
        "warmup = min(p - s - 1, m)",
        "warmup = min(p - s, m)",
        ["tests/test_pipeline.py::test_one_f_one_b_reference_point", "tests/grading/test_ch07_pipeline_parallel.py::test_one_f_one_b_order_bubble_and_memory"],
    ),
    Mutation(
        "pipeline: 1F1B warm-up not capped at m (m < p)",
        "minitrain/pipeline/schedules.py",
        "warmup = min(p - s - 1, m)",
        "warmup = p - s - 1",
        ["tests/test_pipeline.py::test_gpipe_and_1f1b_bubble_and_memory", "tests/test_pipeline.py::test_every_schedule_matches_one_process"],
    ),
    Mutation(
        "pipeline: DP gradients all-reduced after every micro-batch's backward",
        "minitrain/pipeline/executor.py",
        "        self.run(schedule, state)\n",
        "        for what, item in message_plan(schedule, self.num_chunks)[self.stage]:\n"
        "            (run_action if what == \"action\" else post_group)(self, item, state)\n"
        "            if dp_group is not None and what == \"action\" and item[0] != \"F\":\n"
        "                average_gradients(self.parameters(), dp_group)\n",
        ["tests/test_pipeline.py::test_pipeline_with_data_parallel_matches_one_process"],
    ),
    Mutation(
        "pipeline: micro-batch loss not divided by the number of micro-batches",
        "minitrain/pipeline/executor.py",
        "out = loss / state.num_microbatches",
        "out = loss",
        ["tests/test_pipeline.py::test_every_schedule_matches_one_process", "tests/grading/test_ch07_pipeline_parallel.py::test_run_action_trains_like_one_process"],
    ),
    Mutation(
        "pipeline: interleaved backward visits the chunks in forward order",
        "minitrain/pipeline/schedules.py",
        "forwards, backwards = order(False), order(True)",
        "forwards, backwards = order(False), order(False)",
        ["tests/test_pipeline.py::test_interleaved_bubble_is_exact_when_p_divides_m"],
    ),
    Mutation(
        "pipeline: the checker forgets that B waits for the next stage's B",
        "minitrain/pipeline/check.py",
        "        if virtual < last:\n",
        "        if False:\n",
        ["tests/test_pipeline.py::test_checker_finds_deadlock_and_malformed_schedules", "tests/test_pipeline.py::test_one_f_one_b_reference_point"],
    ),
    Mutation(
        "MoE: capacity off by one (an expert keeps capacity + 1 assignments)",
        "minitrain/moe/router.py",
        "keep = slot < capacity",
        "keep = slot <= capacity",
        [
            "tests/test_moe.py::test_top_k_routing_matches_the_loop_reference[0.5-2]",
            "tests/test_moe.py::test_moe_layer_matches_the_token_loop[1-0.5]",
            "tests/grading/test_ch08_mixture_of_experts.py::test_top_k_routing",
        ],
    ),
    Mutation(
        "MoE: top-k weights not renormalised",
        "minitrain/moe/router.py",
        "weights = chosen / chosen.sum(dim=-1, keepdim=True)",
        "weights = chosen",
        [
            "tests/test_moe.py::test_weights_are_renormalised_and_bias_only_chooses",
            "tests/test_moe.py::test_moe_layer_matches_the_token_loop[2-None]",
            "tests/grading/test_ch08_mixture_of_experts.py::test_top_k_routing",
        ],
    ),
    Mutation(
        "MoE: all-to-all split check removed (gloo returns garbage silently)",
        "minitrain/moe/dispatchers.py",
        "check_splits(send_splits, recv_splits, self.group, device=rows.device)",
        "pass",
        ["tests/test_moe.py::test_disagreeing_splits_fail_on_every_rank_naming_ranks_and_counts"],
    ),
    Mutation(
        "MoE: replicated router gradient not averaged over the expert-parallel group",
        "minitrain/moe/expert_parallel.py",
        "dist.all_reduce(p.grad, group=self.group)",
        "pass",
        ["tests/test_moe.py::test_expert_parallel_equals_the_local_layer[2-1]"],
    ),
    Mutation(
        "MoE: all-to-all backward with the forward's splits (not reversed)",
        "minitrain/moe/all_to_all.py",
        "return (_all_to_all(grad, in_splits, out_splits,",
        "return (_all_to_all(grad, out_splits, in_splits,",
        ["tests/test_moe.py::test_expert_parallel_equals_the_local_layer[4-2]"],
    ),
    Mutation(
        "MoE: load-balancing fraction over tokens, not over the T·k assignments",
        "minitrain/moe/losses.py",
        "f = counts / max(flat.numel(), 1)",
        "f = counts / router_probs.shape[0]",
        ["tests/test_moe.py::test_load_balancing_loss_against_the_formula", "tests/grading/test_ch08_mixture_of_experts.py::test_load_balancing_loss"],
    ),
    Mutation(
        "MoE: aux loss not carried in backward (lost under activation checkpointing)",
        "minitrain/moe/layer.py",
        "if self.aux_loss_in_backward and torch.is_grad_enabled()",
        "if False and torch.is_grad_enabled()",
        [
            "tests/test_moe.py::test_moe_gpt_adds_aux_loss_and_trains",
            "tests/test_moe.py::test_expert_parallel_gpt_with_data_parallel_rest_equals_local[checkpointed]",
        ],
    ),
    Mutation(
        "MoE: expert gradients not divided by the expert-parallel size",
        "minitrain/moe/expert_parallel.py",
        """        for p in self.experts.parameters():
            if p.grad is not None:
                p.grad /= self.world""",
        """        for p in self.experts.parameters():
            pass""",
        ["tests/test_moe.py::test_expert_parallel_equals_the_local_layer[2-2]"],
    ),
    Mutation(
        "bug hunt 7: interleaved warm-up not capped at m*v (m < p)",
        "minitrain/pipeline/schedules.py",
        "            warmup = min(warmup, m * v)\n",
        "",
        [
            "tests/grading/test_ch07_bughunt.py",
            "tests/test_pipeline.py::test_interleaved_runs_for_any_m_and_never_beats_its_formula",
        ],
    ),
    Mutation(
        "bug hunt 8: router gradient summed over the expert-parallel group, not averaged",
        "minitrain/moe/expert_parallel.py",
        "                dist.all_reduce(p.grad, group=self.group)\n                p.grad /= self.world\n",
        "                dist.all_reduce(p.grad, group=self.group)\n",
        ["tests/grading/test_ch08_bughunt.py", "tests/test_moe.py::test_expert_parallel_equals_the_local_layer[2-1]"],
    ),
    Mutation(
        "learner message: choose_segments' budget message no longer says what was returned",
        "tests/grading/test_ch03_checkpointing.py",
        'f"choose_segments(64, 10, 10, budget_bytes={budget}) returned {got}; the fewest "',
        'f"with budget_bytes={budget} the fewest "',
        ["tests/test_wrong_answer_messages.py::test_the_grader_says_what_went_wrong[ch3-choose_segments]"],
    ),
    # issue 26: accumulation dtypes (low precision up to fp32, fp64 stays fp64)
    Mutation(
        "issue 26: pipeline loss sent in the model's dtype into a float64 buffer",
        "minitrain/pipeline/step_messages.py",
        "        loss = torch.stack(state.losses).to(dtype).mean().double()  # exact: fp32 or fp64\n",
        "        loss = torch.stack(state.losses).mean()\n",
        ["tests/test_wide_dtypes.py::test_pipeline_returns_the_same_loss_on_every_stage_in_any_dtype"],
    ),
    Mutation(
        "issue 26: pipeline loss averaged over the micro-batches in the model's dtype",
        "minitrain/pipeline/step_messages.py",
        "loss = torch.stack(state.losses).to(dtype).mean().double()",
        "loss = torch.stack(state.losses).mean().double()",
        ["tests/test_wide_dtypes.py::test_pipeline_returns_the_same_loss_on_every_stage_in_any_dtype"],
    ),
    Mutation(
        "issue 26: vocab-parallel cross-entropy upcast with .float()",
        "minitrain/tensor_parallel/cross_entropy.py",
        "z = logits_shard.to(torch.promote_types(logits_shard.dtype, torch.float32))",
        "z = logits_shard.float()",
        ["tests/test_wide_dtypes.py::test_tensor_parallel_float64_equals_dense"],
    ),
    Mutation(
        "issue 26: FlashAttention tile scores upcast with .float()",
        "minitrain/flash_attention/tiles.py",
        "        k_j, v_j = k[..., j0:j1, :], v[..., j0:j1, :]\n"
        "        s = tile_matmul(q_i, k_j.transpose(-2, -1), acc_dtype) * scale\n",
        "        k_j, v_j = k[..., j0:j1, :], v[..., j0:j1, :]\n"
        "        s = tile_matmul(q_i, k_j.transpose(-2, -1), acc_dtype).float() * scale\n",
        # fp64 takes the fused tiles (issue 33), so only this test runs the readable ones in fp64
        ["tests/test_flash_attention.py::test_readable_tiles_keep_fp64_in_fp64"],
    ),
    Mutation(
        "issue 26: FlashAttention backward's D = rowsum(dO * O) in fp32",
        "minitrain/flash_attention/tiles.py",
        "delta = (do.to(acc) * o.to(acc)).sum(dim=-1)",
        "delta = (do.float() * o.float()).sum(dim=-1)",
        ["tests/test_flash_attention.py::test_readable_tiles_keep_fp64_in_fp64"],  # as above
    ),
    Mutation(
        "issue 26: ring attention merge weights in fp32",
        "minitrain/context_parallel/merge.py",
        "w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)",
        "w_a, w_b = torch.exp(lse_a - m).float(), torch.exp(lse_b - m).float()",
        ["tests/test_wide_dtypes.py::test_ring_attention_and_context_parallel_gpt_float64_equal_one_process"],
    ),
    Mutation(
        "issue 26: context-parallel average loss summed in bf16",
        "minitrain/context_parallel/model.py",
        "value = loss.detach().to(torch.promote_types(loss.dtype, torch.float32), copy=True)",
        "value = loss.detach().clone()",
        ["tests/test_wide_dtypes.py::test_ring_attention_and_context_parallel_gpt_float64_equal_one_process"],
    ),
    Mutation(
        "issue 26: MoE router logits upcast with .float()",
        "minitrain/moe/router.py",
        "logits = logits.to(torch.promote_types(logits.dtype, torch.float32))",
        "logits = logits.float()",
        ["tests/test_wide_dtypes.py::test_moe_router_keeps_float64"],
    ),
    Mutation(
        "issue 26: FSDP clip_grad_norm_ sums the squares in fp32",
        "minitrain/fsdp/clipping.py",
        "acc = torch.promote_types(ref.dtype, torch.float32)",
        "acc = torch.float32",
        ["tests/test_wide_dtypes.py::test_fsdp_clip_grad_norm_float64_equals_torch"],
    ),
    Mutation(
        "issue 26: Triton kernels take float64 and compute it in fp32",
        "minitrain/flash_attention/triton_kernels.py",
        "if torch.float64 in (q.dtype, k.dtype, v.dtype):",
        "if False:",
        ["tests/test_wide_dtypes.py::test_triton_kernels_refuse_float64_instead_of_rounding_it"],
    ),
    # issue 26: random streams under activation checkpointing and in the run checkpoint
    Mutation(
        "checkpoint: the recompute replays torch's generators only, not the modules' streams",
        "minitrain/checkpointing/function.py",
        "    if holders:\n        fn = _Replaying(fn, holders)\n",
        "",
        [
            "tests/test_checkpointing.py::test_recompute_replays_the_streams_of_the_modules_it_runs",
            "tests/test_tensor_parallel.py::test_checkpointing_policies_replay_the_tensor_parallel_dropout_streams",
            "tests/test_pipeline.py::test_checkpointed_tensor_parallel_stages_replay_dropout",
            "tests/test_moe.py::test_router_load_is_counted_once_under_checkpointing",
        ],
    ),
    Mutation(
        "checkpoint: the recompute leaves the streams where it ended, not where the caller was",
        "minitrain/checkpointing/function.py",
        "            for holder, state in zip(self.holders, live):\n                holder.set_state(state)\n",
        "            pass\n",
        [
            "tests/test_checkpointing.py::test_recompute_replays_the_streams_of_the_modules_it_runs",
            "tests/test_tensor_parallel.py::test_checkpointing_policies_replay_the_tensor_parallel_dropout_streams",
        ],
    ),
    Mutation(
        "TP dropout stream: a recompute under sequence parallelism forgets it ran inside the fork",
        "minitrain/tensor_parallel/random.py",
        "        self._inside = state[\"inside\"]\n",
        "",
        [
            "tests/test_tensor_parallel.py::test_checkpointing_policies_replay_the_tensor_parallel_dropout_streams",
            "tests/test_pipeline.py::test_checkpointed_tensor_parallel_stages_replay_dropout[tp+sp]",
        ],
    ),
    # (issue 40 retired "ParallelGPT.load_state: TP dropout's per-rank streams restart from the
    # seed": ParallelGPT's dropout is keyed and draws from no TP stream, so a resume needs none)
    Mutation(
        "MoE: the router's load counted again in the checkpoint's recompute",
        "minitrain/moe/router.py",
        "        self.observed_load.copy_(state[\"observed_load\"])\n",
        "",
        ["tests/test_moe.py::test_router_load_is_counted_once_under_checkpointing"],
    ),
    # issue 26: ZeRO-3 resume, CP with TP + SP, every planner layout, SGD with lr = 1
    Mutation(
        "compose: ZeRO-3 checkpoint of model.state_dict() (views of freed storage)",
        "minitrain/parallel/trainer.py",
        "        if isinstance(self.wrapped, ZeroDataParallel):\n            return {}\n",
        "",
        ["tests/test_train.py::test_zero3_resumes_bit_exactly[dp2-zero3]",
         "tests/test_train.py::test_zero3_resumes_bit_exactly[dp2-tp2-zero3]"],
    ),
    Mutation(
        "compose: SP with CP refused again (the planner's layouts do not build)",
        "minitrain/parallel/parallelize.py",
        'if lo["sequence_parallel"] and (config.seq_len // lo["cp"]) % lo["tp"]:',
        'if lo["sequence_parallel"] and lo["cp"] > 1:',
        ["tests/test_train.py::test_loss_curve_equals_the_single_process"
         "[tp2-cp2-sequence_parallelTrue-microbatches2]",
         "tests/test_planner_layouts.py::test_every_planner_layout_trains_like_one_process[4]"],
    ),
    Mutation(
        "tensor_parallel: SP+CP positions 0..n-1 (the CP shard's positions ignored)",
        TP_APPLY,
        "        pos = split(positions, 0, self.group).clone()\n",
        "        pos = split(torch.arange(len(positions), device=positions.device), 0, self.group)\n",
        ["tests/test_train.py::test_loss_curve_equals_the_single_process"
         "[tp2-cp2-sequence_parallelTrue-microbatches2]"],
    ),
    Mutation(
        "planner: SP for every tp > 1 (TP not dividing a CP rank's positions)",
        "minitrain/parallel/layouts.py",
        "sp = tp > 1 and (seq_len // cp) % tp == 0",
        "sp = tp > 1",
        ["tests/test_planner_layouts.py::"
         "test_planner_proposes_sp_only_where_tp_divides_a_cp_shard_and_no_pipeline_when_tied"],
    ),
    Mutation(
        "mesh: uneven pipeline stages refused (the planner proposes them)",
        "minitrain/parallel/mesh.py",
        "    if config.n_layer < pp:",
        "    if config.n_layer % pp:",
        ["tests/test_mesh.py::test_uneven_pipeline_stages_pass_as_the_planner_proposes_them"],
    ),
    Mutation(
        "tensor_parallel: LayerNorm gradients summed over TP without SP (t times; AdamW cancels)",
        TP_APPLY,
        '("blocks.*.ln_1",          "sequence_norm",  SP)',
        '("blocks.*.ln_1",          "sequence_norm",  ALWAYS)',
        ["tests/test_train.py::test_sgd_lr_1_losses_equal_the_single_process[dp2-tp2-optimizersgd]"],
    ),
    Mutation(
        "tensor parallel plan: a LayerNorm left dense under SP (its gradients not summed)",
        TP_APPLY,
        '    ("blocks.*.ln_2",          "sequence_norm",  SP),\n',
        "",
        [f"{TP_TESTS}::test_forward_loss_and_every_gradient_match_dense[tp+sp-2]",
         "tests/grading/test_ch06_bughunt.py"],
    ),
    Mutation(
        "pipeline: gradients summed, not averaged, over DP (AdamW cancels it)",
        "minitrain/pipeline/step_messages.py",
        "flat /= dist.get_world_size(group)",
        "flat /= 1",
        ["tests/test_train.py::test_sgd_lr_1_losses_equal_the_single_process"
         "[dp2-tp2-pp2-microbatches2-optimizersgd]"],
    ),
    # issue 26: ZeRO-3 / FSDP units when parameters sit in containers
    Mutation(
        "issue 26: stage-3 units from module.children() again (a ModuleList is a unit)",
        "minitrain/zero/units.py",
        "            if isinstance(child, CONTAINERS):\n"
        "                visit(child.children())\n"
        "            else:\n"
        "                out.append(child)\n",
        "            out.append(child)\n",
        [
            "tests/test_sharded_units.py::test_container_models_match_one_process[2]",
            "tests/test_sharded_units.py::test_default_units_are_modules_whose_forward_runs",
        ],
    ),
    Mutation(
        "issue 26: no check of ungathered use (no pre-hook naming the parameter)",
        SHARED,
        "        guard_parameter_use(self, [u for u in self.live_units() if not u.keep_full])\n",
        "",
        [
            "tests/test_sharded_units.py::test_a_parameter_used_while_its_unit_is_not_gathered_is_named[zero]",
            "tests/test_sharded_units.py::test_a_parameter_used_while_its_unit_is_not_gathered_is_named[fsdp]",
        ],
    ),
    Mutation(
        "issue 26: freed parameters stay views of freed memory (no empty tensor)",
        "minitrain/zero/buffers.py",
        "        empty = self.full.new_empty(0)\n        for p in self.params:\n            p.data = empty\n",
        "        pass\n",
        [
            "tests/test_sharded_units.py::test_a_parameter_used_while_its_unit_is_not_gathered_is_named[zero]",
            "tests/test_sharded_units.py::test_a_parameter_used_while_its_unit_is_not_gathered_is_named[fsdp]",
        ],
    ),
    Mutation(
        "issue 26: a parameter read outside its unit's forward is not named in the error",
        SHARED,
        "                note_ungathered(exc, self)\n",
        "                pass\n",
        [
            "tests/test_sharded_units.py::test_a_parameter_used_while_its_unit_is_not_gathered_is_named[zero]",
            "tests/test_sharded_units.py::test_a_parameter_used_while_its_unit_is_not_gathered_is_named[fsdp]",
        ],
    ),
    Mutation(
        "issue 26: a gradient computed from a freed parameter's empty tensor goes unnoticed",
        SHARED,
        "        if param.grad.shape != u.shapes[k]:",
        "        if False:",
        [
            "tests/test_sharded_units.py::test_a_parameter_used_while_its_unit_is_not_gathered_is_named[zero]",
            "tests/test_sharded_units.py::test_a_parameter_used_while_its_unit_is_not_gathered_is_named[fsdp]",
        ],
    ),
    Mutation(
        "issue 26: ZeRO-3 gathers in call order when ranks skip units (rank r: branch r)",
        ZERO,
        "class ZeroDataParallel(OrderedGathers):",
        "class ZeroDataParallel(OrderedGathers.__base__):",
        ["tests/test_sharded_units.py::test_container_models_match_one_process[3]"],
    ),
    # issue 28: learning-rate schedule, resume, dropout, text data, evaluation
    Mutation(
        "issue 28: the schedule is off by one step (step s uses the rate of s + 1)",
        "minitrain/parallel/command.py",
        "            lr = lr_at(step, **schedule)",
        "            lr = lr_at(step + 1, **schedule)",
        ["tests/test_train_schedule.py::test_schedule_one_process_equals_the_formula_and_the_reference"],
    ),
    Mutation(
        "issue 28: warm-up starts at 0 (step 0 wasted)",
        "minitrain/parallel/schedule.py",
        "        return lr * (step + 1) / warmup_steps",
        "        return lr * step / warmup_steps",
        ["tests/test_train_schedule.py::test_lr_at_equals_the_closed_form_at_every_step"],
    ),
    Mutation(
        "issue 28: a resumed run restarts the schedule",
        "minitrain/parallel/command.py",
        "            lr = lr_at(step, **schedule)",
        "            lr = lr_at(step - first, **schedule)",
        ["tests/test_train_schedule.py::test_schedule_reaches_every_optimizer_and_resumes_exactly[dp2-zero1]"],
    ),
    Mutation(
        "issue 28: another --lr on resume is silently ignored (not in the checkpoint's identity)",
        "minitrain/parallel/command.py",
        '"batch_size": args["batch_size"], **schedule_identity(schedule)}',
        '"batch_size": args["batch_size"]}',
        ["tests/test_train_schedule.py::test_resume_with_other_schedule_flags_names_both_values"],
    ),
    Mutation(
        "issue 28: set_lr misses the optimizer a wrapper holds (ZeRO-3's inner optimizer)",
        "minitrain/parallel/evaluation.py",
        '        optimizer = getattr(optimizer, "optimizer", None)',
        "        optimizer = None",
        ["tests/test_train_schedule.py::test_schedule_reaches_every_optimizer_and_resumes_exactly[dp2-zero3]"],
    ),
    Mutation(
        "issue 28: evaluation with dropout on",
        "minitrain/parallel/evaluation.py",
        "    for m in modules:\n        m.eval()\n",
        "    for m in modules:\n        m.train()\n",
        ["tests/test_train_data.py::test_evaluate_is_the_eval_mode_loss_and_keeps_the_rng"],
    ),
    Mutation(
        "issue 28: evaluation consumes the training RNG (run as in training, states not restored)",
        "minitrain/parallel/evaluation.py",
        "    for m in modules:\n        m.eval()\n    try:\n        yield\n    finally:\n"
        "        for m, mode in zip(modules, modes):\n            m.train(mode)\n"
        "        set_rng_state(generators)\n        load_rng_state_dict(model, streams)\n",
        "    yield\n",
        ["tests/test_train_data.py::test_evaluate_is_the_eval_mode_loss_and_keeps_the_rng",
         "tests/test_train_data.py::test_evaluation_leaves_training_unchanged_with_dropout"],
    ),
    Mutation(
        "issue 28: the pipeline's held-out loss is broadcast from the first stage (it holds none)",
        "minitrain/parallel/evaluation.py",
        "    if stage.stage == last:\n        loss = state.losses[0].double()",
        "    if state.losses:\n        loss = state.losses[0].double()\n    last = 0",
        ["tests/test_train_data.py::test_val_loss_equals_one_process_on_every_layout"],
    ),
    Mutation(
        "issue 28: each data-parallel rank draws its own --data batch, not its rows of the global one",
        "minitrain/data.py",
        "            gen = torch.Generator(device=\"cpu\").manual_seed(self.seed * 1_000_003 + step)\n"
        "            starts = torch.randint(",
        "            gen = torch.Generator(device=\"cpu\").manual_seed(self.seed * 1_000_003 + step + rank)\n"
        "            starts = torch.randint(",
        ["tests/test_train_data.py::test_text_batches_are_the_files_bytes",
         "tests/test_train_data.py::test_data_losses_and_val_loss_on_dp2_tp2_equal_one_process"],
    ),
    # issue 31: notebooks as a learner meets them
    Mutation(
        "issue 31: the MoE widget starts at top-1 while notebook 08 trains top-2",
        "minitrain/widgets/ch08_moe.py",
        "def build_moe_widget(world: int = 2, steps: int = 40, top_k: int = 2):",
        "def build_moe_widget(world: int = 2, steps: int = 40, top_k: int = 1):",
        ["tests/test_notebook_structure.py::test_moe_widget_starts_where_notebook_08_trains"],
    ),
    Mutation(
        "issue 28: a TP-replicated LayerNorm's gradient counted t times in the global norm",
        GRAD_NORM,
        "    tp_ok = local_numel < dense_numel or tp_rank == 0\n",
        "    tp_ok = True\n",
        [f"{CLIPPING}::test_layout_equals_one_process_clip_grad_norm[tp2-sp-sgd]"],
    ),
    Mutation(
        "issue 28: DP replicas' identical gradients added to the global norm",
        GRAD_NORM,
        "    dp_ok = dp_sharded or dp_rank == 0\n",
        "    dp_ok = True\n",
        [f"{CLIPPING}::test_layout_equals_one_process_clip_grad_norm[dp2-sgd]"],
    ),
    Mutation(
        "issue 28: ZeRO shards of the gradient not summed (counted on DP rank 0 only)",
        GRAD_NORM,
        "            if owns(numel, dense_numels[name], tp_rank, dp_rank, dp_sharded=True):",
        "            if owns(numel, dense_numels[name], tp_rank, dp_rank, dp_sharded=False):",
        [f"{CLIPPING}::test_layout_equals_one_process_clip_grad_norm[dp2-zero3-sgd]"],
    ),
    Mutation(
        "issue 28: the norm (and the clip) of the scaled fp16 gradient, measured before ÷ S",
        GRAD_NORM,
        "            self.scaler.unscale_(optimizer)  # first: the norm is of the gradient ÷ S\n"
        "            # the whole mesh (group=None): every rank skips, or none does\n"
        "            overflow = self.scaler.all_reduce_found_inf(optimizer, None)\n"
        "        total = global_grad_norm(self.grads)\n",
        "            total = global_grad_norm(self.grads)\n"
        "            self.scaler.unscale_(optimizer)\n"
        "            overflow = self.scaler.all_reduce_found_inf(optimizer, None)\n"
        "        else:\n"
        "            total = global_grad_norm(self.grads)\n",
        [f"{PRECISION_TESTS}::test_fp16_logs_the_scale_and_the_unscaled_norm[fp16-dp2xtp2-clip]"],
    ),
    Mutation(
        "issue 28: fp16's skip decided by each rank alone (one pipeline stage steps, one skips)",
        GRAD_NORM,
        "            overflow = self.scaler.all_reduce_found_inf(optimizer, None)\n",
        "            overflow = self.scaler._found_inf[id(optimizer)]\n",
        [f"{PRECISION_TESTS}::test_fp16_skip_is_decided_by_every_rank"],
    ),
    Mutation(
        "issue 28: the fp32 master weights not restored on resume (bf16 without ZeRO)",
        TRAINER,
        "                for master, saved in zip(self.optimizer.master_params, state[\"masters\"]):\n"
        "                    master.copy_(saved)\n",
        "                pass\n",
        [f"{PRECISION_TESTS}::test_resume_is_bit_exact[dp2]"],
    ),
    Mutation(
        "MoE: Switch top-1 gated by the renormalised weight (1), router untrained by the task",
        "minitrain/moe/router.py",
        "            weights = probs.gather(-1, indices)\n",
        "            pass\n",
        ["tests/test_moe.py::test_switch_top1_router_learns_from_the_task_loss_alone"],
    ),
    Mutation(
        "MoE capstone: expert gradients averaged over dp_cp, not the expert-data-parallel group",
        "minitrain/parallel/parallelize.py",
        'ExpertGradients(params, mesh.group("expert_dp"), dist.get_world_size(dp_cp))',
        "ExpertGradients(params, dp_cp, dist.get_world_size(dp_cp))",
        ["tests/test_train_moe.py::test_moe_layouts_equal_one_process[dp4-ep2-sgd]"],
    ),
    Mutation(
        "MoE capstone: DDP averages (and broadcasts) the expert-parallel experts too",
        "minitrain/parallel/parallelize.py",
        "                                             experts.params if experts else ())",
        "                                             ())",
        ["tests/test_train_moe.py::test_moe_layouts_equal_one_process[dp2-ep2-adamw]"],
    ),
    Mutation(
        "MoE capstone: each rank balances its own tokens (load not counted over dp × cp)",
        "minitrain/parallel/parallelize.py",
        "            layer.router.token_group = dp_cp\n",
        "            pass\n",
        ["tests/test_train_moe.py::test_moe_layouts_equal_one_process[dp2-ep2-sgd]"],
    ),
    Mutation(
        "MoE capstone: aux loss not scaled 1/M with M micro-batches",
        "minitrain/parallel/trainer.py",
        "set_aux_loss_scale(self.model, 1.0 / m)",
        "set_aux_loss_scale(self.model, 1.0)",
        ["tests/test_train_moe.py::test_moe_layouts_equal_one_process[dp2-ep2-microbatches2-sgd]"],
    ),
    # issue 28 (merge): expert-parallel experts in the global gradient norm
    Mutation(
        "issue 28: expert-parallel experts counted on every expert-data-parallel rank in the norm",
        "minitrain/parallel/grad_norm.py",
        "            out.add(param, tp_rank == 0 and expert_rank == 0)\n",
        "            out.add(param, tp_rank == 0)\n",
        ["tests/test_train_moe.py::test_moe_layouts_equal_one_process"],
    ),
    Mutation(
        "pipelined ring forgets this rank's own contribution",
        "minitrain/collectives/pipelined.py",
        "torch.add(own, got, out=own)",
        "own.copy_(got)",
        ["tests/test_allreduce_auto.py::test_pipelined_ring_and_auto_equal_gloo"],
    ),
    Mutation(  # the time is agreed in runtime.slowest_rank_seconds (review h34a moved it there)
        "auto: each rank fits alpha and beta to its own times (ranks may pick different algorithms)",
        "minitrain/runtime/timing.py",
        "    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)\n",
        "",
        ["tests/test_allreduce_auto.py::test_pipelined_ring_and_auto_equal_gloo",
         "tests/test_timing.py"],
    ),
    Mutation(
        "auto: the model's most expensive algorithm is chosen",
        "minitrain/collectives/auto.py",
        "    return min(\n        CANDIDATES,",
        "    return max(\n        CANDIDATES,",
        ["tests/test_allreduce_auto.py::test_choose_algorithm_is_the_cheapest_by_the_formulas",
         "tests/test_allreduce_auto.py::test_choose_algorithm_crossover_at_world_4"],
    ),
    Mutation(
        "auto: the time of the adds recursive doubling cannot hide is left out of the choice",
        "minitrain/collectives/auto.py",
        "        + _reduction_seconds(a, nbytes, world_size, link.gamma),",
        "        + 0.0,",
        ["tests/test_allreduce_auto.py::test_the_reduction_term_makes_two_ranks_use_the_ring_for_large_tensors"],
    ),
    Mutation(
        "fused FlashAttention forward: the accumulator is not rescaled when the max grows",
        "minitrain/flash_attention/fused_tiles.py",
        "acc.mul_(alpha[..., None]).baddbmm_(s, v3[:, j0:j1])",
        "acc.baddbmm_(s, v3[:, j0:j1])",
        ["tests/test_perf_flash.py::test_fused_tiles_match_sdpa_forward_and_backward"],
    ),
    Mutation(
        "fused FlashAttention backward: the causal mask is not applied to P",
        "minitrain/flash_attention/fused_tiles.py",
        "                p.view(bt, g, i1 - i0, j1 - j0).masked_fill_(mask, 0.0)\n",
        "                pass\n",
        ["tests/test_perf_flash.py::test_fused_tiles_match_sdpa_forward_and_backward"],
    ),
    Mutation(
        "fp32 attention silently takes the slow readable tiles",
        "minitrain/flash_attention/tiles.py",
        "    return all(t.dtype == acc_dtype for t in tensors)",
        "    return False",
        ["tests/test_perf_flash.py::test_fp32_runs_the_fused_tiles_and_bf16_the_readable_ones"],
    ),
    Mutation(
        "DDP hook without the no_sync guard",
        DDP,
        "        if not self._sync_enabled:\n            return\n        self._start_sync()",
        "        self._start_sync()",
        [G4 + "::test_no_sync_accumulates_without_communicating"],
    ),
    Mutation(
        "run_action: W with no parked gradient",
        "minitrain/pipeline/executor.py",
        'elif kind == "W" and key in state.pending_w:',
        'elif kind == "W":',
        [G7 + "::test_run_action_trains_like_one_process"],
    ),
    Mutation(
        "online softmax: p @ v uncast",
        "minitrain/flash_attention/tiles.py",
        "tile_matmul(p.to(v.dtype), v, acc.dtype)",
        "(p @ v)",
        [G9 + "::test_bf16_values_accumulate_in_fp32"],
    ),
    Mutation(
        "ring_step waits before computing",
        "minitrain/context_parallel/ring.py",
        '    exchange = Exchange(kv, group, "forward K,V") if send else None\n',
        '    exchange = Exchange(kv, group, "forward K,V") if send else None\n'
        "    if exchange is not None:\n"
        "        exchange.received, exchange.requests = exchange.wait(), []\n",
        [CP_GRADED + "::test_ring_attention_with_your_step_equals_full_attention"],
    ),
    Mutation(
        "merge_attention without unsqueeze",
        "minitrain/context_parallel/merge.py",
        "out = (out_a * w_a.unsqueeze(-1) + out_b * w_b.unsqueeze(-1)) / safe.unsqueeze(-1)",
        "out = (out_a * w_a + out_b * w_b) / (w_a + w_b)",
        [CP_GRADED + "::test_merge_equals_attention_over_the_union"],
    ),
    Mutation(
        "params_per_rank counts a tied head twice",
        "minitrain/parallel/planner.py",
        "(0 if config.tie_weights else v * h // t)",
        "v * h // t",
        [G + "test_ch11_putting_it_together.py::test_params_per_rank_equals_the_real_model"],
    ),
    Mutation(
        "estimate_training_memory: KeyError for an unknown precision",
        "minitrain/memory/formulas.py",
        "    if precision not in BYTES_PER_PARAMETER:\n        raise ValueError(",
        "    if False:\n        raise ValueError(",
        [G + "test_ch01_single_device.py::test_estimate_training_memory_rejects_bad_input"],
    ),
    Mutation(
        "ZeRO-1 step ignores a changed learning rate",
        "minitrain/zero/optimizer.py",
        '            local.update({k: v for k, v in mine.items() if k != "params"})',
        "            pass",
        [G5 + "::test_zero1_step_follows_a_changed_learning_rate"],
    ),
    Mutation(
        "ZeRO-1 step counts the input share's bytes",
        "minitrain/zero/optimizer.py",
        'count_sent("all_gather", gathered.numel() * gathered.element_size(), self.world_size)',
        'count_sent("all_gather", packed.numel() * packed.element_size(), self.world_size)',
        [G5 + "::test_zero1_step_matches_adamw"],
    ),
    Mutation(
        "ZeRO-3 waits for the prefetch",
        ZERO,
        "            self._start_gather(self.units[index + 1])",
        "            self._wait_gather(self.units[index + 1])",
        [G5 + "::test_stage3_pre_forward_gathers"],
    ),
    Mutation(
        "FSDP _post_forward: single-tensor outputs only",
        FSDP,
        "        for t in tensors_requiring_grad(output) if torch.is_grad_enabled() else []:",
        "        for t in [output] if torch.is_grad_enabled() and isinstance(output, torch.Tensor) else []:",
        [G5 + "::test_fsdp_post_forward_with_tuple_outputs"],
    ),
    Mutation(
        "sort_by_expert: unstable sort",
        "minitrain/moe/dispatch.py",
        "torch.argsort(expert_of_row, stable=True)",
        "torch.argsort(expert_of_row)",
        [G + "test_ch08_mixture_of_experts.py::test_sort_by_expert"],
    ),
    Mutation(
        "load_balancing_loss: detached P",
        "minitrain/moe/losses.py",
        "p = router_probs.mean(dim=0)",
        "p = router_probs.detach().mean(dim=0)",
        [G + "test_ch08_mixture_of_experts.py::test_load_balancing_loss"],
    ),
    Mutation(
        "ring_reduce_scatter: one rank returns without copying",
        "minitrain/collectives/ring.py",
        "    if world == 1:\n        flat_out.copy_(flat_in)\n        return output\n",
        "    if world == 1:\n        return output\n",
        [G4 + "::test_ring_reduce_scatter"],
    ),
    Mutation(
        "1F1B warm-up not capped at m",
        "minitrain/pipeline/schedules.py",
        "warmup = min(p - s - 1, m)",
        "warmup = p - s - 1",
        [G7 + "::test_one_f_one_b_order_bubble_and_memory"],
    ),
    Mutation(
        "grader: every test runs every learner version (no blame isolation)",
        "minitrain/course/patching.py",
        "        use = learners if _matches(qualname, exercise) else reference",
        "        use = learners",
        ["tests/test_wrong_answer_messages.py::test_a_mistake_costs_only_its_own_exercise"],
    ),
    Mutation(
        "issue 30: SIGTERM to the launcher kills it at once (no handler: ranks orphaned, no message)",
        "minitrain/runtime/stopping.py",
        "    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}",
        "    old = {s: signal.signal(s, handler) for s in (signal.SIGINT,)}",
        ["tests/test_fault_signals.py::test_sigterm_to_the_main_process_stops_every_rank_and_resume_is_bit_exact"],
    ),
    Mutation(
        "issue 30: no lifeline: ranks outlive a launcher killed with SIGKILL",
        "minitrain/runtime/rank.py",
        "    if lifeline is not None:\n        _leave_when_parent_goes(lifeline)",
        "    if False:\n        _leave_when_parent_goes(lifeline)",
        ["tests/test_fault_signals.py::test_sigkill_of_the_launcher_leaves_no_rank"],
    ),
    Mutation(
        "issue 30: the rendezvous store listens on every interface",
        "minitrain/runtime/launch.py",
        "    store = loopback_store()\n",
        "    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, use_libuv=True)\n",
        ["tests/test_faults.py::test_no_socket_of_a_launch_listens_beyond_loopback"],
    ),
    Mutation(
        "issue 30: checkpoint checksums not verified on load (a flipped byte trains on)",
        ZERO_CKPT,
        "    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:",
        "    if False:",
        ["tests/test_faults.py::test_a_flipped_byte_in_a_rank_file_stops_resume_naming_the_file",
         "tests/test_faults.py::test_a_flipped_byte_stops_resume_in_one_process_too",
         "tests/test_faults.py::test_a_flipped_byte_in_a_zero_shard_is_named"],
    ),
    Mutation(
        "issue 30: a failed save leaves its .partial directory",
        ZERO_CKPT,
        "        if rank == 0:\n            shutil.rmtree(partial, ignore_errors=True)\n        raise",
        "        raise",
        ["tests/test_faults.py::test_a_full_disk_is_one_line_and_leaves_no_partial_directory"],
    ),
    Mutation(
        "issue 30: --steps 0 accepted (exits 0, trains nothing)",
        COMMAND_ERRORS,
        '        ("--steps", args["steps"] >= 1, "must be at least 1"),',
        '        ("--steps", True, "must be at least 1"),',
        ["tests/test_faults.py::test_bad_values_are_refused_in_one_line_naming_the_flag"],
    ),
    Mutation(
        "issue 30: a fresh run writes into another run's checkpoints",
        COMMAND_ERRORS,
        '    if complete and not args.get("overwrite"):',
        "    if False:",
        ["tests/test_faults.py::test_a_fresh_run_into_another_runs_checkpoints_is_refused_unless_overwrite"],
    ),
    Mutation(
        "issue 30: an unwritable --checkpoint-dir found only at the first save",
        COMMAND_ERRORS,
        '    _probe(parser, "--checkpoint-dir", ckpt, ckpt)',
        "    pass",
        ["tests/test_faults.py::test_a_read_only_checkpoint_dir_is_refused_before_step_1"],
    ),
    Mutation(
        "issue 30: the log after a resume repeats the steps after the checkpoint",
        COMMAND_ERRORS,
        '                    if json.loads(line)["step"] < first_step:',
        "                    if True:",
        ["tests/test_faults.py::test_the_log_after_a_resume_holds_each_step_once"],
    ),
    Mutation(
        "issue 30: a CheckpointError under the launcher printed with the rank's traceback",
        COMMAND_ERRORS,
        "        if exc.error_type in EXPECTED:",
        "        if False:",
        ["tests/test_faults.py::test_a_flipped_byte_in_a_rank_file_stops_resume_naming_the_file"],
    ),
    Mutation(
        "issue 30: tqdm writes its frames when stderr is not a terminal (and leaks a semaphore)",
        "minitrain/parallel/command.py",
        " and sys.stderr.isatty():",
        ":",
        ["tests/test_faults.py::test_a_nproc_run_ends_without_warnings_or_progress_frames"],
    ),
    Mutation(
        "issue 30: grading the untouched broadcast stub blames a send to itself",
        "tests/grading/test_ch00_point_to_point.py",
        "        except NotImplementedError:  # the untouched stub: \"not written yet\", not a send's fault\n            raise\n",
        "",
        ["tests/test_faults.py::test_grading_the_untouched_broadcast_stub_says_not_written_yet"],
    ),
    Mutation(
        "ZeRO flat buffer without device",
        "minitrain/zero/buffers.py",
        "self.full = torch.zeros(self.padded, dtype=ref.dtype, device=ref.device)",
        "self.full = torch.zeros(self.padded, dtype=ref.dtype)",
        ["tests/test_device_canary.py::test_step_gives_the_same_numbers_under_the_canary[ZeRO-3]"],
    ),
    Mutation(
        "loss scaler found-inf flag on the CPU",
        "minitrain/precision/loss_scaling.py",
        "flag = torch.tensor([float(self._found_inf[key])], device=device)",
        "flag = torch.tensor([float(self._found_inf[key])])",
        ["tests/test_device_canary.py::test_step_gives_the_same_numbers_under_the_canary"
         "[ZeRO-3-bf16-loss-scaler]"],
    ),
    Mutation(
        "pipeline shape header without device",
        "minitrain/pipeline/messages.py",
        "header = torch.zeros(HEADER, dtype=torch.int64, device=state.device)",
        "header = torch.zeros(HEADER, dtype=torch.int64)",
        ["tests/test_device_canary.py::test_step_gives_the_same_numbers_under_the_canary"
         "[PipelineStage-1F1B]"],
    ),
    Mutation(
        "tensor-parallel column shard without a device",
        "minitrain/tensor_parallel/layers.py",
        "self.weight = nn.Parameter(torch.empty(self.local_out, in_features, **new))",
        "self.weight = nn.Parameter(torch.empty(self.local_out, in_features))",
        ["tests/test_device_canary.py::test_step_gives_the_same_numbers_under_the_canary[TP-SP]"],
    ),
    # issue 33 (merge): the fused tiles and ring attention
    Mutation(
        "issue 33: the fused backward negates the caller's logsumexp in place (ring attention's later blocks)",
        "minitrain/flash_attention/fused_tiles.py",
        "_rows(lse4, i0, i1).neg(),",
        "_rows(lse4, i0, i1).neg_(),",
        ["tests/test_perf_flash.py::test_the_fused_backward_leaves_its_inputs_untouched",
         "tests/test_context_parallel.py::test_outputs_and_gradients_equal_full_attention"],
    ),
    Mutation(
        "issue 29: the MoE router's copy starts its aux loss on the default device",
        "minitrain/moe/router.py",
        '"aux_loss": torch.zeros((), device=self.gate.weight.device),',
        '"aux_loss": torch.zeros(()),',
        ["tests/test_device_canary.py::test_step_gives_the_same_numbers_under_the_canary"
         "[expert-parallel-MoE]",
         "tests/test_device_canary.py::test_moe_layer_is_built_on_its_device"],
    ),
    Mutation(
        "issue 29: the all-to-all split check's tensor on the CPU (NCCL gets a CPU tensor)",
        "minitrain/moe/all_to_all.py",
        "dtype=torch.long, device=device)",
        "dtype=torch.long)",
        ["tests/test_device_canary.py::test_step_gives_the_same_numbers_under_the_canary"
         "[expert-parallel-MoE]"],
    ),
    Mutation(
        "issue 29: an expert weight without device",
        "minitrain/moe/experts.py",
        "self.w_in = nn.Parameter(torch.empty(num_experts, d_model, d_ff, **kw))",
        "self.w_in = nn.Parameter(torch.empty(num_experts, d_model, d_ff))",
        ["tests/test_device_canary.py::test_moe_layer_is_built_on_its_device"],
    ),
    Mutation(
        "issue 29: the command's MFU against the fp32 peak whatever --precision",
        "minitrain/parallel/command.py",
        'PRECISIONS[args.get("precision", "fp32")] or torch.float32',
        "torch.float32",
        ["tests/test_command_mfu.py::test_mfu_uses_the_devices_peak_in_the_compute_dtype"],
    ),
    Mutation(
        "issue 29: the Markov chain's transition matrix without device",
        "minitrain/data.py",
        'P = torch.zeros(vocab_size, vocab_size, dtype=torch.float64, device="cpu")',
        "P = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)",
        ["tests/test_device_canary.py::test_data_is_generated_on_the_cpu_by_name[canary]"],
    ),
    # issue 33: tp bench side by side with torch's parallelize_module
    Mutation(
        "issue 33: tp bench's torch plan leaves attention unsharded (right numbers, not the same work)",
        "minitrain/bench/tp_peer.py",
        '            f"{b}.attn.q_proj": ColwiseParallel(),  # this rank\'s heads (whole heads: see above)\n'
        '            f"{b}.attn.k_proj": ColwiseParallel(),\n'
        '            f"{b}.attn.v_proj": ColwiseParallel(),\n'
        '            f"{b}.attn.out_proj": RowwiseParallel(output_layouts=seq),\n',
        "",
        ["tests/test_bench_tp_peer.py::test_minitrain_tp_and_torch_tp_train_to_the_same_parameters"
         "[TP]"],
    ),
    Mutation(
        "issue 33: tp bench's torch model from other initial weights",
        "minitrain/bench/tp_peer.py",
        "theirs = parallelize_module(copy.deepcopy(dense), mesh,",
        "theirs = parallelize_module(GPT(GPTConfig(**config)), mesh,",
        ["tests/test_bench_tp_peer.py::test_minitrain_tp_and_torch_tp_train_to_the_same_parameters"
         "[TP]"],
    ),
    Mutation(
        "issue 33: the pipeline's last stage backpropagates the sum over micro-batches",
        "minitrain/pipeline/executor.py",
        "out = loss / state.num_microbatches",
        "out = loss",
        ["tests/test_bench_pipeline_peer.py"],
    ),
    Mutation(
        "issue 33: the pipeline pairs micro-batches with another micro-batch's targets",
        "minitrain/pipeline/executor.py",
        "[t.clone() for t in targets.chunk(m)], m,",
        "[t.clone() for t in targets.chunk(m)][::-1], m,",
        ["tests/test_bench_pipeline_peer.py"],
    ),
    Mutation(
        "issue 33: DataParallel's overlapped buckets sum the gradients instead of averaging",
        DDP,
        "torch.div(param.grad.reshape(-1), self.world_size, out=bucket.view(k))",
        "bucket.view(k).copy_(param.grad.reshape(-1))",
        ["tests/test_bench_ddp_peer.py"],
    ),
    # issue 33: make test's browser pass checks outputs at two threads (nbval's second pass)
    Mutation(
        "issue 33: the browser pass's output check compares nothing",
        "tests/browser/notebook_outputs.py",
        "        if want_fields != got_fields:\n",
        "        if False:\n",
        ["tests/browser/test_notebook_outputs.py::test_a_different_number_is_reported_naming_the_cell"],
    ),
    Mutation(
        "issue 33: the browser pass's output check ignores nbval's sanitizing",
        "tests/browser/notebook_outputs.py",
        "                    fields[field].append(_sanitize(v, patterns))\n",
        "                    fields[field].append(v)\n",
        ["tests/browser/test_notebook_outputs.py::"
         "test_markers_split_streams_sanitized_text_and_images_are_not_reported"],
    ),
    # issue h34a: review: one timing helper, one comparison helper, files under 300 lines
    Mutation(
        "h34a: slowest_rank_seconds starts each rank's clock without waiting for the others",
        "minitrain/runtime/timing.py",
        "    dist.barrier(group=group)\n    start = device_clock(device)\n",
        "    start = device_clock(device)\n",
        ["tests/test_timing.py"],
    ),
    Mutation(
        "h34a: python -m minitrain.bench lists the *_peer sections as benchmarks",
        "minitrain/bench/__main__.py",
        ' and not m.name.endswith("_peer")',
        "",
        ["tests/test_shared_helpers.py::test_bench_lists_the_benchmarks_not_their_peer_sections"],
    ),
    Mutation(
        "issue 33: the forkserver does not preload torch._dynamo (every rank imports it)",
        "minitrain/runtime/launch.py",
        '_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "cloudpickle",\n',
        '_PRELOAD = ["torch", "torch.distributed", "cloudpickle",\n',
        ["tests/test_launch.py::test_ranks_start_with_torch_dynamo_loaded_and_import_techniques_afresh"],
    ),
    Mutation(
        "issue 33: the forkserver preloads a technique (a learner's edit would not run)",
        "minitrain/runtime/launch.py",
        '            "minitrain.runtime.launch", "minitrain.runtime.rank"]\n',
        '            "minitrain.runtime.launch", "minitrain.runtime.rank", "minitrain.ddp"]\n',
        ["tests/test_launch.py::test_ranks_start_with_torch_dynamo_loaded_and_import_techniques_afresh"],
    ),
    Mutation(
        "issue 33: a rank does not freeze what the forkserver imported (gc walks it)",
        "minitrain/runtime/rank.py",
        "    gc.freeze()\n",
        "",
        ["tests/test_launch.py::test_ranks_start_with_torch_dynamo_loaded_and_import_techniques_afresh"],
    ),
    Mutation(
        "issue 33: replicas' start-up broadcast copies every tensor back from the chunk's start",
        "minitrain/ddp/replicas.py",
        "        offset += t.numel()\n",
        "        pass\n",
        ["tests/test_ddp.py::test_replicas_start_equal_in_one_message_per_dtype_and_chunk"],
    ),
    Mutation(
        "issue 33: replicas' start-up broadcast sends one message per tensor again",
        "minitrain/ddp/replicas.py",
        "            if filled[kind] >= BROADCAST_CHUNK_BYTES:",
        "            if True:",
        ["tests/test_ddp.py::test_replicas_start_equal_in_one_message_per_dtype_and_chunk"],
    ),
    Mutation(
        "issue 33: an untraced DDP all-reduce still stamps its end from a callback on gloo's thread",
        "minitrain/ddp/gradient_bucket.py",
        "    if not trace.enabled():\n",
        "    if False:\n",
        ["tests/test_ddp.py::test_an_untraced_all_reduce_runs_no_python_on_the_communication_thread"],
    ),
    Mutation(
        "issue 33: DDP's used flags, set as gradients arrive, never reach the all-reduce",
        "minitrain/ddp/gradient_bucket.py",
        "        self._used_views[k].fill_(1.0)\n",
        "        pass\n",
        [f"{COMPOSE}::test_ddp_unused_parameters_match_torch_ddp[2-torch]"],
    ),
    Mutation(
        "issue 33: browser pages share JupyterLab's default workspace (each restores the notebooks before it)",
        "tests/browser/jupyter_browser.py",
        'url = self.lab.page_url(f"lab/workspaces/{workspace}/tree/{self.path}")',
        'url = self.lab.page_url(f"lab/tree/{self.path}")',
        ["tests/browser/test_browser_check_catches_breakage.py::test_a_new_page_opens_its_notebook_alone"],
    ),
    Mutation(
        "issue 40: expert-parallel experts' averaged gradients never reach their fp32 masters",
        "minitrain/parallel/parallelize.py",
        "        experts.deliver_to(optimizer)  # the experts' averages to their fp32 masters\n",
        "        pass\n",
        ["tests/test_train_moe.py::test_expert_parallel_experts_train_in_low_precision[bf16]"],
    ),
    Mutation(
        "issue 40: the global batch sharded rank first (a rank's micro-batch j is not one process's)",
        "minitrain/parallel/trainer.py",
        'starts = torch.arange(m, device="cpu") * (b // m) + r * per',
        'starts = r * (b // d) + torch.arange(m, device="cpu") * per',
        ["tests/test_train_moe.py::test_moe_layouts_equal_one_process[dp2-tp2-ep2-microbatches2-sgd]"],
    ),
    # issue 40, item 5: the command's tracebacks, silent acceptances, unclear messages, NaN
    Mutation(
        "issue 40: a non-finite loss trains on to the end (exit 0, NaN weights checkpointed)",
        "minitrain/parallel/command.py",
        "            if problem:\n",
        "            if False:\n",
        ["tests/test_train_refusals.py::test_a_non_finite_loss_stops_one_process_in_one_line",
         "tests/test_train_refusals.py::test_a_non_finite_loss_stops_every_rank_at_its_step_in_one_line"],
    ),
    Mutation(
        "issue 40: the fp16 run goes on after the loss scaler has given up",
        "minitrain/parallel/command_errors.py",
        "    if scale is not None and scale < MIN_LOSS_SCALE:",
        "    if False:",
        ["tests/test_train_refusals.py::test_fp16_stops_when_the_loss_scaler_gives_up"],
    ),
    Mutation(
        "issue 40: the JSON log writes NaN (not JSON) for a non-finite loss",
        "minitrain/parallel/command_errors.py",
        "    return json.dumps(clean, allow_nan=False)",
        "    return json.dumps(record)",
        ["tests/test_train_refusals.py::test_divergence_rules_and_strict_json",
         "tests/test_train_refusals.py::test_a_non_finite_loss_stops_one_process_in_one_line"],
    ),
    Mutation(
        "issue 40: the composition check runs only inside the ranks (a traceback per rank)",
        "minitrain/parallel/command.py",
        "    check_composition_before_launch(parser, args)  # else a traceback on every rank\n",
        "",
        ["tests/test_train_refusals.py::test_compositions_are_refused_before_launch"],
    ),
    Mutation(
        "issue 40: MoE flags without --moe-experts accepted silently",
        "minitrain/parallel/command_checks.py",
        '    if moe_given and not args["moe_experts"]:',
        "    if False:",
        ["tests/test_train_refusals.py::test_silent_acceptances_are_refused_naming_the_flag[top-k-without-experts]"],
    ),
    Mutation(
        "issue 40: --min-lr above --lr accepted (the cosine rises)",
        "minitrain/parallel/command_checks.py",
        "    if min_lr_given and min_lr > lr:",
        "    if False:",
        ["tests/test_train_refusals.py::test_silent_acceptances_are_refused_naming_the_flag[min-lr-above-lr]"],
    ),
    Mutation(
        "issue 40: a resume on another --data file or --clip-grad-norm accepted silently",
        "minitrain/parallel/command.py",
        "    identity.update(run_identity(args))  # --data (name, SHA-256) and --clip-grad-norm\n",
        "",
        ["tests/test_train_refusals.py::test_resume_on_another_data_file_or_clip_is_refused"],
    ),
    Mutation(
        "issue 40: a seed mismatch on resume does not name --seed (says 'use the same layout')",
        "minitrain/parallel/run_checkpoint.py",
        'FLAG_OF = {"seed": "--seed", "batch_size": "--batch-size"}',
        "FLAG_OF = {}",
        ["tests/test_train_refusals.py::test_seed_model_and_layout_mismatches_name_the_flag"],
    ),
    # issue 40: 16-bit tiles' scores and products accumulated in fp32, as tensor cores do
    Mutation(
        "issue 40: flash forward's tile scores in the input dtype again",
        "minitrain/flash_attention/tiles.py",
        "        s = tile_matmul(q_i, k_j.transpose(-2, -1), acc_dtype) * scale\n",
        "        s = (q_i @ k_j.transpose(-2, -1)).to(acc_dtype) * scale\n",
        ["tests/test_flash_attention.py::test_16_bit_scores_accumulate_in_fp32_as_accurate_as_sdpa",
         G9 + "::test_bf16_scores_accumulate_in_fp32"],
    ),
    Mutation(
        "issue 40: flash backward's tile scores in the input dtype again",
        "minitrain/flash_attention/tiles.py",
        "    s = tile_matmul(q_i, k_j.transpose(-2, -1), acc_dtype) * scale\n    p = torch.exp(",
        "    s = (q_i @ k_j.transpose(-2, -1)).to(acc_dtype) * scale\n    p = torch.exp(",
        ["tests/test_flash_attention.py::test_16_bit_scores_accumulate_in_fp32_as_accurate_as_sdpa",
         G9 + "::test_bf16_tile_gradients_accumulate_in_fp32"],
    ),
    Mutation(
        "issue 40: online softmax's P V rounded to bf16 before the fp32 accumulator",
        "minitrain/flash_attention/tiles.py",
        "tile_matmul(p.to(v.dtype), v, acc.dtype)",
        "(p.to(v.dtype) @ v).to(acc.dtype)",
        [G9 + "::test_the_product_with_bf16_v_is_accumulated_in_fp32"],
    ),
    # issue 40, item 3: dropout keyed by (seed, step, layer, site, global coordinates)
    Mutation(
        "issue 40: dropout keyed by the local row instead of the global one",
        "minitrain/dropout.py",
        "for r in rows.to(idx.device).chunk(m)]",
        "for r in torch.arange(len(rows), device=idx.device).chunk(m)]",
        [DROP + "[dp2]", DROP + "[dp2-adamw]", DROP + "[moe-dp2-ep2]"],
    ),
    Mutation(
        "issue 40: dropout's layer index made local to a pipeline stage",
        "minitrain/pipeline/partition.py",
        "        self.blocks = nn.ModuleList(gpt.blocks[i] for i in indices)\n",
        "        self.blocks = nn.ModuleList(gpt.blocks[i] for i in indices)\n"
        "        for j, block in enumerate(self.blocks):\n"
        "            block.layer = block.attn.layer = j\n",
        [DROP + "[pp2-gpipe]", DROP + "[pp2-1f1b-full]", DROP + "[pp2xtp2+sp-1f1b-full]"],
    ),
    Mutation(
        "issue 40: dropout's head index made local to a tensor-parallel rank",
        "minitrain/tensor_parallel/apply.py",
        "attn.first_head = rank * (config.n_head // t)",
        "attn.first_head = 0",
        [DROP + "[tp2]", DROP + "[tp2+sp]", DROP + "[moe-tp2]"],
    ),
    Mutation(
        "issue 40: sequence parallelism's dropout positions taken from rank 0's slice",
        "minitrain/dropout.py",
        "residual = positions.chunk(ranks)[rank] if ranks > 1 else None",
        "residual = positions.chunk(ranks)[0] if ranks > 1 else None",
        [DROP + "[tp2+sp]", DROP + "[tp2+sp-full]", DROP + "[pp2xtp2+sp-1f1b-full]"],
    ),
    Mutation(
        "issue 40: a recompute draws under the live dropout key, not its forward's",
        "minitrain/dropout.py",
        "    def set_state(self, state: DropoutKey | None) -> None:\n        self.current = state\n",
        "    def set_state(self, state: DropoutKey | None) -> None:\n        pass\n",
        [DROP + "[pp2-gpipe-full]", DROP + "[pp2-1f1b-full]", DROP + "[pp2xtp2+sp-1f1b-full]"],
    ),
    Mutation(
        "issue 40: the pipeline keys every micro-batch with the first one's rows",
        "minitrain/pipeline/executor.py",
        "self.model.dropout_keys.current = state.dropout_keys[mb]",
        "self.model.dropout_keys.current = state.dropout_keys[0]",
        [DROP + "[pp2-gpipe]", DROP + "[pp2-1f1b-full]"],
    ),
    Mutation(
        "issue 40: context parallelism's attention dropout at local query positions",
        "minitrain/context_parallel/gathered.py",
        "site.at_positions(q_pos, k_pos)",
        "site.at_positions(torch.arange(len(q_pos), device=q.device), k_pos)",
        [DROP + "[cp2]", DROP + "[dp2xcp2]"],
    ),
    Mutation(
        "issue 40: the dropout mask hashes the element's local index, not its coordinate",
        "minitrain/dropout.py",
        "        c = c.to(torch.int64).reshape(",
        "        c = torch.arange(len(c), device=c.device).reshape(",
        ["tests/test_dropout_layouts.py::test_a_slice_of_the_mask_is_the_mask_of_the_sliced_coordinates",
         DROP + "[dp2]", DROP + "[tp2]"],
    ),
    Mutation(
        "issue 40: the step left out of the dropout key (every step the same masks)",
        "minitrain/dropout.py",
        "(k.seed, k.step, self.layer, SITES[self.name])",
        "(k.seed, 0, self.layer, SITES[self.name])",
        ["tests/test_dropout_layouts.py::test_masks_are_independent_across_steps_layers_sites_and_rows",
         "tests/test_dropout_layouts.py::test_a_keyed_gpt_ignores_the_generator_and_numbers_its_layers_globally"],
    ),
    Mutation(
        "issue 40: ZeRO-3's backward pass begins only at the output's hook (a branch that is the output gathers first)",
        "minitrain/zero/gather_order.py",
        "        self._backward_begins(None)\n        super()._pre_backward(index)\n",
        "        super()._pre_backward(index)\n",
        ["tests/test_zero_branches.py::test_per_rank_branches_match_one_process[2]",
         "tests/test_zero_branches.py::test_per_rank_branches_match_one_process[3]"],
    ),
    Mutation(
        "issue 40: ZeRO-3 re-gathers a prefetched unit whose turn in the pass is over (one rank alone)",
        "minitrain/zero/gather_order.py",
        "            if (i - self._cursor) * step < 0 and u is not self._needed:\n",
        "            if False:\n",
        ["tests/test_zero_branches.py::test_per_rank_branches_match_one_process[2]",
         "tests/test_zero_branches.py::test_per_rank_branches_match_one_process[3]"],
    ),
    Mutation(
        "issue 40: a run checkpoint holds the CPU generator only (not the device's)",
        "minitrain/parallel/trainer.py",
        'return [] if self.device.type == "cpu" else [self.device]',
        "return []",
        ["tests/test_train_generators.py"],
    ),
    Mutation(
        "issue 40: under ZeRO a run checkpoint leaves the module's buffers out",
        "minitrain/parallel/trainer.py",
        "                    b.copy_(state.get(\"buffers\", {}).get(name, b))\n",
        "                    pass\n",
        ["tests/test_train_generators.py"],
    ),
    Mutation(
        "issue 40: a router counts its load in every balancing mode (it grows for ever)",
        "minitrain/moe/router.py",
        'if self.training and self.balancing == "bias":',
        "if self.training:",
        ["tests/test_moe.py::test_load_is_counted_only_for_the_bias_that_reads_it"],
    ),
    Mutation(
        "issue 40: gpt_num_params counts a dense MLP where the config has experts",
        "minitrain/model.py",
        "        mlp = config.moe_experts * (h + 2 * h * f + f + h)\n",
        "        pass\n",
        ["tests/test_model.py::test_num_params_formula_matches_numel",
         "tests/grading/test_ch01_single_device.py::test_gpt_num_params"],
    ),
    Mutation(
        "issue 41: a rank's file descriptors 1 and 2 reach the caller's stream unlabelled",
        "minitrain/runtime/rank.py",
        "    capture_file_descriptors(descriptors_file)\n",
        "    pass\n",
        ["tests/test_launch.py::test_what_a_rank_writes_to_its_file_descriptors_is_relayed_with_its_rank"],
    ),
    Mutation(
        "issue 41: a one-process training run makes a gloo-only group (a GPU node trains on its CPU)",
        "minitrain/parallel/command.py",
        "    backend = default_backend(1)\n",
        '    backend = "gloo"\n',
        ["tests/test_train_generators.py::test_a_one_process_run_asks_for_the_machines_backend"],
    ),
    # issue 40, item 2, FSDP: a different branch per rank (branches before the trunk; the root
    # needed again in backward while the branch's output is the model's)
    Mutation(
        "issue 40: FSDP frees a unit that has not run yet (branches first: a second gather of one rank's)",
        "minitrain/fsdp/gathers.py",
        '        if self._pass == "forward" and not_run and u.state != "free":\n',
        "        if False:\n",
        ["tests/test_fsdp_branches.py::test_per_rank_branches_match_one_process[2]",
         "tests/test_fsdp_branches.py::test_per_rank_branches_match_one_process[3]"],
    ),
    Mutation(
        "issue 40: FSDP's backward begins at a branch's hook without the root and the last unit",
        "minitrain/fsdp/gathers.py",
        "        self._backward_begins(None)\n",
        "        pass\n",
        ["tests/test_fsdp_branches.py::test_per_rank_branches_match_one_process[2]"],
    ),
    Mutation(
        "issue 40: FSDP gathers a parked unit again when it runs after all (one rank's collective)",
        "minitrain/fsdp/gathers.py",
        "        if u is not None and id(u) in self._parked:  # it runs after all: its data is here\n",
        "        if False:\n",
        ["tests/test_fsdp_branches.py::test_per_rank_branches_match_one_process[2]"],
    ),
    Mutation(
        "issue 40: FSDP keeps a parked unit's buffer after the forward ends",
        "minitrain/fsdp/gathers.py",
        "            self._release_parked([u])\n            return\n",
        "            return\n",
        ["tests/test_fsdp_branches.py::test_per_rank_branches_match_one_process[2]"],
    ),
    Mutation(
        "issue 41: Triton's mode read from TRITON_INTERPRET, not chosen per call from the tensors' device",
        "minitrain/runtime/triton_modes.py",
        'return _load(module_name, path, interpret=torch.device(device).type == "cpu")',
        'return _load(module_name, path, interpret=os.environ.get("TRITON_INTERPRET") == "1")',
        ["tests/test_device_helpers.py::test_triton_mode_follows_the_tensors_device_not_the_environment"],
    ),
    # issue 41: the strict point-to-point canary (NCCL's semantics on the CPU) and the exchanges
    Mutation(
        "issue 41: strict p2p: a send completes before its receiver's stream reaches the receive",
        "minitrain/runtime/strict_stream.py",
        '                          "has not reached the matching send")\n            work.wait()\n',
        '                          "has not reached the matching send")\n'
        '            if op.kind == "recv":  # a send done once posted: buffered, as gloo\n'
        "                work.wait()\n",
        ["tests/test_strict_p2p.py::test_nccl_semantics_under_the_canary_and_gloo_without"],
    ),
    Mutation(
        "issue 41: strict p2p: batch_isend_irecv runs each operation as its own group",
        "minitrain/runtime/strict_p2p.py",
        "    return stream.submit(ops)\n",
        "    return [work for op in ops for work in stream.submit([op])]\n",
        ["tests/test_strict_p2p.py::test_nccl_semantics_under_the_canary_and_gloo_without"],
    ),
    Mutation(
        "issue 41: launch no longer hands MINITRAIN_P2P=strict to its ranks",
        "minitrain/runtime/launch.py",
        "registered_initializers() + strict_p2p_initializers(timeout)",
        "registered_initializers()",
        ["tests/test_strict_p2p.py::test_irecv_then_isend_fails_bounded_and_named_under_the_canary"],
    ),
    Mutation(
        "issue 41: init_from_env (torchrun) ignores MINITRAIN_P2P=strict",
        "minitrain/runtime/rank.py",
        "    install_from_environment()  # MINITRAIN_P2P=strict: NCCL's point-to-point semantics\n",
        "",
        ["tests/test_strict_p2p.py::test_torchrun_path_installs_from_its_own_environment"],
    ),
    Mutation(
        "issue 41: exchange back to irecv then isend (a receive blocking its own send on NCCL)",
        "minitrain/collectives/exchange.py",
        "    ops = []\n    if recv.numel():\n        ops.append(dist.P2POp(dist.irecv, recv, src, group))\n"
        "    if send.numel():\n        ops.append(dist.P2POp(dist.isend, send, dst, group))\n"
        "        _count(send)\n    for request in dist.batch_isend_irecv(ops) if ops else ():\n"
        "        request.wait()\n",
        "    requests = []\n    if recv.numel():\n        requests.append(dist.irecv(recv, src, group=group))\n"
        "    if send.numel():\n        requests.append(dist.isend(send, dst, group=group))\n"
        "        _count(send)\n    for request in requests:\n        request.wait()\n",
        ["tests/test_strict_p2p.py::test_collectives_and_ddp_equal_torch_under_the_canary[2]"],
    ),
    Mutation(
        "issue 41: the pipelined ring issues a step's receive and send as two groups",
        "minitrain/collectives/pipelined.py",
        "        works = dist.batch_isend_irecv(ops) if ops else []\n",
        "        works = [w for op in ops for w in dist.batch_isend_irecv([op])]\n",
        ["tests/test_strict_p2p.py::test_collectives_and_ddp_equal_torch_under_the_canary[2]"],
    ),
    Mutation(
        "issue 41: the pipeline's loss receive posted before the step's first action under NCCL's semantics",
        "minitrain/pipeline/step_messages.py",
        "             and not strict_p2p.installed())",
        ")",
        ["tests/test_strict_p2p.py::test_gpipe_under_the_canary"],
    ),
    Mutation(
        "issue 41: ring attention sends and receives as two calls (a cycle on NCCL's in-order streams)",
        "minitrain/context_parallel/ring.py",
        "        self.requests = dist.batch_isend_irecv([\n",
        "        self.requests = (lambda ops: [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops])([\n",
        ["tests/test_strict_p2p.py::test_ring_attention_under_the_canary[2]"],
    ),
    # issue 41: MoE parts on get_device() unless told (issue 29), their callers' tokens there too;
    # DDP's flags on the device
    Mutation(
        "issue 41: MoE parts built on torch's default device, not get_device()",
        "minitrain/moe/experts.py",
        '    return {"device": torch.device(device) if device is not None else get_device(),\n',
        '    return {"device": device,\n',
        ["tests/test_moe_devices.py::test_a_layer_built_without_device_lives_on_get_device",
         "tests/test_device_canary.py::test_moe_layer_is_built_on_its_device[MINITRAIN_DEVICE]"],
    ),
    Mutation(
        "issue 41: the MoE tests draw their tokens on the CPU and leave them there",
        "tests/test_moe.py",
        '    return torch.randn(*shape, generator=generator, device="cpu").to(get_device())\n',
        '    return torch.randn(*shape, generator=generator, device="cpu")\n',
        ["tests/test_moe_devices.py::test_the_moe_tests_put_their_tokens_on_get_device"],
    ),
    Mutation(
        "issue 41: chapter 8's graded tests draw their tokens on the CPU and leave them there",
        "tests/grading/test_ch08_mixture_of_experts.py",
        '    return torch.randn(T, d, generator=gen, device="cpu").to(get_device())\n',
        '    return torch.randn(T, d, generator=gen, device="cpu")\n',
        ["tests/test_moe_devices.py::test_the_chapter_8_graded_tests_put_their_tokens_on_get_device"],
    ),
    Mutation(
        "issue 41: chapter 8's bug hunt draws its tokens on the CPU and leaves them there",
        "tests/grading/test_ch08_bughunt.py",
        '    return torch.randn(T, D, generator=gen, device="cpu").to(get_device())\n',
        '    return torch.randn(T, D, generator=gen, device="cpu")\n',
        ["tests/test_moe_devices.py::test_the_chapter_8_graded_tests_put_their_tokens_on_get_device"],
    ),
    Mutation(
        "issue 41: notebook 08's expert-parallel cell passes CPU tokens to its layers",
        "notebooks/08_mixture_of_experts.ipynb",
        'manual_seed(r), device=\\"cpu\\").to(get_device())\\n",',
        'manual_seed(r), device=\\"cpu\\")\\n",',
        ["tests/test_moe_devices.py::test_notebook_08_puts_its_tokens_where_its_layers_are"],
    ),
    Mutation(
        "issue 41: expert parallelism's split check on get_device(), not the rows' device",
        "minitrain/moe/dispatchers.py",
        "check_splits(send_splits, recv_splits, self.group, device=rows.device)",
        "check_splits(send_splits, recv_splits, self.group)",
        ["tests/test_moe_devices.py::"
         "test_expert_parallel_built_with_device_computes_there_whatever_get_device_says"],
    ),
    Mutation(
        "issue 41: a DDP bucket launch copies host-side flags into the buffer",
        "minitrain/ddp/gradient_bucket.py",
        '        if communication == "torch":\n',
        "        self.used.copy_(torch.tensor([1.0] * len(self.params), dtype=self.used.dtype,\n"
        "                                     device=self.used.device))\n"
        '        if communication == "torch":\n',
        ["tests/test_ddp_bucket_flags.py::test_a_bucket_launch_copies_no_host_flags_in"],
    ),
    Mutation(
        "issue 41: a pipeline tick's group posted after the action that starts at that tick",
        "minitrain/pipeline/messages.py",
        "            while ticks and ticks[0] <= start:",
        "            while ticks and ticks[0] < start:",
        ["tests/test_strict_p2p.py::test_every_schedule_equals_one_process_under_the_canary"],
    ),
    Mutation(
        "issue 41: a pipeline message received in the group after its tick's (NCCL order broken)",
        "minitrain/pipeline/messages.py",
        "                groups[dst].setdefault(end, []).append((\"recv\", s, message))",
        "                groups[dst].setdefault(end + 1, []).append((\"recv\", s, message))",
        ["tests/test_strict_p2p.py::"
         "test_the_pipeline_plan_runs_under_nccl_semantics_and_gloo_style_posting_does_not"],
    ),
    Mutation(
        "issue 41: a collective's end stamped by the host clock in its future's callback (NCCL: at enqueue)",
        "minitrain/runtime/trace.py",
        "        if device is None and _enabled:\n"
        "            return now(_device_of(fut.value()))\n"
        "        return now(device)\n",
        "        return now()\n",
        ["tests/test_trace_device_clock.py::test_a_futures_end_is_a_device_mark_on_its_tensors_device",
         "tests/test_trace_device_clock.py::"
         "test_ddp_zero_and_fsdp_take_every_mark_on_their_parameters_device"],
    ),
    # issue 42: the modeled interconnect (minitrain/runtime/link*.py)
    Mutation(
        "issue 42: link: all-reduce costed as one message",
        "minitrain/runtime/link_costs.py",
        "    return 0.0 if N == 1 else 2 * (N - 1) * (link.alpha + nbytes / (N * link.bandwidth))",
        "    return 0.0 if N == 1 else link.alpha + nbytes / link.bandwidth",
        ["tests/test_link.py::test_cost_formulas_are_exact",
         "tests/test_link.py::test_world_2_messages_take_their_modeled_time"],
    ),
    Mutation(
        "issue 42: link: an async wait returns with the real operation, ignoring its modeled finish",
        "minitrain/runtime/link_messages.py",
        "        self._real_wait(timeout)\n        sleep_until(finish_of(self._parts))\n",
        "        self._real_wait(timeout)\n",
        ["tests/test_link.py::test_world_2_messages_take_their_modeled_time"],
    ),
    Mutation(
        "issue 42: link: a modeled wait spins instead of sleeping",
        "minitrain/runtime/link_messages.py",
        "    if delay > 0:\n        time.sleep(delay)\n",
        "    while time.monotonic() < t:\n        pass\n",
        ["tests/test_link.py::test_world_2_messages_take_their_modeled_time"],
    ),
    Mutation(
        "issue 42: link: messages on one group do not queue",
        "minitrain/runtime/link_messages.py",
        "        start = max(now, *(_free.get((group, d), 0.0) for d in directions))",
        "        start = now",
        ["tests/test_link.py::test_world_2_messages_take_their_modeled_time"],
    ),
    Mutation(
        "issue 42: link: a receive ignores its sender's finish (a receive posted early ends early)",
        "minitrain/runtime/link_messages.py",
        "                self.finish = max(free, self.sent if self.sent else time.monotonic())",
        "                self.finish = max(free, time.monotonic())",
        ["tests/test_link.py::test_world_2_messages_take_their_modeled_time"],
    ),
    Mutation(
        "issue 42: link: leaving use_link leaves torch.distributed wrapped",
        "minitrain/runtime/link_wrap.py",
        "            if getattr(module, name) is _WRAPPERS[name]:\n                setattr(module, name, fn)",
        "            if getattr(module, name) is _WRAPPERS[name]:\n                pass",
        ["tests/test_link.py::test_off_nothing_is_wrapped_and_use_link_unwraps"],
    ),
    Mutation(
        "issue 42: link: the mesh's groups are not named after their axes (every axis on the default link)",
        "minitrain/parallel/mesh.py",
        "                group = dist.new_group(ranks, group_desc=axis)  # named: a link per axis",
        "                group = dist.new_group(ranks)",
        ["tests/test_link.py::test_world_4_and_a_link_per_mesh_axis"],
    ),
    Mutation(
        "issue 42: link: ZeRO binds torch's reduce-scatter at import (a later link never sees it)",
        "minitrain/zero/buffers.py",
        "def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):\n"
        "    \"\"\"Reduce-scatter ``input`` (N equal slices) into ``output`` (this rank's slice).\"\"\"\n"
        "    collective = getattr(dist, \"reduce_scatter_single\", None) or dist.reduce_scatter_tensor\n"
        "    return collective(output, input, op=op, group=group, async_op=async_op)\n",
        "reduce_scatter_tensor = getattr(dist, \"reduce_scatter_single\", None) or dist.reduce_scatter_tensor\n",
        ["tests/test_link.py::test_zero_collectives_see_a_link_entered_after_import"],
    ),
    # ch07_10_mutations.py
    Mutation(
        "issue 42: the calibrated-sleep stage's whole backward sleeps one unit, not two (the "
        "chapter's cost convention is F = 1, a whole backward B + W = 2: step times of 1F1B and "
        "ZB-H1 compared unequal work)",
        "minitrain/pipeline/measure.py",
        "model = SleepGPT(p * v, unit, unit if zb else 2 * unit, unit if zb else 0.0)",
        "model = SleepGPT(p * v, unit, unit, unit if zb else 0.0)",
        ["tests/test_ch07_link.py::test_sleep_stage_on_a_link_matches_the_prediction_and_the_convention"],
    ),
    Mutation(
        "issue 42: run_pipelines predicts the non-split schedules with F = B = 1 (the old, "
        "second convention) while the sleep stage and ZB-H1 use a whole backward of 2",
        "minitrain/pipeline/measure.py",
        'costs = UNIT if name == "zero_bubble" else WHOLE_BACKWARD',
        'costs = UNIT if name == "zero_bubble" else {"F": 1, "B": 1}',
        ["tests/test_ch07_link.py::test_sleep_stage_on_a_link_matches_the_prediction_and_the_convention"],
    ),
    Mutation(
        "issue 42: predicted_step lets a rank's messages leave together (no queue on its link: "
        "two activations sent back to back both arrive α + n/β after their own action)",
        "minitrain/pipeline/measure.py",
        "link_free[s] = arrive[key] = max(free[s], link_free[s]) + message_seconds",
        "link_free[s] = arrive[key] = free[s] + message_seconds",
        ["tests/test_ch07_link.py::test_messages_delay_the_receiver_and_queue_on_the_senders_link"],
    ),
    Mutation(
        "issue 42: predicted_step charges no message between ranks (simulate's free "
        "communication with real durations: the compute-only prediction)",
        "minitrain/pipeline/measure.py",
        "start = max([free[s]] + [arrive.get(d, finish[d]) for d in deps])",
        "start = max([free[s]] + [finish[d] for d in deps])",
        ["tests/test_ch07_link.py::test_messages_delay_the_receiver_and_queue_on_the_senders_link",
         "tests/test_ch07_link.py::test_sleep_stage_on_a_link_matches_the_prediction_and_the_convention"],
    ),
    Mutation(
        "issue 42: the overlap threshold counts one of K and V (n ≥ e·F/W: the link then puts "
        "the real threshold at twice the printed one)",
        "minitrain/context_parallel/measure.py",
        "return bytes_per_element * flops_per_second / (2 * bandwidth)",
        "return bytes_per_element * flops_per_second / bandwidth",
        ["tests/test_ch10_link.py::test_threshold_formula",
         "tests/test_ch10_link.py::test_exposed_below_the_threshold_hidden_above_as_the_notebook_measures"],
    ),
    Mutation(
        "issue 42: measure_overlap's link is built with β = 4·e·F/(2n*) (the threshold falls at "
        "n*/4: 128 tokens per rank no longer exposes its transfer, while the printed threshold "
        "still says 512)",
        "minitrain/context_parallel/measure.py",
        'link = Link(t / 50, 4 * flops / (2 * threshold), "cp-threshold",',
        'link = Link(t / 50, 4 * flops / (threshold / 2), "cp-threshold",',
        ["tests/test_ch10_link.py::test_exposed_below_the_threshold_hidden_above_as_the_notebook_measures"],
    ),
    # ch11_mutations.py
    Mutation(
        "issue 42: planner: TP's collectives at the ends (embedding, head input, loss) not charged",
        "minitrain/parallel/planner.py",
        "        (per_layer * len(blocks) + (s == 0) + (s == lo.pp - 1)) * hidden\n"
        "        + 3 * (s == lo.pp - 1) * loss for s, blocks in enumerate(stages))",
        "        per_layer * len(blocks) * hidden for s, blocks in enumerate(stages))",
        ["tests/test_planner_link.py::test_planner_charges_each_axis_what_the_trainer_sends_on_the_link"],
    ),
    Mutation(
        "issue 42: planner: ring attention's last dK, dV hop home not charged (3(P-1) messages)",
        "minitrain/parallel/planner.py",
        "    out[\"cp\"] = (layers * lo.microbatches * (3 * lo.cp - 2) * (a + kv * beta_cp)",
        "    out[\"cp\"] = (layers * lo.microbatches * (3 * lo.cp - 3) * (a + kv * beta_cp)",
        ["tests/test_planner_link.py::test_planner_charges_each_axis_what_the_trainer_sends_on_the_link"],
    ),
    Mutation(
        "issue 42: planner: CP passes every head's K, V on each TP rank (not this rank's heads)",
        "minitrain/parallel/planner.py",
        "    kv = 2 * act / lo.tp\n",
        "    kv = 2 * act\n",
        ["tests/test_planner_link.py::test_planner_charges_each_axis_what_the_trainer_sends_on_the_link"],
    ),
    Mutation(
        "issue 42: planner: a two-stage pipeline's stages charged sends both ways",
        "minitrain/parallel/planner.py",
        "    out[\"pp\"] = (max(2 * lo.microbatches * hop * (lo.pp > 2),",
        "    out[\"pp\"] = (max(2 * lo.microbatches * hop,",
        ["tests/test_planner_link.py::test_planner_charges_each_axis_what_the_trainer_sends_on_the_link"],
    ),
    # ch03_08_09_mutations.py
    Mutation(
        "issue 43: FlashAttention tiles floor(M/4d) square, not Algorithm 1's (min(ceil(M/4d), d), ceil(M/4d))",
        "minitrain/flash_attention/io_model.py",
        "    b_c = -(-sram_elements // (4 * d))  # ceil, as the paper writes it\n"
        "    return min(b_c, d), b_c\n",
        "    b_c = sram_elements // (4 * d)\n"
        "    return b_c, b_c\n",
        ["tests/test_lessons_03_08_09.py::test_block_size_for_sram_is_algorithm_1_line_1",
         "tests/test_flash_attention.py::test_io_follows_theorem_2"],
    ),
    Mutation(
        "issue 43: the score tile is not capped: B_r = ceil(M/4d) like B_c",
        "minitrain/flash_attention/io_model.py",
        "    return min(b_c, d), b_c\n",
        "    return b_c, b_c\n",
        ["tests/test_lessons_03_08_09.py::test_block_size_for_sram_keeps_the_score_tile_small",
         "tests/test_flash_attention.py::test_io_follows_theorem_2"],
    ),
    Mutation(
        "issue 43: tiled_io_for_sram counts minitrain's FA2 loop order as if it were Algorithm 1",
        "minitrain/flash_attention/io_model.py",
        "    if order == \"fa1\":\n        return algorithm1_io(n, n, d, b_r, b_c, causal)\n",
        "    if order == \"fa1\":\n        return tiled_io(n, n, d, b_r, b_c, causal)\n",
        ["tests/test_lessons_03_08_09.py::test_tiled_io_for_sram_uses_algorithm_1_tiles",
         "tests/test_flash_attention.py::test_io_follows_theorem_2"],
    ),
    Mutation(
        "issue 43: Algorithm 1's count forgets that O_i is read back per key block",
        "minitrain/flash_attention/io_model.py",
        "                reads += (i1 - i0) * (2 * d + 2)\n",
        "                reads += (i1 - i0) * (d + 2)\n",
        ["tests/test_lessons_03_08_09.py::test_algorithm1_io_counts_key_blocks_outside",
         "tests/test_flash_attention.py::test_io_follows_theorem_2"],
    ),
    # ch04_mutations.py
    Mutation(
        "ch04: link_for_overlap forgets the ring's 2(N-1)/N (one all-reduce != backward at world 4)",
        "minitrain/collectives/cost_model.py",
        "    bandwidth = steps / world * gradient_bytes / (backward - steps * alpha)\n",
        "    bandwidth = gradient_bytes / (backward - steps * alpha)\n",
        ["tests/test_ch04_link.py::test_link_for_overlap_makes_one_all_reduce_as_long_as_backward"],
    ),
    Mutation(
        "ch04: modeled_step does not queue the all-reduces (many small buckets look free)",
        "minitrain/collectives/cost_model.py",
        "        free = max(ready, free) + all_reduce_time(n, world, link)\n",
        "        free = max(ready + all_reduce_time(n, world, link), free)\n",
        ["tests/test_ch04_link.py::test_modeled_step_trades_bucket_count_times_alpha_against_overlap"],
    ),
    Mutation(
        "ch04: the trace's prediction does not queue a bucket behind the one before",
        "minitrain/ddp/measure.py",
        "        free = max(start, free) + all_reduce_time(bucket_bytes[int(name.split()[-1])], world, link)\n",
        "        free = max(free, start + all_reduce_time(bucket_bytes[int(name.split()[-1])], world, link))\n",
        ["tests/test_ch04_link.py::test_exposed_after_backward_queues_the_launches_on_the_link"],
    ),
    Mutation(
        "ch04: the trace's predicted gain is reference minus variant the wrong way round",
        "minitrain/ddp/measure.py",
        "    return statistics.median(a - b for a, b in zip(per_step(reference), per_step(variant)))\n",
        "    return statistics.median(b - a for a, b in zip(per_step(reference), per_step(variant)))\n",
        ["tests/test_ch04_link.py::test_exposed_after_backward_queues_the_launches_on_the_link",
         "tests/test_ch04_link.py::test_overlap_verdict_reads_the_three_checks"],
    ),
    Mutation(
        "ch04: overlap_verdict takes the gain from the traced prediction (a tautology)",
        "minitrain/bench/ddp.py",
        "    gain = statistics.median(a - b for a, b in zip(slowest[FLAT], slowest[BUCKETED]))\n",
        "    gain = predicted_gain(result, FLAT, BUCKETED)\n",
        ["tests/test_ch04_link.py::test_overlap_verdict_reads_the_three_checks"],
    ),
    Mutation(
        "ch04: the widget's link selector does not switch the sweep shown",
        "minitrain/widgets/ch04_ddp.py",
        "        chosen = sweeps[chooser.value]\n",
        "        chosen = next(iter(sweeps.values()))\n",
        ["tests/test_widgets_ch04.py::test_link_selector_switches_sweeps_and_shows_the_model"],
    ),
    # ch01_02_mutations.py
    Mutation(
        "issue 43: fp32_lm_loss takes the cross-entropy of the fp16 logits (S <= 2^15 again)",
        "minitrain/precision/loss_scaling.py",
        "    return lm_loss(logits.float(), targets)\n",
        "    return lm_loss(logits, targets)\n",
        ["tests/test_lessons_01_02.py::test_fp32_lm_loss_is_fp32_and_equals_the_loss_of_the_cast_logits",
         "tests/test_lessons_01_02.py::test_fp32_loss_scaler_at_gradscalers_default_start_is_clean"],
    ),
    Mutation(
        "issue 43: mixed_fp32_grads counts 16-bit gradients (16 bytes, not Megatron's 18)",
        "minitrain/memory/formulas.py",
        '    "mixed_fp32_grads": {"weights": 2, "gradients": 4, "master": 4, "optimizer": 8,\n',
        '    "mixed_fp32_grads": {"weights": 2, "gradients": 2, "master": 4, "optimizer": 8,\n',
        ["tests/test_lessons_01_02.py::test_estimate_training_memory_recipes",
         "tests/test_lessons_01_02.py::test_master_weight_optimizer_keeps_the_18_byte_recipe"],
    ),
    # ch05_06_mut_fixed.py
    Mutation(
        "issue 42: ZeRO-3/FSDP without prefetch predicted to wait for each block's gather once (backward's re-gather forgotten)",
        "minitrain/fsdp/measure.py",
        "        waits += 2 * sum(gathers)\n",
        "        waits += sum(gathers)  # forgets backward's re-gather\n",
        ["tests/test_ch05_link.py::test_prediction_without_prefetch_waits_for_every_gather"],
    ),
    Mutation(
        "issue 42: TP's crossover width ignores the all-reduces' latency",
        "minitrain/tensor_parallel/measure_link.py",
        "    ar_alpha = 4 * all_reduce_time(0, tp_size, link)  # the α part: 8(t−1)α\n",
        "    ar_alpha = 0.0\n",
        ["tests/test_ch06_link.py::test_crossover_is_where_the_all_reduces_cost_what_they_save"],
    ),
    # me_mutations.py
    Mutation(
        "issue 46: the RMSNorm backward forgets that the reciprocal root depends on x",
        "minitrain/kernels/norms.py",
        "dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))",
        "dx = rstd * gw",
        ["tests/test_kernels.py::test_fused_rms_norm_equals_torch"],
    ),
    Mutation(
        "issue 46: the Triton LayerNorm counts the padding columns in the variance",
        "minitrain/kernels/triton_norms.py",
        "centred = tl.where(mask, x - mean[:, None], 0.0)",
        "centred = x - mean[:, None]",
        ["tests/test_kernels.py::test_fused_layer_norm_equals_torch"],
    ),
    Mutation(
        "issue 46: the chunked loss's backward counts the ignored tokens",
        "minitrain/kernels/chunked_loss.py",
        "grad_logits.mul_((counted[rows].to(acc) * scale).unsqueeze(1))",
        "grad_logits.mul_(scale)",
        ["tests/test_kernels.py::test_chunked_linear_cross_entropy_equals_the_unfused_loss"],
    ),
    Mutation(
        "issue 46: the chunked loss keeps a chunk of logits alive while the next is built",
        "minitrain/kernels/chunked_loss.py",
        "            del logits, grad_logits\n",
        "",
        ["tests/test_kernels.py::test_the_chunked_loss_holds_one_chunk_of_logits_at_vocabulary_4096"],
    ),
    Mutation(
        "issue 46: the allocation counter takes a view for a new allocation",
        "minitrain/memory/allocations.py",
        "if key == 0 or key in inputs:",
        "if key == 0:",
        ["tests/test_kernels.py::test_live_allocations_counts_temporaries_and_their_release"],
    ),
    # issue 44: hints on request
    Mutation(
        "issue 44: the hint command forgets the level it showed",
        "minitrain/course/hints.py",
        "        record_level(folder, args.chapter, exercise, level)\n",
        "        pass\n",
        ["tests/test_hints.py::test_levels_come_in_order_and_are_remembered"],
    ),
    Mutation(
        "issue 44: a stub keeps the HINT comments of its solution",
        "minitrain/course/exercise_regions.py",
        "            if any(line.strip().startswith(HINT) for line in body):",
        "            if False:",
        ["tests/test_hints.py::test_a_hint_comment_in_the_library_is_refused"],
    ),
    # ch05_06_mutations.py
    Mutation(
        "zero_prefetch_cited_as_section_5_2",
        ZERO,  # "minitrain/zero/data_parallel.py"
        "et al. 2020, section 7.2.2: prefetching); waiting for it here would serialise them again.",
        "et al. 2020, section 5.2: prefetching); waiting for it here would serialise them again.",
        ["tests/test_lessons_05_06.py::test_the_stage3_hook_cites_7_2_2"],
    ),
    # ch07_mutations.py
    Mutation(
        "zero bubble: B asks autograd for the weights too (W adds them again)",
        "minitrain/pipeline/executor.py",
        "rest = [q for q in self.chunk_parameters(chunk) if q not in self.w_params[chunk]]",
        "rest = self.chunk_parameters(chunk)",
        ["tests/test_zero_bubble_w.py::test_real_w_is_exact_against_one_process",
         "tests/test_pipeline.py::test_every_schedule_matches_one_process"],
    ),
    Mutation(
        "zero bubble: B keeps the graph (retain_graph): memory does not fall",
        "minitrain/pipeline/weight_grad.py",
        "torch.autograd.grad(out, inputs, grad, allow_unused=True)",
        "torch.autograd.grad(out, inputs, grad, allow_unused=True, retain_graph=True)",
        ["tests/test_zero_bubble_w.py::test_b_frees_the_graph_and_w_walks_no_node"],
    ),
    Mutation(
        "zero bubble: W forgets the bias gradient",
        "minitrain/pipeline/weight_grad.py",
        "            if bias is not None:\n                accumulate(bias, g2.sum(0))\n",
        "",
        ["tests/test_zero_bubble_w.py::test_real_w_is_exact_against_one_process"],
    ),
    Mutation(
        "zero bubble: W overwrites .grad instead of accumulating (micro-batches lost)",
        "minitrain/pipeline/weight_grad.py",
        "        param.grad.add_(grad)\n",
        "        param.grad = grad.to(param.dtype)\n",
        ["tests/test_zero_bubble_w.py::test_real_w_is_exact_against_one_process"],
    ),
    Mutation(
        "zero bubble: the old W, which re-walks the graph B kept",
        "minitrain/pipeline/executor.py",
        "        if state.split_backward:  # the input gradient only: W's GEMMs are parked\n"
        "            x_grad = stage.backward_input(name, c, mb, out, grad, x, state)\n"
        "        else:\n"
        "            stage.backward(name, out, grad)\n"
        "            x_grad = None if stage.is_first(c) else x.grad\n"
        "        if not stage.is_first(c):\n"
        "            stage.send(\"B\", mb, x_grad, v - 1, state)\n"
        "    elif kind == \"W\" and key in state.pending_w:\n"
        "        stage.backward_weights(name, c, state.pending_w.pop(key))\n",
        "        if state.split_backward:  # the old W: B keeps the graph, W walks it again\n"
        "            torch.autograd.backward(out, grad, inputs=[x], retain_graph=True)\n"
        "            x_grad, state.pending_w[key] = x.grad, (out, grad)\n"
        "        else:\n"
        "            stage.backward(name, out, grad)\n"
        "            x_grad = None if stage.is_first(c) else x.grad\n"
        "        if not stage.is_first(c):\n"
        "            stage.send(\"B\", mb, x_grad, v - 1, state)\n"
        "    elif kind == \"W\" and key in state.pending_w:\n"
        "        out, grad = state.pending_w.pop(key)\n"
        "        torch.autograd.backward(out, grad, inputs=stage.chunk_parameters(c))\n",
        ["tests/test_zero_bubble_w.py::test_b_frees_the_graph_and_w_walks_no_node"],
    ),
    Mutation(
        "zero bubble: a weight tied to the embedding is left to W (its embedding gradient lost)",
        "minitrain/pipeline/weight_grad.py",
        "    return gemm - other\n",
        "    return gemm\n",
        ["tests/test_zero_bubble_w.py::test_real_w_is_exact_against_one_process"],
    ),
    Mutation(
        "zero bubble: the row-parallel bias (added after the reduce) counted as a GEMM's",
        "minitrain/pipeline/weight_grad.py",
        "                   RowParallelLinear: (\"weight\",)}",
        "                   RowParallelLinear: (\"weight\", \"bias\")}",
        ["tests/test_pipeline.py::test_pipeline_of_tensor_parallel_stages_matches_one_process"],
    ),
    Mutation(
        "zero bubble: the sleep stage's W does not sleep (W free, the convention broken)",
        "minitrain/pipeline/sleep_stage.py",
        "            calibrated_sleep(sum(b.t_w for b in self.chunks[chunk].blocks), self.ref_device)\n",
        "",
        ["tests/test_ch07_link.py::test_sleep_stage_on_a_link_matches_the_prediction_and_the_convention"],
    ),
    # ch10_11_mutations.py
    Mutation(
        "issue 43: the pipeline's data-parallel gradient all-reduce untraced (no DP bar in chapter 11's timeline)",
        "minitrain/parallel/trainer.py",
        'with trace.span("all-reduce gradients (DP)", "communication", self.device):',
        "with nullcontext():",
        ["tests/test_lessons_10_11.py::test_the_traced_3d_step_shows_the_data_parallel_reduction"],
    ),
    Mutation(
        "issue 43: context-parallel gradients summed over the group, not averaged",
        "minitrain/context_parallel/model.py",
        "                dist.all_reduce(p.grad, group=self.group)\n                p.grad /= self.world_size\n",
        "                dist.all_reduce(p.grad, group=self.group)\n",
        ["tests/test_lessons_10_11.py::test_context_parallel_gradient_is_the_average_of_partial_gradients"],
    ),
    Mutation(
        "issue 43: all-gather CP's backward charged an all-reduce of dK, dV (not Llama 3's reduce-scatter)",
        "minitrain/context_parallel/gathered.py",
        '    return {"forward": (P - 1) * 2 * block, "backward": (P - 1) * 2 * block,\n',
        '    return {"forward": (P - 1) * 2 * block, "backward": 2 * (P - 1) * 2 * block,\n',
        ["tests/test_lessons_10_11.py::test_cp_bytes_per_rank_against_the_formulas[4]"],
    ),
    Mutation(
        "issue 43: all-gather CP's K, V memory counted as the ring's two blocks",
        "minitrain/context_parallel/gathered.py",
        '            "kv_held": P * 2 * block}',
        '            "kv_held": 2 * 2 * block}',
        ["tests/test_lessons_10_11.py::test_cp_bytes_per_rank_against_the_formulas[4]"],
    ),
    # hints_0_4_mutations.py
    Mutation(
        "ddp: the gradient hook launches full buckets even with overlap off",
        "minitrain/ddp/data_parallel.py",
        "        bucket.ready += 1\n        if self.overlap:\n            self._launch_ready_buckets()\n",
        "        bucket.ready += 1\n        self._launch_ready_buckets()\n",
        ["tests/grading/test_ch04_groups_and_overlap.py::test_no_launch_during_backward_with_overlap_off"],
    ),
    Mutation(
        "pass_the_token: the ring is the world, not the group",
        "minitrain/runtime/point_to_point.py",
        "    rank, world = dist.get_rank(group), dist.get_world_size(group)\n"
        "    prev_rank, next_rank = ring_neighbours(group)\n    held = token.clone()",
        "    rank, world = dist.get_rank(), dist.get_world_size()\n"
        "    prev_rank, next_rank = ring_neighbours()\n    held = token.clone()",
        ["tests/grading/test_ch00_point_to_point.py::test_pass_the_token_goes_round_the_group"],
    ),
    Mutation(
        "ring_reduce_scatter: neighbours of the world, not of the group",
        "minitrain/collectives/ring.py",
        "    prev_rank, next_rank = ring_neighbours(group)\n    if world == 1:",
        "    prev_rank, next_rank = ring_neighbours()\n    if world == 1:",
        ["tests/grading/test_ch04_groups_and_overlap.py::test_ring_collectives_honour_the_group[ring_reduce_scatter]"],
    ),
    Mutation(
        "ring_all_gather: neighbours of the world, not of the group",
        "minitrain/collectives/ring.py",
        "    prev_rank, next_rank = ring_neighbours(group)\n    chunks[rank].copy_(flat_in)",
        "    prev_rank, next_rank = ring_neighbours()\n    chunks[rank].copy_(flat_in)",
        ["tests/grading/test_ch04_groups_and_overlap.py::test_ring_collectives_honour_the_group[ring_all_gather]"],
    ),
    Mutation(
        "ring_all_reduce: the halves run on the world, not on the group",
        "minitrain/collectives/ring.py",
        "    ring_reduce_scatter(mine, flat, group)\n    ring_all_gather(flat, mine, group)",
        "    ring_reduce_scatter(mine, flat)\n    ring_all_gather(flat, mine)",
        ["tests/grading/test_ch04_groups_and_overlap.py::test_ring_collectives_honour_the_group[ring_all_reduce]"],
    ),
    Mutation(
        "checkpoint backward: the caller's RNG state restored only when fn succeeds",
        "minitrain/checkpointing/function.py",
        "        try:\n            with torch.enable_grad():\n                outputs = ctx.fn(*args)\n"
        "        finally:\n            if ctx.rng_state is not None:\n                set_rng_state(current)",
        "        with torch.enable_grad():\n            outputs = ctx.fn(*args)\n"
        "        if ctx.rng_state is not None:\n            set_rng_state(current)",
        ["tests/grading/test_ch03_checkpointing.py::test_backward_restores_the_random_stream_when_the_recomputation_raises"],
    ),
    Mutation(
        "accumulate_gradients: every micro-batch's graph kept, one backward of the sum",
        "minitrain/step.py",
        "    mean_loss = 0.0\n    for x, y in micro_batches:\n"
        "        loss = loss_fn(model(x), y) * (y.numel() / total)\n"
        "        loss.backward()  # adds into .grad; the graph of this micro-batch is freed now\n"
        "        mean_loss += loss.item()\n    return mean_loss",
        "    losses = [loss_fn(model(x), y) * (y.numel() / total) for x, y in micro_batches]\n"
        "    sum(losses).backward()\n    return sum(loss.item() for loss in losses)",
        ["tests/grading/test_ch01_single_device.py::test_accumulate_gradients_backwards_each_micro_batch_before_the_next"],
    ),
    Mutation(
        "gpt_num_params: counts by building the model",
        "minitrain/model.py",
        "    h, f, v, s, L = (config.d_model, config.d_ff, config.vocab_size, config.seq_len, config.n_layer)\n",
        "    return sum(p.numel() for p in GPT(config).parameters())\n",
        ["tests/grading/test_ch01_single_device.py::test_gpt_num_params"],
    ),
]

# Run in the copy, with the copy first on sys.path: the copy's minitrain must be the one
# imported, here and in a rank (the forkserver's children), or the run would test the original.
PRECHECK = """
import sys, minitrain
from minitrain.runtime import launch
def where():
    import minitrain
    return minitrain.__file__
found = [minitrain.__file__] + list(launch(where, 1, timeout=60))
bad = [f for f in found if not f.startswith(sys.argv[1])]
sys.exit(f"imported {bad}, not the copy in {sys.argv[1]}" if bad else 0)
"""


def _copy(dest: Path) -> None:
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)


def _run(copy: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{copy}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("MINITRAIN_EXERCISES", None)  # graded tests test the (mutated) library itself
    return subprocess.run(
        [sys.executable, *args], cwd=copy, env=env, capture_output=True, text=True
    )


def _failed(copy: Path, tests: list[str]) -> tuple[list[str], str]:
    """Run the tests in the copy; (the named tests none of whose tests failed, summary)."""
    args = ["-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "--rootdir", str(copy)]
    result = _run(copy, args + tests)
    if result.returncode not in (0, 1):  # 2: collection error, 4: usage, 5: nothing collected
        raise RuntimeError(
            f"pytest exit {result.returncode}: {(result.stdout + result.stderr)[-800:]}"
        )
    failed = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("FAILED ")]
    survived = [
        t for t in tests if not any(f == t or f.startswith((t + "[", t + "::")) for f in failed)
    ]
    return survived, (result.stdout.strip().splitlines() or ["(no output)"])[-1]


def check(mutation: Mutation | None, tests: list[str]) -> tuple[list[str], str]:
    """Apply ``mutation`` (None: none) to a fresh copy and run ``tests`` there:
    (the named tests that did not fail, pytest's summary line). Raises if it cannot run."""
    with tempfile.TemporaryDirectory(prefix="minitrain-mutant-") as tmp:
        copy = Path(tmp).resolve()
        _copy(copy)
        if mutation is not None:
            path = copy / mutation.file
            text = path.read_text()
            if text.count(mutation.old) != 1:
                raise RuntimeError(
                    f"old text found {text.count(mutation.old)} times in {mutation.file}, "
                    "not once: update the entry to the code as it is now"
                )
            path.write_text(text.replace(mutation.old, mutation.new))
        pre = _run(copy, ["-c", PRECHECK, str(copy)])
        if pre.returncode != 0:
            raise RuntimeError(f"pre-check: {(pre.stderr or pre.stdout).strip()[-500:]}")
        return _failed(copy, tests)


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not argv or any(a in m.name for a in argv)]
    every_test = sorted({t for m in chosen for t in m.tests})
    survived, summary = check(None, every_test)
    if set(survived) != set(every_test):  # without a mutation every named test must pass
        print(f"baseline: named tests fail on the unmutated code ({summary})")
        return 1
    print(f"baseline: the {len(every_test)} named tests pass on the unmutated code ({summary})")
    failures = 0
    for m in chosen:
        try:
            survived, summary = check(m, m.tests)
            verdict = "caught" if not survived else "NOT CAUGHT"
            detail = summary if not survived else f"these passed: {', '.join(survived)}"
        except RuntimeError as exc:
            verdict, detail = "BROKEN", str(exc)
        failures += verdict != "caught"
        print(f"{verdict:>10}  {m.name}  ({detail})", flush=True)
    print(f"{len(chosen) - failures} of {len(chosen)} mutations caught")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
