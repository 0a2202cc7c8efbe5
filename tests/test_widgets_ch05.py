"""The chapter 5 widget: the calculator against the ZeRO paper's per-parameter bytes, and the
headless widget reacting to its controls."""

import pytest

from minitrain.runtime.trace import Event
from minitrain.widgets.ch05_zero import build_zero_memory_widget, compute_zero_memory


def test_compute_matches_the_papers_bytes_per_parameter():
    # mixed precision, K = 12: DP 16, P_os 4 + 12/N, P_os+g 2 + 14/N, P_os+g+p 16/N
    view = compute_zero_memory(10**9, 8, 2, "mixed")
    assert view["per_param"] == pytest.approx([16, 4 + 12 / 8, 2 + 14 / 8, 16 / 8])
    assert view["selected"]["total"] == pytest.approx((2 + 14 / 8) * 1e9)
    assert view["saving"] == pytest.approx(16 / (2 + 14 / 8))
    fp32 = compute_zero_memory(10**6, 4, 3, "fp32")
    assert fp32["per_param"] == pytest.approx([16, 8 + 8 / 4, 4 + 12 / 4, 16 / 4])
    off = compute_zero_memory(10**6, 4, 1, "fp32", offload=True)
    assert off["selected"]["optimizer"] == 0 and off["selected"]["host"] == pytest.approx(2e6)
    with pytest.raises(ValueError, match="-5"):
        compute_zero_memory(-5, 4, 1)


def test_measured_points_are_overlaid_for_the_matching_world_size():
    measured = [
        {
            "stage": 2,
            "world_size": 4,
            "params": 400,
            "grads": 100,
            "optimizer": 200,
            "num_params": 100,
        },
        {
            "stage": 2,
            "world_size": 2,
            "params": 400,
            "grads": 200,
            "optimizer": 400,
            "num_params": 100,
        },
    ]
    assert compute_zero_memory(10**6, 4, 2, measured=measured)["points"] == [(2, 7.0)]
    assert compute_zero_memory(10**6, 4, 2, "mixed", measured=measured)["points"] == []


def test_widget_updates_headlessly():
    traces = [
        [
            Event("gather block 0", "communication", 0.0, 0.001),
            Event("forward block 0", "compute", 0.001, 0.002),
        ]
    ] * 2
    box = build_zero_memory_widget(traces=traces)
    stage, (precision, offload), status, image, timeline = (
        box.children[1],
        box.children[2].children,
        box.children[3],
        box.children[4],
        box.children[5],
    )
    assert len(bytes(timeline.value)) > 1000
    before, picture = status.value, bytes(image.value)
    assert "ZeRO-3 on 64 ranks" in before and "0.25 bytes/parameter" in before  # 16/64
    stage.value = 0
    assert "DP on 64 ranks" in status.value and "16 bytes/parameter" in status.value
    assert bytes(image.value) != picture
    precision.value = "fp32"
    stage.value = 1
    assert "8.12 bytes/parameter" in status.value  # 4 + 4 + 8/64
    offload.value = True
    assert "on the host" in status.value


def test_offload_leaves_plain_data_parallelism_alone():
    from minitrain.widgets.ch05_zero import compute_zero_memory, describe

    view = compute_zero_memory(10**9, 8, 0, "mixed", offload=True)
    plain = compute_zero_memory(10**9, 8, 0, "mixed", offload=False)
    assert view["stages"][0] == plain["stages"][0] and view["stages"][0]["host"] == 0
    assert view["stages"][1]["optimizer"] == 0 and view["stages"][1]["host"] > 0
    assert view["saving"] == 1.0 and "ZeRO stages only" in describe(view)


def test_parameters_slider_offers_exact_model_sizes():
    box = build_zero_memory_widget()
    params, status = box.children[0].children[0], box.children[3]
    assert params.value == 7_500_000_000 and "7.5e+09 parameters" in status.value
    params.value = 175_000_000_000
    assert "1.75e+11 parameters" in status.value



def test_fsdp_bytes_and_communication_per_compute_dtype():
    from minitrain.widgets.ch05_zero import compute_fsdp

    fp32 = compute_fsdp(10**6, 4, "fp32")  # ZeRO-3: 16Ψ/N, 3Ψ·4·(N-1)/N
    assert fp32["total"] == pytest.approx(16e6 / 4) and fp32["sent"] == pytest.approx(9e6)
    assert fp32["sent"] / fp32["dp_sent"] == pytest.approx(1.5) and fp32["dp_total"] == 16e6
    bf16 = compute_fsdp(10**6, 4, "bf16")  # 2-byte shard, fp32 master: 18Ψ/N; (2+2+4)Ψ·¾
    assert bf16["params"] == pytest.approx(0.5e6) and bf16["total"] == pytest.approx(18e6 / 4)
    assert bf16["sent"] == pytest.approx(6e6) and compute_fsdp(10**6, 4, "fp16") == {
        **bf16, "compute_dtype": "fp16"
    }
    with pytest.raises(ValueError, match="'int8'"):
        compute_fsdp(10**6, 4, "int8")


def test_fsdp_controls_update_headlessly():
    box = build_zero_memory_widget()
    compute, status = box.children[-1].children
    assert "FSDP (bf16" in status.value and "4.5 bytes/parameter" not in status.value
    ranks = box.children[0].children[1]
    ranks.value = 4
    assert "4.5 bytes/parameter" in status.value  # 18/4
    compute.value = "fp32"
    assert "FSDP (fp32" in status.value and "4 bytes/parameter" in status.value
    assert "1.5× DP" in status.value
