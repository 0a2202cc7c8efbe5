"""``python -m minitrain.bench pipeline``'s peers (issue 33): minitrain's GPipe and 1F1B train
the GPT to the same parameters and losses as ``torch.distributed.pipelining`` (the reference:
torch's own schedules), and the benchmark reports what it measured."""

from minitrain.bench.pipeline_peer import report, run_peers

TINY = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def test_pipeline_peers_train_to_torch_pipelinings_parameters():
    results = run_peers(TINY, cases=[("gpipe", 2), ("1f1b", 2)], pairs=2, microbatch=2)
    for case, r in results.items():
        assert r["moved"] > 1e-3, f"{case}: the parameters did not train"
        assert r["param diff"] < 1e-5, f"{case}: minitrain's stage trained apart from torch's"
        assert r["loss diff"] < 1e-5, f"{case}: the step losses differ from torch's"
        assert r["max |diff|"] == max(r["param diff"], r["loss diff"])
        assert r["ratio"] > 0 and r["minitrain ms"] > 0 and r["torch ms"] > 0
    assert "gpipe" in report(results, 2) and "1f1b" in report(results, 2)
