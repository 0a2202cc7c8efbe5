"""minitrain.precision against torch's own dtypes: every bit pattern, millions of roundings."""

import math

import pytest
import torch

from minitrain.precision import (
    BF16,
    FP8_E4M3,
    FP8_E5M2,
    FP16,
    FP32,
    FloatFormat,
    round_significand,
    sequential_sum,
)

SMALL = [FP16, BF16, FP8_E4M3, FP8_E5M2]
IDS = [f.name for f in SMALL]


def all_patterns(fmt: FloatFormat) -> torch.Tensor:
    """Every bit pattern of a 16- or 8-bit format, viewed as that torch dtype, in float32."""
    n = 2**fmt.bits
    raw = torch.arange(n, dtype=torch.int32)
    if fmt.bits == 16:
        return (raw - (raw >= 2**15).int() * 2**16).to(torch.int16).view(fmt.torch_dtype).float()
    return raw.to(torch.uint8).view(fmt.torch_dtype).float()


def same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: identical bits (so -0.0 differs from 0.0), or both NaN."""
    a64, b64 = a.double(), b.double()
    return (a64.view(torch.int64) == b64.view(torch.int64)) | (a64.isnan() & b64.isnan())


@pytest.mark.parametrize("fmt", SMALL, ids=IDS)
def test_decode_every_bit_pattern_matches_torch(fmt):
    ref = all_patterns(fmt)
    mine = torch.tensor([fmt.decode(b) for b in range(2**fmt.bits)], dtype=torch.float64)
    bad = ~same(mine, ref)
    assert not bad.any(), f"{fmt.name}: patterns {bad.nonzero()[:5].flatten().tolist()} differ"


@pytest.mark.parametrize("fmt", SMALL, ids=IDS)
def test_encode_inverts_decode(fmt):
    ref = all_patterns(fmt)
    g = torch.Generator().manual_seed(0)
    # every fp8 pattern; 3000 random fp16/bf16 ones (encode is one scalar round per call)
    patterns = (
        range(256) if fmt.bits == 8 else torch.randint(0, 2**16, (3000,), generator=g).tolist()
    )
    for b in patterns:
        if not math.isnan(ref[b]):
            assert fmt.encode(float(ref[b])) == b, f"{fmt.name}: pattern {b:#x}"
    assert math.isnan(fmt.decode(fmt.encode(math.nan)))
    assert fmt.encode(-0.0) == 1 << (fmt.bits - 1)


def test_fp32_decode_encode_random_patterns():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (3000,), generator=g, dtype=torch.int64)
    values = bits.to(torch.int32).view(torch.float32)
    for b, v in zip(bits.tolist(), values.tolist()):
        d = FP32.decode(b % 2**32)
        assert (math.isnan(d) and math.isnan(v)) or (
            d == v and math.copysign(1, d) == math.copysign(1, v)
        )
        if not math.isnan(v):
            assert FP32.encode(v) == b % 2**32


@pytest.mark.parametrize(
    "fmt, bias, mx, min_normal, min_sub, eps",
    [
        (FP32, 127, 3.4028234663852886e38, 2.0**-126, 2.0**-149, 2.0**-23),
        (FP16, 15, 65504.0, 2.0**-14, 2.0**-24, 2.0**-10),
        (BF16, 127, 3.3895313892515355e38, 2.0**-126, 2.0**-133, 2.0**-7),
        (FP8_E4M3, 7, 448.0, 2.0**-6, 2.0**-9, 2.0**-3),
        (FP8_E5M2, 15, 57344.0, 2.0**-14, 2.0**-16, 2.0**-2),
    ],
    ids=["fp32"] + IDS,
)
def test_constants(fmt, bias, mx, min_normal, min_sub, eps):
    assert (fmt.bias, fmt.max, fmt.min_normal, fmt.min_subnormal, fmt.eps) == (
        bias,
        mx,
        min_normal,
        min_sub,
        eps,
    )
    if fmt.torch_dtype.is_floating_point and fmt.bits >= 16:
        info = torch.finfo(fmt.torch_dtype)
        assert (info.max, info.tiny, info.eps) == (mx, min_normal, eps)


def random_values(fmt: FloatFormat, n: int, seed: int) -> torch.Tensor:
    """Random float32 values over the whole range of fmt and beyond, plus exact ties and their
    float32 neighbours, zeros, infinities and NaN."""
    g = torch.Generator().manual_seed(seed)
    lo = math.log2(fmt.min_subnormal) - 3
    hi = math.log2(fmt.max) + 2 if fmt.max < 1e38 else 127.5
    exps = torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo
    signs = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    values = (signs * torch.exp2(exps)).float()
    # Midpoints between consecutive representable values: the ties.
    grid = all_patterns(fmt).double()
    grid = grid[grid.isfinite()].unique()
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    up, down = (
        torch.nextafter(mids, torch.tensor(math.inf)),
        torch.nextafter(mids, -torch.tensor(math.inf)),
    )
    special = torch.tensor(
        [
            0.0,
            -0.0,
            math.inf,
            -math.inf,
            math.nan,
            fmt.max,
            -fmt.max,
            fmt.min_subnormal / 2,
            -fmt.min_subnormal / 2,
            fmt.max * 1.0625,
        ]
    )
    return torch.cat([values, mids, up, down, special])


@pytest.mark.parametrize("fmt", SMALL, ids=IDS)
def test_round_matches_torch_cast(fmt):
    x = random_values(fmt, 2_000_000, seed=1)
    ref = x.to(fmt.torch_dtype).float()
    mine = fmt.round(x)
    assert mine.dtype == torch.float32
    bad = ~same(mine, ref)
    assert not bad.any(), (
        f"{fmt.name}: {int(bad.sum())} differ, e.g. {x[bad][:3].tolist()} -> "
        f"{mine[bad][:3].tolist()}, torch {ref[bad][:3].tolist()}"
    )


def nearest_even_reference(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Correct rounding by brute force: the nearest of all finite values torch decodes from
    fmt's bit patterns, ties to the even pattern. Only for |x| <= fmt.max."""
    grid = all_patterns(fmt).double()
    pattern = torch.arange(grid.numel())
    keep = grid.isfinite() & (grid.view(torch.int64) >= 0)  # +0 and positive values
    grid, pattern = grid[keep], pattern[keep]
    order = grid.argsort()
    grid, pattern = grid[order], pattern[order]
    mag = x.abs()
    hi = torch.searchsorted(grid, mag).clamp(max=grid.numel() - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (pattern[hi] % 2 == 0))
    out = torch.where(pick_hi, grid[hi], grid[lo])
    return torch.where(x.view(torch.int64) < 0, -out, out)


@pytest.mark.parametrize("fmt", SMALL, ids=IDS)
def test_round_float64_input_is_correctly_rounded(fmt):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300_000, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-140, 20, (300_000,), generator=g).double()
    )
    x = x[x.abs() <= fmt.max]
    grid = all_patterns(fmt).double()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties, and ties nudged by 2**-40 relative
    x = torch.cat([x, mids, mids * (1 + 2.0**-40), mids * (1 - 2.0**-40)])
    assert same(fmt.round(x, single_rounding=True), nearest_even_reference(x, fmt)).all()
    # by default, round equals torch's cast of float64 (which goes through float32)
    assert same(fmt.round(x), x.to(fmt.torch_dtype).double()).all()


def test_round_float64_default_matches_torchs_double_rounding():
    # torch casts float64 -> fp16 through float32: 1 + 2**-11 + 2**-40 first becomes the tie
    # 1 + 2**-11, which then goes to even, 1.0. Rounded once, it is above the tie: 1 + 2**-10.
    x = torch.tensor([1 + 2.0**-11 + 2.0**-40], dtype=torch.float64)
    assert x.to(torch.float16).item() == 1.0
    assert FP16.round(x).item() == 1.0
    assert FP16.round(x, single_rounding=True).item() == 1 + 2.0**-10


def test_fp32_round_of_float64_matches_torch_cast():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300_000, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-160, 130, (300_000,), generator=g).double()
    )
    f = torch.randn(50_000, generator=g).double()  # float32 ties, which only float64 holds
    x = torch.cat([x, (f + torch.nextafter(f.float(), torch.tensor(math.inf)).double()) / 2])
    assert same(FP32.round(x), x.float().double()).all()


def test_round_overflow_semantics():
    # IEEE formats overflow to inf; e4m3fn saturates (torch's cast does, inf included).
    assert FP16.round(torch.tensor([65519.0, 65520.0]))[1] == math.inf
    assert FP16.round(torch.tensor([65519.0]))[0] == 65504.0
    assert FP8_E5M2.round(torch.tensor([61440.0]))[0] == math.inf
    got = FP8_E4M3.round(torch.tensor([464.0, 1e6, math.inf, -math.inf]))
    assert got.tolist() == [448.0, 448.0, 448.0, -448.0]
    assert FP8_E4M3.round(torch.tensor([math.nan])).isnan().all()


def test_round_significand_ties_to_even():
    sig = torch.tensor([0b1011, 0b1010, 0b1110, 0b1001, 0b0110])
    shift = torch.tensor([2, 2, 2, 1, 2])
    assert round_significand(sig, shift).tolist() == [3, 2, 4, 4, 2]


def test_round_rejects_integer_tensors():
    with pytest.raises(TypeError, match="int64"):
        FP16.round(torch.arange(3))


def test_decode_rejects_out_of_range_pattern():
    with pytest.raises(ValueError, match="256"):
        FP8_E4M3.decode(256)


@pytest.mark.parametrize("fmt", [BF16, FP8_E4M3, FP8_E5M2], ids=["bf16", "e4m3", "e5m2"])
def test_stochastic_rounding_is_unbiased(fmt):
    g = torch.Generator().manual_seed(3)
    value = 1.0 + fmt.eps / 8  # an eighth of an ulp above 1.0
    x = torch.full((400_000,), value)
    sr = fmt.stochastic_round(x, generator=g)
    assert set(sr.unique().tolist()) == {1.0, 1.0 + fmt.eps}  # only the two neighbours
    # mean of Bernoulli(1/8) * eps: standard error eps * sqrt(7/64 / n) ~ eps * 5e-4
    assert abs(sr.double().mean().item() - value) < 5 * fmt.eps * 5.3e-4
    assert fmt.round(x).double().mean().item() == 1.0  # nearest rounding: biased by -eps/8


def test_stochastic_rounding_keeps_representable_values():
    grid = all_patterns(BF16)
    grid = grid[grid.isfinite()]
    assert same(BF16.stochastic_round(grid), grid).all()


def test_sequential_sum_matches_torch_low_precision_loop():
    g = torch.Generator().manual_seed(4)
    values = torch.rand(3, 2000, generator=g) * 1e-2
    for fmt in (FP16, BF16):
        acc = torch.zeros(3, dtype=fmt.torch_dtype)
        vals = values.to(fmt.torch_dtype)
        for i in range(values.shape[1]):
            acc = acc + vals[:, i]
        mine = sequential_sum(fmt.round(values), fmt)
        assert torch.equal(mine, acc.double()), fmt.name


def test_neighbours():
    assert FP16.neighbours(1.0) == (1.0 - 2**-11, 1.0 + 2**-10)
    assert FP16.neighbours(-1.0) == (-1.0 - 2**-10, -1.0 + 2**-11)
    assert FP16.neighbours(0.0) == (-(2.0**-24), 2.0**-24)
    assert FP8_E4M3.neighbours(448.0)[0] == 416.0
