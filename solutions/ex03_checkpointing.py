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
        """Run ``fn(*args)`` without recording a graph; keep what backward needs to redo it.

        Save in ``ctx``: fn; the RNG state *before* fn runs (``get_rng_state`` of the
        CPU and of the devices the tensor arguments are on) if ``preserve_rng_state``;
        the tensor arguments with ``ctx.save_for_backward`` (it takes tensors only, so
        remember where they go among the non-tensor ones). Return fn's output(s).
        """
        ### BEGIN SOLUTION
        # HINT: autograd already runs forward under no_grad, so fn builds no graph here
        # HINT: only tensors can be saved for backward; remember where they sat among args so
        # HINT: backward can rebuild the call with non-tensor arguments in their places
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
        """Recompute fn's forward with grad enabled, then backpropagate ``grad_outputs``.

        1. Rebuild the arguments: each saved tensor ``.detach()``ed (a fresh leaf, so
           this graph stops here) with ``requires_grad`` set from ``ctx.needs_input_grad``.
        2. Remember the current RNG state, restore the forward's, re-run fn under
           ``torch.enable_grad()``, and restore the current state again (in ``finally``):
           dropout draws the same mask as in forward, and the caller's random stream
           continues as if no recomputation had happened.
        3. ``torch.autograd.backward`` the outputs that require grad with their incoming
           gradients (skip None ones); parameters used inside fn accumulate ``.grad``.
        Return one gradient per forward input: None for fn and preserve_rng_state, the
        leaves' ``.grad`` for tensors, None for non-tensor arguments.
        """
        ### BEGIN SOLUTION
        # HINT: needs_input_grad has an entry for fn and preserve_rng_state first (offset 2)
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
    """The segment count k in [1, L] for ``checkpoint_sequential`` of L layers.

    Predicted peak: peak(k) = (k - 1) * input_bytes + ceil(L / k) * layer_bytes.
    Without a budget: the k with the smallest peak (the smallest such k if several tie:
    fewer segments, less recomputation). With ``budget_bytes``: the smallest k whose peak
    fits in the budget (every k > 1 recomputes all but the last segment, so the fewest
    segments cost least); raise ValueError naming the budget if no k fits.
    For A = c the minimum is near k = sqrt(L) (Chen et al. 2016); in general sqrt(L A / c).
    """
    ### BEGIN SOLUTION
    # HINT: try every k from 1 to num_layers; math.ceil(num_layers / k) layers in the last one
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

# minitrain-exercises-hash: dbb325de1abd67d1
