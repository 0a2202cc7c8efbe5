"""Benchmarks: ``python -m minitrain.bench <name> [options]``.

Each benchmark measures minitrain against its reference (torch's own
implementation, or the plain single-process run) in the same run, on the same
machine, and prints the medians side by side with their ratio. Speed targets are
checked here, never by timed unit tests. ``python -m minitrain.bench`` lists them.

What they share lives here: the command line (``bench_parser``: ``--quick``, ``--steps``),
the step-time columns of their reports (``step_time_header``, ``step_time_row``), the
aligned table (``print_table``) and how far apart two sets of parameters are
(``max_abs_difference``: a side-by-side run's agreement, and how far training moved them).
The step times themselves are summarised by
``minitrain.runtime.summarize_step_times``, which the techniques' measuring code uses too.
"""

from __future__ import annotations

import argparse


class _BenchParser(argparse.ArgumentParser):
    """An ArgumentParser whose ``--steps``, when not given, defaults by ``--quick``."""

    step_defaults: tuple[int, int] | None = None  # (with --quick, without)

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if self.step_defaults is not None and parsed.steps is None:
            parsed.steps = self.step_defaults[0] if parsed.quick else self.step_defaults[1]
        return parsed


def bench_parser(
    name: str,
    doc: str | None = None,
    *,
    quick: str | None = None,
    steps: int | tuple[int, int] | None = None,
) -> argparse.ArgumentParser:
    """The command line of ``python -m minitrain.bench <name>``, described by the first
    paragraph of ``doc`` (the benchmark's module docstring).

    ``quick``: the help of a ``--quick`` flag (smaller sizes, fewer steps), none if None.
    ``steps``: the default of ``--steps N``, or (default with ``--quick``, without); none if
    None. A benchmark adds its own options to the parser returned.
    """
    parser = _BenchParser(
        prog=f"python -m minitrain.bench {name}",
        description=doc.strip().split("\n\n")[0] if doc else None,
    )
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    if isinstance(steps, tuple):
        if quick is None:
            raise ValueError("bench_parser: steps=(quick, full) needs a --quick flag")
        parser.step_defaults = steps
        parser.add_argument(
            "--steps", type=int, default=None,
            help=f"measured steps (default {steps[0]} with --quick, else {steps[1]})",
        )
    elif steps is not None:
        parser.add_argument("--steps", type=int, default=steps)
    return parser


def _ratio_width(vs: str) -> int:
    return max(7, len(f"vs {vs}"))  # "12.34x" fits, and so does the column's title


def step_time_header(name_width: int, vs: str, spread: bool = True) -> str:
    """The first columns' titles of a step-time report: variant, step (ms), its p25-p75
    spread (if ``spread``) and the ratio to the variant ``vs``."""
    quartiles = f" {'p25-p75 (ms)':>13}" if spread else ""
    return f"{'variant':<{name_width}} {'step (ms)':>9}{quartiles} {'vs ' + vs:>{_ratio_width(vs)}}"


def step_time_row(
    name: str,
    seconds: float,
    base: float,
    name_width: int,
    vs: str,
    spread: tuple[float, float] | None = None,
) -> str:
    """One variant's first columns under ``step_time_header``: its median step ``seconds``,
    its (q1, q3) ``spread`` if given, and the ratio to ``base``, the step time of ``vs``."""
    cells = f"{name:<{name_width}} {seconds * 1e3:9.1f}"
    if spread is not None:
        lo, hi = spread
        cells += f" {f'{lo * 1e3:.1f}-{hi * 1e3:.1f}':>13}"
    return cells + f" {seconds / base:{_ratio_width(vs) - 1}.2f}x"


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Print rows of dicts as an aligned text table (the benchmarks' common output)."""
    widths = {c: max(len(c), *(len(_fmt(r.get(c, ""))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c, "")).rjust(widths[c]) for c in columns))


def max_abs_difference(a: dict, b: dict) -> float:
    """``minitrain.runtime.max_abs_difference``: the largest |a[name] - b[name]| over every
    element of every tensor of ``a`` (imported when called: ``python -m minitrain.bench``
    lists without importing torch)."""
    from minitrain.runtime.compare import max_abs_difference as compare

    return compare(a, b)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)
