"""What activation checkpointing costs and saves, as formulas: chapter 3's predictions.

Chapter 3: used by the checkpointing policies, its measurements, its benchmark and
notebooks/03_activation_checkpointing.ipynb, where every formula is set beside a
measurement. Built on chapter 1's activation formula (``block_activation_bytes``).
Chen et al. 2016: L layers in k segments keep (k-1) segment inputs plus one segment in
full, a peak of (k-1)c + ceil(L/k)A, smallest near k = sqrt(L A / c).
"""

from __future__ import annotations

import math

from minitrain.memory import block_activation_bytes, model_activation_bytes

POLICIES = ("none", "full", "every_k", "selective", "segments")


def segment_sizes(num_layers: int, segments: int) -> list[int]:
    """Sizes as equal as possible; the remainder goes to the *last* segments.

    The last segment is the one held in full at the end of forward, so making it a
    largest one makes the peak exactly ``(k-1) c + ceil(L/k) A`` (see ``sequential_peak_bytes``).
    """
    if not isinstance(segments, int) or not 1 <= segments <= num_layers:
        raise ValueError(
            f"segments must be an int in [1, {num_layers}] for {num_layers} "
            f"layers, got {segments!r}"
        )
    base, extra = divmod(num_layers, segments)
    return [base + (i >= segments - extra) for i in range(segments)]


def check_policy(policy: str, k: int, num_layers: int) -> None:
    """Raise ValueError naming the bad value unless ``policy`` with ``k`` fits ``num_layers``."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if policy in ("every_k", "segments") and (not isinstance(k, int) or k < 1):
        raise ValueError(f"policy {policy!r} needs a positive int k, got {k!r}")
    if policy == "segments":
        segment_sizes(num_layers, k)  # k <= L too


def policy_saved_bytes(
    config, batch: int, policy: str, k: int = 1, seq_len: int | None = None
) -> int:
    """Bytes the GPT's loss saves for backward under ``policy`` (fp32), from chapter 1's formula.

    With A = ``block_activation_bytes`` and c = 4 b s h (one block input): "full" and
    "every_k" replace the L A of the blocks by one c per checkpointed group; "segments"
    keeps (k-1) inputs plus the last segment in full; "selective" drops, per block, the
    attention core's s x s tensors: a s^2 b 4 (softmax) + a s^2 b 5 (dropout mask and output).
    """
    s, L = seq_len or config.seq_len, config.n_layer
    check_policy(policy, k, L)
    b, h, a = batch, config.d_model, config.n_head
    everything = model_activation_bytes(config, b, s)
    A = block_activation_bytes(b, s, h, a, config.d_ff, config.dropout)
    c = 4 * b * s * h
    if policy == "none":
        return everything
    if policy in ("full", "every_k"):
        return everything - L * A + math.ceil(L / (1 if policy == "full" else k)) * c
    if policy == "segments":
        return everything - (L - segment_sizes(L, k)[-1]) * A + (k - 1) * c
    core = a * s * s * b * (4 + (5 if config.dropout > 0 else 0))
    return everything - L * core


def policy_peak_bytes(
    config, batch: int, policy: str, k: int = 1, seq_len: int | None = None
) -> int:
    """Peak of the bytes held for backward through a whole step under ``policy`` (fp32).

    The bytes saved at the end of forward (``policy_saved_bytes``) are one candidate; the
    other is the moment in backward when a checkpointed part has just been recomputed.
    By then backward has released everything saved after that part (the head and loss, the
    later blocks), and the recomputed part's first op saves its input again in the very
    storage the checkpoint kept (counted once). With E the embedding's saved bytes (token
    ids, positions, dropout mask), c = 4 b s h one block input and A one block's bytes:

    - "full" / "every_k", groups g_1..g_m: recomputing group j holds E + j c + g_j A - c;
    - "segments", sizes n_1..n_k: recomputing segment j < k holds E + j c + n_j A - c;
    - "selective": recomputing the last block's attention core holds what forward saved
      minus the head and loss (H) and minus what that block saved after the core (its out
      projection, LayerNorm, MLP and residual-dropout inputs: 11 s b h e + 8 s b, + 2 s b h
      with dropout), plus the recomputed core: the a s^2 b (4 + 5) of the probabilities and
      their dropout, and 3 s b h e of contiguous q, k, v copies.

    The peak is the larger of the end of forward and the largest of those moments.
    """
    s, L = seq_len or config.seq_len, config.n_layer
    check_policy(policy, k, L)
    b, h, a = batch, config.d_model, config.n_head
    end_of_forward = policy_saved_bytes(config, b, policy, k, s)
    if policy == "none":
        return end_of_forward
    A = block_activation_bytes(b, s, h, a, config.d_ff, config.dropout)
    c = 4 * b * s * h
    embed = 8 * b * s + 8 * s + (b * s * h if config.dropout > 0 else 0)
    if policy in ("full", "every_k"):
        size = 1 if policy == "full" else k
        groups = [min(size, L - start) for start in range(0, L, size)]
        moments = [embed + j * c + g * A - c for j, g in enumerate(groups, start=1)]
    elif policy == "segments":
        sizes = segment_sizes(L, k)[:-1]  # the last segment is not recomputed
        moments = [embed + j * c + n * A - c for j, n in enumerate(sizes, start=1)]
    else:
        head_and_loss = model_activation_bytes(config, b, s) - embed - L * A
        after_core = 11 * 4 * b * s * h + 8 * b * s + (2 * b * s * h if config.dropout > 0 else 0)
        core = a * s * s * b * (4 + (5 if config.dropout > 0 else 0))
        moments = [end_of_forward - head_and_loss - after_core + core + 3 * 4 * b * s * h]
    return max([end_of_forward, *moments])


def policy_extra_flops(
    config, batch: int, policy: str, k: int = 1, seq_len: int | None = None
) -> int:
    """Matmul FLOPs recomputed in backward under ``policy`` (what FlopCounterMode counts).

    One block's forward: 2 b s (4h^2 + 2hf) for its Linears + 4 b s^2 h for q k^T and
    probs @ v. Full recomputation redoes every block's forward (about a third more than
    the 3x-forward step); selective only the 4 b s^2 h of each block.
    """
    s, L = seq_len or config.seq_len, config.n_layer
    check_policy(policy, k, L)
    b, h, f = batch, config.d_model, config.d_ff
    attention_core = 4 * b * s * s * h
    block = 2 * b * s * (4 * h * h + 2 * h * f) + attention_core
    recomputed_blocks = {
        "none": 0,
        "full": L,
        "every_k": L,
        "selective": 0,
        "segments": L - segment_sizes(L, k)[-1] if policy == "segments" else 0,
    }
    return recomputed_blocks[policy] * block + (L * attention_core if policy == "selective" else 0)


def sequential_peak_bytes(
    num_layers: int, segments: int, layer_bytes: int, input_bytes: int
) -> int:
    """Peak activation bytes of ``checkpoint_sequential``: (k - 1) c + ceil(L / k) A.

    Chen et al. 2016, section 4: at the end of forward k-1 segment inputs (c bytes each)
    are kept plus the whole last segment (ceil(L/k) layers of A bytes); every later moment
    of backward holds less (one recomputed segment, fewer inputs). Add the bytes saved
    outside the chain (embedding, head, loss) for a whole model.
    """
    segment_sizes(num_layers, segments)  # validates
    return (segments - 1) * input_bytes + math.ceil(num_layers / segments) * layer_bytes


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
