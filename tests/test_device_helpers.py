"""The GPU path's small helpers, checked on the CPU (issue 29): MFU's peak from the device,
and a clock that waits for a GPU's queued work and never synchronises on the CPU."""

from __future__ import annotations

import pytest
import torch

from minitrain.runtime import device_clock, synchronize
from minitrain.step import peak_flops


@pytest.mark.parametrize("name,dtype,expected", [
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),  # NVIDIA A100 data sheet, dense
    ("NVIDIA A100-PCIE-40GB", torch.float32, 19.5e12),
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),  # H100 SXM5
    ("NVIDIA H100 80GB HBM3", torch.float32, 67e12),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
    ("NVIDIA H200", torch.float16, 989e12),
])
def test_peak_flops_of_known_gpus(monkeypatch, name, dtype, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0), dtype) == expected


def test_peak_flops_on_the_cpu_is_the_course_machines_core():
    # 2 FMA pipes x 8 fp32 lanes x 2 FLOPs x 3.7 GHz (bench mfu's docstring), any dtype
    assert peak_flops("cpu") == peak_flops("cpu", torch.bfloat16) == 2 * 8 * 2 * 3.7e9


def test_peak_flops_of_an_unknown_gpu_names_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce GTX 1080")
    with pytest.raises(ValueError, match="GTX 1080.*--peak-flops"):
        peak_flops("cuda:0", torch.bfloat16)


def test_clock_waits_for_a_gpu_and_never_synchronises_the_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    device_clock("cpu")
    synchronize(torch.device("cpu"))
    assert calls == [], "a CPU timing called torch.cuda.synchronize"
    before = device_clock(torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1)] and before <= device_clock("cpu")


def test_peak_memory_reads_the_gpu_allocator_and_on_the_cpu_the_saved_bytes(monkeypatch):
    from minitrain.memory import PeakMemory

    # CPU: the course's accounting, one Linear's saved input (4 x 8 fp32 = 128 bytes)
    layer = torch.nn.Linear(8, 8, device="cpu")
    x = torch.randn(4, 8, device="cpu", requires_grad=True)
    with PeakMemory("cpu", exclude=list(layer.parameters())) as m:
        layer(x).sum()
    assert m.peak == 4 * 8 * 4 and "LiveSavedBytes" in m.source
    # GPU: the allocator's high-water mark above what was there on entry
    allocated = iter([1000])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(allocated))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 5096)
    with PeakMemory("cuda:0") as m:
        pass
    assert m.peak == 4096 and m.source == "torch.cuda.max_memory_allocated"


def test_triton_flash_attention_names_a_tensor_on_the_wrong_kind_of_device():
    from minitrain.flash_attention import FlashAttentionTritonFunction

    q = torch.randn(1, 1, 16, 16, device="cpu")
    with pytest.raises(ValueError, match=r"\['cpu', 'meta'\].*one device"):
        FlashAttentionTritonFunction.apply(q, q.to("meta"), q, True)
    with pytest.raises(ValueError, match=r"\['meta'\].*CPU .*interpreter.*CUDA"):
        FlashAttentionTritonFunction.apply(*(q.to("meta"),) * 3, True)


def test_triton_mode_follows_the_tensors_device_not_the_environment(monkeypatch):
    """Issue 41: the mode was read once, from TRITON_INTERPRET, when the kernels were decorated:
    on a GPU machine CPU tensors (notebook 09) met compiled kernels. Now per call, by device."""
    from minitrain.flash_attention import FlashAttentionTritonFunction
    from minitrain.flash_attention.triton_kernels import kernels_for

    interpreted, compiled = kernels_for(torch.device("cpu")), kernels_for(torch.device("cuda", 0))
    assert type(interpreted.flash_forward_kernel).__name__ == "InterpretedFunction"
    assert type(compiled.flash_forward_kernel).__name__ == "JITFunction"
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as a GPU machine's environment says
    q = torch.randn(1, 1, 8, 8, device="cpu")
    out = FlashAttentionTritonFunction.apply(q, q, q, True)  # CPU tensors: interpreted anyway
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
