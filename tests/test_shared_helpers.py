"""The pieces widgets and benchmarks share: ``minitrain.widgets.live``/``plot_png``,
``minitrain.runtime.summarize_step_times`` and ``minitrain.bench``'s command line, report
columns, listing and parameter comparison. Quick: nothing here launches ranks."""

import re
from pathlib import Path

import pytest
import torch

from minitrain.bench import bench_parser, max_abs_difference, step_time_header, step_time_row
from minitrain.runtime import median_and_quartiles, summarize_step_times
from minitrain.widgets import live, plot_png

WIDGETS = Path(__file__).resolve().parent.parent / "minitrain" / "widgets"


def test_no_widget_module_wires_its_controls_itself():
    wired = [p.name for p in sorted(WIDGETS.glob("ch*.py")) if ".observe(" in p.read_text()]
    assert not wired, f"use minitrain.widgets.live instead of .observe( in {wired}"


def test_no_widget_draws_into_an_output_area():
    styles = {p.name: re.findall(r"\bOutput\(|plt\.show\(|matplotlib\.use\(", p.read_text())
              for p in sorted(WIDGETS.glob("ch*.py"))}
    assert not {k: v for k, v in styles.items() if v}


def test_live_renders_now_and_on_every_change_of_any_control():
    w = pytest.importorskip("ipywidgets")
    a, b = w.IntSlider(value=1), w.Dropdown(options=["x", "y"], value="x")
    shown = []
    live([a, b], lambda: shown.append((a.value, b.value)))
    assert shown == [(1, "x")]
    a.value = 2
    b.value = "y"
    assert shown == [(1, "x"), (2, "x"), (2, "y")]
    later = []
    live([a], lambda: later.append(a.value), now=False)
    assert later == []
    a.value = 3
    assert later == [3]


def test_plot_png_leaves_the_notebooks_backend_alone():
    import matplotlib

    before = matplotlib.get_backend()
    png = plot_png(lambda axes: [ax.plot([0, 1]) for ax in axes], (4, 2), ncols=2)
    assert png.startswith(b"\x89PNG") and matplotlib.get_backend() == before


def test_step_times_are_the_slowest_ranks_median_and_quartiles():
    per_rank = [
        {"dp": [1.0, 5.0, 3.0, 2.0, 4.0], "alone": [2.0, 2.0, 4.0, 6.0, 8.0]},
        {"dp": [2.0, 1.0, 6.0, 1.0, 1.0], "alone": []},  # sat out: left out
    ]
    summary = summarize_step_times(per_rank)
    assert list(summary["step_time"]) == ["dp", "alone"]
    assert summary["step_time"] == {"dp": 4.0, "alone": 4.0}  # dp steps: 2, 5, 6, 2, 4
    assert summary["spread"]["dp"] == (2.0, 5.5)
    assert median_and_quartiles([3.0]) == (3.0, (3.0, 3.0))


def test_bench_parser_steps_default_by_quick():
    parser = bench_parser("zero", "Benchmark: one line.\n\nMore.", quick="smaller", steps=(4, 10))
    parser.add_argument("--world", type=int, default=2)
    assert parser.description == "Benchmark: one line."
    assert parser.parse_args([]).steps == 10
    assert parser.parse_args(["--quick"]).steps == 4
    args = parser.parse_args(["--quick", "--steps", "7", "--world", "3"])
    assert (args.steps, args.world, args.quick) == (7, 3, True)
    assert bench_parser("mfu", None, steps=7).parse_args([]).steps == 7
    assert not hasattr(bench_parser("flash").parse_args([]), "quick")


def test_step_time_columns_line_up():
    header = step_time_header(18, "DP")
    row = step_time_row("ZeRO-3", 0.0266, 0.0191, 18, "DP", (0.0209, 0.0287))
    assert header == "variant            step (ms)  p25-p75 (ms)   vs DP"
    assert row == "ZeRO-3                  26.6     20.9-28.7   1.39x"
    wide = step_time_header(30, "torch DDP", spread=False)
    assert len(wide) == len(step_time_row("flat", 0.0202, 0.0183, 30, "torch DDP"))


def test_max_abs_difference_is_the_largest_elementwise_gap_over_every_name():
    a = {"w": torch.zeros(2, 3, device="cpu"), "b": torch.zeros(4, device="cpu")}
    b = {"w": torch.zeros(2, 3, device="cpu"), "b": torch.zeros(4, device="cpu"),
         "extra": torch.ones(1, device="cpu")}  # names only b holds are not compared
    b["w"][1, 1], b["b"][2] = 0.5, -0.75  # exact in binary: the answer is 0.75 exactly
    assert max_abs_difference(a, b) == 0.75
    assert max_abs_difference({"w": a["w"]}, b) == 0.5
    assert max_abs_difference({}, b) == 0.0
    # 256 - 0.5 = 255.5 needs 9 significant bits; bf16 keeps 8, so a bf16 subtraction
    # would round it to 256 (both operands are exact in bf16)
    hi, lo = (torch.tensor([v], dtype=torch.bfloat16, device="cpu") for v in (256.0, 0.5))
    assert max_abs_difference({"x": hi}, {"x": lo}) == 255.5
    with pytest.raises(KeyError, match="'b'"):
        max_abs_difference(a, {"w": a["w"]})
    with pytest.raises(ValueError, match=r"'w' has shape \(2, 3\).*\(3,\)"):
        max_abs_difference(a, {"w": torch.zeros(3, device="cpu"), "b": a["b"]})


def test_bench_lists_the_benchmarks_not_their_peer_sections(capsys):
    from minitrain.bench.__main__ import main

    assert main([]) == 0
    listed = capsys.readouterr().out.split("benchmarks: ")[1].strip().split(", ")
    assert {"tp", "pipeline", "allreduce", "fsdp"} <= set(listed)
    assert not [n for n in listed if n.endswith("_peer")], listed
    assert main(["tp_peer"]) == 2  # not a benchmark of its own: refused, naming the choices
    err = capsys.readouterr().err
    assert "'tp_peer'" in err and "pipeline_peer" not in err
