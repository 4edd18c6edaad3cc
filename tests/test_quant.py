"""Quantized inference policies (int8, fp8): fidelity per policy, sizes, export round trip, applicability."""

from __future__ import annotations

import copy
import math
import os
import stat
import sys

import pytest
import torch
from conftest import fake_hardware
from torch import nn

from dtypelab import DtypelabError, bench, export, load_exported, recommend
from dtypelab.core.calibration import calibrating, task_feed
from dtypelab.core.policies import REGISTRY, Precision, get_policy, policies_for
from dtypelab.core.policies.kinds import quantize
from dtypelab.inference.fidelity import compare
from dtypelab.inference.sizes import linear_weight_bytes, serialize, tensor_bytes
from dtypelab.render.bench import render
from dtypelab.sweep.listing import policy_table

# GPU ones: test_cuda.py; whole-model programs (ExecuTorch's et-*): test_executorch.py
QUANT = [n for n, c in REGISTRY.items() if c.modes == ("infer",) and not c.gpu_only and not c.program]
# Lowest acceptable output SQNR on the MLP below. Expected from the formats: int8 with a scale per row has
# ~7 significant bits (~40 dB per matmul, less once activations are quantized too); e4m3 has 4 (~28 dB).
MIN_SQNR_DB = {"int8-dyn": 32, "int8-dyn-compile": 32, "int8-wo": 40, "fp8-wo": 24,
               "int8-dyn-legacy": 27, "int8-dyn-legacy-pc": 27,
               # emulated MX: e4m3 / e2m1 elements (4 / 2 significant bits) under a power-of-two scale per 32 values
               "mxfp8-dyn-emu": 22, "mxfp4-dyn-emu": 10,
               # emulated integer weight-only: int8 per channel (~7 bits), int4 in groups of 128 (~3 bits; GPTQ and
               # AWQ calibrated on the inputs judged)
               "int8-wo-emu": 40, "w8a16-rtn": 38, "w8a16-gptq": 38, "w8a16-awq": 38,
               "int4-wo-emu": 18, "w4a16-rtn": 18, "w4a16-gptq": 18, "w4a16-awq": 18}
FOUR_BIT = {"int4-wo-emu", "w4a16-rtn", "w4a16-gptq", "w4a16-awq"}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 16)).eval()


def _run(name: str, model: nn.Module, x: torch.Tensor) -> tuple[nn.Module, torch.Tensor]:
    policy = Precision(get_policy(name), "cpu")
    with calibrating(task_feed(x)):  # GPTQ and AWQ read the inputs they are judged on
        q = policy.convert_module(copy.deepcopy(model)).eval()
    with torch.no_grad(), policy.session(), policy.forward_context():
        return q, q(policy.convert_input(x)).float()


def test_every_quantized_policy_has_a_threshold():
    assert set(MIN_SQNR_DB) == set(QUANT)


@pytest.mark.parametrize("name", QUANT)
def test_sqnr_above_threshold(name):
    model, x = _mlp(), torch.randn(128, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x)
    _, out = _run(name, model, x)
    fid = compare(ref, out)
    assert MIN_SQNR_DB[name] < fid["sqnr_db"] < 80, fid  # < 80: it really was quantized, not left in fp32
    # 4-bit values: 2 significant bits (MX's e2m1), 16 levels a group (int4)
    assert fid["cos_min"] > (0.9 if name == "mxfp4-dyn-emu" else 0.98 if name in FOUR_BIT else 0.99), fid
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["int8-dyn", "int8-wo", "fp8-wo", "int8-dyn-legacy", "int8-dyn-legacy-pc"])
def test_linear_weight_bytes(name):
    model = _mlp()
    fp32 = linear_weight_bytes(model)
    assert fp32 == sum(m.weight.numel() * 4 for m in model if isinstance(m, nn.Linear))
    q, _ = _run(name, model, torch.randn(4, 64))
    rows = sum(m.weight.shape[0] for m in model if isinstance(m, nn.Linear))
    data = fp32 // 4  # one byte per weight
    # the 1-byte data plus one scale (and zero point) per row: float32 + int8 in torchao, float64 + int64 in
    # torch.ao per channel, one float64 + int64 per tensor in torch.ao per tensor
    per_row = {"int8-dyn": 5, "int8-wo": 5, "fp8-wo": 4, "int8-dyn-legacy-pc": 16}.get(name)
    expected = data + rows * per_row if per_row else data + 3 * 16
    assert linear_weight_bytes(q) == expected


def test_tensor_bytes_plain_and_quantized():
    assert tensor_bytes(torch.zeros(10, 3)) == 120
    assert tensor_bytes(torch.zeros(10, dtype=torch.bfloat16)) == 20
    q = torch.quantize_per_tensor(torch.zeros(100), 0.1, 0, torch.qint8)
    assert tensor_bytes(q) == 100 + 16


def test_file_size_shrinks_with_the_weights():
    model = _mlp()
    fp32_blob, fmt = serialize(model)
    assert fmt == "safetensors"
    for name, (low, high) in {"int8-dyn": (0.24, 0.30), "bf16": (0.49, 0.52), "fp8-wo": (0.24, 0.30)}.items():
        q, _ = _run(name, model, torch.randn(4, 64))
        blob, _ = serialize(q)
        assert low < len(blob) / len(fp32_blob) < high, (name, len(blob) / len(fp32_blob))
    legacy, _ = _run("int8-dyn-legacy", model, torch.randn(4, 64))
    assert serialize(legacy)[1] == "torch.save"


@pytest.mark.parametrize("name", [*QUANT, "bf16", "fp32"])
def test_export_load_round_trip(name, tiny, tmp_path):
    ext = ".pt" if name.startswith("int8-dyn-legacy") else ".safetensors"
    saved = os.umask(0o022)
    try:
        info = export(tiny, name, str(tmp_path / f"m{ext}"))
    finally:
        os.umask(saved)
    assert info.roundtrip_max_abs_diff == 0
    assert stat.S_IMODE(os.stat(info.path).st_mode) == 0o644  # readable like any file the user writes
    assert info.file_bytes == (tmp_path / f"m{ext}").stat().st_size
    model, meta = load_exported(info.path, task=tiny)
    assert meta["policy"] == name and meta["task"] == tiny and "trained here" in meta["weights"]
    # tiny layers: per-row scales weigh a lot; test_linear_weight_bytes checks exact sizes. An emulation stores its
    # dequantized values (its format's bytes are the compressed-tensors export's)
    if name in QUANT and not get_policy(name).numerics_only:
        assert info.linear_weight_bytes < info.fp32_linear_weight_bytes
    policy = Precision(get_policy(name), "cpu")
    x = torch.randn(5, 8)
    with torch.no_grad(), policy.session():
        out = model(policy.convert_input(x)).float()
    assert out.shape == (5, 3) and torch.isfinite(out).all()


def test_export_refuses_the_wrong_extension_and_foreign_files(tiny, tmp_path):
    with pytest.raises(DtypelabError, match=r"torch.save: give a path ending in .pt or .pth"):
        export(tiny, "int8-dyn-legacy", str(tmp_path / "m.safetensors"))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a file")
    with pytest.raises(DtypelabError, match="not a file written by dtypelab export"):
        load_exported(str(junk))
    with pytest.raises(DtypelabError, match="no such file"):
        load_exported(str(tmp_path / "missing.pt"))


def test_inference_only_policies_are_refused_in_training(tiny):
    assert not set(QUANT) & set(policies_for("train"))
    assert set(QUANT) <= set(policies_for("infer"))
    with pytest.raises(DtypelabError, match=r"inference-only.*--mode infer"):
        bench(tiny, "int8-dyn", mode="train", isolate=False, hardware=fake_hardware())
    with pytest.raises(DtypelabError, match=r"--per-layer.*--mode infer"):
        bench(tiny, "bf16", mode="train", per_layer=True, isolate=False, hardware=fake_hardware())


def test_training_commands_refuse_inference_only_policies(tiny):
    from dtypelab import audit, trace

    for command in (audit, trace):
        with pytest.raises(DtypelabError, match="inference-only"):
            command(tiny, policy="fp8-wo", hardware=fake_hardware())


def test_unsupported_here_is_skipped_with_the_reason(tiny, monkeypatch):
    cuda = fake_hardware(device="cuda")
    why = get_policy("int8-dyn-legacy").availability(cuda)
    assert not why.ok and "CPU only" in why.reason
    monkeypatch.setattr(quantize, "torchao_missing", lambda: "torchao cannot be imported (planted)")
    bench_module = sys.modules["dtypelab.sweep.sweep"]  # the package's `bench` attribute is the function
    monkeypatch.setattr(bench_module, "default_policies",
                        lambda mode, device="cpu": ["fp32", "int8-dyn", "int8-dyn-legacy"])
    report = bench(tiny, mode="infer", steps=2, warmup=1, isolate=False, hardware=fake_hardware())
    skipped = report.result("int8-dyn")
    assert skipped.status == "skipped" and skipped.reason == "torchao cannot be imported (planted)"
    assert report.result("int8-dyn-legacy").status == "ok"
    with pytest.raises(DtypelabError, match="int8-dyn cannot run here: torchao cannot be imported"):
        bench(tiny, "int8-dyn", mode="infer", isolate=False, hardware=fake_hardware())


def test_infer_report_has_fidelity_sizes_and_per_layer(tiny):
    report = bench(tiny, "int8-dyn,fp8-wo", mode="infer", steps=3, warmup=1, per_layer=True, isolate=False,
                   hardware=fake_hardware())
    base, q = report.result("fp32"), report.result("int8-dyn")
    assert base.fidelity["sqnr_db"] == math.inf and base.fidelity["cos_min"] == pytest.approx(1.0)
    assert 20 < q.fidelity["sqnr_db"] < 80 and 0.99 < q.fidelity["cos_min"] < 1
    assert q.size["linear_weight_bytes"] < 0.4 * base.size["linear_weight_bytes"]
    layers = {row["layer"]: row for row in q.per_layer}
    assert set(layers) == {"net.0", "net.1", "net.2"}
    assert layers["net.0"]["sqnr_db"] == pytest.approx(layers["net.0"]["own_sqnr_db"])  # nothing before it
    assert layers["net.1"]["own_sqnr_db"] == math.inf  # ReLU is not quantized: its own error is zero
    assert 20 < layers["net.2"]["own_sqnr_db"] < 80
    md = render(report, "markdown")
    assert "per-layer SQNR" in md and "| net.2 | Linear |" in md and "worst cos" in md and "linear W" in md
    fp8_row = next(line for line in md.splitlines() if line.startswith("| fp8-wo |"))
    assert "†" in fp8_row and "† emulated format" in md  # emulated speed is marked, never shown as native
    html = render(report, "html")
    assert html.count("<table>") == 2


def test_low_cosine_is_not_recommended(tiny):
    report = bench(tiny, "int8-dyn", mode="infer", steps=3, warmup=1, min_cosine=0.99999999, isolate=False,
                   hardware=fake_hardware())
    from dtypelab import recommend

    rec = recommend(report)
    assert rec.best != "int8-dyn" and rec.verdicts["int8-dyn"].startswith("cosine")
    with pytest.raises(DtypelabError, match="--min-cosine"):
        bench(tiny, "int8-dyn", mode="infer", min_cosine=2, isolate=False, hardware=fake_hardware())


def test_compare_edge_cases():
    a = torch.randn(4, 3)
    assert compare(a, a)["cos_min"] == pytest.approx(1.0)
    assert compare(a, torch.randn(5, 3)) == {}
    assert "cos_min" not in compare(torch.randn(4, 1), torch.randn(4, 1))  # one feature: cosine means nothing


def test_int8_without_vnni_is_called_not_native(tiny):
    report = bench(tiny, "int8-dyn", mode="infer", steps=2, warmup=1, isolate=False, hardware=fake_hardware())
    assert "no int8 dot-product instructions" in render(report, "markdown")  # the fake CPU has no VNNI flag
    vnni = fake_hardware()
    vnni = type(vnni)(**{**vnni.__dict__, "cpu_flags": (*vnni.cpu_flags, "avx512_vnni")})
    report = bench(tiny, "int8-dyn", mode="infer", steps=2, warmup=1, isolate=False, hardware=vnni)
    assert "no int8 dot-product instructions" not in render(report, "markdown")


def test_quantized_policies_are_judged_by_the_kernel_they_run():
    keys = {name: get_policy(name).default.facts.probe_key for name in QUANT}
    assert keys == {"int8-dyn": "int8", "int8-dyn-compile": "int8", "int8-wo": "int8-weight-only",
                    "fp8-wo": "fp8-weight-only", "int8-dyn-legacy": "int8-fbgemm", "int8-dyn-legacy-pc": "int8-fbgemm",
                    "mxfp8-dyn-emu": "float32", "mxfp4-dyn-emu": "float32",  # emulated: float32 matmuls
                    "int8-wo-emu": "float32", **dict.fromkeys(("w8a16-rtn", "w8a16-gptq", "w8a16-awq", "int4-wo-emu",
                                                                "w4a16-rtn", "w4a16-gptq", "w4a16-awq"), "bfloat16")}
    slow_int8 = fake_hardware(int8=2.0, int8_fbgemm=150.0, int8_weight_only=60.0, fp8_weight_only=40.0)
    avail = get_policy("int8-dyn").availability(slow_int8)
    assert avail.ok and avail.slow and "torch._int_mm" in avail.reason and "50x slower" in avail.reason
    # compiled, it inherits the verdict of the int8 matmul it still runs (not fp32's, as it once did)
    compiled = get_policy("int8-dyn-compile").availability(slow_int8)
    assert compiled.slow and "50x slower" in compiled.reason and "compiling does not change that" in compiled.reason
    for fine in ("int8-wo", "fp8-wo", "int8-dyn-legacy"):
        assert not get_policy(fine).availability(slow_int8).slow, fine


def test_a_slow_int8_kernel_is_skipped_unless_forced(tiny):
    slow_int8 = fake_hardware(int8=2.0)
    report = bench(tiny, "int8-dyn,int8-wo", mode="infer", steps=2, warmup=1, isolate=False, hardware=slow_int8)
    skipped = report.result("int8-dyn")
    assert skipped.status == "skipped" and skipped.skip == "slow" and "2 GFLOP/s" in skipped.reason
    assert report.result("int8-wo").status == "ok"
    assert "use --force to run anyway" in " ".join(recommend(report).sentences)
    forced = bench(tiny, "int8-dyn", mode="infer", steps=2, warmup=1, isolate=False, hardware=slow_int8, force=True)
    assert forced.result("int8-dyn").status == "ok"
    rows = {name: verdict for name, _, verdict in policy_table(hardware=slow_int8)}
    assert rows["int8-dyn"].startswith("skipped unless --force: the int8 × int8 matmul")


def test_default_inference_sweep_leaves_fp64_out_but_runs_it_by_name(tiny, monkeypatch):
    from dtypelab.core.policies import default_policies

    assert "fp64" not in default_policies("infer") and "fp64" in default_policies("train")
    assert "fp64" in policies_for("infer")
    rows = {name: verdict for name, _, verdict in policy_table(hardware=fake_hardware())}
    assert "not in the default infer sweep" in rows["fp64"]
    report = bench(tiny, "fp64", mode="infer", steps=2, warmup=1, isolate=False, hardware=fake_hardware())
    assert report.result("fp64").status == "ok"


def test_an_int8_policys_notes_say_whether_its_matmul_reached_the_cpus_int8_units():
    """The probe's record names the oneDNN primitive each int8 kernel ran; the table's notes say it per policy: on
    AMX's units, or not (on an AMX Xeon where the eager path reached neither)."""
    from dataclasses import replace

    from dtypelab.core.judging.notes import table_notes
    from dtypelab.core.policies import policy_info
    from dtypelab.core.results import PolicyResult, Report, RunConfig

    xeon = replace(fake_hardware(int8=500.0), cpu_flags=("avx512f", "avx512_vnni", "amx_int8"),
                   kernel_paths={"int8": "matmul brg_matmul:avx512_core_amx", "int8-fbgemm": ""})
    config = RunConfig(task="t", mode="infer", policies=("fp32", "int8-dyn", "int8-dyn-legacy"), steps=4,
                       batch_size=8, warmup=1, seed=0, tolerance="1%", device="cpu", force=False, timeout_s=60,
                       metric="accuracy", higher_is_better=True)
    results = tuple(PolicyResult(n, "ok", step_times_s=(0.01,) * 4, warmup=1, info=policy_info(get_policy(n)),
                                 batch_size=8, metrics={"accuracy": 0.9}) for n in config.policies)
    notes = table_notes(Report(config, {"hardware": xeon.to_dict()}, results=results))
    assert "int8-dyn: int8 matmuls on AMX's int8 units (oneDNN matmul brg_matmul:avx512_core_amx)." in notes
    assert ("int8-dyn-legacy: int8 matmuls not on AMX's int8 units (no oneDNN primitive: torch's own loop or "
            "fbgemm).") in notes
    assert not any(n.startswith("fp32: int8") for n in notes)
