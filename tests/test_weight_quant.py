"""Weight formats emulated in float (core.weightquant, kinds/weight_quant.py), quality with intervals
(serving.quality), and the compressed-tensors checkpoint (serving.compressed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from dtypelab.core.calibration import calibrating
from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies import Precision, get_policy, numerics_twin
from dtypelab.core.weightquant import IntFormat, fake_quantize, gptq, rtn, scales
from dtypelab.serving.bench import calibration_windows
from dtypelab.serving.quality import PerPosition, edges, judge
from dtypelab.serving.served import load_served

CPU = torch.device("cpu")


def _kl(spec_plan: str, served, windows, cal=None) -> float:
    def logprobs(name: str) -> torch.Tensor:
        torch.manual_seed(0)
        with calibrating(cal):
            model = Precision(get_policy(name), CPU).convert_module(served.make_model().eval())
        with torch.no_grad():
            return torch.log_softmax(model(windows).logits.float(), -1)
    base, mine = logprobs("fp32"), logprobs(spec_plan)
    return float((base.exp() * (base - mine)).sum(-1).mean())


@pytest.fixture(scope="module")
def tiny():
    served = load_served("tinylm")
    cal, _ = calibration_windows(served, None, 16, 256)
    return served, served.text(8, 256), cal


def test_the_format_matches_compressed_tensors_own_quantizer():
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake

    w = torch.randn(64, 256, dtype=torch.bfloat16)
    fmt = IntFormat(4, 128)
    s = scales(w, fmt, torch.bfloat16)
    args = ct.preset_name_to_scheme("W4A16", ["Linear"]).weights
    theirs = ct_fake(w, s, torch.zeros_like(s), args)
    assert torch.equal(fake_quantize(w, s, fmt), theirs.to(torch.bfloat16))


def test_rtn_puts_every_value_on_the_grid():
    w = torch.randn(16, 256)
    deq, s = rtn(w, IntFormat(4, 128), torch.float32)
    q = deq / s.repeat_interleave(128, 1)
    assert torch.allclose(q, q.round(), atol=1e-5) and q.abs().max() <= 8


def test_gptq_with_an_identity_hessian_is_round_to_nearest():
    """With uncorrelated inputs of equal scale there is no error to spread: GPTQ rounds to nearest."""
    w = torch.randn(8, 128)
    fmt = IntFormat(4, 128)
    got, _ = gptq(w, torch.eye(128) * 2, fmt, torch.float32)
    assert torch.equal(got, rtn(w, fmt, torch.float32)[0])


def test_gptq_lowers_the_layer_output_error_on_correlated_inputs():
    torch.manual_seed(0)
    x = torch.randn(2048, 128) @ torch.randn(128, 128) * 0.3
    w = torch.randn(32, 128)
    fmt = IntFormat(4, 128)
    h = 2 * x.T @ x / len(x)
    err = {name: float((x @ (deq - w).T).pow(2).mean()) for name, deq in
           (("rtn", rtn(w, fmt, torch.float32)[0]), ("gptq", gptq(w, h, fmt, torch.float32)[0]))}
    assert err["gptq"] < 0.8 * err["rtn"]


def test_gptq_costs_tinylm_less_kl_than_round_to_nearest(tiny):
    served, windows, cal = tiny
    rtn_kl, gptq_kl = _kl("w4a16-rtn", served, windows), _kl("w4a16-gptq", served, windows, cal)
    assert gptq_kl < rtn_kl


def test_the_int8_emulation_equals_torchaos_int8_kernel(tiny):
    """int8-wo-emu is checked against the real kernel that runs here: the same weights, the same logits."""
    pytest.importorskip("torchao")
    served, windows, _ = tiny
    outs = []
    for name in ("int8-wo", "int8-wo-emu"):
        torch.manual_seed(0)
        model = Precision(get_policy(name), CPU).convert_module(served.make_model().eval())
        with torch.no_grad():
            outs.append(model(windows).logits)
    assert torch.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_a_gpu_format_has_its_emulation_and_a_calibrated_one_needs_text(tiny):
    assert numerics_twin(get_policy("int4-wo")).name == "int4-wo-emu"
    served, _, _ = tiny
    with pytest.raises(DtypelabError, match="needs calibration data"):
        Precision(get_policy("w4a16-gptq"), CPU).convert_module(served.make_model().eval())


def test_the_output_head_is_left_as_it_is(tiny):
    served, _, _ = tiny
    model = served.make_model().eval()
    before = model.lm_head.weight.detach().clone()
    Precision(get_policy("w4a16-rtn"), CPU).convert_module(model)
    assert torch.equal(model.lm_head.weight.float(), before.to(torch.bfloat16).float())


def test_calibration_windows_are_none_of_the_judged_ones(tiny):
    served, _, cal = tiny
    judged = served.text(16, 256)
    assert not any(torch.equal(c[:256], j) for c in cal for j in judged)


def test_quality_intervals_bracket_the_figures_and_tighten_with_agreement():
    rng = np.random.default_rng(0)
    nll = rng.normal(3, 0.3, (16, 128))
    kl = np.abs(rng.normal(0.01, 0.005, (16, 128)))
    value = PerPosition((nll + 0.01).tolist(), kl.tolist(), (rng.random((16, 128)) > 0.1).tolist())
    got = judge(value, PerPosition(nll.tolist()), split=64)
    for e in (got.kl, got.top1, got.change):
        assert e.low <= e.value <= e.high
    assert got.change.low > 0  # a shift of 0.01 nats at every position, every document: beyond noise
    assert [(b.start, b.end) for b in got.buckets] == edges(128) == [(1, 64), (65, 128)]


def test_the_same_figures_everywhere_are_their_own_interval():
    same = PerPosition([[1.0] * 8] * 4, [[0.0] * 8] * 4, [[True] * 8] * 4)
    got = judge(same, PerPosition([[1.0] * 8] * 4), split=4)
    assert (got.kl.low, got.kl.high, got.change.value) == (0.0, 0.0, 0.0)


def test_an_exported_plan_loads_back_in_transformers_with_equal_outputs(tmp_path):
    pytest.importorskip("compressed_tensors")
    from dtypelab.serving import export_compressed

    done = export_compressed("tinylm", get_policy("w4a16-gptq"), str(tmp_path / "ckpt"), samples=8)
    assert done.max_abs_diff == 0.0 and done.ignored == ["lm_head"] and len(done.layers) == 28
    import json

    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"


def test_a_per_layer_plan_exports_a_group_per_format_and_ignores_the_rest(tmp_path):
    pytest.importorskip("compressed_tensors")
    import json

    from dtypelab.core.policies import Cast, Plan
    from dtypelab.serving import export_compressed

    w4, w8 = get_policy("w4a16-rtn").default, get_policy("w8a16-rtn").default
    plan = Plan(Cast("bfloat16"), (("model.layers.0.mlp.down_proj", w8), ("model.layers.1.mlp.gate_proj", w4),
                                   ("model.layers.1.mlp.up_proj", w4)), name="mixed")
    done = export_compressed("tinylm", plan, str(tmp_path / "ckpt"))
    assert done.max_abs_diff == 0.0 and sorted(done.layers.values()) == ["w4a16", "w4a16", "w8a16"]
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    targets = sorted(t for g in config["config_groups"].values() for t in g["targets"])
    assert targets == sorted(done.layers) and "lm_head" in config["ignore"] and len(config["ignore"]) == 26


def test_export_refuses_a_plan_vllm_would_not_load(tmp_path):
    """q/k/v split between formats: vLLM fuses them and refuses mixed schemes (its compressed-tensors utils)."""
    pytest.importorskip("compressed_tensors")
    from dtypelab.core.policies import Cast, Plan
    from dtypelab.serving import export_compressed

    plan = Plan(Cast("bfloat16"), (("model.layers.0.self_attn.q_proj", get_policy("w4a16-rtn").default),),
                name="split")
    with pytest.raises(DtypelabError, match=r"q_proj and k_proj and v_proj of model\.layers\.0\.self_attn are "
                                            r"unquantized, w4a16: vLLM fuses them"):
        export_compressed("tinylm", plan, str(tmp_path / "x"))


def test_export_refuses_torchaos_own_layouts(tmp_path):
    pytest.importorskip("compressed_tensors")
    from dtypelab.serving import export_compressed

    with pytest.raises(DtypelabError, match="not compressed-tensors"):
        export_compressed("tinylm", get_policy("int4-wo-emu"), str(tmp_path / "x"))


def test_the_kinds_forecast_answers():
    from dtypelab.forecasting import STORED_WEIGHT_BYTES

    layer = nn.Linear(256, 64, bias=False)
    assert STORED_WEIGHT_BYTES(get_policy("w4a16-gptq").default, layer) == 64 * 256 // 2 + 64 * 2 * 2
    assert get_policy("w4a16-awq").default.kernel(layer) == "int4-weight-only"


@pytest.mark.cuda
def test_the_int4_emulation_follows_tinygemm_on_a_gpu():
    """On a GPU, where int4's tinygemm kernel runs: the emulation bench measures in its place (int4-wo-emu, the same
    dequantized values) gives the kernel's next-token distributions."""
    served = load_served("tinylm")
    windows = served.text(4, 128).cuda()
    outs = []
    for policy in ("int4-wo", numerics_twin(get_policy("int4-wo")).name):
        torch.manual_seed(0)
        model = Precision(get_policy(policy), torch.device("cuda")).convert_module(served.make_model().cuda().eval())
        with torch.no_grad():
            outs.append(torch.log_softmax(model(windows).logits.float(), -1))
    kl = float((outs[0].exp() * (outs[0] - outs[1])).sum(-1).mean())
    agree = float((outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean())
    assert kl < 1e-3 and agree > 0.98, (kl, agree)  # the kernel's accumulation order, not its values, differs


def test_fp8_kv_at_scale_one_saturates_and_calibrated_scales_are_per_layer(tiny):
    from dtypelab.serving.kv import kv_format, kv_scales
    from dtypelab.serving.served import config_of

    s1 = kv_format("kv-fp8-s1")
    x = torch.tensor([0.5, 1000.0, -1000.0])
    assert s1.decode(s1.encode(x, None, torch.tensor([0]), torch.float8_e4m3fn), None, torch.float32).tolist() == \
        [0.5, 448.0, -448.0]
    served, _, cal = tiny
    model = served.make_model().eval()
    scales = kv_scales(model, config_of(model), kv_format("kv-fp8-cal"), cal[:4])
    assert len(scales) == 4 and all(0 < k < 1 and 0 < v < 1 for k, v in scales)
    assert len({k for k, _ in scales}) > 1  # a scale of each layer's own


def test_bench_calibrates_the_fp8_cache_and_says_its_scales(tmp_path):
    from dtypelab.serving import serve_bench

    report = serve_bench("tinylm", prompt_len=32, gen_len=4, batch_size=4, rounds=0, launcher="inline",
                         policies="fp32+kv-fp8-s1,fp32+kv-fp8-cal")
    cal = report.result("fp32+kv-fp8-cal")
    assert cal.status == "ok" and any("calibrated scales" in n and "by layer: 0:" in n for n in cal.notes)
    assert report.config.calibration.startswith("32 held-out windows")
    assert all(b.kl is not None for b in cal.quality.buckets)


def test_a_gpu_forecast_counts_the_formats_layout_and_times_its_kernel():
    """Emulated here, a weight format is forecast for a GPU as its kernel runs it (Marlin/Machete in vLLM, tinygemm's
    key in the static engine) from its stored bytes, not the emulation's bfloat16 weights."""
    from dtypelab.serving import serve_forecast

    report = serve_forecast("tinylm", policies="bf16,w4a16-gptq", device="H100", prompt_len=32, gen_len=8,
                            batch_size=2, batch_search=False)
    bf16, w4 = report.result("bf16").generate, report.result("w4a16-gptq").generate
    # a quarter of bf16's, and a bit: the scales, the embeddings and output head left in bfloat16
    assert 0.25 < w4.weights_bytes / bf16.weights_bytes < 0.35 and w4.decode_tok_s is not None


def test_the_forecasts_leave_the_head_as_the_conversion_leaves_it():
    """The output head a compressed-tensors format leaves in bfloat16 is counted and timed unconverted; torchao's
    int4 converts it, and its forecast says so."""
    from dtypelab.forecasting.layouts import layout_bytes
    from dtypelab.serving.fake_serve import quantized_layers

    served = load_served("tinylm")
    with torch.device("meta"):
        model = served.make_model()
    assert "lm_head" not in quantized_layers(get_policy("w4a16-gptq"), model)
    assert "lm_head" not in layout_bytes(get_policy("w4a16-gptq"), model, 1)
    assert "model.layers.0.mlp.down_proj" in layout_bytes(get_policy("w4a16-gptq"), model, 1)
    assert "lm_head" in quantized_layers(get_policy("int4-wo"), model)
