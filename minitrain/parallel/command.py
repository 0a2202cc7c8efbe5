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
Rank 0 shows a progress bar (tqdm) and writes JSON lines ``{"step", "loss", "tokens_per_s", "mfu", ...}`` to
``--log-file``. ``--checkpoint-dir`` with ``--checkpoint-every K`` saves sharded, atomic
checkpoints; ``--resume`` continues from the newest one exactly as if never stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch.distributed as dist

from minitrain.model import GPTConfig
from minitrain.parallel.command_errors import (
    OneLineParser,
    check_storage,
    check_values,
    open_log,
    run_reporting,
)
from minitrain.parallel.mesh import check_layout
from minitrain.parallel.run_checkpoint import latest_checkpoint, load_run, save_run
from minitrain.parallel.trainer import ParallelGPT
from minitrain.runtime import run, running_under_torchrun
from minitrain.step import flops_per_token, mfu

CPU_PEAK_FLOPS = 118.4e9  # per rank: this course machine's fp32 FMA peak per core (bench mfu)


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
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=50)
    train.add_argument("--batch-size", type=int, default=8, help="global batch (sequences)")
    train.add_argument("--seq-len", type=int, default=32)
    train.add_argument("--n-layer", type=int, default=2)
    train.add_argument("--n-head", type=int, default=4)
    train.add_argument("--d-model", type=int, default=64)
    train.add_argument("--vocab-size", type=int, default=64)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--peak-flops", type=float, default=CPU_PEAK_FLOPS,
                       help="peak FLOP/s of one device, for the MFU estimate")
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


def config_of(args: dict) -> GPTConfig:
    return GPTConfig(vocab_size=args["vocab_size"], seq_len=args["seq_len"],
                     n_layer=args["n_layer"], n_head=args["n_head"], d_model=args["d_model"])


def layout_of(args: dict) -> dict:
    keys = ("dp", "tp", "pp", "cp", "zero", "microbatches", "schedule", "sequence_parallel")
    return {k: args[k] for k in keys}


def train_rank(args: dict) -> dict:
    """Run on every rank: build the layout, resume, train, checkpoint. Returns rank 0's log
    (the losses) and this rank's coordinates."""
    config, layout = config_of(args), layout_of(args)
    job = ParallelGPT(config, layout, args["batch_size"], args["lr"], args["seed"])
    identity = {"config": vars(config), "layout": job.layout, "seed": args["seed"],
                "batch_size": args["batch_size"]}
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
            start = time.perf_counter()
            loss = job.step(step)
            seconds = time.perf_counter() - start
            rate = tokens / seconds
            rec = {"step": step, "loss": loss, "tokens_per_s": round(rate, 1),
                   "seconds": round(seconds, 5),
                   "mfu": mfu(rate, fpt, args["peak_flops"] * world)}
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
    world = args["dp"] * args["tp"] * args["pp"] * args["cp"]
    layout = f"dp={args['dp']} × tp={args['tp']} × pp={args['pp']} × cp={args['cp']} = {world}"
    if running_under_torchrun():
        have = int(os.environ["WORLD_SIZE"])
        if have != world:
            parser.error(f"impossible layout: {layout} ranks, but torchrun started {have}")
    elif args["nproc"] is not None and args["nproc"] != world:
        parser.error(f"impossible layout: {layout} ranks, but --nproc is {args['nproc']}")
    check_values(parser, args)
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
