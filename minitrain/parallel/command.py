"""``python -m minitrain.train``: one command trains the course's GPT on any parallel layout.

Chapter 11, notebooks/11_putting_it_together.ipynb and the README's "Train at scale"
(``minitrain/train.py`` is only the command: it calls ``main`` here).

    python -m minitrain.train --steps 50                                   # one process
    python -m minitrain.train --nproc 4 --dp 2 --tp 2 --steps 50           # 4 local ranks
    torchrun --standalone --nproc-per-node=4 -m minitrain.train --dp 2 --tp 2
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29400 --rdzv-id=run1 -m minitrain.train --dp 2 --tp 8

The same seed and model flags give the same loss curve on every layout (the global batch is
fixed; ``minitrain.parallel.parallelize`` builds the layout from the chapters' techniques).
Rank 0 shows a progress bar (tqdm) and writes JSON lines ``{"step", "loss", "lr", "tokens_per_s", "mfu", ...}`` to
``--log-file`` (``"val_loss"`` every ``--eval-every`` steps). ``--lr-schedule cosine
--warmup-steps N``: linear warm-up, then cosine decay (``minitrain.parallel.schedule``);
``--data FILE`` trains on a text file's bytes (vocabulary 256, its last 10 % held out). ``--checkpoint-dir`` with ``--checkpoint-every K`` saves sharded, atomic
checkpoints; ``--resume`` continues from the newest one exactly as if never stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from minitrain.data import TextData
from minitrain.model import GPTConfig
from minitrain.parallel.command_errors import (
    OneLineParser,
    check_storage,
    check_values,
    open_log,
    run_reporting,
)
from minitrain.parallel.mesh import check_layout
from minitrain.parallel.parallelize import PRECISIONS, check_moe_composition, full_layout
from minitrain.parallel.run_checkpoint import (
    latest_checkpoint,
    load_run,
    save_run,
)
from minitrain.parallel.schedule import SCHEDULES, lr_at
from minitrain.parallel.trainer import ParallelGPT
from minitrain.runtime import device_clock, get_device, run, running_under_torchrun
from minitrain.step import CPU_PEAK_FLOPS, flops_per_token, mfu, peak_flops  # noqa: F401

# CPU_PEAK_FLOPS is minitrain.step's, re-exported here (minitrain.parallel exports it)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minitrain.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
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
    moe = p.add_argument_group("mixture of experts (chapter 8) and expert parallelism")
    moe.add_argument("--moe-experts", type=int, default=0,
                     help="experts per MoE layer, in every block's MLP (0: dense MLPs)")
    moe.add_argument("--moe-top-k", type=int, default=2, help="experts per token")
    moe.add_argument("--moe-capacity-factor", type=float, default=None,
                     help="expert capacity ⌈C·k·T/E⌉ (default: none, no token dropped)")
    moe.add_argument("--ep", type=int, default=1,
                     help="expert-parallel size: ranks of dp × cp holding different experts")
    moe.add_argument("--moe-aux-weight", type=float, default=0.01,
                     help="weight of Switch's load-balancing loss (log: aux_loss, unweighted)")
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
    return p


def add_schedule_and_data_flags(p: argparse.ArgumentParser) -> None:
    """Issue 28: the learning-rate schedule, dropout, a text file and the held-out loss."""
    sched = p.add_argument_group("learning rate and regularisation")
    sched.add_argument("--lr-schedule", choices=SCHEDULES, default="constant",
                       help="after the warm-up: constant --lr, or cosine decay to --min-lr at "
                            "--steps (Loshchilov & Hutter 2017)")
    sched.add_argument("--warmup-steps", type=int, default=0,
                       help="linear warm-up: step s < N uses lr·(s+1)/N")
    sched.add_argument("--min-lr", type=float, default=None,
                       help="where cosine ends (default: 0.1 × --lr)")
    sched.add_argument("--dropout", type=float, default=0.0, help="dropout probability, [0, 1)")
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


def config_of(args: dict) -> GPTConfig:
    vocab = args["vocab_size"] or (256 if args.get("data") else 64)
    moe = {"moe_experts": args.get("moe_experts", 0), "moe_top_k": args.get("moe_top_k", 2),
           "moe_capacity_factor": args.get("moe_capacity_factor"),
           "moe_aux_weight": args.get("moe_aux_weight", 0.01)}
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


def layout_of(args: dict) -> dict:
    keys = ("dp", "tp", "pp", "cp", "zero", "microbatches", "schedule", "sequence_parallel",
            "precision")
    return {**{k: args[k] for k in keys}, "ep": args.get("ep", 1)}


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


def train_rank(args: dict) -> dict:
    """Run on every rank: build the layout, resume, train, checkpoint. Returns rank 0's log
    (the losses) and this rank's coordinates."""
    config, layout = config_of(args), layout_of(args)
    data = TextData.from_file(args["data"], config.seq_len, args["seed"]) \
        if args.get("data") else None
    job = ParallelGPT(config, layout, args["batch_size"], args["lr"], args["seed"], data=data,
                      eval_batches=args.get("eval_batches", 4),
                      clip_grad_norm=args["clip_grad_norm"])
    schedule = schedule_of(args)
    identity = {"config": vars(config), "layout": job.layout, "seed": args["seed"],
                "batch_size": args["batch_size"], **schedule_identity(schedule)}
    rank, first = dist.get_rank(), 0
    ckpt = args["checkpoint_dir"]
    if args["resume"]:
        path = latest_checkpoint(ckpt) if ckpt else None
        if path is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint in {ckpt!r}")
        first, state = load_run(path, identity)
        job.load_state(state)
    tokens = args["batch_size"] * config.seq_len
    fpt = flops_per_token(config)
    # MFU against this device's peak in the compute dtype (bf16/fp16 tensor cores, else fp32;
    # issue 29); an unknown GPU fails here, before training, asking for --peak-flops
    device = get_device()
    peak = args.get("peak_flops")
    if peak is None:
        peak = peak_flops(device, PRECISIONS[args.get("precision", "fp32")] or torch.float32)
    world = dist.get_world_size()
    bar = None
    if rank == 0 and not args["no_progress"] and sys.stderr.isatty():  # no \r frames in a file
        from tqdm import tqdm

        bar = tqdm(total=args["steps"], initial=first, desc="train", unit="step", file=sys.stderr)
    log = open_log(args["log_file"], first, args["resume"]) if rank == 0 and \
        args["log_file"] else None
    records = []
    try:
        for step in range(first, args["steps"]):
            lr = lr_at(step, **schedule)  # a function of the step: a resume continues it
            job.set_lr(lr)
            # device_clock: a GPU's queued kernels finish before the clock is read
            start = device_clock(device)
            loss = job.step(step)
            seconds = device_clock(device) - start
            rate = tokens / seconds
            rec = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": round(rate, 1),
                   "seconds": round(seconds, 5),
                   "mfu": mfu(rate, fpt, peak * world)}
            rec.update(job.last_metrics)  # grad_norm; loss_scale with fp16
            eval_every = args.get("eval_every", 0)
            if eval_every and ((step + 1) % eval_every == 0 or step + 1 == args["steps"]):
                rec["val_loss"] = job.evaluate()  # after this step's update, not timed
            records.append(rec)
            if log:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:.0f}")
                bar.update(1)
            done = step + 1
            every = args["checkpoint_every"]
            if ckpt and ((every and done % every == 0) or done == args["steps"]):
                save_run(ckpt, done, job.state(), identity)
    finally:
        if bar is not None:
            bar.close()
        if log:
            log.close()
    return {"rank": rank, "coords": tuple(job.mesh.coords()), "records": records}


def _in_this_process(args: dict) -> dict:
    """One rank, here: a one-process gloo group on an in-memory store."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return train_rank(args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    if args["precision"] not in PRECISIONS:
        parser.error(f"--precision {args['precision']}: expected one of fp32, bf16, fp16")
    if not args["clip_grad_norm"] >= 0:
        parser.error(f"--clip-grad-norm {args['clip_grad_norm']}: must be >= 0 (0: off)")
    world = args["dp"] * args["tp"] * args["pp"] * args["cp"]
    layout = f"dp={args['dp']} × tp={args['tp']} × pp={args['pp']} × cp={args['cp']} = {world}"
    if running_under_torchrun():
        have = int(os.environ["WORLD_SIZE"])
        if have != world:
            parser.error(f"impossible layout: {layout} ranks, but torchrun started {have}")
    elif args["nproc"] is not None and args["nproc"] != world:
        parser.error(f"impossible layout: {layout} ranks, but --nproc is {args['nproc']}")
    check_values(parser, args)
    check_schedule_and_data(parser, args)
    problem = check_moe_flags(args)
    if problem:
        parser.error(problem)
    try:
        check_layout(config_of(args), args["dp"], args["tp"], args["pp"], args["cp"],
                     args["seq_len"], args["batch_size"], args["microbatches"])
    except ValueError as exc:
        parser.error(str(exc))
    check_storage(parser, args, rank0=os.environ.get("RANK", "0") == "0")

    def train():
        if world == 1 and not running_under_torchrun():
            return [_in_this_process(args)]  # no worker: the progress bar is live
        # --nproc ranks print through the launcher, after they finish
        return run(train_rank, world, args, timeout=args["timeout"])

    results, status = run_reporting(train, args)
    if status:
        return status
    mine = [results] if running_under_torchrun() else results
    first = mine[0]
    if first["rank"] == 0 and first["records"]:
        last = first["records"][-1]
        print(f"done: {len(first['records'])} steps, final loss {last['loss']:.4f}, "
              f"{last['tokens_per_s']:.0f} tokens/s, MFU {100 * last['mfu']:.2f} %", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
