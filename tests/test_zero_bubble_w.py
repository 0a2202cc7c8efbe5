"""Chapter 7: zero bubble's W is real (Qi et al. 2024, section 2): B computes the input's
gradient and frees the graph; W only multiplies stored (input, output gradient) pairs.

Exact against one process in float64 (several SGD and AdamW steps, interleaved chunks, a tied
head); W walks no autograd node; after B the graph's activations are gone, W's pairs remain
(counted by ``LiveSavedBytes``) and W frees them. Tensor parallelism composed with it is in
tests/test_pipeline.py (``test_pipeline_of_tensor_parallel_stages_matches_one_process``).
"""

import copy

import torch

from minitrain.runtime import launch

CONFIG = dict(vocab_size=16, seq_len=8, n_layer=4, n_head=2, d_model=8)


def _gpt(**over):  # float64: the split backward must match to rounding
    from minitrain.model import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**CONFIG, **over})).double()


def _data(step, seq_len=8):
    g = torch.Generator().manual_seed(step)
    return tuple(torch.randint(0, 16, (4, seq_len), generator=g) for _ in range(2))


def _with_w_after_each_b(schedule):
    """Interleaved 1F1B with every backward split: B then its W at once (still valid)."""
    return [[a for act in stage for a in ([act, ("W", *act[1:])] if act[0] == "B" else [act])]
            for stage in schedule]


def _train(cases):
    """Per case, three steps of a pipelined model and its one-process copy: the worst gradient
    difference on the first step and the worst parameter difference after the last. A tied
    head runs on a one-stage pipeline (each rank its own group): p > 1 refuses ties."""
    import torch.distributed as dist

    from minitrain.pipeline import PipelineStage, interleaved_one_f_one_b_schedule
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    out = []
    for optimizer, v, tie in cases:
        model = _gpt(tie_weights=tie)
        ref = copy.deepcopy(model)
        stage = PipelineStage(model, group=singles[dist.get_rank()] if tie else None, num_chunks=v)
        p = stage.num_stages
        schedule = _with_w_after_each_b(interleaved_one_f_one_b_schedule(p, 4, v)) if v > 1 else "zero_bubble"
        make = (lambda ps: torch.optim.SGD(ps, lr=0.5)) if optimizer == "sgd" else (
            lambda ps: torch.optim.AdamW(ps, lr=1e-2))
        opt, ref_opt = make(stage.parameters()), make(ref.parameters())
        grad_err = None
        for step in range(3):
            x, y = _data(step)
            opt.zero_grad()
            stage.train_step(x, y, schedule, 4)
            ref_opt.zero_grad()
            ref.loss(x, y).backward()
            refp = dict(ref.named_parameters())
            if grad_err is None:
                grad_err = max((q.grad - refp[n].grad).abs().max().item()
                               for n, q in stage.model.named_parameters())
            opt.step()
            ref_opt.step()
        out.append(((optimizer, v, tie), grad_err,
                    max((q - refp[n]).abs().max().item() for n, q in stage.model.named_parameters())))
    return out


def test_real_w_is_exact_against_one_process():
    cases = [("sgd", 1, False), ("adamw", 1, False), ("sgd", 2, False), ("adamw", 1, True)]
    for rank, rows in enumerate(launch(_train, 2, cases, timeout=90)):
        for case, grad_err, param_err in rows:
            assert grad_err < 1e-12 and param_err < 1e-12, (rank, case, grad_err, param_err)


def _graph_nodes(out):
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo += [n for n, _ in node.next_functions]
    return seen


def _one_stage_by_hand():
    """F, B, W of one micro-batch on a one-stage pipeline, observed between the actions:
    autograd nodes run, live saved bytes, whether the graph can be walked again."""
    from minitrain.memory import LiveSavedBytes
    from minitrain.pipeline import PipelineStage, StepState, run_action
    # seq_len 32, 4 heads: the attention scores (a s^2 per sequence) dominate, as they do at scale
    stage = PipelineStage(_gpt(seq_len=32, n_head=4))
    x, y = _data(0, seq_len=32)
    state = StepState([x], [y], 1, split_backward=True)
    state.device = x.device
    calls = []
    out = {}
    with LiveSavedBytes(exclude=list(stage.parameters())) as live:
        run_action(stage, ("F", 0), state)
        after_f = live.live
        out["loss"] = state.saved[(0, 0)][1]
        for node in _graph_nodes(out["loss"]):
            node.register_prehook(lambda grads, node=node: calls.append(node.name()))
        run_action(stage, ("B", 0), state)
        after_b, b_calls = live.live, len(calls)
        try:
            torch.autograd.grad(out.pop("loss"), list(stage.parameters()), allow_unused=True)
            walkable = True
        except RuntimeError:  # "backward through the graph a second time": B freed it
            walkable = False
        calls.clear()
        run_action(stage, ("W", 0), state)
        after_w = live.live
    grads_set = all(q.grad is not None for q in stage.parameters())
    return dict(after_f=after_f, after_b=after_b, after_w=after_w, b_calls=b_calls,
                w_calls=len(calls), walkable=walkable, grads_set=grads_set)


def test_b_frees_the_graph_and_w_walks_no_node():
    r, = launch(_one_stage_by_hand, 1, timeout=60)
    assert r["b_calls"] > 0, r  # B is a graph walk
    assert r["w_calls"] == 0, f"W ran {r['w_calls']} autograd nodes: it must only multiply"
    assert not r["walkable"], "after B the graph can be walked again: B kept it (retain_graph)"
    # after B only W's (input, output gradient) pairs are held: the linears' inputs and output
    # gradients, not the attention scores, LayerNorm and GELU intermediates of the graph
    assert 0 < r["after_b"] < 0.6 * r["after_f"], r
    assert r["after_w"] == 0, r  # W frees its pairs
    assert r["grads_set"], r
