"""``python -m minitrain.train``'s expected failures: refused flags, storage found wanting before
step 1, signals and checkpoint errors, each reported in one line (issue 30).

Chapter 11, notebooks/11_putting_it_together.ipynb (``minitrain.parallel.command`` calls these).
An operator reads one line naming the cause — the flag as typed, the file — and a non-zero exit
status: 2 for a refused flag, 1 for a failed run, 128 + the signal for a stop (130 for Ctrl-C).
An *unexpected* error keeps its traceback: that is a bug to report, and the stack is the report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile

from minitrain.runtime.launch_errors import LaunchError
from minitrain.runtime.stopping import Interrupted, signals_interrupt
from minitrain.zero.checkpoint import CheckpointError, latest_checkpoint

PROG = "minitrain.train"


class Diverged(RuntimeError):
    """The run stopped at a non-finite loss (issue 40): raised by every rank at the same step
    (the loss is the same number on every rank), reported in one line, exit 1."""


# the exceptions a rank may raise that are an operator's problem, not a bug (one line each)
EXPECTED = {
    f"{CheckpointError.__module__}.{CheckpointError.__qualname__}",
    f"{Diverged.__module__}.{Diverged.__qualname__}",
    "builtins.FileNotFoundError",
    "builtins.PermissionError",
    "builtins.IsADirectoryError",
    "builtins.NotADirectoryError",
}


class OneLineParser(argparse.ArgumentParser):
    """``parser.error(message)`` prints one line, ``minitrain.train: error: <message>``, to
    stderr and exits 2 — no usage dump (``--help`` still shows it)."""

    def error(self, message):
        self.exit(2, f"{PROG}: error: {message}\n")


def check_values(parser: argparse.ArgumentParser, args: dict) -> None:
    """Refuse values that would train nothing, checkpoint every step by accident, or fail later
    with a traceback. Each message names the flag as typed."""
    rules = [
        ("--steps", args["steps"] >= 1, "must be at least 1"),
        ("--batch-size", args["batch_size"] >= 1, "must be at least 1"),
        ("--checkpoint-every", args["checkpoint_every"] >= 0,
         "must be 0 (only at the end) or a positive number of steps"),
        ("--timeout", args["timeout"] > 0, "must be a positive number of seconds"),
        ("--microbatches", args["microbatches"] >= 1, "must be at least 1"),
    ]
    if args.get("nproc") is not None:
        rules.append(("--nproc", args["nproc"] >= 1, "must be at least 1"))
    for axis in ("dp", "tp", "pp", "cp"):
        rules.append((f"--{axis}", args[axis] >= 1, "must be at least 1"))
    for flag, ok, rule in rules:
        if not ok:
            value = args[flag[2:].replace("-", "_")]
            parser.error(f"{flag} {rule}, got {value:g}" if isinstance(value, float)
                         else f"{flag} {rule}, got {value}")
    if args["resume"] and not args["checkpoint_dir"]:
        parser.error("--resume needs --checkpoint-dir (the directory to resume from)")


def check_storage(parser: argparse.ArgumentParser, args: dict, rank0: bool = True) -> None:
    """Before step 1: the log's directory exists and is writable; the checkpoint directory can
    be created and written; ``--resume`` finds a checkpoint; a fresh run does not mix its
    checkpoints with another run's (``--overwrite`` removes those first, on rank 0)."""
    log = args.get("log_file")
    if log:
        where = os.path.dirname(os.path.abspath(log))
        if not os.path.isdir(where):
            parser.error(f"--log-file {log}: directory {where} does not exist")
        if os.path.isdir(log):
            parser.error(f"--log-file {log} is a directory")
        _probe(parser, "--log-file", log, where)
    ckpt = args.get("checkpoint_dir")
    if not ckpt:
        return
    if os.path.exists(ckpt) and not os.path.isdir(ckpt):
        parser.error(f"--checkpoint-dir {ckpt} is a file, not a directory")
    try:
        os.makedirs(ckpt, exist_ok=True)
    except OSError as exc:
        parser.error(f"--checkpoint-dir {ckpt} cannot be created: {exc.strerror or exc}")
    _probe(parser, "--checkpoint-dir", ckpt, ckpt)
    found = latest_checkpoint(ckpt)
    if args["resume"]:
        if found is None:
            parser.error(f"--resume: no complete checkpoint in --checkpoint-dir {ckpt}")
        return
    old = sorted(d for d in os.listdir(ckpt) if d.startswith("step_"))
    complete = [d for d in old if not d.endswith(".partial")]
    if complete and not args.get("overwrite"):
        parser.error(f"--checkpoint-dir {ckpt} already holds checkpoints of another run "
                     f"({complete[-1]}): continue it with --resume, replace them with --overwrite, "
                     f"or choose another directory")
    if old and rank0:
        for d in old:  # else a later --resume could pick the older run's newest step
            shutil.rmtree(os.path.join(ckpt, d), ignore_errors=True)


def _probe(parser, flag: str, shown: str, directory: str) -> None:
    """Create and remove a file in ``directory``: a read-only mount or a full quota shows now,
    not after the first steps (``os.access`` would say yes to root on a read-only mount)."""
    try:
        fd, path = tempfile.mkstemp(prefix=".minitrain-probe-", dir=directory)
        os.close(fd)
        os.unlink(path)
    except OSError as exc:
        parser.error(f"{flag} {shown} is not writable: {exc.strerror or exc}")


def open_log(path: str, first_step: int, resume: bool):
    """The log file, opened for appending. On resume it is first cut back to the steps before
    ``first_step`` (the checkpoint's): steps the killed run logged after its last checkpoint
    are trained again, and each step must appear once."""
    if resume and os.path.exists(path):
        kept = []
        with open(path) as fh:
            for line in fh:
                try:
                    if json.loads(line)["step"] < first_step:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError, TypeError):
                    break  # a line cut by the kill: nothing after it is trusted
        tmp = f"{path}.tmp"
        with open(tmp, "w") as fh:
            fh.writelines(kept)
        os.replace(tmp, path)
        return open(path, "a")  # noqa: SIM115 — closed by the training loop
    return open(path, "w")  # noqa: SIM115


# fp16's smallest subnormal: a loss scale below it flushes an O(1) loss's scaled gradients to
# zero, so when overflows still drive the scale down past it, scaling cannot help any more —
# the gradients themselves are inf/NaN (40 halvings in a row from the initial 2**16)
MIN_LOSS_SCALE = 2.0**-24


def divergence(step: int, loss: float, metrics: dict, scale: float | None) -> str | None:
    """Why the run must stop after ``step`` (None: it goes on). ``metrics``: the step's
    ``last_metrics``; ``scale``: the fp16 loss scale the *next* step would use (None without
    a scaler). Every input is the same number on every rank, so every rank stops here."""
    if not math.isfinite(loss):
        return f"the loss is not finite at step {step} ({loss})"
    norm = metrics.get("grad_norm")
    if scale is None and norm is not None and not math.isfinite(norm):
        # without a scaler nothing skips the update: the weights are non-finite from here
        return f"the gradient norm is not finite at step {step} ({norm})"
    if scale is not None and scale < MIN_LOSS_SCALE:
        return (f"the fp16 loss scale fell to {scale:.3g} at step {step}, below 2**-24: every "
                "step overflows (the loss scaler has given up)")
    return None


def stop_diverged(problem: str, checkpoint_dir: str | None) -> Diverged:
    """The one line of a diverged run, naming the checkpoint to go back to: the newest, as this
    step's own (its weights are not finite) is never written."""
    last = latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
    where = (f"the last good checkpoint is {last}" if last else
             "no checkpoint was written" if checkpoint_dir else "no --checkpoint-dir")
    return Diverged(f"{problem}: stopped; {where}")


def json_line(record: dict) -> str:
    """A log record as strict JSON: a non-finite number (a diverged step's loss) as null —
    Python's default writes NaN, which no JSON parser reads."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v
             for k, v in record.items()}
    return json.dumps(clean, allow_nan=False)


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _no_signals():
    """Reporting runs with stop signals ignored: a second Ctrl-C must not turn the one line
    into a traceback."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_reporting(train, args: dict):
    """``train()`` with every expected failure turned into one line and an exit status.

    Returns ``(results, 0)`` or ``(None, status)``. SIGINT/SIGTERM/SIGHUP stop every rank (the
    launcher's clean-up) and are reported with the checkpoint to resume from."""
    try:
        with signals_interrupt():
            return train(), 0
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        with _no_signals():
            name = signal.Signals(signum).name
            ckpt = args.get("checkpoint_dir")
            last = latest_checkpoint(ckpt) if ckpt else None
            where = (f"the last complete checkpoint is {last}: continue with --resume"
                     if last else "no complete checkpoint was written")
            _say(f"stopped by {name}; every rank has stopped; {where}")
        return None, 128 + int(signum)
    except LaunchError as exc:
        if exc.error_type in EXPECTED:
            _say(exc.error_text.splitlines()[0] if exc.error_text else str(exc).splitlines()[0])
        elif not exc.error_type:  # a rank died or hung: the message says which, and where
            _say(str(exc))
        else:  # an unexpected exception: its traceback is the report
            _say(str(exc))
        return None, 1
    except (CheckpointError, Diverged, FileNotFoundError, PermissionError, IsADirectoryError,
            NotADirectoryError) as exc:  # one process: raised here, not through the launcher
        _say(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None, 1
