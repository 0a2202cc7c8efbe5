"""The runtime's one communication log (minitrain/runtime/communication_log.py): every technique
records into it, none keeps a counter of its own (issue 27)."""

import ast
import re
from pathlib import Path

from minitrain.runtime import COMMUNICATION_LOG, CommunicationLog

PACKAGE = Path(__file__).resolve().parent.parent / "minitrain"
LOG_FILE = PACKAGE / "runtime" / "communication_log.py"


def test_records_read_back_by_source_and_kind_and_reset_per_source():
    log = CommunicationLog()
    log.record("tp", "all-reduce", 24, 32, 4)
    log.record("tp", "all-gather", 12, 16, 4)
    log.record("moe", "dispatch", 100)
    assert log.bytes_sent() == 136 and log.bytes_sent("tp") == 36
    assert log.bytes_sent("tp", "all-gather") == 12
    assert [r.kind for r in log.records("tp")] == ["all-reduce", "all-gather"]
    assert log.records("moe")[0].message_bytes == 100  # the message defaults to what was sent
    log.reset("tp")
    assert log.bytes_sent() == 100 and log.records("tp") == []
    log.reset()
    assert log.bytes_sent() == 0 and log.records() == []


def test_a_long_run_keeps_exact_totals_and_a_bounded_list():
    log = CommunicationLog(max_records=10)
    for _ in range(1000):
        log.record("ddp", "send", 3)
    assert log.bytes_sent("ddp") == 3000 and len(log.records()) == 10


def test_the_techniques_views_read_the_one_log():
    from minitrain import collectives, context_parallel, moe, tensor_parallel, zero

    COMMUNICATION_LOG.reset()
    COMMUNICATION_LOG.record("tp", "all-reduce", 6, 8, 4)
    COMMUNICATION_LOG.record("moe", "dispatch", 5)
    COMMUNICATION_LOG.record("cp", "K,V", 7)
    COMMUNICATION_LOG.record("collectives", "send", 9)
    COMMUNICATION_LOG.record("zero", "all_gather", 11)
    assert tensor_parallel.communication_log() == [("all-reduce", 8, 6)]
    assert moe.communication_log() == [("dispatch", 5)]
    assert context_parallel.communication_log() == [("K,V", 7)]
    assert collectives.bytes_sent() == 9 and zero.bytes_sent()["all_gather"] == 11
    tensor_parallel.reset_communication_log()
    assert tensor_parallel.communication_log() == [] and moe.communication_log() == [("dispatch", 5)]
    COMMUNICATION_LOG.reset()


def test_no_module_keeps_a_byte_counter_of_its_own():
    """A module-level list, dict or number named like a log or a byte count, outside the
    runtime's log: a second counter, which a reset elsewhere would miss."""
    suspicious = re.compile(r"log|sent|bytes", re.IGNORECASE)
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == LOG_FILE:
            continue
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
            value = getattr(node, "value", None)
            mutable = isinstance(value, (ast.List, ast.Dict)) or (
                isinstance(value, ast.Constant) and isinstance(value.value, int))
            for t in targets:
                # an UPPER_CASE table of constants (BYTES_PER_PARAMETER) is not a counter
                constant = t.id.isupper() and "SENT" not in t.id if isinstance(t, ast.Name) else 1
                if isinstance(t, ast.Name) and suspicious.search(t.id) and mutable and not constant:
                    bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {t.id}")
    assert not bad, "module-level counters besides the communication log:\n" + "\n".join(bad)
