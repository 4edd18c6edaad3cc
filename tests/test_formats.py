"""Format properties are computed, and agree with numpy / ml_dtypes; casts and bit layouts are right."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from dtypelab.core.errors import DtypelabError
from dtypelab.numerics.catalog import (
    bit_fields,
    cast,
    formats,
    get_format,
    ieee_like,
    overflow_threshold,
    parse_formats,
)


@pytest.mark.parametrize("name", ["float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2",
                                  "float8_e4m3fnuz", "float6_e3m2fn", "float4_e2m1fn"])
def test_float_properties_match_ml_dtypes(name):
    f = get_format(name)
    ref = ml_dtypes.finfo(getattr(ml_dtypes, name, None) or getattr(np, name))
    assert f.max == float(ref.max)
    assert f.smallest_normal == float(ref.smallest_normal)
    assert f.smallest_subnormal == float(ref.smallest_subnormal)
    assert f.eps == float(ref.eps)
    assert (f.bits, f.exponent_bits, f.mantissa_bits) == (ref.bits, ref.nexp, ref.nmant)


@pytest.mark.parametrize("name", ["int8", "uint8", "int16", "int32", "int64", "int4", "uint4"])
def test_int_properties_match_iinfo(name):
    f = get_format(name)
    ref = ml_dtypes.iinfo(getattr(ml_dtypes, name, None) or getattr(np, name))
    assert (f.min, f.max, f.bits) == (float(ref.min), float(ref.max), ref.bits)
    assert not f.is_float and f.eps == 1


def test_torch_formats_agree_with_torch_finfo_and_with_casting():
    for f in formats().values():
        if f.backend == "torch" and f.is_float and f.name != "float8_e8m0fnu":
            ti = torch.finfo(f.torch_dtype)
            assert (f.max, f.bits, f.smallest_normal) == (ti.max, ti.bits, ti.smallest_normal), f.name
            # eps is the gap above 1, as the cast itself shows
            got, _ = cast(torch.tensor([1 + f.eps, 1 + f.eps / 2], dtype=torch.float64), f)
            assert got.tolist() == [1 + f.eps, 1.0], f.name
    # torch 2.13 reports eps 0.125 for float8_e5m2fnuz, yet 1.125 rounds to 1.0: the gap is 0.25
    assert get_format("float8_e5m2fnuz").eps == 0.25


def test_ieee_formula_reproduces_real_formats_and_gives_tf32():
    for name, (e, m) in {"float16": (5, 10), "bfloat16": (8, 7), "float8_e5m2": (5, 2), "float32": (8, 23)}.items():
        f = get_format(name)
        assert ieee_like(e, m) == {"max": f.max, "smallest_normal": f.smallest_normal,
                                   "smallest_subnormal": f.smallest_subnormal, "eps": f.eps}
    tf32 = get_format("tf32")
    assert tf32.smallest_normal == get_format("float32").smallest_normal and tf32.eps == 2.0**-10
    assert tf32.decimal_digits == pytest.approx(get_format("float16").decimal_digits)


def test_names_aliases_and_suggestions():
    assert get_format("bf16").name == "bfloat16"
    assert get_format("torch.float16").name == "float16"
    assert get_format("FP8").name == "float8_e4m3fn"
    with pytest.raises(DtypelabError, match="did you mean 'float16'"):
        get_format("flaot16")
    with pytest.raises(DtypelabError, match="unknown format 'complex7'"):
        get_format("complex7")
    assert [f.name for f in parse_formats("fp16, bf16")] == ["float16", "bfloat16"]


def test_tf32_rounds_to_ten_mantissa_bits_nearest_even():
    tf32 = get_format("tf32")
    one_ulp = 2.0**-10
    x = torch.tensor([1 + one_ulp / 2, 1 + 1.5 * one_ulp, 1 + one_ulp * 0.49, 3.0e38, float("inf")])
    values, raw = cast(x, tf32)
    assert values.tolist()[:3] == [1.0, 1 + 2 * one_ulp, 1.0]  # ties to even, both ways
    assert values[3] == pytest.approx(3.0e38, rel=2**-10) and math.isinf(values[4])
    assert bit_fields(int(raw[0]), tf32) == "0 | 01111111 | 0000000000"


def test_bit_fields_against_known_encodings():
    _, raw = cast(torch.tensor([-2.0, 65504.0]), get_format("float16"))
    assert [bit_fields(int(r), get_format("float16")) for r in raw] == ["1 | 10000 | 0000000000",
                                                                        "0 | 11110 | 1111111111"]
    _, raw = cast(torch.tensor([448.0]), get_format("float8_e4m3fn"))
    assert bit_fields(int(raw[0]), get_format("float8_e4m3fn")) == "0 | 1111 | 110"
    _, raw = cast(torch.tensor([-1.0]), get_format("int8"))
    assert bit_fields(int(raw[0]), get_format("int8")) == "1111 1111"


def test_overflow_threshold_follows_round_to_nearest_even():
    # float16: max 65504 has an odd mantissa, so the midpoint 65520 already overflows
    assert overflow_threshold(get_format("float16")) == (65520.0, False)
    assert torch.tensor([65519.996]).half().isfinite().item() and torch.tensor([65520.0]).half().isinf().item()
    # e4m3fn: max 448 has an even mantissa, so the midpoint 464 still rounds down to 448
    assert overflow_threshold(get_format("float8_e4m3fn")) == (464.0, True)
    e4m3 = ml_dtypes.float8_e4m3fn
    assert np.array([464.0], np.float32).astype(e4m3).astype(np.float32)[0] == 448
    assert np.isnan(np.array([464.01], np.float32).astype(e4m3).astype(np.float32)[0])
