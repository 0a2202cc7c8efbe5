"""minitrain.runtime.trace's device clocks (issue 41): a span that names an asynchronous device
takes its marks from that device's events, mapped onto the host's axis through one anchor when
the events are read; the CPU keeps ``perf_counter``. No GPU here: a fake event clock stands in
(for the device type "meta", or for "cpu" inside ranks, to check that DDP, ZeRO and FSDP name
their device at every mark)."""

import time

import torch
import torch.distributed as dist
from toy_models import Toy, mse, toy_batch

from minitrain.runtime import launch, trace


class FakeDevice:
    """An asynchronous device's torch module, faked: ``now`` is where its stream is (seconds on
    its own clock, unrelated to the host's); an event records the stream's position."""

    def __init__(self, now: float):
        self.now, self.synchronized, self.made = now, 0, 0

    def Event(self, enable_timing=False):  # noqa: N802 — torch.cuda.Event's name
        assert enable_timing, "a device mark needs a timing event"
        self.made += 1
        return FakeEvent(self)

    def current_stream(self, device):
        assert torch.device(device).type == "meta"
        return "the current stream"

    def synchronize(self, device):
        self.synchronized += 1


class FakeEvent:
    def __init__(self, device: FakeDevice):
        self.device, self.at = device, None

    def record(self, stream):
        assert stream == "the current stream"
        self.at = self.device.now

    def synchronize(self):
        pass

    def elapsed_time(self, end) -> float:  # milliseconds, as torch.cuda.Event's
        return (end.at - self.at) * 1e3


def _fake_clock(monkeypatch, device_now=100.0, host_at_anchor=50.0):
    fake, host_reads = FakeDevice(device_now), []

    def host():
        host_reads.append(host_at_anchor)
        return host_at_anchor

    monkeypatch.setitem(trace.CLOCKS, "meta", trace.EventClock(fake, host=host))
    return fake, host_reads


def test_a_device_span_is_timed_by_its_events_and_mapped_through_the_anchor(monkeypatch):
    fake, host_reads = _fake_clock(monkeypatch)
    trace.reset()
    with trace.span("kernel", "compute", device=torch.device("meta")):
        fake.now += 0.25  # the device runs 0.25 s of work queued inside the span
    fake.now += 0.5
    with trace.span("copy", "memory", device="meta"):
        fake.now += 0.125
    fake.now = 101.0  # where the device's stream is when the events are read
    assert host_reads == [], "device marks are resolved lazily, when the events are read"
    events = {e.name: e for e in trace.events()}
    # the anchor: device time 101.0 is host time 50.0; a mark d seconds before it, 50.0 - d
    assert (events["kernel"].start, events["kernel"].end) == (49.0, 49.25)
    assert (events["copy"].start, events["copy"].end) == (49.75, 49.875)
    assert fake.synchronized == 1 and host_reads == [50.0], "one anchor per device"
    assert fake.made == 5  # two events per span, one anchor
    trace.events()
    assert fake.synchronized == 1, "resolved once"
    trace.reset()


def test_cpu_spans_are_host_times_and_make_no_device_event(monkeypatch):
    fake, _ = _fake_clock(monkeypatch)
    trace.reset()
    before = time.perf_counter()
    with trace.span("host", "compute"):
        pass
    with trace.span("cpu", "compute", device=torch.device("cpu")):
        pass
    mark = trace.now("cpu")
    after = time.perf_counter()
    assert isinstance(mark, float) and isinstance(trace.now(), float)
    events = trace.events()
    assert [e.name for e in events] == ["host", "cpu"]
    assert all(before <= e.start <= e.end <= after for e in events)
    assert fake.made == 0 and fake.synchronized == 0
    trace.reset()


def test_an_untraced_device_mark_costs_no_event(monkeypatch):
    fake, _ = _fake_clock(monkeypatch)
    try:
        trace.enable(False)
        assert isinstance(trace.now("meta"), float)
        with trace.span("x", "compute", device="meta"):
            pass
    finally:
        trace.enable(True)
    assert fake.made == 0 and trace.events() == []


class _Work:
    """A collective's work handle whose future completes with its tensors."""

    def __init__(self, value):
        self.value = value

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(self.value)
        return future


def test_a_futures_end_is_a_device_mark_on_its_tensors_device(monkeypatch):
    """NCCL runs a future's callbacks when the collective is queued, on streams that wait for
    it: the end must be an event recorded there, not the host's clock at that moment."""
    fake, _ = _fake_clock(monkeypatch)
    trace.reset()
    start = trace.now("meta")
    fake.now += 0.5
    end = trace.end_mark(_Work([torch.empty(3, device="meta")])).wait()  # device read from it
    assert isinstance(end, trace.DeviceMark) and end.device.type == "meta"
    explicit = trace.end_mark(_Work([]), device="meta").wait()
    assert isinstance(explicit, trace.DeviceMark)
    assert isinstance(trace.end_mark(_Work([torch.empty(3)])).wait(), float)  # cpu: the host
    trace.record("all-reduce", "communication", start, end)
    fake.now += 1.0
    (event,) = trace.events()
    assert (event.start, event.end) == (48.5, 49.0)
    trace.reset()


# ------------------------------------------------------------------ the techniques name their device
SHIFT = 1000.0  # seconds the fake clock's times land after the host's: a host mark stands out


class _HostAsDevice:
    """The CPU faked as an asynchronous device: an event holds the host time it was recorded
    at; mapped through an anchor read SHIFT seconds late, every device mark lands SHIFT later
    than a host mark of the same moment."""

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self, stream=None):
            self.at = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    @staticmethod
    def current_stream(device):
        return None

    @staticmethod
    def synchronize(device):
        pass


def _traced_steps():
    from minitrain.ddp import DataParallel
    from minitrain.fsdp import FullyShardedDataParallel
    from minitrain.zero import ZeroDataParallel

    trace.CLOCKS["cpu"] = trace.EventClock(_HostAsDevice, host=lambda: time.perf_counter() + SHIFT)
    cases = {
        "DDP": lambda: DataParallel(Toy(n=4), bucket_cap_mb=1e-4),
        "ZeRO-2": lambda: ZeroDataParallel(Toy(n=4), torch.optim.AdamW, 2, lr=1e-2,
                                           bucket_cap_mb=1e-4),
        "ZeRO-3": lambda: ZeroDataParallel(Toy(n=4), torch.optim.AdamW, 3, lr=1e-2),
        "FSDP": lambda: FullyShardedDataParallel(Toy(n=4)),
    }
    x, y = toy_batch(0, dist.get_rank(), dist.get_world_size())
    out = {}
    try:
        for name, build in cases.items():
            torch.manual_seed(0)
            model = build()
            trace.reset()
            mse(model(x), y).backward()
            if name.startswith("ZeRO"):
                model.step()
            out[name] = trace.events()
    finally:
        del trace.CLOCKS["cpu"]
        trace.reset()
    return out


def test_ddp_zero_and_fsdp_take_every_mark_on_their_parameters_device():
    """With the CPU's clock replaced by an event clock, every span of a traced step —
    backward, all-reduces, gathers, frees, reduce-scatters (ends stamped by a future's
    callback), forward blocks, the optimizer — lands SHIFT late: both its marks came from the
    device's clock (a host mark would give an event of about ±SHIFT seconds)."""
    expected = {
        "DDP": ["backward", "all-reduce bucket 0", "wait for gradients"],
        "ZeRO-2": ["reduce-scatter bucket 0", "optimizer step", "all-gather bucket 0"],
        "ZeRO-3": ["gather block 0", "forward block 0", "free block 0", "backward block 0",
                   "reduce-scatter block 0"],
        "FSDP": ["gather block 0", "forward block 0", "backward block 0", "reduce-scatter block 0"],
    }
    for rank, per_case in enumerate(launch(_traced_steps, 2, timeout=120)):
        for name, events in per_case.items():
            names = [e.name for e in events]
            assert set(expected[name]) <= set(names), (name, names)
            host_marked = [(e.name, e.start, e.end) for e in events
                           if not (e.start > SHIFT / 2 and 0 <= e.duration < SHIFT / 2)]
            assert not host_marked, f"rank {rank}, {name}: spans with a host mark {host_marked}"
