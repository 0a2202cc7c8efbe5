"""``python -m minitrain.train``'s command line: its flags, their checks, and what they mean.

Chapter 11, notebooks/11_putting_it_together.ipynb; ``minitrain.parallel.command`` builds its
parser with ``add_flags`` and runs. Here: every flag with its help (the groups ``--help``
shows), the checks that refuse a bad value in one line naming the flag (``parser.error``), and
the flags turned into what the run is made of — the model's ``GPTConfig`` (``config_of``), the
layout (``layout_of``), the learning-rate schedule (``schedule_of``) and the parts of a
checkpoint's identity that name the schedule's flags (``schedule_identity``), the data file and
the clipping (``run_identity``). Flags refused only together: ``command_checks``.
"""

from __future__ import annotations

import argparse
import hashlib
import os

from minitrain.data import TextData
from minitrain.model import GPTConfig
from minitrain.parallel.parallelize import check_moe_composition, full_layout
from minitrain.parallel.schedule import SCHEDULES


def add_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of ``python -m minitrain.train``, by group, onto the parser ``p``."""
    layout = p.add_argument_group("layout (dp × tp × pp × cp must equal the number of ranks)")
    for axis, what in (("dp", "data"), ("tp", "tensor"), ("pp", "pipeline"), ("cp", "context")):
        layout.add_argument(f"--{axis}", type=int, default=1, help=f"{what}-parallel size")
    layout.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                        help="ZeRO stage of the data-parallel axis (0: plain DDP)")
    layout.add_argument("--microbatches", type=int, default=1, help="micro-batches per step")
    layout.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    layout.add_argument("--sequence-parallel", action="store_true", help="with --tp > 1")
    layout.add_argument("--nproc", type=int, default=None,
                        help="local ranks through minitrain.runtime (default: dp·tp·pp·cp)")
    moe = p.add_argument_group("mixture of experts (chapter 8) and expert parallelism",
                               "the flags after --moe-experts need it")
    moe.add_argument("--moe-experts", type=int, default=0,
                     help="experts per MoE layer, in every block's MLP (0: dense MLPs)")
    # default None, filled in by fill_moe_defaults: a typed value, even the default's own,
    # shows as given, and is refused without --moe-experts (issue 40)
    moe.add_argument("--moe-top-k", type=int, default=None, help="experts per token (default 2)")
    moe.add_argument("--moe-capacity-factor", type=float, default=None,
                     help="expert capacity ⌈C·k·T/E⌉ (default: none, no token dropped)")
    moe.add_argument("--ep", type=int, default=None,
                     help="expert-parallel size: ranks of dp × cp holding different experts "
                          "(default 1)")
    moe.add_argument("--moe-aux-weight", type=float, default=None,
                     help="weight (≥ 0) of Switch's load-balancing loss (default 0.01; log: "
                          "aux_loss, unweighted)")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=50)
    train.add_argument("--batch-size", type=int, default=8, help="global batch (sequences)")
    train.add_argument("--seq-len", type=int, default=32)
    train.add_argument("--n-layer", type=int, default=2)
    train.add_argument("--n-head", type=int, default=4)
    train.add_argument("--d-model", type=int, default=64)
    train.add_argument("--vocab-size", type=int, default=None,
                       help="default 64; with --data 256 (bytes), and nothing else is accepted")
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--peak-flops", type=float, default=None,
                       help="peak FLOP/s of one device, for the MFU estimate (default: the "
                       "device's, minitrain.step.peak_flops: A100/H100/H200 data sheets in the "
                       "--precision's dtype, one core of the course machine on a CPU)")
    add_schedule_and_data_flags(p)
    prec = p.add_argument_group("precision and clipping")
    prec.add_argument("--precision", default="fp32", help="fp32, bf16 or fp16: the compute "
                      "dtype (masters and optimizer state stay fp32; fp16: loss scaling)")
    prec.add_argument("--clip-grad-norm", type=float, default=0.0,
                      help="clip the global gradient norm to X (0: off); logs grad_norm")
    out = p.add_argument_group("logging and checkpoints")
    out.add_argument("--log-file", default=None, help="JSON lines, one per step (rank 0)")
    out.add_argument("--checkpoint-dir", default=None)
    out.add_argument("--checkpoint-every", type=int, default=0, help="steps (0: only at the end)")
    out.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    out.add_argument("--overwrite", action="store_true",
                     help="a fresh run may replace the checkpoints already in --checkpoint-dir")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument("--timeout", type=float, default=900.0, help="seconds (with --nproc)")


def add_schedule_and_data_flags(p: argparse.ArgumentParser) -> None:
    """Issue 28: the learning-rate schedule, dropout, a text file and the held-out loss."""
    sched = p.add_argument_group("learning rate and regularisation")
    sched.add_argument("--lr-schedule", choices=SCHEDULES, default="constant",
                       help="after the warm-up: constant --lr, or cosine decay to --min-lr at "
                            "--steps (Loshchilov & Hutter 2017)")
    sched.add_argument("--warmup-steps", type=int, default=0,
                       help="linear warm-up: step s < N uses lr·(s+1)/N (N ≤ --steps)")
    sched.add_argument("--min-lr", type=float, default=None,
                       help="where cosine ends, ≤ --lr (default: 0.1 × --lr; only with "
                            "--lr-schedule cosine)")
    sched.add_argument("--dropout", type=float, default=0.0, help="dropout probability, [0, 1); every mask is a function of "
                       "(seed, step, layer, global position), so every layout follows one "
                       "process's curve (under --cp, attention dropout gathers K and V "
                       "instead of running the ring)")
    data = p.add_argument_group("data and evaluation")
    data.add_argument("--data", default=None, metavar="FILE",
                      help="train on this text file's bytes (byte-level tokens, vocabulary 256), "
                           "its last 10 %% held out for --eval-every (default: the synthetic "
                           "Markov-chain data of minitrain.data)")
    data.add_argument("--eval-every", type=int, default=0, metavar="K",
                      help="every K steps and at the last, log val_loss: the mean loss over a "
                           "fixed held-out set (--data's last 10 %%, or without --data synthetic "
                           "batches from a separate random stream), no dropout, no step "
                           "(0: never)")
    data.add_argument("--eval-batches", type=int, default=4,
                      help="global batches in the held-out set")


def check_schedule_and_data(parser: argparse.ArgumentParser, args: dict) -> None:
    """One clear error per bad value, naming the flag; fills in the defaults that depend on
    other flags (--min-lr from --lr, --vocab-size from --data)."""
    for flag in ("warmup_steps", "eval_every"):
        if args[flag] < 0:
            parser.error(f"argument --{flag.replace('_', '-')}: must be >= 0, got {args[flag]}")
    if args["eval_batches"] < 1:
        parser.error(f"argument --eval-batches: must be >= 1, got {args['eval_batches']}")
    if not 0.0 <= args["dropout"] < 1.0:
        parser.error(f"argument --dropout: must be in [0, 1), got {args['dropout']}")
    if args["min_lr"] is None:
        args["min_lr"] = 0.1 * args["lr"]
    elif args["min_lr"] < 0:
        parser.error(f"argument --min-lr: must be >= 0, got {args['min_lr']}")
    if args["data"] is None:
        args["vocab_size"] = 64 if args["vocab_size"] is None else args["vocab_size"]
        return
    if args["vocab_size"] not in (None, 256):
        parser.error(f"argument --vocab-size: --data trains on bytes, a vocabulary of 256; "
                     f"--vocab-size {args['vocab_size']} conflicts with it")
    args["vocab_size"] = 256
    try:
        TextData.from_file(args["data"], args["seq_len"], args["seed"])
    except ValueError as exc:
        parser.error(f"argument --data: {exc}")


# the effective defaults of the flags whose parser default is None (so that typing one shows)
MOE_DEFAULTS = {"moe_top_k": 2, "moe_capacity_factor": None, "moe_aux_weight": 0.01, "ep": 1}


def given_moe_flags(args: dict) -> list[str]:
    """The MoE flags typed on the command line (before ``fill_moe_defaults``), as typed."""
    return [f"--{k.replace('_', '-')} {args[k]:g}" for k in MOE_DEFAULTS
            if args.get(k) is not None]


def fill_moe_defaults(args: dict) -> None:
    for key, default in MOE_DEFAULTS.items():
        if args.get(key) is None:
            args[key] = default


def _value(args: dict, key: str):
    """``args[key]``, or its effective default when absent or None (a parser's raw output,
    or a dict built by hand for ``train_rank``)."""
    value = args.get(key)
    return MOE_DEFAULTS[key] if value is None else value


def config_of(args: dict) -> GPTConfig:
    vocab = args["vocab_size"] or (256 if args.get("data") else 64)
    moe = {"moe_experts": args.get("moe_experts", 0), "moe_top_k": _value(args, "moe_top_k"),
           "moe_capacity_factor": args.get("moe_capacity_factor"),
           "moe_aux_weight": _value(args, "moe_aux_weight")}
    return GPTConfig(vocab_size=vocab, seq_len=args["seq_len"], n_layer=args["n_layer"],
                     n_head=args["n_head"], d_model=args["d_model"],
                     dropout=args.get("dropout", 0.0), **moe)


def schedule_of(args: dict) -> dict:
    """``lr_at``'s keyword arguments from the flags. The checkpoint's identity holds them
    under the flags' names, so a resume with another --lr is an error naming both values;
    --steps is the cosine's length, so it counts only for the cosine."""
    min_lr = args.get("min_lr")
    return {"lr": args["lr"], "schedule": args.get("lr_schedule", "constant"),
            "warmup_steps": args.get("warmup_steps", 0),
            "min_lr": 0.1 * args["lr"] if min_lr is None else min_lr,
            "total_steps": args["steps"]}


def schedule_identity(s: dict) -> dict:
    cosine = s["schedule"] == "cosine"
    return {"--lr": s["lr"], "--lr-schedule": s["schedule"], "--warmup-steps": s["warmup_steps"],
            "--min-lr": s["min_lr"] if cosine else None,
            "--steps (the cosine's length)": s["total_steps"] if cosine else None}


def run_identity(args: dict) -> dict:
    """The rest of a checkpoint's identity (issue 40): a resume on another text file, or with
    another clipping threshold, would continue a different run without a word. The file is
    named by its name and the SHA-256 of its bytes (the same path may hold new text)."""
    return {"--data": data_identity(args.get("data")),
            "--clip-grad-norm": args.get("clip_grad_norm", 0.0)}


def data_identity(path: str | None) -> str | None:
    if not path:
        return None  # the synthetic data: a function of the seed, already in the identity
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return f"{os.path.basename(path)} (sha256 {digest.hexdigest()})"


def layout_of(args: dict) -> dict:
    keys = ("dp", "tp", "pp", "cp", "zero", "microbatches", "schedule", "sequence_parallel",
            "precision")
    return {**{k: args[k] for k in keys}, "ep": _value(args, "ep")}


def check_moe_flags(args: dict) -> str | None:
    """The mixture-of-experts flags' problem, as one line naming the flag (None: fine)."""
    experts, k, c = args["moe_experts"], args["moe_top_k"], args["moe_capacity_factor"]
    if experts < 0:
        return f"--moe-experts {experts} must be ≥ 0"
    if experts and not 1 <= k <= experts:
        return f"--moe-top-k {k} must be between 1 and --moe-experts {experts}"
    if c is not None and not c > 0:
        return f"--moe-capacity-factor {c} must be positive"
    try:  # (a bad model shape is reported here too: one line either way)
        check_moe_composition(config_of(args), full_layout(layout_of(args)))
    except ValueError as exc:
        return str(exc)
    return None
