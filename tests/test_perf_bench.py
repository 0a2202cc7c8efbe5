"""The side-by-side benchmarks of issue 33 compute what they print (correctness, not speed)."""

from minitrain.bench import flash as bench_flash
from minitrain.bench import fsdp as bench_fsdp

TINY = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def test_fsdp_bench_trains_both_to_the_same_parameters():
    r = bench_fsdp.run(TINY, steps=2, world=2, batch=2)
    assert r["moved"] > 1e-4, "the parameters did not train"
    assert r["max |diff|"] < 1e-5, "minitrain's FSDP and torch's fully_shard trained apart"
    assert r["ratio"] > 0 and r["minitrain ms"] > 0 and r["torch ms"] > 0


def test_flash_bench_side_by_side_agrees_with_sdpa():
    r = bench_flash.side_by_side(64, pairs=1, d=16, heads=2)
    assert r["max |diff|"] < 1e-4 and r["flash/sdpa"] > 0
