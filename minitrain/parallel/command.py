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
checkpoints; ``--resume`` continues from the newest one exactly as if never stopped, and refuses
one of another model, layout, seed, schedule, ``--data`` file or ``--clip-grad-norm``, naming
the flag. A flag refused, alone or with another (``--min-lr`` above ``--lr`` or without the
cosine, ``--warmup-steps`` beyond ``--steps``, a MoE flag without ``--moe-experts``,
``--sequence-parallel`` at ``--tp 1``, ZeRO-2/3 with ``--pp``), is one line naming it, before
any rank starts (exit 2). A loss that is not finite stops the run at that step, in one line
naming the step and the last good checkpoint (exit 1; the log line holds ``"loss": null``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from minitrain.data import TextData
from minitrain.parallel.command_checks import check_combinations, check_composition_before_launch
from minitrain.parallel.command_errors import (
    OneLineParser,
    check_storage,
    check_values,
    divergence,
    json_line,
    open_log,
    run_reporting,
    stop_diverged,
)
from minitrain.parallel.command_flags import (  # noqa: F401 (all importable from here)
    add_flags,
    add_schedule_and_data_flags,
    check_moe_flags,
    check_schedule_and_data,
    config_of,
    fill_moe_defaults,
    given_moe_flags,
    layout_of,
    run_identity,
    schedule_identity,
    schedule_of,
)
from minitrain.parallel.mesh import check_layout
from minitrain.parallel.parallelize import PRECISIONS
from minitrain.parallel.run_checkpoint import (
    latest_checkpoint,
    load_run,
    save_run,
)
from minitrain.parallel.schedule import lr_at
from minitrain.parallel.trainer import ParallelGPT
from minitrain.runtime import (
    default_backend,
    device_clock,
    get_device,
    run,
    running_under_torchrun,
)
from minitrain.step import CPU_PEAK_FLOPS, flops_per_token, mfu, peak_flops  # noqa: F401

# CPU_PEAK_FLOPS is minitrain.step's, re-exported here (minitrain.parallel exports it)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minitrain.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    add_flags(p)  # command_flags.py: every flag, by group
    return p


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
    identity.update(run_identity(args))  # --data (name, SHA-256) and --clip-grad-norm
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
            # issue 40: stop at the first non-finite loss, before evaluating or checkpointing
            # its weights; every rank sees the same numbers, so all stop here, no collective
            scaler = getattr(job, "scaler", None)
            problem = divergence(step, loss, job.last_metrics,
                                 scaler.get_scale() if scaler is not None else None)
            if problem:
                if log:
                    log.write(json_line(rec) + "\n")  # the bad step, its loss null
                raise stop_diverged(problem, ckpt)
            eval_every = args.get("eval_every", 0)
            if eval_every and ((step + 1) % eval_every == 0 or step + 1 == args["steps"]):
                rec["val_loss"] = job.evaluate()  # after this step's update, not timed
            records.append(rec)
            if log:
                log.write(json_line(rec) + "\n")
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
    """One rank, here: a one-process group on an in-memory store — gloo, and NCCL for CUDA
    tensors on a GPU machine (``default_backend``: then ``get_device()`` is the GPU; with gloo
    alone a GPU node's one-rank run trained on the CPU, issue 41)."""
    backend = default_backend(1)
    if "nccl" in backend:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        return train_rank(args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    # read before the defaults are filled in: a typed flag shows even at its default's value
    moe_given, min_lr_given = given_moe_flags(args), args["min_lr"] is not None
    fill_moe_defaults(args)
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
    check_combinations(parser, args, moe_given, min_lr_given)
    try:
        check_layout(config_of(args), args["dp"], args["tp"], args["pp"], args["cp"],
                     args["seq_len"], args["batch_size"], args["microbatches"])
    except ValueError as exc:
        parser.error(str(exc))
    check_composition_before_launch(parser, args)  # else a traceback on every rank
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
