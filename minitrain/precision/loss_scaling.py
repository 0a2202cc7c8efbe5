"""Loss scaling: keep small fp16 gradients above fp16's smallest subnormal.

Chapter 2, notebooks/02_floating_point_and_loss_scaling.ipynb. `DynamicLossScaler` multiplies
the loss by S, divides the gradients by S before the step, skips steps whose gradients
overflowed and adapts S: the rules of torch.amp.GradScaler (the tests' oracle). Where they come
from: Micikevicius et al. 2018, "Mixed Precision Training", section 3.2, scale the loss by a
*constant* S chosen per network and skip a step whose gradients overflowed; the *dynamic* rule
(halve S on overflow, double it after N clean steps) came with NVIDIA's mixed-precision tools
(Apex's `fp16_utils.DynamicLossScaler`, NVIDIA's "Training With Mixed Precision" guide) and is
GradScaler's (start at 2^16, grow every 2000 clean steps).

The loss itself is fp32, as in practice (Micikevicius et al. section 3.3 keep reductions and
the softmax in fp32; `torch.autocast` runs cross-entropy in fp32): `fp32_lm_loss` casts
low-precision logits to fp32 first. Then S lives in fp32 and 2^16 or 2^24 is as good a scale
as 2^8: only a real gradient times S beyond fp16's 65504 overflows. Computing the loss in fp16
is a pitfall: the first gradient of backward, d(S*L)/dL = S, is then an fp16 number and any
S >= 2^16 is inf before a single layer runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from minitrain.model import lm_loss
from minitrain.runtime import get_device


def fp32_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The language-modelling loss of (fp16/bf16) logits, computed in fp32: a ``GPT.loss_fn``.

    The softmax and the mean over tokens are reductions, which mixed precision keeps in fp32
    (Micikevicius et al. 2018, section 3.3); so is the scaled loss S*L and the gradient
    backward starts from, S. The first fp16 gradient is the logits' (S (p - onehot) / N).
    """
    return lm_loss(logits.float(), targets)


class DynamicLossScaler:
    """Dynamic loss scaling with `torch.amp.GradScaler`'s semantics.

    Per iteration: `scaler.scale(loss).backward()`, optionally `scaler.unscale_(opt)` (e.g. to
    clip), `scaler.step(opt)` (unscales if not yet done, skips the step if any gradient is inf
    or NaN), then `scaler.update()`: back off (S *= backoff_factor) after an overflow, grow
    (S *= growth_factor) after `growth_interval` consecutive clean steps. Like GradScaler the
    scale is a float32 number, so the arithmetic rounds the same way.

    S multiplies the fp32 loss (``fp32_lm_loss``, or autocast's fp32 cross-entropy), so the
    default start, 2^16, need not be an fp16 number: what bounds S is the largest gradient,
    which must stay below fp16's max (65504) after scaling.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        if not (0 < init_scale < float("inf")):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1.0, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        # S is one number the host reads (get_scale, update): it lives on the CPU and goes to
        # the loss's device in scale(); the overflow flags live where the gradients are.
        self._scale = torch.tensor(init_scale, dtype=torch.float32, device="cpu")
        self._growth_tracker = 0  # consecutive clean steps since the last growth or backoff
        self._found_inf: dict[int, bool] = {}  # id(optimizer) -> overflow seen, since update()
        self._stepped: set[int] = set()
        self._grad_device: dict[int, torch.device] = {}  # id(optimizer) -> its gradients' device

    def get_scale(self) -> float:
        return float(self._scale)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * S: by the chain rule every gradient of the backward pass is S times larger."""
        return loss * self._scale.to(loss.device)

    def unscale_(self, optimizer) -> None:
        """Divide the gradients of `optimizer`'s parameters by S in place (at most once per
        iteration) and record whether any of them is inf or NaN."""
        key = id(optimizer)
        if key in self._found_inf:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if key in self._stepped:
            raise RuntimeError("unscale_() is being called after step().")
        # 1/S in float64 then float32, as GradScaler does, so the two agree bit for bit.
        inv_scale = self._scale.double().reciprocal().float()
        # One overflow flag per gradient device, on that device: the checks queue up on the
        # GPU and the host waits once, at the end, instead of once per parameter.
        flags: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.dtype == torch.float16:
                        # Dividing in fp16 would flush exactly the values scaling saved.
                        raise ValueError(
                            "unscale_ got fp16 gradients: keep fp32 master gradients "
                            "(see MasterWeightOptimizer)"
                        )
                    device = p.grad.device
                    if device not in flags:
                        flags[device] = torch.zeros((), dtype=torch.bool, device=device)
                    flags[device] |= ~torch.isfinite(p.grad).all()
                    p.grad.mul_(inv_scale.to(device))
        self._found_inf[key] = any(bool(flag) for flag in flags.values())
        if flags:
            self._grad_device[key] = next(iter(flags))

    def all_reduce_found_inf(self, optimizer, group: ProcessGroup | None = None) -> bool:
        """Make this iteration's overflow verdict for `optimizer` the same on every rank of
        `group` (None: the default group): True if *any* rank's `unscale_` saw inf/NaN.

        For sharded training (ZeRO, FSDP), where each rank unscales only its slice of the
        gradients: without this, the rank holding the overflow skips its step and backs off
        while the others step and keep their scale, and the replicas drift apart (torch's
        ShardedGradScaler does the same all-reduce). Call after `unscale_`, before `step`.
        """
        key = id(optimizer)
        if key not in self._found_inf:
            raise RuntimeError("all_reduce_found_inf() needs unscale_() first.")
        # On the gradients' device: under NCCL a CPU flag would go to gloo (the backend is
        # chosen by the tensor's device), one more round trip beside NCCL's. A rank that had
        # no gradient at all uses the rank's device.
        device = self._grad_device.get(key) or get_device()
        flag = torch.tensor([float(self._found_inf[key])], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        self._found_inf[key] = bool(flag.item())
        return self._found_inf[key]

    def step(self, optimizer, *args, **kwargs):
        """optimizer.step() unless this iteration's gradients overflowed (then skip it)."""
        key = id(optimizer)
        if key in self._stepped:
            raise RuntimeError("step() has already been called since the last update().")
        if key not in self._found_inf:
            self.unscale_(optimizer)
        self._stepped.add(key)
        if self._found_inf[key]:
            return None  # skipped: the weights keep their values, update() will back off
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Adapt the scale S after the iteration: torch.amp.GradScaler's rule, exactly.

        Reads `found_inf` (did any optimizer's `unscale_` see inf/NaN this iteration) and
        updates `self._scale` (S, a 1-element float32 tensor) and `self._growth_tracker` (an
        int: the clean iterations counted towards the next growth). The policy: an overflow
        shrinks S by `backoff_factor` at once; `growth_interval` clean iterations in a row grow
        it by `growth_factor` — unless the grown S would not be finite, when S stays. S stays
        float32 and each product is computed in float64 and rounded once,
        `(S.double() * f).float()`, so the values are GradScaler's bit for bit. The grader runs
        both side by side for 20 iterations with injected overflows (two in a row among them)
        and compares S after every one.
        """
        if not self._found_inf:
            raise RuntimeError("No inf checks were recorded prior to update(): call step() first.")
        found_inf = any(self._found_inf.values())
        ### BEGIN SOLUTION
        if found_inf:
            self._scale = (self._scale.double() * self.backoff_factor).float()
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                grown = (self._scale.double() * self.growth_factor).float()
                if torch.isfinite(grown):
                    self._scale = grown
                self._growth_tracker = 0
        ### END SOLUTION
        self._found_inf.clear()
        self._stepped.clear()
        self._grad_device.clear()

    def state_dict(self) -> dict:
        """The scale and the growth tracker, so a resumed run scales as the straight run
        would (``torch.amp.GradScaler.state_dict`` holds the same)."""
        return {"scale": float(self._scale), "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self._scale = torch.tensor(state["scale"], dtype=torch.float32, device="cpu")
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval = state["growth_interval"]
        self._growth_tracker = state["_growth_tracker"]
