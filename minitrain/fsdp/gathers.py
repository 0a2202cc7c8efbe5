"""FSDP's gathers: one unit order on every rank, whichever units a rank runs and in what order.

Chapter 5, used by ``FullyShardedDataParallel`` (wrapper.py). Collectives of one group pair up
by position: the k-th all-gather of every rank is one collective, so all ranks must launch
the same gathers in the same order, also when each runs other units (a trunk and one branch
per rank: the public contract lets ranks use different parameters). The rule is chapter 5's,
shared with ZeRO stage 3 (``minitrain.zero.gather_order.OrderedGathers``): each pass launches
the units' gathers in unit order — forward first to last, backward last to first — catching
up the units this rank skips, and ends by launching those nobody asked for; the backward pass
begins with the root and the last unit on every rank, even when a unit's own backward hook
fires first (a branch whose output *is* the model's output: its hook was registered on that
tensor before the model output's). Without that, the root was never gathered for backward
(issue 40).

FSDP's forward also *frees* every earlier unit before a unit computes (``_pre_forward``): a
branch not taken may have skipped a unit whose prefetched gather is still held. But whether
an earlier unit that has not run was skipped or is still to come, a rank cannot tell: when
units run out of their listed order (branches registered before the trunk they follow), the
trunk's forward would free the rank's own branch, and gathering it again is a collective
only that rank issues — paired with another rank's gather of another unit: gloo aborts when
the sizes differ, and with equal sizes every gradient is silently wrong (issue 40). So a unit
freed in the forward pass before it ran there is *parked*: its parameters hidden and its
state "free" as any freed unit's, its gathered buffer kept until the pass ends; if it runs
after all, its parameters are shown again without a collective. Its bytes stay counted in
``peak_gathered_bytes`` until then: an order a rank cannot predict costs holding a skipped
unit until the end of forward, as stage 3 does.
"""

from __future__ import annotations

from minitrain.runtime import trace
from minitrain.zero.buffers import wait_timed
from minitrain.zero.gather_order import OrderedGathers


class UnitGathers(OrderedGathers):
    """``OrderedGathers`` plus FSDP's freeing of earlier units, made safe by parking."""

    def _init_gathering(self) -> None:
        # units whose forward began in this pass, hooks entered in backward, parked units
        self._ran, self._entered, self._parked = set(), set(), {}
        super()._init_gathering()

    def _begin_forward(self) -> None:
        """Called at the start of each forward: nothing run, entered or parked yet (a forward
        that raised may have left units parked)."""
        self._release_parked()
        self._ran, self._entered = set(), set()

    def _gather_in_order(self, upto):
        """Launch the forward gathers of the units not yet launched, up to unit ``upto``, in
        unit order (units this rank skipped included): never out of order, so all ranks issue
        the same collectives. Outside the forward pass it launches nothing: the cursor then
        walks backward's order."""
        if self._pass == "forward":
            self._launch_until(min(upto, len(self.blocks) - 1) + 1, 1)

    def _gather_down_to(self, lowest):
        """Launch the backward gathers not yet launched, down to unit ``lowest``, last unit
        first (units this rank's backward skips included)."""
        if self._pass == "backward":
            self._launch_until(max(lowest, 0) - 1, -1)

    def _pre_hook(self, index, module, args):
        if self.units[index] is not None:  # before _pre_forward frees the units before it
            self._ran.add(id(self.units[index]))
        super()._pre_hook(index, module, args)

    def _free(self, u):
        if u is not None and id(u) in self._parked:
            if self._pass == "forward":
                return  # parked: kept until the pass ends, in case it still runs
            self._release_parked([u])
            return
        not_run = u is not None and id(u) in self._block_index and id(u) not in self._ran
        if self._pass == "forward" and not_run and u.state != "free":
            self._park(u)  # skipped, or still to come: this rank cannot tell which
            return
        super()._free(u)

    def _park(self, u) -> None:
        """Hide ``u``'s parameters as a free would, but keep its gathered buffer (see above)."""
        if u.state == "gathering":  # (the one wait a free of it would have made too)
            trace.record(f"gather {u.name}", "communication", u.launched,
                         wait_timed(u.work, u.full.device))
            u.work = None
        u.hide_params()
        u.state = "free"
        self._parked[id(u)] = u

    def _start_gather(self, u):
        if u is not None and id(u) in self._parked:  # it runs after all: its data is here
            del self._parked[id(u)]
            u.state = "full"
            u.show_params()
            return
        super()._start_gather(u)

    def _release_parked(self, units=None) -> None:
        """Give back the buffers of ``units`` (default: every parked unit)."""
        for u in list(self._parked.values()) if units is None else units:
            del self._parked[id(u)]
            u.state = "full"  # its buffer is still allocated: the ordinary free returns it
            super()._free(u)

    def _pre_backward(self, index):
        """Unit ``index``'s backward is next: gather it (and, in order, any unit this rank's
        backward skips), prefetch the one before it."""
        if index in self._entered:  # a hook of a second output tensor of the same unit
            return
        self._entered.add(index)
        # a unit whose output is the model's output: its hook fires before the output's, and
        # the pass must still begin as on every rank — the root, then the last unit
        self._backward_begins(None)
        self._gather_down_to(index - 1)
        self._wait_gather(self.units[index])
        if self.units[index] is not None:
            self.units[index].backward_start = trace.now(self.device)
