"""Range statistics equal brute force: cast, then count inf / NaN / zero / subnormal."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dtypelab.core.errors import DtypelabError
from dtypelab.numerics.catalog import cast, get_format
from dtypelab.numerics.rangestats import RangeCounter, RangeStats, format_thresholds, range_stats

FORMATS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float6_e2m3fn",
           "float4_e2m1fn", "tf32")


def brute_force(x: torch.Tensor, name: str) -> dict[str, int]:
    """Counts from actually casting. Overflow: inf or NaN out of a finite value; for formats that
    saturate instead (PyTorch's e4m3fn, fp6, fp4), ml_dtypes' non-saturating e4m3fn or the threshold."""
    f = get_format(name)
    xs = x.to(torch.float64)
    finite = torch.isfinite(xs)
    if name == "float8_e4m3fn":  # ml_dtypes turns overflow into NaN, so it can be counted
        y = torch.from_numpy(x.to(torch.float64).numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float64))
    else:
        y, _ = cast(x, f)
    if f.has_inf or name == "float8_e4m3fn" or name.endswith("fnuz"):
        over = finite & ~torch.isfinite(y)
    else:
        t, strict = format_thresholds(f)["overflow"]
        over = finite & ((xs.abs() > t) if strict else (xs.abs() >= t))
    under = finite & (xs != 0) & (y == 0)
    sub = finite & (y != 0) & (y.abs() < f.smallest_normal)
    return {"overflow": int(over.sum()), "underflow": int(under.sum()), "subnormal": int(sub.sum())}


def edge_values() -> list[float]:
    """Every threshold of every format, and its float32 neighbours on both sides."""
    out = []
    for name in FORMATS:
        for t, _ in format_thresholds(get_format(name)).values():
            c = np.float32(t)
            out += [float(c), float(np.nextafter(c, np.float32(np.inf))), float(np.nextafter(c, np.float32(0)))]
    return out + [-v for v in out]


def check(x: torch.Tensor) -> None:
    s = range_stats(x, FORMATS, histogram=True)
    for name in FORMATS:
        assert s.counts[name] == brute_force(x, name), (name, x.dtype)
    a = x.to(torch.float64).abs()
    finite = torch.isfinite(a)
    nz = finite & (a > 0)
    assert s.zeros == int((a == 0).sum()) and s.nonfinite == int((~finite).sum())
    if nz.any():
        assert s.max_abs == a[finite].max().item() and s.min_nonzero == a[nz].min().item()
        assert sum(s.binades.values()) == int(nz.sum())  # exact below the sampling size


finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
anything32 = st.floats(width=32)


@settings(max_examples=150, deadline=None)
@given(arrays(np.float32, st.integers(1, 300), elements=anything32),
       st.lists(st.sampled_from(edge_values()), max_size=40))
def test_random_and_adversarial_float32(values, edges):
    check(torch.from_numpy(np.concatenate([values, np.array(edges, np.float32)])))


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.integers(1, 200), elements=finite32), st.integers(-40, 40))
def test_scaled_normal_data(values, exponent):
    check(torch.from_numpy(values) * 2.0**exponent)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_input_dtypes(dtype):
    torch.manual_seed(0)
    x = (torch.randn(5000, dtype=torch.float64) * 10.0 ** torch.randint(-12, 12, (5000,))).to(dtype)
    check(x)


def test_all_zero_empty_and_integer_tensors():
    s = range_stats(torch.zeros(10), FORMATS)
    assert s.zeros == 10 and s.counts["float16"] == {"overflow": 0, "underflow": 0, "subnormal": 0}
    assert range_stats(torch.zeros(0), FORMATS).numel == 0
    assert range_stats(torch.arange(5), FORMATS) is None
    assert range_stats(torch.ones(3, dtype=torch.bool), FORMATS) is None


def test_histogram_is_sampled_for_large_tensors_but_counts_stay_exact():
    x = torch.randn(200_000) * 1e-3
    s = RangeCounter(FORMATS)(x, histogram=True)
    assert sum(s.binades.values()) == pytest.approx(200_000, rel=1e-3)
    assert s.counts["float16"] == brute_force(x, "float16")


def test_merge_adds_counts_and_keeps_extremes():
    a, b = range_stats(torch.tensor([1e-9, 2.0]), FORMATS, True), range_stats(torch.tensor([0.0, 7e4]), FORMATS, True)
    a.merge(b)
    assert (a.numel, a.zeros, a.max_abs) == (4, 1, pytest.approx(7e4, rel=1e-6))
    assert a.min_nonzero == pytest.approx(1e-9, rel=1e-6)
    assert a.counts["float16"]["overflow"] == 1 and a.counts["float16"]["underflow"] == 1
    assert RangeStats.from_dict(a.to_dict()) == a


def test_formats_without_subnormals_are_refused_up_front():
    with pytest.raises(DtypelabError, match="no subnormal range"):
        RangeCounter(["int8"])
    with pytest.raises(DtypelabError, match="no subnormal range"):
        RangeCounter(["float8_e8m0fnu"])


def test_scratch_buffers_do_not_leak_between_calls():
    rc = RangeCounter(FORMATS)
    big = rc(torch.full((1000,), 1e5))
    small = rc(torch.tensor([1.0, 0.5]))
    assert big.counts["float16"]["overflow"] == 1000 and small.counts["float16"]["overflow"] == 0
    assert math.isclose(small.max_abs, 1.0) and small.numel == 2
