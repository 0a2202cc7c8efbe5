"""DDP's per-parameter "used" flags live on the bucket's device (issue 41).

Backward's hooks set each flag in the bucket's flat buffer as its gradient arrives; launching
the bucket's all-reduce then builds nothing from host data and copies nothing in. (Gathered in
a Python list and copied in at launch, the flags were a pageable host-to-device copy per
bucket: on a GPU the host waits for it, which defeats the overlap of communication with
backward.) That the summed flags keep their meaning — a parameter no rank used keeps its
``.grad`` — is checked against torch's DDP in tests/test_composition.py.
"""

from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from minitrain.ddp.gradient_bucket import GradientBucket


class _Ops(TorchDispatchMode):
    """The operators this thread runs inside the block."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _host_data(*args, **kwargs):
    raise AssertionError("a tensor built from host data while launching a bucket")


def test_a_bucket_launch_copies_no_host_flags_in(monkeypatch):
    params = [nn.Parameter(torch.ones(3, device="meta")) for _ in range(3)]  # not the host
    bucket = GradientBucket(0, params)
    bucket.mark_used(0)
    bucket.mark_used(2)
    sent = {}

    def all_reduce(buffer, group):  # any fn(tensor, group): here it only looks
        sent["buffer"] = buffer

    with ThreadPoolExecutor(1) as executor, monkeypatch.context() as m:
        m.setattr(torch, "tensor", _host_data)
        m.setattr(torch, "as_tensor", _host_data)
        with _Ops() as ops:
            bucket.start_all_reduce(None, all_reduce, executor)
        bucket.wait()
    # nothing runs on this thread at launch but the submission: no copy into the buffer
    assert ops.names == [], ops.names
    assert sent["buffer"] is bucket.buffer


def test_flags_are_set_in_the_buffer_as_gradients_arrive_and_cleared_by_reset():
    params = [nn.Parameter(torch.ones(n)) for n in (3, 2, 4)]
    bucket = GradientBucket(0, params)
    assert bucket.used.tolist() == [0.0, 0.0, 0.0]
    bucket.mark_used(0)
    bucket.mark_used(2)
    assert bucket.used.tolist() == [1.0, 0.0, 1.0]
    assert bucket.used.data_ptr() == bucket.buffer[9:].data_ptr()  # part of the all-reduce
    bucket.reset()
    assert bucket.used.tolist() == [0.0, 0.0, 0.0]
