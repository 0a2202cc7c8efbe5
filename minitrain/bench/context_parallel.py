"""Benchmark: ring attention's per-rank work, bytes and memory, contiguous against zigzag.

    python -m minitrain.bench context_parallel [--quick] [--seq-len 1024] [--world 4]

Causal ring attention (forward + backward) over P gloo ranks on one sequence of N tokens,
both layouts (``minitrain.context_parallel.measure.measure_ring``). Per rank it prints the
forward FLOPs counted by torch's FlopCounterMode next to the formula (4·bh·d per score
computed), the CPU seconds of forward + backward (median of repeats; CPU time, not wall
time, so ranks sharing two cores are still compared fairly), the bytes sent next to the
formula (forward (P−1)·2 blocks, backward (P−1)·2 + P·2) and the bytes saved for backward
next to the formula; then the saved bytes for P = 1, 2, 4 (linear in N/P), and the share of
each rank's compute time during which a send/recv was in flight (from the trace).

Last, the overlap threshold on a modeled link (``measure.measure_overlap``): P = 2, forward, not
causal, the link's bandwidth W chosen so that e·F/(2W) = 512 tokens per rank (F this machine's
attention rate, measured first); at 64 and 128 tokens per rank the K, V transfer must be
exposed (the rank waits at least a third of it), at 1,024 and 1,536 hidden; the wait is
printed next to the prediction max(0, transfer − compute).

What to expect: contiguous gives the last rank about P times the first rank's causal work
(its queries see every earlier key); zigzag gives every rank the same (max/min ≈ 1).
"""

from __future__ import annotations

from minitrain.bench import bench_parser
from minitrain.context_parallel.measure import measure_overlap, measure_ring, overlap_summary
from minitrain.runtime.link import describe


def _row(label, values, fmt="{:,}"):
    return f"  {label:<30}" + "".join(f"{fmt.format(v):>14}" for v in values)


def main(argv=None) -> int:
    parser = bench_parser("context_parallel", __doc__, quick="small sizes (seconds)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    n, world, repeats = args.seq_len, args.world, args.repeats
    shape = dict(batch=1, heads=2, head_dim=32)
    if args.quick:
        n, repeats = 256, 2
    print(f"causal ring attention, N = {n}, P = {world}, batch·heads = 2, head size 32, fp32, gloo")
    all_ok = True
    for layout in ("contiguous", "zigzag"):
        m = measure_ring(seq_len=n, world_size=world, layout=layout, causal=True,
                         repeats=repeats, timeout=600, **shape)
        print(f"\n{layout}:" + "".join(f"{'rank ' + str(r):>14}" for r in range(world)))
        print(_row("forward FLOPs (counted)", m["flops_forward"]))
        print(_row("forward FLOPs (formula)", m["formula_flops_forward"]))
        print(_row("CPU s, forward+backward", m["cpu_seconds"], "{:.4f}"))
        print(_row("bytes sent forward", m["sent_forward"]))
        print(_row("bytes sent backward", m["sent_backward"]))
        print(_row("bytes saved for backward", m["saved_bytes"]))
        flops, cpu = m["flops_forward"], m["cpu_seconds"]
        ok = (flops == m["formula_flops_forward"]
              and set(m["sent_forward"]) == {m["formula_sent_forward"]}
              and set(m["sent_backward"]) == {m["formula_sent_backward"]}
              and set(m["saved_bytes"]) == {m["formula_saved_bytes"]})
        all_ok &= ok
        hidden = [overlap_summary(t) for t in m["traces"]]
        frac = [h["overlapped"] / h["compute"] if h["compute"] else 0.0 for h in hidden]
        print(f"  formulas: bytes forward {m['formula_sent_forward']:,}, backward "
              f"{m['formula_sent_backward']:,}, saved {m['formula_saved_bytes']:,}; "
              f"all equal to the counts: {ok}")
        print(f"  work balance max/min: FLOPs {max(flops) / min(flops):.2f}, "
              f"CPU time {max(cpu) / min(cpu):.2f}")
        print("  share of compute time with a send/recv in flight, per rank: "
              + ", ".join(f"{f:.0%}" for f in frac))
    print(f"\nbytes saved for backward per rank against N/P (N = {n}, contiguous, causal):")
    for p in (1, 2, 4):
        m = measure_ring(seq_len=n, world_size=p, repeats=1, timeout=600, **shape)
        print(f"  P = {p}: N/P = {n // p:>5}, saved {m['saved_bytes'][0]:>10,} bytes "
              f"(formula {m['formula_saved_bytes']:,}), per token {m['saved_bytes'][0] / (n // p):.0f}")
    all_ok &= _overlap()
    return 0 if all_ok else 1


def _overlap() -> bool:
    result = measure_overlap(sizes=(64, 128, 1536, 2048), threshold=512)
    print(f"\noverlap threshold on a modeled link, P = 2, forward, not causal, batch·heads = 8, d = 64"
          f"\n  {describe(result['link'])}\n  predicted threshold e·F/(2W) = "
          f"{result['threshold']:.0f} tokens per rank")
    print(f"  {'n':>6}{'transfer ms':>13}{'compute ms':>12}{'waited ms':>11}{'predicted ms':>14}"
          f"{'hidden':>8}")
    for n, row in result["sizes"].items():
        print(f"  {n:>6}{1e3 * row['transfer']:>13.1f}{1e3 * row['compute']:>12.1f}"
              f"{1e3 * row['exposed']:>11.1f}{1e3 * row['predicted_exposed']:>14.1f}"
              f"{row['hidden']!s:>8}")
    ok = all(row["hidden"] == (n > result["threshold"]) for n, row in result["sizes"].items())
    print(f"  exposed below the threshold, hidden above: {ok}")
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
