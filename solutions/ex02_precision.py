"""Chapter 2 solutions — generated from minitrain.precision.formats, minitrain.precision.loss_scaling, minitrain.precision.master_weights.

The worked answers. Look one up when you are stuck; the library has them too.
"""

from __future__ import annotations

import math
import torch
import torch.distributed as dist
from dataclasses import dataclass
from torch import nn
from torch.distributed import ProcessGroup
from minitrain.model import lm_loss
from minitrain.runtime import get_device


def round_significand(sig: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Drop the lowest `shift` bits of the integer significands `sig`, rounding to nearest, ties
    to even (IEEE 754 roundTiesToEven, section 4.3.1).

    Both are int64 tensors of the same shape, `shift >= 1`. Returns `q`, the kept integer, so that
    `q * 2**shift` is the multiple of `2**shift` nearest to `sig`; when `sig` lies exactly halfway
    between two multiples, the one with an even `q` wins. Examples: sig=0b1011, shift=2 -> 3
    (remainder 0b11 is more than half); sig=0b1010, shift=2 -> 2 (a tie, 2 is even);
    sig=0b1110, shift=2 -> 4 (a tie, 3 is odd so round up to 4).
    """
    ### BEGIN SOLUTION
    # HINT: split each value into the bits kept and the bits dropped; the dropped bits decide,
    # HINT: compared with exactly half of one unit of the kept ones — and a tie goes to even
    one = torch.ones_like(sig)
    q = sig >> shift
    remainder = sig - (q << shift)
    half = one << (shift - 1)
    round_up = (remainder > half) | ((remainder == half) & ((q & 1) == 1))
    return q + round_up.to(sig.dtype)
    ### END SOLUTION


class FloatFormat:
    # Only the methods you write; the rest of the class is in minitrain.precision.formats.

    def decode(self, bits: int) -> float:
        """The value of the bit pattern `bits` (an int in [0, 2**self.bits)).

        Layout, most significant first: sign S, exponent field E, mantissa field M.
        Normal (0 < E < all ones): (-1)^S * (1 + M / 2**mantissa_bits) * 2**(E - bias).
        Subnormal (E == 0):        (-1)^S * (M / 2**mantissa_bits) * 2**(1 - bias).
        All-ones E: inf if M == 0 and NaN otherwise (IEEE formats); when `has_inf` is False
        only M all ones is NaN and every other pattern is an ordinary normal number.
        """
        if not isinstance(bits, int) or not 0 <= bits < 2**self.bits:
            raise ValueError(
                f"{self.name} bit pattern must be an int in [0, 2**{self.bits}), got {bits!r}"
            )
        ### BEGIN SOLUTION
        # HINT: extract the fields with >> and & ((1 << n) - 1); math.ldexp(m, e) is m * 2**e
        m_bits = self.mantissa_bits
        sign = -1.0 if (bits >> (self.exponent_bits + m_bits)) & 1 else 1.0
        exponent = (bits >> m_bits) & ((1 << self.exponent_bits) - 1)
        mantissa = bits & ((1 << m_bits) - 1)
        if exponent == (1 << self.exponent_bits) - 1:
            if self.has_inf:
                return sign * math.inf if mantissa == 0 else math.nan
            if mantissa == (1 << m_bits) - 1:
                return math.nan
        if exponent == 0:  # subnormal: no implicit leading 1, exponent pinned at 1 - bias
            return sign * math.ldexp(mantissa, 1 - self.bias - m_bits)
        return sign * math.ldexp((1 << m_bits) + mantissa, exponent - self.bias - m_bits)
        ### END SOLUTION


class DynamicLossScaler:
    # Only the methods you write; the rest of the class is in minitrain.precision.loss_scaling.

    def update(self) -> None:
        """Adapt S after the iteration (dynamic loss scaling, torch.amp.GradScaler's rule).

        If any optimizer saw inf/NaN: S = S * backoff_factor and the growth tracker restarts
        at 0. Otherwise the tracker counts one more clean step; when it reaches
        growth_interval, S = S * growth_factor (only if that is finite) and it restarts at 0.
        Keep S a float32 tensor: compute in float64 and round, `(S.double() * f).float()`.
        """
        if not self._found_inf:
            raise RuntimeError("No inf checks were recorded prior to update(): call step() first.")
        found_inf = any(self._found_inf.values())
        ### BEGIN SOLUTION
        # HINT: self._scale, self._growth_tracker, self.growth_factor, self.backoff_factor
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


class MasterWeightOptimizer:
    # Only the methods you write; the rest of the class is in minitrain.precision.master_weights.

    def step(self) -> None:
        """One optimizer step on the fp32 masters, then copy them back into the model.

        The masters' `.grad` already hold the fp32 gradients. After `self.optimizer.step()`,
        write each master into its model parameter (`copy_` rounds to the model's dtype, to
        nearest even); the master keeps the digits the low-precision copy cannot hold.
        """
        ### BEGIN SOLUTION
        # HINT: self.optimizer, self.model_params, self.master_params; use torch.no_grad()
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.model_params, self.master_params):
                p.copy_(m)
        ### END SOLUTION

# minitrain-exercises-hash: 91b80b86ca1b4a32
