"""``python -m minitrain.bench tp``'s side-by-side section (issue 33): minitrain's tensor
parallelism and torch's ``parallelize_module`` train the same GPT to the same losses and
parameters, with and without sequence parallelism (correctness, not speed: the ratio is
measured by the benchmark, never by a timed test). One launch runs both variants, so torch's
DTensor machinery warms up once."""

import pytest

from minitrain.bench import tp_peer

TINY = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


@pytest.fixture(scope="module")
def results():
    try:
        return tp_peer.run_variants(TINY, steps=2, batch=4)
    except Exception as exc:  # each test fails with it (a fixture's error would not count as
        return exc  # a failure of the tests that use it)


@pytest.mark.parametrize("variant", ["TP", "TP + SP"])
def test_minitrain_tp_and_torch_tp_train_to_the_same_parameters(results, variant):
    if isinstance(results, Exception):
        pytest.fail(f"the side-by-side benchmark raised: {results}")
    r = results[variant]
    # AdamW moves every trained parameter by ~lr per step: far above the tolerance
    assert r["moved"] > 1e-3, f"{variant}: the parameters did not train"
    assert r["loss |diff|"] < 1e-5, f"{variant}: the losses differ by {r['loss |diff|']:.2e}"
    assert r["max |diff|"] < 1e-5, (
        f"{variant}: minitrain's TP and torch's parallelize_module trained apart: "
        f"{r['worst']} differs by {r['max |diff|']:.2e} (moved {r['moved']:.2e})")
    assert r["|diff| elsewhere"] < 2e-6
    assert r["grad |diff|"] < 5e-7, f"{variant}: the first step's gradients differ"
    held = r["block numel"]
    assert held["minitrain"] == held["torch"], (
        f"{variant}: a rank holds {held} parameters of the blocks: not the same work")
    assert r["ratio"] > 0 and r["minitrain ms"] > 0 and r["torch ms"] > 0
    assert r["pairs"] == 2
