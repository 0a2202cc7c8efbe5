"""Chapter 5, continued — FSDP: ZeRO-3 as frameworks ship it.

Used by notebooks/05_zero.ipynb (Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully
Sharded Data Parallel"; Rajbhandari et al. 2020, "ZeRO", stage 3). Files by role:

- ``wrapper.py``: ``FullyShardedDataParallel``, an ``nn.Module`` whose parameters are this
  rank's shards, built on chapter 5's ``minitrain.zero.ShardedUnits``;
- ``gathers.py``: the gathers in one unit order on every rank (chapter 5's
  ``OrderedGathers``), a unit freed before it ran kept until the forward ends;
- ``shards.py``: the module's parameters become this rank's shards (``replicated_params``
  checked, the flat shards registered);
- ``clipping.py``: the global gradient norm over shards;
- ``measure.py``: bytes per rank, peak gathered bytes, bytes sent, a timeline — what the
  notebook, the widget and the benchmark show.
"""

from minitrain.fsdp.wrapper import FullyShardedDataParallel

__all__ = ["FullyShardedDataParallel"]
