"""tests/gpu/: what only a machine with GPUs can check (issue 29; `make test-gpu` runs it).

Collected everywhere, run only with 2 or more GPUs: on a CPU machine every test here is
skipped with the reason, so `make test` shows they exist and why they did not run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
REASON = f"needs 2 or more GPUs (this machine has {GPUS}): run `make test-gpu` on a GPU node"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "device_canary"))


def pytest_collection_modifyitems(config, items):
    if GPUS >= 2:
        return
    here = Path(__file__).resolve().parent
    for item in items:
        if here in item.path.resolve().parents:
            item.add_marker(pytest.mark.skip(reason=REASON))
