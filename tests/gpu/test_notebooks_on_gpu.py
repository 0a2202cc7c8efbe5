"""Each notebook under nbval on the GPU: its multi-rank functions run on NCCL with a GPU per
rank, and the committed outputs (booleans, rounded values, byte counts) must reproduce."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_reproduces_on_the_gpu(notebook):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MINITRAIN_DEVICE", "MINITRAIN_BACKEND")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--nbval",
         "--nbval-current-env", "--nbval-sanitize-with", str(ROOT / "tests/nbval_sanitize.cfg"),
         str(notebook), "-q"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:]
