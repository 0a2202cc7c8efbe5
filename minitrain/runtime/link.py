"""A modeled interconnect: messages between ranks take the time a real network would (issue 42).

What it teaches: on a laptop CPU the "network" between ranks is a memory copy done by the same
cores that compute, so overlapping communication with computation, bucketing, prefetching or
hiding a pipeline's messages cannot pay off there — the course's timings would contradict its
lessons. With a link on, every message and collective the ranks issue completes no earlier
than its α–β time, the messages of one group queue behind each other, and waiting sleeps, so
the cores stay free for the computation that should overlap it. Notebooks 04–07, 10 and 11
measure on it and print ``describe(link)`` beside what they measured.

The model (Hockney 1994, "The communication challenge for MPP"): a message of n bytes costs
α + n/β, α the latency in seconds and β the bandwidth in bytes per second, per direction per
rank. Collectives cost what NCCL's ring algorithm spends: all-reduce 2(N−1)(α + n/(Nβ)),
reduce-scatter, all-gather and all-to-all (N−1)(α + n/(Nβ)) with n the full tensor's bytes,
broadcast (N−1)α + n/β (pipelined), as Thakur, Rabenseifner & Gropp 2005 ("Optimization of
Collective Communication Operations in MPICH") count them: ``link_costs.py``. How the waits are
enforced (queues, the senders' finish times, sleeping Works): ``link_messages.py``; the
wrapped torch.distributed functions: ``link_wrap.py``.

The presets in ``LINKS`` are *relative to this machine's compute*: a named real system's
figures divided by the time dilation D = (the real accelerator's FLOP/s) / (this machine's,
``machine_flops()``), so that communication : computation of a model trained here is that of
the same model on the real system. Bandwidths are divided by D exactly. Latencies are
multiplied by D / LATENCY_SCALE: multiplied by D alone, α·β — the message size at which latency
and transfer cost the same, 1.5 MB on NVLink — would stay the real system's, and the course's
messages, ~100× smaller than a 7B model's (64 KiB activations against 32 MiB, a few hundred KB
of gradients against 25 MB buckets), would be all latency. docs/design.md ("A modeled
interconnect") has the figures and their sources.

Off by default and free when off (nothing is wrapped). On with ``use_link(link)`` (in this
process), ``launch(..., link=...)`` (in every rank), or ``MINITRAIN_LINK=<preset>`` (or
``tp=intra-node,dp=inter-node``) in the environment of ``launch``'s caller or of a torchrun
process. A link per mesh axis: a dict ``{"tp": intra, "dp": inter, "default": ...}`` keyed by
the process group's description (``DeviceMesh`` names its groups after their axes).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from minitrain.runtime import link_costs, link_wrap

ENV, FLOPS_ENV = "MINITRAIN_LINK", "MINITRAIN_LINK_FLOPS"
LATENCY_SCALE = 100  # real messages / course messages: α's extra scale (module docstring)


@dataclass(frozen=True)
class Link:
    """α (seconds per message) and bandwidth (bytes per second, per direction per rank);
    ``basis``: what the figures stand for (``describe`` prints it)."""

    alpha: float
    bandwidth: float
    name: str = ""
    basis: str = ""

    def __post_init__(self):
        for field in ("alpha", "bandwidth"):
            value = getattr(self, field)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and 0 < value < float("inf")):
                raise ValueError(f"Link: {field} must be a positive number, got {value!r}")


class RealSystem(NamedTuple):
    """A real system's figures: accelerator FLOP/s, per-message latency α (s), bandwidth (B/s
    per direction per GPU)."""

    description: str
    flops: float
    alpha: float
    bandwidth: float


H100_BF16_FLOPS = 989.4e12  # H100 SXM, dense bf16 tensor-core peak (NVIDIA's Hopper figures)
SYSTEMS = {  # sources: docs/design.md, "A modeled interconnect (issue 42)"
    "intra-node": RealSystem("H100 SXM over NVLink 4 (450 GB/s, 3.4 µs)", H100_BF16_FLOPS,
                             3.4e-6, 450e9),
    "inter-node": RealSystem("H100 SXM over InfiniBand NDR 400 Gb/s (50 GB/s, 14 µs)",
                             H100_BF16_FLOPS, 14e-6, 50e9),
    "ethernet": RealSystem("H100 SXM over 100 Gb/s Ethernet, TCP (12.5 GB/s, 30 µs)",
                           H100_BF16_FLOPS, 30e-6, 12.5e9),
}

_flops: float | None = None  # measured once per process


def machine_flops() -> float:
    """This machine's fp32 matrix-multiply rate on one thread (what one rank computes with when
    there are as many cores as ranks), in FLOP/s: ``MINITRAIN_LINK_FLOPS`` if set (for runs
    that must agree), else measured once per process in ~0.2 s — the best of short runs of
    256×256 products, so that a busy moment of a shared machine counts little."""
    global _flops
    if os.environ.get(FLOPS_ENV):
        value = float(os.environ[FLOPS_ENV])
        if not value > 0:
            raise ValueError(f"{FLOPS_ENV}={os.environ[FLOPS_ENV]!r}: expected FLOP/s > 0")
        return value
    if _flops is None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            g = torch.Generator(device="cpu").manual_seed(0)
            a, b = (torch.randn(256, 256, generator=g, device="cpu") for _ in range(2))
            a @ b
            best, deadline = 0.0, time.perf_counter() + 0.2
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                for _ in range(4):
                    a @ b
                best = max(best, 4 * 2 * 256**3 / (time.perf_counter() - start))
        finally:
            torch.set_num_threads(threads)
        _flops = best
    return _flops


def scaled(system: RealSystem, name: str = "", flops: float | None = None) -> Link:
    """``system``'s link as seen from this machine (``flops``: its FLOP/s, default measured):
    bandwidth / D, α · D / LATENCY_SCALE, D = system.flops / flops."""
    here = flops or machine_flops()
    dilation = system.flops / here
    return Link(system.alpha * dilation / LATENCY_SCALE, system.bandwidth / dilation, name,
                f"{system.description} scaled to this machine's {here / 1e9:.0f} GFLOP/s")


class _Presets(Mapping):
    """``LINKS[name]``: ``scaled(SYSTEMS[name])``, made on first use (measuring this machine)."""

    def __init__(self):
        self._made: dict = {}

    def __getitem__(self, name: str) -> Link:
        if name not in SYSTEMS:
            raise KeyError(f"no link preset {name!r}; the presets are {list(SYSTEMS)}")
        key = (name, machine_flops())  # MINITRAIN_LINK_FLOPS may change between calls
        if key not in self._made:
            self._made[key] = scaled(SYSTEMS[name], name, key[1])
        return self._made[key]

    def __contains__(self, name) -> bool:  # without measuring this machine
        return name in SYSTEMS

    def __iter__(self):
        return iter(SYSTEMS)

    def __len__(self) -> int:
        return len(SYSTEMS)


LINKS = _Presets()


def describe(link) -> str:
    """One line per link for a notebook to print beside what it measured."""
    if isinstance(link, Mapping):
        return "\n".join(f"{axis}: {describe(one)}" for axis, one in link.items())
    basis = f" ({link.basis})" if link.basis else ""
    mb = link.bandwidth / 1e6
    return (f"modeled link {link.name or 'custom'}: α = {link.alpha * 1e6:,.0f} µs, "
            f"β = {f'{mb:,.0f}' if mb >= 100 else f'{mb:.3g}'} MB/s{basis}")


# ---------------------------------------------------------------- which link a group is on
def resolve(spec):
    """A Link, a dict axis → Link (or preset name), a preset name, or "tp=intra-node,dp=..."
    (as MINITRAIN_LINK takes it) → a Link or a dict of Links."""
    if isinstance(spec, Link):
        return spec
    if isinstance(spec, str):
        if "=" in spec:
            pairs = [item.split("=", 1) for item in spec.split(",") if item.strip()]
            return resolve({axis.strip(): preset.strip() for axis, preset in pairs})
        return LINKS[spec.strip()]
    if isinstance(spec, Mapping) and spec:
        return {str(axis): resolve(one) for axis, one in spec.items()}
    raise TypeError(f"a link is a Link, a preset name ({list(SYSTEMS)}) or a non-empty dict "
                    f"axis → link, got {spec!r}")


def _slowest(links) -> Link:
    return max(links, key=lambda one: link_costs.p2p_time(1 << 20, one))


def _resolver(spec):
    """group → Link: a Link for every group; a dict by the group's description (its mesh axis),
    "dp_cp"-like names by the slowest of their parts, others by "default" (else the slowest)."""
    if isinstance(spec, Link):
        return lambda group: spec
    fallback = spec.get("default") or _slowest(spec.values())

    def link_of_group(group) -> Link:
        name = getattr(group, "group_desc", "") or ""
        if name in spec:
            return spec[name]
        parts = [spec[part] for part in name.split("_") if part in spec]
        return _slowest(parts) if parts else fallback

    return link_of_group


_stack: list = []  # the specs in force in this process, innermost last


def active():
    """The link (or dict) in force in this process, or None."""
    return _stack[-1] if _stack else None


def link_of(group=None):
    """The Link messages on ``group`` (None: the default group) are modeled with, or None."""
    spec = active()
    return None if spec is None else _resolver(spec)(dist.group.WORLD if group is None else group)


def install(link) -> None:
    """Switch the link on in this process for good (a rank started by ``launch(link=...)``)."""
    _stack.append(resolve(link))
    link_wrap.wrap(_resolver(_stack[-1]))


@contextlib.contextmanager
def use_link(link):
    """``with use_link(LINKS["inter-node"]): ...``: every message this process sends or receives
    meanwhile is modeled (see the module docstring); nesting restores the outer link."""
    install(link)
    try:
        yield _stack[-1]
    finally:
        _stack.pop()
        if _stack:
            link_wrap.wrap(_resolver(_stack[-1]))
        else:
            link_wrap.unwrap()


def from_environment(environ=None):
    """MINITRAIN_LINK: unset, "" or "off" → None; a preset name or "axis=preset,..." → its
    link(s); anything else a ValueError (a typo must not run unmodeled)."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip()
    if value.lower() in ("", "off", "0"):
        return None
    try:
        return resolve(value)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{ENV}={value!r}: expected a preset ({', '.join(SYSTEMS)}) or "
                         f"axis=preset pairs separated by commas") from exc


def rank_initializers(link=None) -> list:
    """What ``launch`` adds to its rank initializers (after the strict canary's, so the link
    wraps it): ``link`` if given, else the link in force in the caller (``use_link``), else
    MINITRAIN_LINK — resolved here, so every rank models the same figures."""
    spec = resolve(link) if link is not None else active() or from_environment()
    return [] if spec is None else [functools.partial(install, spec)]


def install_from_environment() -> None:
    """Under torchrun (``init_from_env``): install MINITRAIN_LINK if set. One machine only: the
    finish times ranks exchange are read on CLOCK_MONOTONIC, which machines do not share."""
    spec = from_environment()
    if spec is None:
        return
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local and world and local != world:
        raise ValueError(f"{ENV}: a modeled link needs every rank on one machine "
                         f"(LOCAL_WORLD_SIZE={local}, WORLD_SIZE={world}); between machines "
                         "the network is real")
    install(spec)
