"""The distributed runtime (layer 1 of docs/design.md's three): starting ranks and what a rank
sees. It knows nothing of techniques, exercises or grading; everything above imports it.

Notebook 00 teaches it; every multi-process chapter uses it.

- ``launch.py``: ``launch(fn, world_size, ...)`` from a notebook, a test or a script;
- ``rank.py``: a rank's side (``init_from_env`` under torchrun, ``get_device``, the backend);
- ``launch_errors.py``: waiting for ranks and naming the one that failed (``LaunchError``);
- ``stopping.py``: stop signals end every rank (``Interrupted``), the forkserver's start and stop;
- ``point_to_point.py``: send/recv helpers (chapter 0's exercises);
- ``strict_p2p.py`` / ``strict_stream.py``: the NCCL-semantics canary (``MINITRAIN_P2P=strict``:
  one in-order stream per rank, unbuffered sends, tags ignored, ``batch_isend_irecv`` a group);
- ``link.py`` (with ``link_costs.py``, ``link_messages.py``, ``link_wrap.py``): a modeled
  interconnect (``use_link``, ``launch(link=)``, ``MINITRAIN_LINK``): every message takes its
  α–β time, relative to this machine's compute (issue 42);
- ``trace.py``: per-rank timelines of compute and communication (a GPU's spans on its events);
- ``communication_log.py``: the one log of what every technique sent (``COMMUNICATION_LOG``);
- ``timing.py``: step times of several ranks summarised (the slowest rank's, median, quartiles),
  one call timed on every rank (``slowest_rank_seconds``);
- ``hello.py``: ``python -m minitrain.runtime.hello``, the smallest multi-rank program.
"""

from minitrain.runtime.communication_log import COMMUNICATION_LOG, CommunicationLog, Message
from minitrain.runtime.compare import max_abs_difference
from minitrain.runtime.launch import RankResults, add_rank_initializer, launch, run
from minitrain.runtime.launch_errors import LaunchError
from minitrain.runtime.rank import (
    default_backend,
    get_device,
    init_from_env,
    running_under_torchrun,
)
from minitrain.runtime.stopping import Interrupted
from minitrain.runtime.timing import (
    device_clock,
    median_and_quartiles,
    slowest_rank_seconds,
    summarize_step_times,
    synchronize,
)

__all__ = [
    "max_abs_difference",
    "COMMUNICATION_LOG",
    "CommunicationLog",
    "Message",
    "Interrupted",
    "LaunchError",
    "RankResults",
    "add_rank_initializer",
    "default_backend",
    "get_device",
    "init_from_env",
    "launch",
    "device_clock",
    "median_and_quartiles",
    "run",
    "running_under_torchrun",
    "slowest_rank_seconds",
    "summarize_step_times",
    "synchronize",
]
