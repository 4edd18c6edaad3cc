"""Formats this machine cannot run fast, by emulation: float8 training's recipes with torchao's emulated numerics on a
CPU, checked against a hand-written quantize-dequantize reference; numerics only in the record and the decision; a
case of one layer's outliers that break tensorwise scaling but not rowwise."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from conftest import HERE, fake_hardware
from torch import nn

import dtypelab
from dtypelab.core.emulation import float8_linear_reference, float8_roundtrip
from dtypelab.core.policies import Precision, get_policy, single
from dtypelab.core.results import Verdict

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
def test_massive_tokens_break_tensorwise_scaling_but_not_rowwise(tmp_path):
    report = dtypelab.bench(MASSIVE, "amp-bf16,fp8-tensorwise-all-emu,fp8-rowwise-all-emu", rounds=0,
                            tolerance="3%", hardware=fake_hardware())
    acc = {r.policy: r.metric("accuracy") for r in report.results}
    rec = report.recommendation
    kept = rec.verdicts["fp8-rowwise-all-emu"]
    assert kept.startswith("numerics only: ") and kept.split(": ")[1].startswith(("within", "better", "equal"))
    assert rec.verdicts["fp8-tensorwise-all-emu"].startswith("outside")
    assert acc["fp8-tensorwise-all-emu"] < acc["fp32"] - 0.2
    tensorwise, rowwise = (report.result(n).emulated_layers for n in ("fp8-tensorwise-all-emu", "fp8-rowwise-all-emu"))
    assert [e["layer"] for e in rowwise] == ["0"] and rowwise[0]["shape"] == "64×64"  # 4 outputs: not divisible by 16
    assert tensorwise[0]["input_underflow"] > 0.5 and rowwise[0]["input_underflow"] < 0.01
    assert rowwise[0]["sqnr_db"] > tensorwise[0]["sqnr_db"] + 20
    # the wording survives the record: saved, loaded and drawn again
    from dtypelab.render.bench import render_markdown

    path = os.path.join(str(tmp_path), "r.json")
    report.save(path)
    text = render_markdown(dtypelab.load_record(path))
    verdict = rec.verdict("fp8-rowwise-all-emu")
    assert verdict.verdict == Verdict.NUMERICS_ONLY and verdict.text.startswith("numerics only: ")
    assert "| emulated |" in text and f"| {verdict.text} |" in text
    # numerics only: no speedup, never chosen, and the sentence says what its speed needs
    assert rec.best != "fp8-rowwise-all-emu" and rec.verdict("fp8-rowwise-all-emu").speedup is None
    assert any(s.startswith("fp8-rowwise-all-emu: numerically ") and "float8 tensor cores" in s
               for s in rec.sentences)


def test_mx_training_and_inference_emulated_on_a_cpu():
    from dtypelab.core.emulation import emulated_layers
    from dtypelab.core.policies.kinds.mx import _mx_training_torch, mx_roundtrip

    torch.manual_seed(0)
    plan = get_policy("mxfp8-emu")
    too_old = _mx_training_torch()  # torchao's MX training needs DTensor's scaled_mm strategy (torch 2.13, not 2.11)
    if too_old:  # then the policy says so before anything runs, and the inference half below still runs
        assert plan.availability(fake_hardware()).reason == too_old
    else:
        precision = Precision(plan, "cpu")
        model = precision.convert_module(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 40)))
        assert precision.conversion()["converted"] == ["0"]  # 40 outputs: not a multiple of MX's 32-value blocks
        x = precision.convert_input(torch.randn(32, 64))  # the weight gradient's blocks run along the tokens: 32
        model(x).float().square().mean().backward()  # the emulated backward runs too
        rows = emulated_layers(model, lambda: model(x), "mxfp8", names=["0"], roundtrip=mx_roundtrip)
        assert rows[0]["shape"] == "64×64" and 12 < rows[0]["sqnr_db"] < 60  # bf16 inputs: mxfp8 vs bf16
    # mxfp8: e4m3 elements under a power-of-two scale per 32 values; a block's largest value is kept to e4m3's 3 bits
    block = torch.linspace(-1, 1, 32)
    assert torch.allclose(mx_roundtrip(block), block, rtol=0.07, atol=2**-9)
    infer = dtypelab.bench("digits", "mxfp8-dyn-emu,mxfp4-dyn-emu", mode="infer", steps=4, rounds=0,
                           hardware=fake_hardware())
    sqnr = {r.policy: r.fidelity["sqnr_db"] for r in infer.results if r.policy != "fp32"}
    assert sqnr["mxfp8-dyn-emu"] > sqnr["mxfp4-dyn-emu"] + 6 > 6  # 3 mantissa bits against 1
    assert all(infer.result(n).info.numerics_only for n in sqnr)


def test_tune_refuses_an_emulated_candidate_in_one_line():
    with pytest.raises(dtypelab.DtypelabError, match="emulated numerics only, no speed to tune for"):
        dtypelab.tune("digits", mode="train", candidates="fp8-rowwise-all-emu", hardware=fake_hardware())


def test_emulate_runs_what_cannot_run_here_as_its_emulation(monkeypatch):
    from dtypelab.sweep.plans import emulate_here

    named = {p.name: p for p in map(get_policy, ("fp32", "fp8-rowwise", "mxfp8"))}
    swapped = emulate_here(named, True, "train", torch.device("cpu"))
    assert list(swapped) == ["fp32", "fp8-rowwise-emu", "mxfp8-emu"]
    default = emulate_here({"fp32": get_policy("fp32")}, False, "train", torch.device("cpu"))
    assert {"fp8-tensorwise-emu", "fp8-rowwise-emu", "fp8-rowwise-gw-hp-emu", "mxfp8-emu"} <= set(default)
    infer = emulate_here({"fp32": get_policy("fp32")}, False, "infer", torch.device("cpu"))
    assert {"mxfp8-dyn-emu", "mxfp4-dyn-emu"} <= set(infer)


@pytest.mark.slow
def test_a_recipe_whose_filter_converts_nothing_says_so():
    report = dtypelab.bench("digits", "fp8-tensorwise-emu", steps=20, rounds=0, hardware=fake_hardware())
    assert report.recommendation.verdicts["fp8-tensorwise-emu"] == "numerics only: no layer converted"
    assert any("converts no layer of this model" in s for s in report.recommendation.sentences)


@pytest.mark.cuda
def test_emulated_float8_matches_the_real_kernels_on_a_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs float8 tensor cores (compute capability 8.9+)")
    torch.manual_seed(0)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    for recipe in ("tensorwise", "rowwise"):
        outs = {}
        emulated = get_policy(f"fp8-{recipe}-all-emu")
        for emulate in (False, True):
            torch.manual_seed(1)
            model = nn.Sequential(nn.Linear(1024, 2048)).cuda()
            plan = emulated if emulate else single(dataclasses.replace(emulated.default, emulate=False))
            precision = Precision(plan, "cuda")
            model = precision.convert_module(model)
            with torch.no_grad(), precision.forward_context():
                outs[emulate] = model(x).float()
        sqnr = 10 * torch.log10(outs[False].square().sum() / (outs[False] - outs[True]).square().sum())
        assert sqnr > 40, (recipe, float(sqnr))  # the same quantization; only the matmul's accumulation differs
