"""Where the memory of a training step goes: model states, activations, and their timeline.

Used by notebooks/01_single_device_training.ipynb. Two kinds of memory (Rajbhandari et
al. 2020, "ZeRO", section 3):

- *model states*: weights, gradients and optimizer state, a fixed number of bytes per
  parameter (``estimate_training_memory``);
- *activations*: the tensors autograd saves during forward for use in backward; they
  grow with batch and sequence (``saved_activation_bytes`` measures them, and
  ``block_activation_bytes`` predicts them the way Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", section 4.1, derive
  sbh(34 + 5as/h) — here for minitrain's block in fp32).

``memory_timeline`` follows all of them through forward -> backward -> optimizer step.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

# ------------------------------------------------------------------ bytes per parameter
# The one table of training-state bytes per parameter, with Adam (chapters 1, 2 and 5 read it).
# fp32: 4 (weights) + 4 (gradients) + 8 (Adam's two fp32 moments) = 16.
# mixed (Micikevicius et al. 2018): 2 (bf16/fp16 weights) + 2 (their gradients) + 4 (fp32
#   master weights) + 8 (fp32 moments) + 4 (the fp32 buffer low-precision gradients are summed
#   into before the update) = 20. ZeRO's paper counts 2 + 2 + K with K = 12 = master + moments.
# bf16: everything, moments included, in bf16 and no master copy.
# fp8: "mixed" with the weights the matmuls read cached in fp8; fp8_lean follows FP8-LM (Peng
#   et al. 2023): fp8 weights and gradients, fp16 master weights, an fp8 first and an fp16
#   second moment.
BYTES_PER_PARAMETER: dict[str, dict[str, int]] = {
    "fp32": {"weights": 4, "gradients": 4, "master": 0, "optimizer": 8, "gradient_accumulation": 0},
    "mixed": {"weights": 2, "gradients": 2, "master": 4, "optimizer": 8, "gradient_accumulation": 4},
    "bf16": {"weights": 2, "gradients": 2, "master": 0, "optimizer": 4, "gradient_accumulation": 0},
    "fp8": {"weights": 1, "gradients": 2, "master": 4, "optimizer": 8, "gradient_accumulation": 4},
    "fp8_lean": {"weights": 1, "gradients": 1, "master": 2, "optimizer": 3, "gradient_accumulation": 0},
}


def bytes_per_parameter(recipe: str) -> dict[str, int]:
    """Bytes of training state per parameter for ``recipe`` (a key of ``BYTES_PER_PARAMETER``),
    by component, plus "total"."""
    if recipe not in BYTES_PER_PARAMETER:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {sorted(BYTES_PER_PARAMETER)}")
    parts = dict(BYTES_PER_PARAMETER[recipe])
    parts["total"] = sum(parts.values())
    return parts


def estimate_training_memory(num_params: int, precision: str = "fp32") -> dict:
    """Bytes of model states for training ``num_params`` parameters with Adam.

    Returns a dict with keys weights, gradients, master, optimizer,
    gradient_accumulation and total (total = the sum of the others).
    fp32: 4 (weights) + 4 (gradients) + 8 (Adam's two moments) = 16 bytes/parameter.
    mixed (Micikevicius et al. 2018): 2 (bf16 weights) + 2 (bf16 gradients)
    + 4 (fp32 master weights) + 8 (fp32 moments) + 4 (fp32 gradient accumulation) = 20.
    So 1e9 parameters need 16e9 bytes in fp32, 20e9 mixed. "gradient_accumulation" is
    the fp32 buffer mixed precision sums low-precision gradients into before the fp32
    update; in fp32 the gradients are that buffer, so it is 0 there. Master weights are
    0 in fp32 (the weights are already fp32). ``BYTES_PER_PARAMETER[precision]`` holds
    these numbers (and those of the other recipes of chapter 2). Bad input raises
    ValueError naming it.
    """
    if isinstance(num_params, float) and num_params.is_integer():
        num_params = int(num_params)  # 7e9 is a fine way to write seven billion
    ### BEGIN SOLUTION
    # HINT: validate the inputs, then multiply bytes-per-parameter by num_params for each part
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params must be a non-negative int, got {num_params!r}")
    if precision not in BYTES_PER_PARAMETER:
        raise ValueError(
            f"precision must be 'fp32' or 'mixed' (or another of {sorted(BYTES_PER_PARAMETER)}), "
            f"got {precision!r}"
        )
    parts = {name: per * num_params for name, per in BYTES_PER_PARAMETER[precision].items()}
    parts["total"] = sum(parts.values())
    return parts
    ### END SOLUTION


def _is_parameter(t: torch.Tensor, param_storages: set) -> bool:
    # A Linear saves weight.t(): a view whose _base is the Parameter. Storage identity
    # also catches views whose _base was lost, and parameters passed in `exclude`.
    return (
        isinstance(t, nn.Parameter)
        or isinstance(t._base, nn.Parameter)
        or t.untyped_storage().data_ptr() in param_storages
    )


def _parameter_storages(fn, args, exclude) -> set:
    """Storage addresses of the parameters reachable from fn, its args and ``exclude``."""
    ptrs = set()
    for obj in [fn, getattr(fn, "__self__", None), *args, *(exclude or [])]:
        if isinstance(obj, nn.Module):
            ptrs.update(p.untyped_storage().data_ptr() for p in obj.parameters())
        elif isinstance(obj, nn.Parameter):
            ptrs.add(obj.untyped_storage().data_ptr())
    for obj in exclude or []:
        if isinstance(obj, torch.Tensor):
            ptrs.add(obj.untyped_storage().data_ptr())
    return ptrs


def saved_activation_bytes(fn, *args, exclude=None, **kwargs) -> int:
    """Bytes of the distinct storages autograd saves for backward while running ``fn``.

    Uses ``torch.autograd.graph.saved_tensors_hooks``: every tensor an op saves passes
    through the pack hook, so the count is exact and the same on every device. A storage
    saved several times (three Linears saving the same input) is counted once; parameters,
    views of them, and every tensor of ``exclude`` (tensors or modules) are left out.
    """
    param_storages = _parameter_storages(fn, args, exclude)
    seen = {}  # storage address -> tensor; holding it stops the address being reused

    def pack(t):
        if not _is_parameter(t, param_storages):
            seen.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    return sum(t.untyped_storage().nbytes() for ptr, t in seen.items() if ptr != 0)


def block_activation_bytes(
    batch: int,
    seq_len: int,
    d_model: int,
    n_head: int,
    d_ff: int | None = None,
    dropout: float = 0.0,
    bytes_per_element: int = 4,
) -> int:
    """Bytes one minitrain ``Block`` saves for backward (b=batch, s=seq_len, h=d_model, a=n_head).

    Korthikanti et al. 2022 (section 4.1) list what each op of a block keeps; for
    minitrain's block, f = d_ff (4h by default), e = bytes_per_element (4 in fp32):
      ln_1 input, q/k/v input, q, k, v, out_proj input, ln_2 input, fc_in input: 8 sbh e
      GELU input and fc_out input: 2 sbf e
      softmax output: a s^2 b e
      each LayerNorm's mean and 1/std (two per token, kept in fp32): 2 x 2 sb x 4
      with dropout > 0: the attention-dropout mask (1 byte) and its output
      a s^2 b (1 + e), and two residual-dropout masks 2 sbh (1 byte each).
    With f = 4h, no dropout, fp32: sbh(64 + 4as/h) + 16sb. In their fp16 units with
    dropout this is sbh(34 + 5as/h) (+ the small LayerNorm statistics they omit).
    """
    ### BEGIN SOLUTION
    # HINT: list every tensor saved by LayerNorm, Linear, matmul, softmax, GELU, dropout
    b, s, h, a = batch, seq_len, d_model, n_head
    f = 4 * h if d_ff is None else d_ff
    e = bytes_per_element
    total = (8 * s * b * h + 2 * s * b * f + a * s * s * b) * e
    total += 2 * 2 * s * b * 4  # two LayerNorms, each saving mean and rstd in fp32
    if dropout > 0:
        total += a * s * s * b * (1 + e)  # bool mask + the dropped probabilities
        total += 2 * s * b * h  # two residual-dropout bool masks
    return total
    ### END SOLUTION


def model_activation_bytes(
    config, batch: int, seq_len: int | None = None, bytes_per_element: int = 4
) -> int:
    """Bytes ``GPT(config).loss(idx, targets)`` saves for backward (exact in fp32).

    ``n_layer`` blocks plus: the int64 token ids and positions (the embeddings' backward
    needs them), the embedding dropout mask, ln_f's input and statistics, the head's
    input, the fp32 log-softmax output (b s v), the int64 targets and the loss's 4-byte
    normaliser. Assumes contiguous ``idx``/``targets`` of shape (batch, seq_len).
    """
    b, s, e = batch, seq_len or config.seq_len, bytes_per_element
    h, v = config.d_model, config.vocab_size
    blocks = config.n_layer * block_activation_bytes(
        b, s, h, config.n_head, config.d_ff, config.dropout, e
    )
    embed = 8 * b * s + 8 * s + (b * s * h if config.dropout > 0 else 0)
    head = 2 * e * b * s * h + 2 * b * s * 4  # ln_f and head inputs, ln_f statistics
    loss = 4 * b * s * v + 8 * b * s + 4
    return blocks + embed + head + loss


class LiveSavedBytes:
    """Live bytes autograd holds for backward, over time: ``with tracker:`` around a forward.

    Chapter 1's ``memory_timeline`` and chapter 3's peak measurements both use it. ``_pack``
    counts each saved storage once (parameters and views of them excluded) and hands autograd
    a small holder; autograd drops the holder once the node that saved it has run backward,
    and a ``weakref.finalize`` then un-counts it. Keep the hooks on through backward too and
    recomputed activations (checkpointing) are counted while they live.
    ``.live`` (now), ``.peak`` (highest so far), ``.timeline``: one ``(phase, bytes)`` per
    change, phase being whatever ``.phase`` was set to ("forward", "backward").
    """

    def __init__(self, exclude=()):
        self.param_storages = {p.untyped_storage().data_ptr() for p in exclude}
        self.counts = {}  # storage address -> [nbytes, saved references to it]
        self.live = self.peak = 0
        self.phase = "forward"
        self.timeline = []

    def _pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr == 0 or _is_parameter(t, self.param_storages):  # model state, not activations
            return _Holder(t)
        entry = self.counts.setdefault(ptr, [t.untyped_storage().nbytes(), 0])
        entry[1] += 1
        if entry[1] == 1:
            self._change(entry[0])
        holder = _Holder(t)
        weakref.finalize(holder, self._release, ptr)  # runs when autograd lets go
        return holder

    def _release(self, ptr):
        entry = self.counts[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self.counts[ptr]
            self._change(-entry[0])

    def _change(self, delta):
        self.live += delta
        self.peak = max(self.peak, self.live)
        self.timeline.append((self.phase, self.live))

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def _state_bytes(optimizer) -> int:
    return sum(
        v.nbytes
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def memory_timeline(model: nn.Module, optimizer, loss_fn, batches) -> list[dict]:
    """Live bytes of parameters, gradients, optimizer state and activations over steps.

    ``batches`` is a list of (x, y), one optimizer step each; ``loss_fn(model, x, y)``
    returns the loss. Returns one dict per sample point with keys step, phase
    ("forward", "backward", "step"), label and the four byte counts, sampled after each
    block's forward, at each parameter's gradient, and after step and zero_grad.
    Activations are counted from the storages autograd holds, as they are released.
    On CUDA each point also has ``allocated`` (torch.cuda.memory_allocated).
    """
    params = list(dict.fromkeys(model.parameters()))  # tied weights once
    param_bytes = sum(p.nbytes for p in params)
    tracker = LiveSavedBytes(params)
    points, where = [], {"step": 0, "phase": ""}

    def sample(label):
        point = dict(
            where,
            label=label,
            parameters=param_bytes,
            gradients=sum(p.grad.nbytes for p in params if p.grad is not None),
            optimizer=_state_bytes(optimizer),
            activations=tracker.live,
        )
        if params[0].is_cuda:
            point["allocated"] = torch.cuda.memory_allocated(params[0].device)
        points.append(point)

    handles = [
        block.register_forward_hook(lambda m, i, o, n=n: sample(f"block {n}"))
        for n, block in enumerate(getattr(model, "blocks", []))
    ]
    handles += [
        p.register_post_accumulate_grad_hook(lambda p, n=n: sample(n))
        for n, p in model.named_parameters()
    ]
    try:
        for step, (x, y) in enumerate(batches, start=1):
            where.update(step=step, phase="forward")
            sample("start")
            with tracker:
                loss = loss_fn(model, x, y)
            sample("loss")
            where["phase"] = "backward"
            loss.backward()
            del loss
            sample("end of backward")
            where["phase"] = "step"
            optimizer.step()
            sample("optimizer.step")
            optimizer.zero_grad(set_to_none=True)
            sample("zero_grad")
    finally:
        for handle in handles:
            handle.remove()
    return points
