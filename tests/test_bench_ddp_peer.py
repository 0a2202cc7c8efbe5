"""``python -m minitrain.bench ddp`` side by side with torch DDP (issue 33): every DataParallel
variant trains the GPT to torch ``DistributedDataParallel``'s parameters (the reference: torch's
own DDP, same initial weights, same batches), and the report prints the median of the per-step
ratios and those differences."""

from minitrain.bench import ddp as bench_ddp
from minitrain.ddp.measure import TORCH_DDP, measure

TINY = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def test_every_ddp_variant_trains_to_torch_ddps_parameters():
    variants = bench_ddp.all_variants()
    result = measure(variants, TINY, bucket_mb=0.01, steps=2)
    assert set(result["max_diff"]) == set(variants) - {TORCH_DDP}
    for name in variants:
        assert result["moved"][name] > 1e-4, f"{name}: the parameters did not train"
        assert result["step_ratio"][name] > 0
    for name, diff in result["max_diff"].items():
        assert diff < 1e-5, f"{name} trained apart from torch DDP (max |diff| {diff:.2e})"
    assert result["step_ratio"][TORCH_DDP] == 1.0
    text = bench_ddp.report(result)
    assert "per step" in text and "max |diff|" in text
    assert "median of the per-step ratios" in text.splitlines()[-1]
