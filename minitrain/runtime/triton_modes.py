"""Triton kernels in the mode the tensors' device needs: interpreted on a CPU, compiled on CUDA.

Used by chapter 9's FlashAttention kernels and chapter 12's fused norms
(notebooks/09_flash_attention.ipynb, 12_kernels_and_compilers.ipynb). Triton picks its mode
when a kernel is *decorated*, reading ``TRITON_INTERPRET``, so a file of kernels is loaded
once more per mode, as a module of its own, with the variable set around the load: a notebook
can pass CPU tensors on a GPU machine (the interpreter: numpy on the CPU, correctness only)
and CUDA tensors in the same process (compiled kernels), and no test sets the variable
process-wide.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


def kernels_for_device(module_name: str, path: str, device) -> object:
    """The kernels file ``path`` (module ``module_name``) decorated for ``device``:
    interpreted for the CPU, compiled for CUDA (loaded once per mode)."""
    return _load(module_name, path, interpret=torch.device(device).type == "cpu")


@functools.lru_cache(maxsize=8)
def _load(module_name: str, path: str, interpret: bool):
    name = f"{module_name}.{'interpreted' if interpret else 'compiled'}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"  # read by @triton.jit
    try:
        spec.loader.exec_module(module)
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before
    return module


def check_device(name: str, *tensors) -> torch.device:
    """The one device of ``tensors``: a CPU (Triton's interpreter) or CUDA (compiled kernels).
    Several devices, or another kind, are named here, not met as a crash."""
    devices = {t.device for t in tensors}
    if len(devices) > 1 or next(iter(devices)).type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: inputs on {sorted(map(str, devices))}, but the kernels need "
                         "them all on one device: a CPU (Triton's interpreter) or a CUDA GPU "
                         "(compiled kernels)")
    return next(iter(devices))
