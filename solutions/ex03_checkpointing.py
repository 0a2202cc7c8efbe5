"""Chapter 3 solutions — generated from minitrain.checkpointing.function, minitrain.checkpointing.cost.

The worked answers. Look one up when you are stuck; the library has them too.
"""

from __future__ import annotations

import contextlib
import math
import torch
import warnings
from minitrain.checkpointing.cost import segment_sizes
from minitrain.checkpointing.function import _accelerators, get_rng_state, set_rng_state
from minitrain.memory import block_activation_bytes, model_activation_bytes


class CheckpointFunction:
    # Only the methods you write; the rest of the class is in minitrain.checkpointing.function.

    @staticmethod
    def forward(ctx, fn, preserve_rng_state, *args):
        """Run ``fn(*args)`` without recording a graph; keep only what backward needs to redo it.

        Returns what ``fn(*args)`` returns (one tensor or a tuple), and the outputs of ``apply``
        require grad when an input does (autograd wraps them). ``args`` mixes tensors and other
        values (numbers, None, flags). Requirements: the only bytes kept for backward are the
        tensor arguments' (the grader measures what is saved: nothing of fn's inside), and a
        random draw inside fn (dropout) must be replayable by backward.

        The contract between forward and backward (each is graded with the library's
        other half, so keep exactly these names):
        - ``ctx.fn``: fn;
        - ``ctx.tensor_positions``: the indices i (ascending) with ``args[i]`` a tensor;
        - ``ctx.others``: a list as long as ``args``: ``args[i]`` where it is not a tensor,
          None where a tensor sat;
        - ``ctx.save_for_backward(*tensors)``: the tensor arguments themselves, in the order
          of ``ctx.tensor_positions`` (``ctx.saved_tensors`` gives them back);
        - ``ctx.rng_state``: ``get_rng_state(devices)`` taken before fn draws anything, where
          ``devices`` are the non-CPU devices of the tensor arguments (``_accelerators``), or
          None when ``preserve_rng_state`` is False;
        - ``ctx.set_materialize_grads(False)`` was called: an output nobody used gets None
          in ``grad_outputs``, not a tensor of zeros.
        """
        ### BEGIN SOLUTION
        ctx.fn = fn
        ctx.tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        tensors = [args[i] for i in ctx.tensor_positions]
        # The state *before* fn draws its random numbers: backward replays from here.
        ctx.rng_state = get_rng_state(_accelerators(tensors)) if preserve_rng_state else None
        ctx.save_for_backward(*tensors)  # the only memory this segment keeps
        ctx.set_materialize_grads(False)  # outputs nobody used get None, not zeros
        with torch.no_grad():
            return fn(*args)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, *grad_outputs):
        """Recompute fn's forward with grad enabled, then backpropagate ``grad_outputs`` through it.

        ``grad_outputs``: one per output of forward, in order (None for an output nobody used).
        Returns one entry per argument of forward — None for ``fn``, None for
        ``preserve_rng_state``, then for each of ``args``: the gradient of that tensor argument
        where ``ctx.needs_input_grad`` asks for it (None otherwise) and None for non-tensors.
        Parameters used inside fn accumulate their ``.grad`` exactly as without checkpointing.
        Requirements and why (each graded against the same model without checkpointing, with
        dropout inside fn and random draws between forward and backward): the recomputation
        draws the same random numbers as the forward did (the same dropout mask, or the
        gradients are of another network); and afterwards the caller's random stream is where
        it was before backward — the recomputation leaves no trace, even if fn raises.

        The contract between forward and backward (each is graded with the library's
        other half, so keep exactly these names):
        - ``ctx.fn``: fn;
        - ``ctx.tensor_positions``: the indices i (ascending) with ``args[i]`` a tensor;
        - ``ctx.others``: a list as long as ``args``: ``args[i]`` where it is not a tensor,
          None where a tensor sat;
        - ``ctx.save_for_backward(*tensors)``: the tensor arguments themselves, in the order
          of ``ctx.tensor_positions`` (``ctx.saved_tensors`` gives them back);
        - ``ctx.rng_state``: ``get_rng_state(devices)`` taken before fn draws anything, where
          ``devices`` are the non-CPU devices of the tensor arguments (``_accelerators``), or
          None when ``preserve_rng_state`` is False;
        - ``ctx.set_materialize_grads(False)`` was called: an output nobody used gets None
          in ``grad_outputs``, not a tensor of zeros.
        """
        ### BEGIN SOLUTION
        args = list(ctx.others)
        for i, saved in zip(ctx.tensor_positions, ctx.saved_tensors):
            args[i] = saved.detach().requires_grad_(ctx.needs_input_grad[2 + i])
        if ctx.rng_state is not None:
            current = get_rng_state([d for d in ctx.rng_state if isinstance(d, torch.device)])
            set_rng_state(ctx.rng_state)
        try:
            with torch.enable_grad():
                outputs = ctx.fn(*args)
        finally:
            if ctx.rng_state is not None:
                set_rng_state(current)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs)
            if torch.is_tensor(out) and out.requires_grad and grad is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [a.grad if torch.is_tensor(a) else None for a in args]
        return (None, None, *input_grads)
        ### END SOLUTION


def choose_segments(
    num_layers: int, layer_bytes: int, input_bytes: int, budget_bytes: int | None = None
) -> int:
    """The segment count k in [1, L] for ``checkpoint_sequential`` of L = ``num_layers`` layers.

    ``layer_bytes`` (A): what one layer saves for backward; ``input_bytes`` (c): one segment
    input kept. The predicted peak of k segments is ``sequential_peak_bytes(L, k, A, c)``
    (this module; you may call it). Without a budget: the k with the smallest peak; when
    several k tie, the smallest of them (fewer segments, less recomputation). With
    ``budget_bytes``: the smallest k whose peak is at most the budget (every k > 1
    recomputes all but the last segment, so the fewest segments cost least); if no k fits,
    raise ``ValueError`` naming the budget. The grader compares with every k's peak for
    many (L, A, c), ties and budgets included.
    """
    ### BEGIN SOLUTION
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    peaks = {
        k: (k - 1) * input_bytes + math.ceil(num_layers / k) * layer_bytes
        for k in range(1, num_layers + 1)
    }
    if budget_bytes is None:
        return min(peaks, key=lambda k: (peaks[k], k))
    fitting = [k for k, peak in peaks.items() if peak <= budget_bytes]
    if not fitting:
        raise ValueError(
            f"no segment count fits budget_bytes={budget_bytes}: the smallest "
            f"predicted peak is {min(peaks.values())} bytes"
        )
    return min(fitting)
    ### END SOLUTION

# minitrain-exercises-hash: 248b6914506545c2
