"""Formats this machine cannot run fast, by emulation: float8 training's recipes with torchao's emulated numerics on a
CPU, checked against a hand-written quantize-dequantize reference; numerics only in the record and the decision; a
case of one layer's outliers that break tensorwise scaling but not rowwise."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import HERE, fake_hardware
from torch import nn

import dtypelab
from dtypelab.core.emulation import float8_linear_reference, float8_roundtrip
from dtypelab.core.policies import Precision, get_policy

ROOT = os.path.dirname(HERE)
MASSIVE = f"{os.path.join(ROOT, 'examples', 'massive_tokens.py')}:make_task"


def test_emulated_recipes_are_policies_that_run_anywhere_and_say_they_are_numerics_only():
    for name in ("fp8-tensorwise-emu", "fp8-rowwise-emu", "fp8-rowwise-gw-hp-emu", "fp8-rowwise-all-emu"):
        plan = get_policy(name)
        assert plan.numerics_only and not plan.gpu_only and not plan.compiles, name
        assert plan.availability(fake_hardware()).ok, name
        assert "numerics only" in plan.describe()
    assert not get_policy("fp8-rowwise-gw-hp").availability(fake_hardware()).ok  # the real one needs sm_89+
    from dtypelab.core.policies import default_policies

    assert "fp8-rowwise-emu" not in default_policies("train", "cpu")


def test_the_roundtrip_reference_is_float8_e4m3_with_the_recipes_scales():
    x = torch.tensor([[448.0, 1.0, 0.3, 1e-3, 4e-4], [2.0, -1.0, 0.5, 0.0, 0.0]])
    # tensorwise: one scale, 448 / 448 = 1: values as e4m3 stores them; 1e-3 rounds to its smallest subnormal (2^-9),
    # 4e-4 (under half of it) flushes to zero
    assert float8_roundtrip(x, rowwise=False).tolist() == [[448.0, 1.0, 0.3125, 2**-9, 0.0],
                                                           [2.0, -1.0, 0.5, 0.0, 0.0]]
    # rowwise: the second row scaled by 448 / 2 = 224, rounded down to 128: 2 * 128 = 256 is exact in e4m3
    assert float8_roundtrip(x, rowwise=True)[1].tolist() == [2.0, -1.0, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchaos_emulated_float8_linear_matches_the_hand_written_reference(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    precision = Precision(get_policy(f"fp8-{recipe}-all-emu"), "cpu")
    converted = precision.convert_module(model)
    assert type(converted[0]).__name__ == "Float8Linear"
    x = torch.randn(16, 64) * torch.logspace(-2, 2, 16).unsqueeze(1)  # rows of very different sizes
    with torch.no_grad():
        out = converted(x)
        ref = float8_linear_reference(x, converted[0].weight, converted[0].bias, rowwise=recipe == "rowwise")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_massive_tokens_break_tensorwise_scaling_but_not_rowwise():
    report = dtypelab.bench(MASSIVE, "amp-bf16,fp8-tensorwise-all-emu,fp8-rowwise-all-emu", rounds=0,
                            tolerance="3%", hardware=fake_hardware())
    acc = {r.policy: r.metric("accuracy") for r in report.results}
    rec = report.recommendation
    assert rec.verdicts["fp8-rowwise-all-emu"].startswith("numerics only: within")
    assert rec.verdicts["fp8-tensorwise-all-emu"].startswith("outside")
    assert acc["fp8-tensorwise-all-emu"] < acc["fp32"] - 0.2
    tensorwise, rowwise = (report.result(n).emulated_layers for n in ("fp8-tensorwise-all-emu", "fp8-rowwise-all-emu"))
    assert [e["layer"] for e in rowwise] == ["0"] and rowwise[0]["shape"] == "64×64"  # 4 outputs: not divisible by 16
    assert tensorwise[0]["input_underflow"] > 0.5 and rowwise[0]["input_underflow"] < 0.01
    assert rowwise[0]["sqnr_db"] > tensorwise[0]["sqnr_db"] + 20
    # numerics only: no speedup, never chosen, and the sentence says what its speed needs
    assert rec.best != "fp8-rowwise-all-emu" and rec.verdict("fp8-rowwise-all-emu").speedup is None
    assert any("fp8-rowwise-all-emu: numerically within 3%" in s and "float8 tensor cores" in s
               for s in rec.sentences)
