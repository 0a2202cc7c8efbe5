"""Chapter 7 bug hunt (minitrain.course.bughunts): interleaved 1F1B with fewer micro-batches
than stages. Two independent references: the count every schedule must satisfy (each stage
runs each micro-batch's forward and backward once per chunk; the simulator must run it to the
end), and the pipeline step (2 ranks, 3 chunks each) against one process's autograd, bounded by a
timeout."""

import copy
from collections import Counter

import pytest
import torch

from minitrain.runtime import launch

SMALL = [(p, m, v) for p in (2, 3, 4) for m in range(1, p + 1) for v in (2, 3)]  # m <= p


@pytest.mark.exercise("bug hunt: interleaved_one_f_one_b_schedule", points=1)
def test_every_stage_runs_each_forward_and_backward_once_with_few_microbatches():
    from minitrain.pipeline import ScheduleError, interleaved_one_f_one_b_schedule, simulate

    for p, m, v in SMALL:
        schedule = interleaved_one_f_one_b_schedule(p, m, v)
        want = Counter((kind, mb, c) for kind in "FB" for mb in range(m) for c in range(v))
        for s, actions in enumerate(schedule):
            got = Counter(actions)
            missing, extra = sorted(want - got), sorted(got - want)
            wrong = "; ".join(f"{what} {acts}" for what, acts in
                              (("it never runs", missing), ("it runs too many", extra)) if acts)
            assert not wrong, (
                f"interleaved 1F1B with p={p} stages, m={m} micro-batches, v={v} chunks: stage {s} "
                f"should run each (kind, micro-batch, chunk) once; {wrong}. Its warm-up cannot be "
                f"longer than the m*v = {m * v} forwards the stage has.")
        try:
            simulate(schedule, num_microbatches=m, num_chunks=v)
        except ScheduleError as e:
            pytest.fail(f"interleaved 1F1B with p={p}, m={m}, v={v} does not run to the end: {e}")


def _step_against_one_process(m):
    from minitrain.model import GPT, GPTConfig
    from minitrain.pipeline import PipelineStage

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=6, n_head=2, d_model=8))
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 16, (2, 8), generator=g), torch.randint(0, 16, (2, 8), generator=g)
    ref_loss = ref.loss(x, y)
    ref_loss.backward()
    stage = PipelineStage(model, num_chunks=3)
    loss = stage.train_step(x, y, "interleaved", m)
    refp = dict(ref.named_parameters())
    worst = max(((q.grad - refp[n].grad).abs().max().item() if q.grad is not None else float("inf"), n)
                for n, q in stage.model.named_parameters())
    return abs(loss.item() - ref_loss.item()), worst


@pytest.mark.exercise("bug hunt: interleaved_one_f_one_b_schedule", points=2)
def test_interleaved_pipeline_with_fewer_microbatches_than_stages_trains_like_one_process():
    for m in (2, 1):  # m = 2 = p works even with the bug; m = 1 < p is the case that broke
        try:
            results = launch(_step_against_one_process, 2, m, timeout=90)
        except Exception as e:  # a rank raised or timed out: the launcher's message names it
            lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
            pytest.fail(f"interleaved 1F1B on 2 stages with 3 chunks and m={m} micro-batch(es) "
                        f"did not run — {lines[0]} ... {lines[-1]}")
        for rank, (dloss, (dgrad, param)) in enumerate(results):
            assert dloss < 1e-6, f"m={m}, rank {rank}: the loss differs from one process by {dloss}"
            assert dgrad < 1e-6, (f"m={m}, rank {rank}: the gradient of {param} differs from one "
                                  f"process by {dgrad} (inf: it was never computed)")
