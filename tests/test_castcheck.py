"""cast_report / cast_file / analyze_values describe what a conversion actually does."""

from __future__ import annotations

import math
import platform
from fractions import Fraction

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dtypelab.core.errors import DtypelabError
from dtypelab.numerics.castcheck import analyze_values, cast_file, cast_report, load_tensors
from dtypelab.numerics.catalog import get_format

# What the installed torch does with a value beyond e4m3fn's range: 2.13 saturates it to ±448, 2.11 makes it NaN. A
# report counts what the cast did, so each expectation below follows the torch it runs on.
E4M3_SATURATES = bool(torch.tensor([1000.0]).to(torch.float8_e4m3fn).float().isfinite().item())


def test_float_outcomes_are_counted():
    x = torch.tensor([1.0, 1e5, -1e5, 1e-9, 1e-6, float("nan"), float("inf"), 0.0, 0.1])
    r = cast_report(x, "fp16")
    assert r.counts["overflow_inf"] == 2 and r.counts["underflow_zero"] == 1 and r.counts["subnormal"] == 1
    assert r.counts["nan_input"] == 1 and r.counts["inf_input"] == 1
    assert r.max_abs_error == math.inf and r.sqnr_db == -math.inf  # finite values were lost to inf
    assert (r.bytes_before, r.bytes_after) == (36, 18)


def test_e4m3fn_overflow_is_counted_as_this_torch_casts_it():
    r = cast_report(torch.tensor([1000.0, -1e6, 448.0, 460.0]), "float8_e4m3fn")
    lost, other = ("saturated", "overflow_nan") if E4M3_SATURATES else ("overflow_nan", "saturated")
    assert r.counts[lost] == 2 and r.counts[other] == 0  # 460 rounds to 448 legitimately
    nuz = cast_report(torch.tensor([1000.0]), "float8_e4m3fnuz")
    assert nuz.counts["overflow_nan"] == 1


def test_sqnr_and_errors_for_plain_rounding():
    torch.manual_seed(0)
    x = torch.randn(10_000)
    r = cast_report(x, "bf16")
    y = x.bfloat16().double()
    err = (y - x.double()).abs()
    assert r.max_abs_error == pytest.approx(err.max().item())
    expected = 20 * math.log10(x.double().norm().item() / (y - x.double()).norm().item())
    assert r.sqnr_db == pytest.approx(expected, abs=1e-6)
    assert 45 < r.sqnr_db < 60  # 8 significant bits: about 6 dB per bit
    assert cast_report(x, "fp32").sqnr_db == math.inf


def test_integer_targets_truncate_and_wrap_as_pytorch_does():
    x = torch.tensor([2.7, -2.7, 300.0, -300.0, 127.0])
    r = cast_report(x, "int8")
    got = x.to(torch.int8).tolist()
    assert got[:2] == [2, -2]  # truncation toward zero
    assert r.counts["truncated"] == 2
    # out-of-range: classified by comparing with what PyTorch produced, whatever the platform does
    wrapped = [v for v, g in zip([300, -300], got[2:4], strict=True) if ((v + 128) % 256) - 128 == g]
    assert r.counts["wrapped"] == len(wrapped)
    assert r.counts["wrapped"] + r.counts["saturated"] + r.counts["out_of_range"] == 2
    assert "PyTorch did here" in r.note


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="documents x86-64 behaviour")
def test_pytorch_wraps_float_to_int8_on_x86():
    assert torch.tensor([300.0, -300.0]).to(torch.int8).tolist() == [44, -44]
    r = cast_report(torch.tensor([300.0, -300.0]), "int8")
    assert r.counts["wrapped"] == 2


def test_int_source_and_skipped_dtypes():
    r = cast_report(torch.tensor([2049, 4097], dtype=torch.int64), "float16")
    assert r.counts["rounded"] == 2 and r.max_abs_error == 1.0
    assert cast_report(torch.ones(3, dtype=torch.bool), "fp16").note.startswith("skipped")
    assert cast_report(torch.ones(3), get_format("int4")).bytes_after == 2  # packed 4-bit


def test_analyze_values_labels_and_bits():
    rows = {(r.value, r.format): r for r in analyze_values([0.1, 65520.0, 1e-8, 300.7],
                                                            [get_format(n) for n in ("fp16", "bf16", "int8")])}
    assert rows[(65520.0, "float16")].outcome == "overflow_inf"
    assert rows[(65520.0, "bfloat16")].stored == 65536.0
    assert rows[(1e-8, "float16")].outcome == "underflow_zero"
    assert rows[(0.1, "float16")].bits == "0 | 01011 | 1001100110"
    assert rows[(0.1, "float16")].rel_error == pytest.approx(abs(0.0999755859375 - 0.1) / 0.1)
    # C++ leaves float -> int8 overflow undefined: the report says what this platform's cast did, by its result
    native = float(torch.tensor([300.7]).to(torch.int8)[0])
    expected = {44.0: "wrapped", 127.0: "saturated"}.get(native, "out_of_range")  # 300 mod 256 - 256 = 44
    assert rows[(300.7, "int8")].stored == native and rows[(300.7, "int8")].outcome == expected


def test_files_of_every_kind(tmp_path):
    w = torch.randn(4, 4)
    torch.save({"state_dict": {"w": w, "steps": torch.tensor(3)}, "epoch": 7}, tmp_path / "ck.pt")
    save_file({"a.weight": w, "a.bias": torch.zeros(4)}, str(tmp_path / "m.safetensors"))
    np.save(tmp_path / "x.npy", w.numpy())
    np.savez(tmp_path / "y.npz", p=w.numpy(), q=np.ones(3))
    pt = cast_file(str(tmp_path / "ck.pt"), "bf16")
    assert [r.name for r in pt.rows] == ["state_dict.w", "state_dict.steps"] and pt.skipped == ("epoch",)
    assert pt.total.numel == 17 and pt.total.bytes_before == 16 * 4 + 8
    st = cast_file(str(tmp_path / "m.safetensors"), "fp16")
    assert {r.name for r in st.rows} == {"a.weight", "a.bias"}
    assert cast_file(str(tmp_path / "x.npy"), "fp8").rows[0].numel == 16
    assert len(cast_file(str(tmp_path / "y.npz"), "int8").rows) == 2


def test_unreadable_files_give_clear_errors(tmp_path):
    with pytest.raises(DtypelabError, match="no such file"):
        load_tensors(str(tmp_path / "missing.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(DtypelabError, match="cannot read"):
        load_tensors(str(tmp_path / "junk.pt"))
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(DtypelabError, match="cannot read"):
        load_tensors(str(tmp_path / "junk.safetensors"))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(DtypelabError, match=r"unsupported file type \.txt"):
        load_tensors(str(tmp_path / "notes.txt"))
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(DtypelabError, match="cannot read"):
        load_tensors(str(tmp_path / "obj.npy"))

    torch.save({"obj": Fraction(1, 3)}, tmp_path / "pickle.pt")  # weights_only refuses arbitrary classes
    with pytest.raises(DtypelabError, match="cannot read"):
        load_tensors(str(tmp_path / "pickle.pt"))
    torch.save({"n": 3}, tmp_path / "empty.pt")
    with pytest.raises(DtypelabError, match="holds no tensors"):
        load_tensors(str(tmp_path / "empty.pt"))


def test_sqnr_of_huge_values_does_not_overflow_the_energy_sums():
    """1e300² is inf in float64: the energies are scaled before summing, so a saturating cast of 1e300 reads
    about 0 dB (the error is as large as the signal), not −inf."""
    x = torch.tensor([1e300, -3e299, 2.0], dtype=torch.float64)
    for target in ("float8_e4m3fn", "int8"):
        r = cast_report(x, target)
        assert math.isfinite(r.signal_db), target
        if target == "int8" or E4M3_SATURATES:
            assert math.isfinite(r.sqnr_db) and abs(r.sqnr_db) < 0.1, (target, r.sqnr_db)
        else:  # this torch made them NaN: no finite error describes that
            assert r.sqnr_db == -math.inf and r.counts["overflow_nan"] == 2
    # the same signal-to-noise at any scale: energies in dB subtract exactly
    small = cast_report(torch.tensor([1.5, -2.25, 3.1], dtype=torch.float64), "bfloat16").sqnr_db
    big = cast_report(torch.tensor([1.5, -2.25, 3.1], dtype=torch.float64) * 2.0**900, "float64").sqnr_db
    assert math.isfinite(small) and big == math.inf
    # a finite value that becomes inf is still −inf: no finite error describes it
    lost = cast_report(x, "float32")
    assert lost.counts["overflow_inf"] == 2 and lost.sqnr_db == -math.inf


def test_file_total_sqnr_combines_energies_without_overflow(tmp_path):
    path = tmp_path / "big.safetensors"
    save_file({"a": torch.full((4,), 1e300, dtype=torch.float64), "b": torch.ones(4, dtype=torch.float64)}, path)
    report = cast_file(str(path), "float8_e4m3fn")
    assert math.isfinite(report.total.signal_db)
    if E4M3_SATURATES:
        assert math.isfinite(report.total.sqnr_db) and abs(report.total.sqnr_db) < 0.1
    else:
        assert report.total.sqnr_db == -math.inf and report.total.counts["overflow_nan"] == 4
