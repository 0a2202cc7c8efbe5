"""The one communication log of a process: every collective and send, by technique, kind, bytes.

Used by the notebooks that set "measured" beside a paper's formula (chapters 4–10), by their
tests and by the benchmarks. Each technique records what it sends here; none keeps a counter
of its own, so "how many bytes did this step send" has one answer, read in one place:

    from minitrain.runtime import COMMUNICATION_LOG as log
    log.reset()
    ...                                    # a training step
    log.bytes_sent()                       # everything this rank sent
    log.bytes_sent(source="tp")            # tensor parallelism's share
    [r.kind for r in log.records("moe")]   # the all-to-alls, in order

Two byte counts per record, because the chapters teach both: ``sent_bytes``, what this rank
puts on the wire (a ring all-reduce sends 2(N-1)/N of the message, Patarasuk & Yuan 2009), and
``message_bytes``, the logical size of the tensor the collective is about.

One log per process (ranks are processes): it is the runtime's, like the trace of trace.py.
Totals are exact however long a run is; the list of individual records keeps the newest
``MAX_RECORDS`` so a long training run does not grow without bound.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

MAX_RECORDS = 100_000


class Message(NamedTuple):
    """One collective (or one send) as this rank saw it."""

    source: str  # who sent it: "collectives", "ddp", "zero", "tp", "moe", "cp", ...
    kind: str  # "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send", ...
    sent_bytes: int  # bytes this rank sent to other ranks
    message_bytes: int  # bytes of the logical message (the full tensor)
    group_size: int = 1


class CommunicationLog:
    """Records ``Message``s; reads them back by source and kind; resets per source or whole."""

    def __init__(self, max_records: int = MAX_RECORDS):
        self._records: deque[Message] = deque(maxlen=max_records)
        self._totals: dict[tuple[str, str], int] = {}

    def record(self, source: str, kind: str, sent_bytes: int, message_bytes: int | None = None,
               group_size: int = 1) -> None:
        sent = int(sent_bytes)
        message = sent if message_bytes is None else int(message_bytes)
        self._records.append(Message(source, kind, sent, message, group_size))
        self._totals[source, kind] = self._totals.get((source, kind), 0) + sent

    def records(self, source: str | None = None, kind: str | None = None) -> list[Message]:
        """The newest records, oldest first, of one source (and kind), or all of them."""
        return [
            r for r in self._records
            if (source is None or r.source == source) and (kind is None or r.kind == kind)
        ]

    def bytes_sent(self, source: str | None = None, kind: str | None = None) -> int:
        """Total bytes this rank sent since the last reset (of that source)."""
        return sum(
            n for (s, k), n in self._totals.items()
            if (source is None or s == source) and (kind is None or k == kind)
        )

    def reset(self, source: str | None = None) -> None:
        """Forget everything, or only one source's records and totals."""
        if source is None:
            self._records.clear()
            self._totals.clear()
            return
        kept = [r for r in self._records if r.source != source]
        self._records.clear()
        self._records.extend(kept)
        for key in [k for k in self._totals if k[0] == source]:
            del self._totals[key]


# the process's log: every technique records into it, every reader reads it
COMMUNICATION_LOG = CommunicationLog()
