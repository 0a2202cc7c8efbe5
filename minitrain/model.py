"""The course's GPT: a small decoder-only transformer every later chapter reuses.

Used by notebooks/01_single_device_training.ipynb (and, by swapping its parts, by
every chapter after it). The architecture is GPT-2's (Radford et al. 2019):
token + position embeddings, ``n_layer`` pre-LayerNorm blocks of causal
self-attention and a GELU MLP, a final LayerNorm and a linear LM head.

Built to be taken apart:

- ``model.blocks`` is an ``nn.ModuleList`` of ``Block``s (pipeline parallelism splits
  it, activation checkpointing wraps its elements);
- each ``Block`` has ``.ln_1``, ``.attn``, ``.ln_2``, ``.mlp``;
- ``CausalSelfAttention`` has *separate* ``q_proj``/``k_proj``/``v_proj`` Linears and an
  ``out_proj`` Linear (separate, not fused: a column-parallel split of each then
  gives every rank whole heads), and an ``attention_fn`` attribute, by default
  ``naive_attention``, which flash attention replaces;
- ``MLP`` has ``fc_in`` and ``fc_out`` Linears (tensor parallelism replaces them);
- ``GPT`` has plain attributes later chapters set instead of subclassing it:
  ``loss_fn``, ``block_loop``, ``shard_rng`` and ``dropout_keys`` (see ``GPT.__init__``).

The LM head is untied from the token embedding by default (``tie_weights=False``):
with tied weights a pipeline would have to all-reduce the shared matrix between its
first and last stage. Dropout is written here (``dropout``) rather than taken from
torch so its saved mask is a 1-byte bool on every device (see minitrain.memory).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minitrain.dropout import DropoutKeys, DropoutSite, dropout_site
from minitrain.moe.apply import apply_moe


@dataclass
class GPTConfig:
    """Shape of the model. The defaults train in seconds on a laptop CPU."""

    vocab_size: int = 64
    seq_len: int = 32  # s: the longest sequence (the size of the position table)
    n_layer: int = 2  # L
    n_head: int = 4  # a
    d_model: int = 64  # h
    d_ff: int | None = None  # MLP width; None means 4 * d_model
    dropout: float = 0.0
    bias: bool = True  # biases in every Linear and LayerNorm
    tie_weights: bool = False  # share the LM head with the token embedding
    # mixture of experts (chapter 8's MoELayer in every block's MLP; 0: dense MLPs)
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float | None = None  # None: no token dropped
    moe_aux_weight: float = 0.01  # Switch's load-balancing loss weight α

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"moe_top_k={self.moe_top_k} must be between 1 and "
                             f"moe_experts={self.moe_experts}")


def gpt_num_params(config: GPTConfig) -> int:
    """Exact number of parameters of ``GPT(config)``, counted from the config alone.

    Returns an int equal to ``sum(p.numel() for p in GPT(config).parameters())`` (a tensor
    shared by two modules counted once) for every config: any ``d_ff``, with and without
    ``config.bias``, with ``config.tie_weights``, and with ``config.moe_experts`` > 0 (every
    block's MLP is then chapter 8's mixture of experts, built by ``apply_moe``). What each
    module holds is in this file's classes (``Block``, ``CausalSelfAttention``, ``MLP``,
    ``GPT``) and in ``minitrain.moe``; the notebook derives the dense count before this
    exercise — reproduce it from the code, not from a model you build (the chapter uses it
    for sizes no machine here could allocate).
    """
    ### BEGIN SOLUTION
    h, f, v, s, L = (config.d_model, config.d_ff, config.vocab_size, config.seq_len, config.n_layer)
    b = 1 if config.bias else 0
    attention = 4 * h * h + b * 4 * h  # q, k, v, out projections
    mlp = 2 * h * f + b * (f + h)  # fc_in, fc_out
    if config.moe_experts:  # a router, and E expert MLPs that always have biases
        mlp = config.moe_experts * (h + 2 * h * f + f + h)
    norms = 2 * (h + b * h)  # ln_1, ln_2 (the gain always, the bias if bias)
    per_block = attention + mlp + norms
    embeddings = v * h + s * h
    final_norm = h + b * h
    head = 0 if config.tie_weights else v * h  # the head has no bias
    return embeddings + L * per_block + final_norm + head
    ### END SOLUTION


def dropout(x: torch.Tensor, p: float, training: bool,
            site: DropoutSite | None = None) -> torch.Tensor:
    """Inverted dropout (Srivastava et al. 2014): zero with probability p, scale by 1/(1-p).

    Written out so autograd saves a bool mask (1 byte per element, as Korthikanti et
    al. 2022 count it) on every device; torch's CPU dropout saves a float mask instead.
    ``site`` (minitrain.dropout): the mask is a function of (seed, step, layer, site, each
    element's global coordinates), the same on every layout; None: torch's generator.
    """
    if not training or p == 0.0:
        return x
    keep = torch.rand_like(x) >= p if site is None else site.keep(x, p)  # bool: saved for backward
    return x * keep * (1.0 / (1.0 - p))


def naive_attention(
    q, k, v, causal: bool = True, dropout_p: float = 0.0, training: bool = False,
    dropout_site: DropoutSite | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v on ``(..., seq, head_dim)`` tensors (Vaswani et al. 2017).

    Materialises the full ``(..., s, s)`` score matrix: the memory flash attention
    (chapter 9) avoids. ``causal`` lets query i see keys j <= i only. The mask is
    *added* as 0/-inf rather than applied with masked_fill, so autograd saves no mask.
    ``dropout_site``: the probabilities' keyed dropout (``dropout``'s ``site``).
    """
    s_q, s_k = q.shape[-2], k.shape[-2]
    scores = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)
    if causal:
        future = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
        bias = torch.zeros(s_q, s_k, dtype=scores.dtype, device=q.device)
        scores = scores + bias.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = dropout(probs, dropout_p, training, dropout_site)
    return probs @ v


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v projections."""

    def __init__(self, config: GPTConfig, attention_fn=None, layer: int = 0,
                 dropout_keys: DropoutKeys | None = None):
        super().__init__()
        self.layer, self.first_head, self.dropout_keys = layer, 0, dropout_keys  # keyed dropout
        h = config.d_model
        self.head_dim = h // config.n_head
        self.dropout = config.dropout
        self.q_proj = nn.Linear(h, h, bias=config.bias)
        self.k_proj = nn.Linear(h, h, bias=config.bias)
        self.v_proj = nn.Linear(h, h, bias=config.bias)
        self.out_proj = nn.Linear(h, h, bias=config.bias)
        # A plain attribute, not a submodule: chapter 9 assigns flash_attention here.
        self.attention_fn = attention_fn or naive_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t):  # (b, s, width) -> (b, heads, s, head_dim)
            # heads come from the tensor's width, not the config, so a tensor-parallel
            # rank holding a slice of q_proj's outputs runs its own subset of heads
            return t.view(b, s, t.shape[-1] // self.head_dim, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        site = dropout_site(self.dropout_keys, self.layer, "attention", self.first_head)
        keyed = {"dropout_site": site} if site and self.training and self.dropout > 0 else {}
        y = self.attention_fn(q, k, v, causal=True, dropout_p=self.dropout,
                              training=self.training, **keyed)  # unkeyed: any attention_fn
        y = y.transpose(1, 2).contiguous().view(b, s, -1)
        return self.out_proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward network: fc_out(GELU(fc_in(x)))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc_in = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.fc_out = nn.Linear(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig, attention_fn=None, layer: int = 0,
                 dropout_keys: DropoutKeys | None = None):
        super().__init__()
        self.dropout, self.layer, self.dropout_keys = config.dropout, layer, dropout_keys
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config, attention_fn, layer, dropout_keys)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)), "attention_output")
        return x + self.drop(self.mlp(self.ln_2(x)), "mlp_output")

    def drop(self, x: torch.Tensor, site: str) -> torch.Tensor:
        # keyed by (layer, site) if the GPT holds a key (minitrain.dropout), else torch's RNG
        keyed = dropout_site(self.dropout_keys, self.layer, site)
        return dropout(x, self.dropout, self.training, keyed)


class GPT(nn.Module):
    """Decoder-only language model: ``logits(run_blocks(embed(idx)))``.

    ``forward(idx)`` returns logits of shape (batch, seq, vocab); ``loss(idx, targets)`` is
    ``loss_fn(logits, targets)``. ``embed`` and ``logits`` are separate methods so a
    pipeline's first and last stages can call them around their share of ``blocks``.
    Later chapters replace its modules (``pos_emb`` is called with the positions) and set the
    attributes at the end of ``__init__``; none subclasses or patches it.
    """

    def __init__(self, config: GPTConfig, attention_fn=None):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.dropout_keys = DropoutKeys()  # what every dropout site reads (minitrain.dropout)
        self.blocks = nn.ModuleList(Block(config, attention_fn, i, self.dropout_keys)
                                    for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        if config.moe_experts:  # chapter 8's layers in place of the MLPs, not re-implemented
            apply_moe(self, config.moe_experts, config.moe_top_k, config.moe_capacity_factor,
                      seed=None, aux_loss_weight=config.moe_aux_weight)
        # Extension points: plain attributes later chapters set.
        self.loss_fn = lm_loss  # (logits, targets) -> loss; chapter 6 sets the vocab-parallel one
        self.block_loop = None  # or (blocks, x) -> x instead of the plain loop: chapter 3
        self.shard_rng = None  # or a stream forward runs embed and blocks in, when dropout acts
        # on this rank's own shard of the sequence (chapter 6, sequence parallelism)

    @staticmethod
    def _init_weights(module):
        # GPT-2's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm gains
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token plus position embeddings. ``positions``: where ``idx``'s tokens sit in the
        sequence (default 0..s-1; context parallelism passes its shard's, chapter 10)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, seq), got shape {tuple(idx.shape)}")
        s = idx.shape[1]
        if s > self.config.seq_len:
            raise ValueError(f"sequence length {s} exceeds config.seq_len={self.config.seq_len}")
        pos = torch.arange(s, device=idx.device) if positions is None else positions
        x = self.tok_emb(idx) + self.pos_emb(pos)
        site = dropout_site(self.dropout_keys, 0, "embedding")
        return dropout(x, self.config.dropout, self.training, site)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks in order, or ``block_loop``'s way (chapter 3's checkpointing policies)."""
        if self.block_loop is not None:
            return self.block_loop(self.blocks, x)
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # positions: handed to embed (context parallelism passes its shard's, chapter 11)
        shards = nullcontext() if self.shard_rng is None else self.shard_rng.fork(idx.device)
        with shards:
            x = self.run_blocks(self.embed(idx, positions))
        return self.logits(x)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``targets`` given ``idx``."""
        return self.loss_fn(self(idx), targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: the language-modelling loss."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def set_attention_fn(model: nn.Module, attention_fn) -> None:
    """Use ``attention_fn(q, k, v, causal, dropout_p, training)`` in every attention layer."""
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            module.attention_fn = attention_fn
