"""``python -m minitrain.train``: flags that are fine alone but wrong together (issue 40).

Chapter 11, notebooks/11_putting_it_together.ipynb; ``minitrain.parallel.command.main`` calls
these after the single-flag checks (``command_errors.check_values``,
``command_flags.check_schedule_and_data``) and before any rank starts. Each refusal is one
line naming the flags, through ``parser.error`` (exit 2). Two kinds:

- accepted silently before: a flag that would do nothing (``--min-lr`` with a constant
  schedule, ``--sequence-parallel`` at ``--tp 1``, a MoE flag without ``--moe-experts``) or
  would do something else than it says (``--min-lr`` above ``--lr``: the "decay" rises;
  ``--warmup-steps`` beyond ``--steps``: the run ends inside its warm-up; a negative
  ``--moe-aux-weight`` rewards imbalance);
- refused only inside the ranks before, as a traceback per rank: the techniques'
  compositions (``parallelize.check_composition``: ZeRO-2/3 with a pipeline, sequence
  parallelism over a sequence ``--tp`` does not divide), now run here first.
"""

from __future__ import annotations

import argparse
import re

from minitrain.parallel.command_flags import config_of, layout_of
from minitrain.parallel.parallelize import check_composition, full_layout


def check_combinations(parser: argparse.ArgumentParser, args: dict, moe_given: list[str],
                       min_lr_given: bool) -> None:
    """Refuse the combinations above. ``moe_given``: the MoE flags typed (``given_moe_flags``,
    read before their defaults were filled in); ``min_lr_given``: ``--min-lr`` was typed."""
    lr, min_lr = args["lr"], args["min_lr"]
    if min_lr_given and args["lr_schedule"] == "constant":
        parser.error(f"--min-lr {min_lr:g} does nothing with --lr-schedule constant (it is "
                     "where the cosine ends): add --lr-schedule cosine, or drop --min-lr")
    if min_lr_given and min_lr > lr:
        parser.error(f"--min-lr {min_lr:g} is above --lr {lr:g}: the cosine would rise, not "
                     "decay (--min-lr must be ≤ --lr)")
    if args["warmup_steps"] > args["steps"]:
        parser.error(f"--warmup-steps {args['warmup_steps']} is more than --steps "
                     f"{args['steps']}: the run would end inside its warm-up")
    if args["moe_aux_weight"] < 0:
        parser.error(f"--moe-aux-weight {args['moe_aux_weight']:g} must be ≥ 0 (a negative "
                     "weight rewards routing every token to the same experts)")
    if moe_given and not args["moe_experts"]:
        flags = ", ".join(moe_given)
        parser.error(f"{flags} without --moe-experts: every MLP is dense, so "
                     f"{'it does' if len(moe_given) == 1 else 'they do'} nothing "
                     "(add --moe-experts E)")
    if args["sequence_parallel"] and args["tp"] == 1:
        parser.error("--sequence-parallel needs --tp > 1: it splits the sequence over the "
                     "tensor-parallel ranks (at --tp 1 it does nothing)")


# parallelize's messages name layout keys ("tp=2", "seq_len 15"); the command names flags
_KEYS = re.compile(r"(?<![-\w])(seq_len|dp|tp|pp|cp|ep|zero)[ =](\d+)")


def check_composition_before_launch(parser: argparse.ArgumentParser, args: dict) -> None:
    """``parallelize.check_composition`` here, in the launching process: inside the ranks
    every rank would raise it as a traceback; here it is one line."""
    try:
        check_composition(config_of(args), full_layout(layout_of(args)))
    except ValueError as exc:
        text = _KEYS.sub(lambda m: f"--{m[1].replace('_', '-')} {m[2]}", str(exc))
        if "sequence parallelism" in text and "--sequence-parallel" not in text:
            text = f"--sequence-parallel: {text}"
        parser.error(text)
