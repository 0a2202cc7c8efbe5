"""Benchmark: training-step time of the tensor-parallel GPT against one process and against
data parallelism, and the bytes tensor parallelism sends against the formula.

    python -m minitrain.bench tp [--quick] [--steps 10] [--peers-only] [--widths]

Three ways to train the same GPT on the same global batch with AdamW, gloo:
- dense, one process (rank 0 alone; rank 1 waits at a barrier);
- TP-2: ``apply_tensor_parallel`` over 2 ranks, each seeing the whole batch;
- DP-2: ``minitrain.ddp.DataParallel`` over 2 ranks, each seeing half of it.
They take turns step by step, so a slow moment of the machine hits them all alike; a step's
time is the slowest rank's, and the median over steps is printed with the quartiles.

Bytes (per rank and step, ring): TP sends 4 all-reduces of b*s*h per block plus the
embedding's and the head's (Shoeybi et al. 2019, section 3) and three numbers per token for
the loss — counted by ``minitrain.tensor_parallel.mappings`` — next to the sum of
``layer_collectives``; DP sends 2(N-1)/N of the gradients (not counted here: formula).
What to expect on a 2-core CPU: TP's per-layer all-reduces sit on the critical path and the
matmuls are too small to gain from halving, so TP is the slowest here; on GPUs within a node
(NVLink) it is how models too large for one device are trained at all.

Then, side by side (minitrain/bench/tp_peer.py): minitrain's TP against torch's own
(``torch.distributed.tensor.parallel``'s ``parallelize_module``), without and with sequence
parallelism, from the same weights on the same batches — both medians, the median of the
per-step ratios (target issue 33: ≤ 1.0) and the largest difference of the losses and
parameters. ``--peers-only`` prints that section alone.

``--widths`` (issue 42): one block at t = 1 and t = 2 for widths 64, 256, 1024 on the
modeled intra-node link — TP's communication ∝ b·s·h against compute ∝ b·s·h²/t, where it
stops scaling (``minitrain.tensor_parallel.measure_link``; notebook 06, section 12).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from minitrain.bench import bench_parser, step_time_header, step_time_row
from minitrain.bench.tp_peer import report_peers, run_variants
from minitrain.runtime import device_clock, get_device, launch, summarize_step_times
from minitrain.tensor_parallel.measure_link import measure_widths

DENSE, TP, DP = "dense, 1 process", "TP-2 (tensor_parallel)", "DP-2 (minitrain.ddp)"
MODEL = dict(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=256)  # 3.3 M parameters
QUICK_MODEL = dict(vocab_size=128, seq_len=32, n_layer=2, n_head=4, d_model=128)
PEER_BATCH = 8  # the TP-2 row's global batch: every rank sees all of it


def _rank_measure(config, steps, batch):
    from minitrain.ddp import DataParallel
    from minitrain.model import GPT, GPTConfig, lm_loss
    from minitrain.tensor_parallel import apply_tensor_parallel, mappings

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    device = get_device()
    with torch.device(device):  # the model where this rank computes
        dense = GPT(GPTConfig(**config))
    models = {DENSE: copy.deepcopy(dense), TP: apply_tensor_parallel(copy.deepcopy(dense)),
              DP: DataParallel(copy.deepcopy(dense))}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    g = torch.Generator(device="cpu").manual_seed(1)  # data from the CPU generator, moved
    x = torch.randint(0, config["vocab_size"], (batch, config["seq_len"]), generator=g,
                      device="cpu").to(device)
    y = torch.randint(0, config["vocab_size"], (batch, config["seq_len"]), generator=g,
                      device="cpu").to(device)
    half = slice(rank * batch // world, (rank + 1) * batch // world)
    inputs = {DENSE: (x, y), TP: (x, y), DP: (x[half], y[half])}
    times, sent = {name: [] for name in models}, 0
    for step in range(steps + 2):  # two warm-up steps
        for name, model in models.items():
            dist.barrier()
            if name == DENSE and rank != 0:
                continue  # one process: the others wait at the next barrier
            mappings.reset_communication_log()
            start = device_clock(device)
            opts[name].zero_grad()
            xs, ys = inputs[name]
            # DataParallel wraps forward (its all-reduces start from hooks in backward)
            loss = lm_loss(model(xs), ys) if name == DP else model.loss(xs, ys)
            loss.backward()
            opts[name].step()
            if step >= 2:
                times[name].append(device_clock(device) - start)
            if name == TP:
                sent = sum(r for _, _, r in mappings.communication_log())
    return {"times": times, "sent": sent}


def formula_bytes(config, batch, world=2) -> dict:
    """Bytes one rank sends per step on a ring: {"TP": ..., "DP": ...}."""
    from minitrain.model import GPTConfig, gpt_num_params
    from minitrain.tensor_parallel.measure import layer_collectives, total_bytes

    b, s, h = batch, config["seq_len"], config["d_model"]
    entries = []
    for layer, count in (("embedding", 1), ("attention", config["n_layer"]),
                         ("mlp", config["n_layer"]), ("head", 1)):
        fwd, bwd = layer_collectives(layer, b, s, h, world, False)
        entries += (fwd + bwd) * count
    psi = gpt_num_params(GPTConfig(**config))
    return {"TP": total_bytes(entries, world)["ring_bytes"],
            "DP": round(2 * (world - 1) / world * 4 * psi)}


def measure(config=MODEL, steps: int = 10, batch: int = 8) -> dict:
    """{"step_time": {variant: median}, "spread": {variant: (q1, q3)}, "sent": TP's bytes
    per rank and step, "formula": formula_bytes(...)}."""
    res = launch(_rank_measure, 2, config, steps, batch, timeout=900)
    return {
        **summarize_step_times([r["times"] for r in res]),
        "sent": res[0]["sent"],
        "formula": formula_bytes(config, batch),
    }


def report(result: dict) -> str:
    base = result["step_time"][DENSE]
    sent = {DENSE: "0", TP: f"{result['sent']:,}", DP: "(not counted)"}
    formula = {DENSE: "0", TP: f"{result['formula']['TP']:,}", DP: f"{result['formula']['DP']:,}"}
    lines = [f"{step_time_header(24, 'dense')} {'sent/step/rank (B)':>19} {'formula (B)':>12}"]
    for name, t in result["step_time"].items():
        row = step_time_row(name, t, base, 24, "dense", result["spread"][name])
        lines.append(f"{row} {sent[name]:>19} {formula[name]:>12}")
    return "\n".join(lines)


def report_widths(run: dict) -> str:
    """``measure_link.measure_widths``'s table: per width t = 1 and t = 2 measured, the speedup
    and the one predicted from the α–β formulas, and the predicted crossover width."""
    from minitrain.runtime.link import describe

    lines = [describe(run["link"]), f"one block, b = {run['batch']}, s = {run['seq_len']}, "
             "forward + backward, fastest step (t = 2: the slower rank's)",
             f"{'h':>5} {'t=1 (ms)':>9} {'t=2 (ms)':>9} {'speedup':>8} {'predicted':>10}"]
    for h, d, t2, p in zip(run["widths"], run["dense"], run["tp"], run["predicted"]):
        lines.append(f"{h:>5} {d * 1e3:>9.1f} {t2 * 1e3:>9.1f} {d / t2:>8.2f} {d / p:>10.2f}")
    s = run["speedup"]
    lines.append(f"predicted crossover width {run['crossover']:,.0f}; TP helps at the widest "
                 f"and hurts at the narrowest: {s[-1] > 1 > s[0]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = bench_parser("tp", __doc__, quick="smaller model, fewer steps", steps=(4, 10))
    parser.add_argument("--peers-only", action="store_true",
                        help="only minitrain's TP side by side with torch's (± SP)")
    parser.add_argument("--widths", action="store_true",
                        help="only one block at t = 1 and t = 2 for three widths on the "
                             "modeled intra-node link: where TP stops scaling (issue 42)")
    args = parser.parse_args(argv)
    if args.widths:
        print(report_widths(measure_widths(steps=args.steps)))
        return 0
    config = QUICK_MODEL if args.quick else MODEL
    steps = args.steps
    from minitrain.model import GPTConfig, gpt_num_params

    n = gpt_num_params(GPTConfig(**config))
    if not args.peers_only:
        print(f"GPT {config}: {n / 1e6:.2f} M parameters, AdamW, global batch 8, gloo, "
              f"median of {steps} steps (each the slowest rank's)\n")
        print(report(measure(config, steps)) + "\n")
    print(f"minitrain TP vs torch.distributed.tensor.parallel, world 2, GPT {n / 1e6:.2f} M "
          f"parameters, AdamW, batch {PEER_BATCH}, median of {steps} steps after a warm-up")
    print(report_peers(run_variants(config, steps, PEER_BATCH)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
