"""ZeRO stage 3's gathers in one order on every rank, when ranks run different units.

Chapter 5, used by ``ZeroDataParallel`` (data_parallel.py). Collectives of one group pair up
by position: the k-th all-gather of every rank is one collective. Stage 3 gathers a unit when
its forward runs and prefetches the next (Rajbhandari et al. 2020, §5.3), so a rank whose
forward skips a unit — a trunk and one branch per rank, the branches in an ``nn.ModuleList``
(issue 26) — would launch another sequence of gathers than its peers, and pair one unit's
buffer with another's. As FSDP does (``FullyShardedDataParallel._gather_in_order``), each
pass launches the units' gathers in unit order (forward: first to last; backward: last to
first), catching up any unit this rank skipped, and ends by launching those nobody asked for.
A skipped unit is gathered for nothing on that rank and freed at the end of the pass.

Two ways a rank's own schedule would still leave that order (issue 40, item 2):

- The backward pass begins at the first backward hook that fires, whichever it is. When a
  unit's output *is* the model's output (``return self.branches[rank](h)``), that unit's hook
  runs before the hook on the model's output, and gathered its unit first — each rank a
  different one (gloo: "Received data size doesn't match expected size").
- Within a pass, a *prefetch* of a unit whose turn has passed is dropped: it was launched
  already, and if this rank has since freed it (it ran), gathering it again is a collective
  the other ranks do not issue. Such prefetches happen when units run out of their listed
  order (branches registered before the trunk). A unit a rank *needs* is always gathered.
"""

from __future__ import annotations

from minitrain.zero.sharded_units import ShardedUnits


class OrderedGathers(ShardedUnits):
    """``ShardedUnits`` whose block gathers follow the unit order within each pass."""

    _pass, _cursor, _block_index, _needed = None, 0, {}, None

    def _init_gathering(self) -> None:
        self._block_index = {id(u): i for i, u in enumerate(self.units[:-1]) if u is not None}
        self._pass, self._cursor = None, 0  # outside a pass (a checkpoint's gathers): as called
        super()._init_gathering()

    def _start_gather(self, u):
        i = self._block_index.get(id(u)) if u is not None else None
        if self._pass is not None and i is not None:
            step = 1 if self._pass == "forward" else -1
            if (i - self._cursor) * step < 0 and u is not self._needed:
                return  # a prefetch whose turn in this pass is over (launched already)
            self._launch_until(i, step)  # the units before it in this pass, skipped or not
            if self._cursor == i:
                self._cursor += step
        super()._start_gather(u)

    def _wait_gather(self, u):
        self._needed = u  # this rank computes with it now: gathered even if its turn passed
        try:
            super()._wait_gather(u)
        finally:
            self._needed = None

    def _launch_until(self, stop: int, step: int) -> None:
        """Launch the gathers of the units from the cursor up to (excluding) ``stop``."""
        while (stop - self._cursor) * step > 0:
            super()._start_gather(self.units[self._cursor])
            self._cursor += step

    def _sharded_forward(self, *args, **kwargs):
        self._pass, self._cursor = "forward", 0
        out = super()._sharded_forward(*args, **kwargs)
        self._launch_until(len(self.blocks), 1)  # the units no forward of this rank reached
        self._pass = None
        for u in self.units[:-1]:  # (what a skipped unit was gathered for: nothing)
            self._free(u)
        return out

    def _backward_begins(self, grad):
        if self._pass == "backward":
            return  # a second output tensor, or a unit's hook that began the pass
        self._pass, self._cursor = "backward", len(self.blocks) - 1
        super()._backward_begins(grad)  # the root first, then the last unit: on every rank

    def _pre_backward(self, index):
        # a unit whose output is the model's output: its hook fires before the output's
        self._backward_begins(None)
        super()._pre_backward(index)

    def _finish_backward(self):
        if self._pass == "backward":
            self._launch_until(-1, -1)  # the units no backward of this rank reached
        self._pass = None
        super()._finish_backward()  # (its end frees every unit)
