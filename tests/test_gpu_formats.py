"""GPU-native formats on a CPU-only machine: the policies refuse with the reason, a CPU sweep leaves them out, what
can be checked without a GPU is (float8 training's conversion, the records' notes, MFU, the rated peaks, the gpt2
task reduced). Their runs on a GPU are in test_cuda.py."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from test_policies import global_state
from torch import nn

from dtypelab import DtypelabError
from dtypelab.core.machine.hardware import HardwareInfo, rated_peaks
from dtypelab.core.policies import (
    REGISTRY,
    Cast,
    Float8Train,
    Plan,
    Precision,
    Quantize,
    default_policies,
    get_policy,
    gpu_only_policies,
    plan_from_dict,
    regions,
)
from dtypelab.core.results import PolicyResult

GPU_ONLY = ["fp8-tensorwise", "fp8-rowwise", "fp8-rowwise-gw-hp", "mxfp8", "fp8-dyn-row", "fp8-dyn-tensor", "int4-wo",
            "mxfp8-dyn", "mxfp4-dyn", "lora-fp8"]


def _hw(device: str = "cpu", cc: tuple[int, int] | None = None, name: str = "AMD EPYC") -> HardwareInfo:
    return HardwareInfo(device=device, device_name=name, cpu_name="AMD EPYC", cpu_flags=("avx2",),
                        cpu_capability="AVX2", cuda_capability=cc, threads=2, gflops={"float32": 100.0})


def test_gpu_only_policies_are_registered_and_refuse_here_with_the_reason():
    from dtypelab.core.policies.kinds.mx import _mx_training_torch

    assert sorted(gpu_only_policies("train") + gpu_only_policies("infer")) == sorted(GPU_ONLY)
    for name in GPU_ONLY:
        why = get_policy(name).availability(_hw()).reason
        assert "CUDA compute capability >=" in why and "this run is on the CPU" in why, (name, why)
    ampere = _hw("cuda:0", (8, 0), "NVIDIA A100-SXM4-80GB")
    for name in ("fp8-tensorwise", "fp8-dyn-row"):
        why = get_policy(name).availability(ampere).reason
        assert ">= 8.9" in why and "A100" in why and "is 8.0" in why
    assert get_policy("int4-wo").availability(ampere).ok  # tinygemm runs on Ampere
    hopper = _hw("cuda:0", (9, 0), "NVIDIA H100 80GB HBM3")
    assert all(get_policy(n).availability(hopper).ok for n in GPU_ONLY if not n.startswith("mx"))
    assert ">= 10.0" in get_policy("mxfp8").availability(hopper).reason  # MX tensor cores: Blackwell
    blackwell = _hw("cuda:0", (10, 0), "NVIDIA B200")
    too_old = _mx_training_torch()  # torchao's MX training needs a newer torch than 2.11: then mxfp8 says so
    assert all(get_policy(n).availability(blackwell).ok for n in GPU_ONLY if not (n == "mxfp8" and too_old))
    if too_old:
        assert get_policy("mxfp8").availability(blackwell).reason == too_old


def test_a_cpu_sweep_leaves_the_gpu_formats_out_and_a_gpu_sweep_adds_the_compiled_baselines():
    for mode in ("train", "infer"):
        assert not set(default_policies(mode, "cpu")) & set(GPU_ONLY)
    gpu = default_policies("train", "cuda")
    assert {"fp8-tensorwise", "fp8-rowwise", "amp-bf16+compile", "fp32+compile"} <= set(gpu)
    assert {"fp8-dyn-row", "fp8-dyn-tensor", "int4-wo"} <= set(default_policies("infer", "cuda"))
    assert "amp-bf16+compile" not in default_policies("train", "cpu")


def test_named_on_a_cpu_a_gpu_format_is_a_one_line_error(tiny):
    from dtypelab import bench

    with pytest.raises(DtypelabError, match="policy fp8-tensorwise cannot run here: float8 training"):
        bench(tiny, "fp8-tensorwise", device="cpu", steps=2)
    with pytest.raises(DtypelabError, match="training policy: use --mode train"):
        bench(tiny, "fp8-rowwise", mode="infer", device="cpu", steps=2)


def test_configs_round_trip_and_are_named_by_what_they_do():
    for name in GPU_ONLY:
        plan = get_policy(name)
        again = plan_from_dict(json.loads(plan.to_json()))
        assert again.default == plan.default and again.name == name
    assert Quantize("fp8-dynamic", granularity="per-tensor").label == "fp8-dyn-tensor"
    assert Float8Train("rowwise", "none").label == "fp8-rowwise-all"
    assert get_policy("fp8-tensorwise").modes == ("train",) and get_policy("int4-wo").modes == ("infer",)
    assert get_policy("int4-wo").default.facts.storage_dtype == "bfloat16"
    with pytest.raises(DtypelabError, match="unknown recipe"):
        Float8Train("blockwise")
    with pytest.raises(DtypelabError, match="share no mode"):
        Plan(Float8Train(), (("head", Quantize("int4-weight-only")),))
    with pytest.raises(DtypelabError, match="per-tensor is for fp8-dynamic"):
        Quantize("int8-dynamic", granularity="per-tensor")


@pytest.mark.parametrize(("recipe", "shape", "kept"), [
    ("tensorwise", (1024, 4096), False), ("tensorwise", (2048, 768), True), ("tensorwise", (768, 8192), True),
    ("rowwise", (2304, 768), False), ("rowwise", (8192, 4096), True), ("rowwise", (4096, 2048), False),
    ("tensorwise", (1000, 8192), False)])
def test_float8_leaves_out_the_layers_that_do_not_pay(recipe, shape, kept):
    why = Float8Train(recipe).left_out(*shape)
    assert (why is None) == kept
    if not kept:
        assert f"{shape[0]}×{shape[1]}" in why
    # without the size filter only a shape the tensor cores cannot take is left out
    assert (Float8Train(recipe, "none").left_out(*shape) is None) == (shape[0] % 16 == 0 and shape[1] % 16 == 0)


def test_float8_training_converts_the_layers_that_pay_and_trains_here_emulated():
    """The conversion is the GPU's; on a CPU torch._scaled_mm is emulated, slowly but exactly enough to check it."""
    float8 = pytest.importorskip("torchao.float8.float8_linear")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.Linear(1024, 10))
    plan = Plan(Float8Train("tensorwise"), (("3", Cast("float32")),), name="fp8-head-fp32")
    precision = Precision(plan, "cpu")
    before = global_state()
    compiled = precision.convert_module(model)
    eager = compiled._orig_mod  # the compiled wrapper's module: run eagerly, compiling a step costs minutes here
    assert isinstance(eager[0], float8.Float8Linear) and type(eager[2]) is nn.Linear
    assert isinstance(eager[3], nn.Linear) and set(regions(eager)) == {"3"}  # the fp32 head: a region of its own
    conversion = precision.conversion()
    assert conversion["converted"] == ["0"] and conversion["format"] == "float8 training (tensorwise)"
    (left,) = conversion["left_out"]
    assert left["layer"] == "2" and "too small to pay" in left["why"]
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    with precision.session():
        for _ in range(2):
            with precision.forward_context():
                out = eager(torch.randn(8, 64))
            assert out.dtype == torch.float32  # the fp32 rule's region casts the head back
            precision.backward(out.square().mean())
            precision.optimizer_step(opt)
            opt.zero_grad()
    assert all(torch.isfinite(p).all() for p in eager.parameters())
    assert global_state() == before


def test_the_record_says_what_a_float8_policy_converted_and_what_it_left_out():
    from dtypelab.core.judging.notes import _conversion_text

    left = [{"layer": f"blocks.{i}.qkv", "why": "2304×768: too small to pay"} for i in range(6)]
    r = PolicyResult("fp8-rowwise", "ok",
                     conversion={"format": "float8 training (rowwise)", "converted": [], "left_out": left})
    text = _conversion_text(r)
    assert "float8 training (rowwise) in 0 of 6 Linear layers" in text and "float part alone" in text
    assert "blocks.0.qkv 2304×768: too small to pay" in text and "and 2 more" in text
    assert _conversion_text(PolicyResult("fp32", "ok")) == ""


def test_mfu_is_the_step_flops_against_the_rated_peak_of_the_dtype_that_did_most():
    from dtypelab.profiling.summary import mfu

    used, key, peak = mfu({"bfloat16": 4e14, "float32": 1e12}, 1.0, {"bfloat16": 989.5, "float32": 67}, tf32=False)
    assert key == "bfloat16" and peak == 989.5 and used == pytest.approx(4.01e14 / 989.5e12)
    assert mfu({"float32": 1e12}, 0.5, {"tf32": 494.5}, tf32=True)[1] == "tf32"
    assert mfu({"float8_e4m3fn": 1e12}, 1.0, {"fp8": 1979}, tf32=False)[1] == "fp8"
    assert mfu({"float32": 1e12}, 1.0, {}, tf32=False) == (None, "", None)  # a CPU: no datasheet


def test_rated_peaks_by_device_name():
    assert rated_peaks("NVIDIA H100 80GB HBM3")[1]["bfloat16"] == 989.5
    assert rated_peaks("NVIDIA H100 PCIe")[1]["fp8"] == 1513
    assert rated_peaks("NVIDIA H200")[1]["fp8"] == 1979
    assert "fp8" not in rated_peaks("NVIDIA A100-SXM4-80GB")[1]
    assert rated_peaks("NVIDIA A10G") == ("", {}) and rated_peaks("AMD EPYC") == ("", {})
    # torch's names for the cards (as their records and nvidia-smi show them): each is one row's, and only one's
    names = {"NVIDIA H100 80GB HBM3": "H100", "NVIDIA H100 PCIe": "H100-PCIe", "NVIDIA H100 NVL": "H100-NVL",
             "NVIDIA H200 NVL": "H100-NVL", "NVIDIA H200": "H200", "NVIDIA GH200 480GB": "H200",
             "NVIDIA A100-SXM4-80GB": "A100-80GB", "NVIDIA A100 80GB PCIe": "A100-80GB",
             "NVIDIA A100-SXM4-40GB": "A100-40GB", "NVIDIA A100-PCIE-40GB": "A100-40GB", "NVIDIA L40S": "L40S",
             "NVIDIA L4": "L4", "NVIDIA A10": "A10", "Tesla T4": "T4", "NVIDIA GeForce RTX 4090": "RTX4090",
             "NVIDIA GeForce RTX 3090": "RTX3090"}
    from dtypelab.core.machine.devices import DEVICES

    for name, row in names.items():
        matched = [d.name for d in DEVICES if re.search(d.matches, name)]
        assert matched == [row], (name, matched)
        assert rated_peaks(name) == next(d for d in DEVICES if d.name == row).peaks
    assert {d.name for d in DEVICES} <= set(names.values())  # every row is a name's
    hw = dataclasses.replace(_hw("cuda:0", (9, 0), "NVIDIA H100"), rated_tflops={"bfloat16": 989.5})
    assert hw.rated("bfloat16") == 989.5e3 and hw.rated("fp8") is None
    assert HardwareInfo.from_dict(hw.to_dict()) == hw


def test_gpt2_runs_reduced_without_cuda_and_its_corpus_is_deterministic(monkeypatch):
    from dtypelab.core.errors import TaskError
    from dtypelab.core.task import load_task
    from dtypelab.core.tasks import gpt2

    for size in (gpt2.REDUCED, dataclasses.replace(gpt2.FULL, layers=1, vocab=1024, seq=128)):  # the formula
        assert size.parameters == sum(p.numel() for p in gpt2.GPT(size).parameters())
    assert round(gpt2.FULL.parameters / 1e6) == 124
    monkeypatch.delenv("DTYPELAB_GPT2_SIZE", raising=False)
    task = load_task("gpt2")
    assert "reduced" in task.description and task.metric == "val_loss" and not task.higher_is_better
    x, y = task.train_batch(3, 4)
    assert x.shape == (4, gpt2.REDUCED.seq) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(task.train_batch(3, 4)[0], x) and not torch.equal(task.train_batch(4, 4)[0], x)
    chain = gpt2.Chain(gpt2.REDUCED.vocab, gpt2.REDUCED.seq)
    seqs = chain.sample(32, 0)
    nxt = chain.successors[seqs[:, :-1]]  # outside the repeated span every token is one of its successors
    follows = (nxt == seqs[:, 1:, None]).any(-1).float().mean()
    assert follows > 0.8
    monkeypatch.setenv("DTYPELAB_GPT2_SIZE", "huge")
    with pytest.raises(TaskError, match="use full or reduced"):
        load_task("gpt2")


def test_gpt2_trains_reduced_and_its_loss_falls(monkeypatch):
    from dtypelab import bench

    monkeypatch.setenv("DTYPELAB_GPT2_SIZE", "reduced")
    report = bench("gpt2", "fp32", device="cpu", steps=40, rounds=0)
    r = report.result("fp32")
    assert r.status == "ok" and r.losses[-1] < r.losses[0] - 0.5, r.reason
    assert 1 < r.metrics["perplexity"] < 512 and r.metrics["val_loss"] == pytest.approx(
        torch.tensor(r.metrics["perplexity"]).log().item(), rel=1e-4)


def test_registry_has_no_gpu_format_the_listing_omits():
    from dtypelab.sweep.listing import policy_table

    rows = {name: verdict for name, _, verdict in policy_table("cpu", _hw())}
    assert all(rows[n].startswith("not here:") for n in GPU_ONLY)
    assert set(REGISTRY) == set(rows)


def test_tune_takes_float8_training_as_a_candidate_and_refuses_it_here(tiny):
    import dtypelab

    with pytest.raises(DtypelabError, match="candidate fp8-tensorwise cannot run here: float8 training"):
        dtypelab.tune(tiny, mode="train", candidates="fp8-tensorwise", device="cpu")
    with pytest.raises(DtypelabError, match="candidate int4-wo cannot run here"):
        dtypelab.tune(tiny, mode="infer", candidates="int4-wo", device="cpu")


def test_the_profile_table_gains_an_mfu_column_only_where_a_peak_is_rated():
    from dtypelab.core.results import ProfileSummary, Report, RunConfig
    from dtypelab.render.profile import breakdown_section

    def report(mfu: float | None) -> Report:
        prof = ProfileSummary(mode="train", steps=3, device="cuda", step_s=0.1, timed_step_s=0.09,
                              phases={"forward": 0.03, "backward": 0.06}, categories={"matmul": 0.07, "other": 0.02,
                                                                                      "cast": 0.0, "outside": 0.01},
                              dtype_flops={"bfloat16": 3e13}, matmul_flops=3e13, mfu=mfu,
                              mfu_key="bfloat16" if mfu else "", rated_tflops=989.5 if mfu else None)
        config = RunConfig(task="gpt2", mode="train", policies=("amp-bf16",), steps=3, batch_size=16, warmup=1, seed=0,
                           tolerance="1%", device="cuda", force=False, timeout_s=60, metric="val_loss",
                           higher_is_better=False)
        return Report(config, {}, results=(PolicyResult("amp-bf16", "ok", profile=prof),))

    rated = breakdown_section(report(0.337))
    assert "MFU" in rated.headers and rated.rows[0][rated.headers.index("MFU")] == "34%"
    assert any("rated dense peak" in n and "amp-bf16 bfloat16 989.5" in n for n in rated.notes)
    assert "MFU" not in breakdown_section(report(None)).headers


def test_float8_training_is_compared_with_its_fair_baseline_when_both_ran():
    from dtypelab.core.judging.notes import _conversion_text
    from dtypelab.core.results import Report, RunConfig

    config = RunConfig(task="gpt2", mode="train", policies=("fp8-tensorwise", "amp-bf16+compile"), steps=4,
                       batch_size=16, warmup=1, seed=0, tolerance="1%", device="cuda", force=False, timeout_s=60,
                       metric="val_loss", higher_is_better=False)
    fp8 = PolicyResult("fp8-tensorwise", "ok", warmup=1, step_times_s=(9.0, 0.08, 0.08, 0.08),
                       conversion={"format": "float8 training (tensorwise)", "converted": ["blocks.0.qkv"],
                                   "left_out": []})
    base = PolicyResult("amp-bf16+compile", "ok", warmup=1, step_times_s=(9.0, 0.1, 0.1, 0.1))
    text = _conversion_text(fp8, Report(config, {}, results=(fp8, base)))
    assert "1.25x the speed of amp-bf16+compile, its fair baseline" in text
    assert "fair baseline" not in _conversion_text(fp8, Report(config, {}, results=(fp8,)))


def test_a_gpu_format_says_which_layers_its_kernel_cannot_take():
    """torchao leaves such layers as they are without a word; the record says it."""
    int4, fp8 = Quantize("int4-weight-only"), Quantize("fp8-dynamic")
    assert int4.unfit(nn.Linear(1024, 4096)) is None and fp8.unfit(nn.Linear(1024, 4096)) is None
    assert "multiple of 128" in int4.unfit(nn.Linear(384 + 8, 64))
    assert "outputs of 8" in int4.unfit(nn.Linear(128, 12))
    assert fp8.unfit(nn.Linear(8, 32)) == "32×8: float8 matmuls need dimensions divisible by 16"
    assert Quantize("int8-dynamic").unfit(nn.Linear(8, 3)) is None
