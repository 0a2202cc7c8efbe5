"""Floating-point formats built from their bits: decode, encode, round to nearest even.

Chapter 2, notebooks/02_floating_point_and_loss_scaling.ipynb. A float is three integers
(sign, exponent, mantissa); everything here is integer arithmetic on those fields, so the
learner sees *why* fp16 flushes small gradients to zero and bf16 does not. torch's casts are
only used by the tests, as the oracle.

References: IEEE 754-2019 section 3.4 (binary interchange formats) and 4.3.1
(roundTiesToEven); Kalamkar et al. 2019, "A Study of BFLOAT16 for Deep Learning Training";
Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (E4M3 without infinities, E5M2);
Gupta et al. 2015, "Deep Learning with Limited Numerical Precision" (stochastic rounding).

The rest of the chapter is beside this file: loss_scaling.py, master_weights.py, fp8.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_F64_MANTISSA = 52  # float64 keeps 52 explicit mantissa bits; we round from float64
_F64_BIAS = 1023


def round_significand(sig: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Drop the lowest `shift` bits of the integer significands `sig`, rounding to nearest, ties
    to even (IEEE 754 roundTiesToEven, section 4.3.1).

    `sig` and `shift` are int64 tensors of the same shape, `0 <= sig < 2**53` (a float64
    significand) and `1 <= shift <= 54`, element by element (``FloatFormat.round`` calls it
    once for a whole tensor: work on tensors, no Python loop over elements). Returns `q`, an int64
    tensor of that shape: the integer for which `q * 2**shift` is the multiple of `2**shift`
    nearest to `sig`; when `sig` lies exactly halfway between two multiples, the one with
    an even `q`. Examples: sig=0b1011, shift=2 -> 3 (0b1011 is 11; 12 = 3 * 4 is nearest);
    sig=0b1010, shift=2 -> 2 (10 is halfway between 8 and 12: 2 is even);
    sig=0b1110, shift=2 -> 4 (14 is halfway between 12 and 16: 4 is even). The grader
    compares with exact rational rounding on random and on tied significands up to 2**53.
    """
    ### BEGIN SOLUTION
    one = torch.ones_like(sig)
    q = sig >> shift
    remainder = sig - (q << shift)
    half = one << (shift - 1)
    round_up = (remainder > half) | ((remainder == half) & ((q & 1) == 1))
    return q + round_up.to(sig.dtype)
    ### END SOLUTION


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: 1 sign bit, `exponent_bits`, `mantissa_bits`.

    `has_inf=False` selects the "fn" (finite, single NaN) variant of E4M3: the all-ones
    exponent holds ordinary numbers, only S.1111.111 is NaN, and casts saturate to +-max
    (what torch's `float8_e4m3fn` cast does on CPU). `torch_dtype` names the torch type with
    the same semantics; it is used by tests and widgets as the oracle, never by `round`.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    has_inf: bool = True
    torch_dtype: torch.dtype | None = None

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def max_exponent(self) -> int:
        # IEEE reserves the all-ones exponent for inf/NaN; "fn" formats use it for numbers.
        top = 2**self.exponent_bits - (2 if self.has_inf else 1)
        return top - self.bias

    @property
    def max(self) -> float:
        # Largest mantissa: all ones, except in "fn" formats where all ones with the top
        # exponent is the NaN pattern, so one less.
        top_mantissa = 2**self.mantissa_bits - (1 if self.has_inf else 2)
        return math.ldexp(
            2**self.mantissa_bits + top_mantissa, self.max_exponent - self.mantissa_bits
        )

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, 1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return math.ldexp(1.0, 1 - self.bias - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Distance from 1.0 to the next representable number: 2**-mantissa_bits."""
        return math.ldexp(1.0, -self.mantissa_bits)

    def __repr__(self) -> str:
        return f"FloatFormat({self.name}: 1 sign, {self.exponent_bits} exponent, {self.mantissa_bits} mantissa bits)"

    # ----------------------------------------------------------------- bits <-> values
    def decode(self, bits: int) -> float:
        """The value of the bit pattern `bits` (an int in [0, 2**self.bits)), as a Python float.

        Layout, most significant first: sign S (1 bit), exponent field E (`exponent_bits`),
        mantissa field M (`mantissa_bits`); the value rules are IEEE 754's (section 3.4):
        normal (0 < E < all ones): (-1)^S * (1 + M / 2**mantissa_bits) * 2**(E - bias);
        subnormal (E == 0): (-1)^S * (M / 2**mantissa_bits) * 2**(1 - bias) — zero included,
        with its sign (-0.0 for S = 1); all-ones E: inf (with its sign) if M == 0 and NaN
        otherwise (IEEE formats); when `has_inf` is False only M all ones is NaN and every
        other all-ones-E pattern is an ordinary normal number. Every value of these formats is
        a float64 exactly. The grader decodes every pattern of FP16, BF16 and both FP8 formats
        and compares with torch's reading of the same bits.
        """
        if not isinstance(bits, int) or not 0 <= bits < 2**self.bits:
            raise ValueError(
                f"{self.name} bit pattern must be an int in [0, 2**{self.bits}), got {bits!r}"
            )
        ### BEGIN SOLUTION
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

    def encode(self, x: float) -> int:
        """The bit pattern of the representable value nearest to `x` (ties to even).

        NaN encodes as the format's canonical quiet NaN (sign 0); values beyond `max` become
        inf (IEEE formats) or saturate to +-max (E4M3fn), exactly as `round` does.
        """
        r = float(self.round(torch.tensor([float(x)], dtype=torch.float64, device="cpu"))[0])
        e_bits, m_bits = self.exponent_bits, self.mantissa_bits
        sign = (1 << (e_bits + m_bits)) if math.copysign(1.0, r) < 0 else 0
        all_ones = (1 << e_bits) - 1
        if math.isnan(r):  # quiet NaN: top mantissa bit set (all mantissa bits for E4M3fn)
            return (all_ones << m_bits) | (
                (1 << m_bits) - 1 if not self.has_inf else 1 << (m_bits - 1)
            )
        if math.isinf(r):
            return sign | (all_ones << m_bits)
        mag = abs(r)
        if mag < self.min_normal:  # subnormal (or zero): an integer multiple of min_subnormal
            return sign | int(mag / self.min_subnormal)
        exponent = math.frexp(mag)[1] - 1  # mag = 1.f * 2**exponent
        mantissa = int(math.ldexp(mag, m_bits - exponent)) - (1 << m_bits)
        return sign | ((exponent + self.bias) << m_bits) | mantissa

    # ----------------------------------------------------------------- rounding tensors
    def _split(self, x: torch.Tensor):
        """Write float64 `x` as sig * 2**(e - 52) and find how many significand bits fall below
        this format's quantum there (`shift`). The quantum is 2**(max(e, 1 - bias) - mantissa_bits):
        below the normal range it stays at min_subnormal, which is what makes subnormals."""
        bits = x.view(torch.int64)
        magnitude = bits & 0x7FFF_FFFF_FFFF_FFFF
        exp_field = magnitude >> _F64_MANTISSA
        frac = magnitude & ((1 << _F64_MANTISSA) - 1)
        normal64 = exp_field > 0
        sig = torch.where(normal64, frac | (1 << _F64_MANTISSA), frac)
        e = torch.where(normal64, exp_field - _F64_BIAS, torch.full_like(exp_field, 1 - _F64_BIAS))
        below = (1 - self.bias - e).clamp(min=0)  # extra bits lost to subnormality
        # sig < 2**53, so shifting by 54 or more always gives 0: clamp keeps int64 shifts defined.
        shift = (_F64_MANTISSA - self.mantissa_bits + below).clamp(max=54)
        return sig, shift, e - _F64_MANTISSA + shift

    def _finish(self, x: torch.Tensor, q: torch.Tensor, exp2: torch.Tensor, dtype) -> torch.Tensor:
        """Value q * 2**exp2, then overflow, inf/NaN and sign handling; returns `dtype`."""
        # 2**exp2 built from its float64 bits (exp2 is always inside float64's normal range).
        value = q.to(torch.float64) * ((exp2 + _F64_BIAS) << _F64_MANTISSA).view(torch.float64)
        too_big = (value > self.max) | x.isinf()
        value = torch.where(too_big, math.inf if self.has_inf else self.max, value)
        value = torch.where(x.view(torch.int64) < 0, -value, value)  # keeps -0.0
        return torch.where(x.isnan(), math.nan, value).to(dtype)

    def _check(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.float32, torch.float64):
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{self.name}.round expects a float32 or float64 tensor, got {got}")
        return t.detach().to(torch.float64)  # exact: every float32 is a float64

    def round(self, t: torch.Tensor, single_rounding: bool = False) -> torch.Tensor:
        """Round every element of `t` (float32/float64) to the nearest value of this format, ties
        to even, returning the same dtype: exactly what `t.to(dtype).to(t.dtype)` gives.

        torch casts float64 to the formats narrower than fp32 *through float32*, rounding
        twice (1 + 2**-11 + 2**-40 -> tie 1 + 2**-11 -> 1.0, where one rounding gives
        1 + 2**-10). `round` does the same, so it equals the cast for float64 too;
        `single_rounding=True` rounds float64 once, correctly, instead.

        Beyond max: inf for IEEE formats (after rounding, so max + half an ulp still becomes
        inf), +-max for E4M3fn (torch saturates; inf also becomes max). NaN stays NaN.
        """
        if t.dtype == torch.float64 and not single_rounding and self.mantissa_bits < 23:
            t = FP32.round(t)  # the first of torch's two roundings (still float64)
        x = self._check(t)
        sig, shift, exp2 = self._split(x)
        return self._finish(x, round_significand(sig, shift), exp2, t.dtype)

    def stochastic_round(self, t: torch.Tensor, generator: torch.Generator | None = None):
        """Round up with probability equal to the distance from the value below, in ulps, so the
        expected result equals the input (Gupta et al. 2015): add a uniform random integer
        in [0, 2**shift) to the significand, then truncate."""
        x = self._check(t)
        sig, shift, exp2 = self._split(x)
        # drawn where the generator lives (the default: x's device), then beside x
        where = generator.device if generator is not None else x.device
        noise = torch.randint(0, 2**62, x.shape, generator=generator, dtype=torch.int64,
                              device=where).to(x.device)
        noise = noise & ((torch.ones_like(shift) << shift) - 1)
        return self._finish(x, (sig + noise) >> shift, exp2, t.dtype)

    # ----------------------------------------------------------------- helpers for teaching
    def neighbours(self, x: float) -> tuple[float, float]:
        """The representable values just below and just above `round(x)`, for finite `x`."""
        bits = self.encode(x)
        r = self.decode(bits)
        if r == 0:
            return -self.min_subnormal, self.min_subnormal
        sign_bit = 1 << (self.bits - 1)
        mag = bits & (sign_bit - 1)  # patterns of one sign are ordered like their magnitudes
        larger = self.decode(mag + 1) if mag + 1 < sign_bit else math.nan
        smaller = self.decode(mag - 1)
        return (smaller, larger) if r > 0 else (-larger, -smaller)


FP32 = FloatFormat("fp32", 8, 23, torch_dtype=torch.float32)
FP16 = FloatFormat("fp16", 5, 10, torch_dtype=torch.float16)
BF16 = FloatFormat("bf16", 8, 7, torch_dtype=torch.bfloat16)
FP8_E4M3 = FloatFormat("fp8_e4m3", 4, 3, has_inf=False, torch_dtype=torch.float8_e4m3fn)
FP8_E5M2 = FloatFormat("fp8_e5m2", 5, 2, torch_dtype=torch.float8_e5m2)
FORMATS = {f.name: f for f in (FP32, FP16, BF16, FP8_E4M3, FP8_E5M2)}


def sequential_sum(values: torch.Tensor, accumulator: FloatFormat) -> torch.Tensor:
    """Sum `values` along the last dimension one element at a time, rounding the running sum to
    `accumulator` after every addition (what a naive low-precision reduction does).

    Each addition is done in float64 and rounded once; for formats up to fp32 this equals the
    correctly rounded IEEE addition, because float64 has more than 2p + 2 bits (Figueroa 1995,
    "When is double rounding innocuous?"). Vectorised over the leading dimensions.
    """
    v = values.to(torch.float64)
    acc = torch.zeros(v.shape[:-1], dtype=torch.float64, device=v.device)
    for i in range(v.shape[-1]):
        acc = accumulator.round(acc + v[..., i])
    return acc
