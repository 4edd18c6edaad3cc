"""CUDA-only paths: run where a GPU is present, skipped cleanly elsewhere."""

from __future__ import annotations

import itertools

import pytest
import torch

from dtypelab import bench, probe
from dtypelab.core.measure import MemoryMeter

pytestmark = pytest.mark.cuda


def test_probe_on_cuda_measures_tf32_on_ampere_or_newer():
    hw = probe("cuda", budget_s=0.05)
    assert hw.cuda_capability is not None and hw.gflops["float32"] > 0
    if hw.cuda_capability >= (8, 0):
        assert "tf32" in hw.gflops and hw.native("bfloat16")


def test_cuda_memory_meter_counts_allocations():
    meter = MemoryMeter(torch.device("cuda"))
    meter.start()
    x = torch.empty(32 * 2**20, dtype=torch.uint8, device="cuda")
    assert meter.peak_bytes() >= 32 * 2**20
    del x


def test_sweep_on_cuda_including_tf32_and_amp_fp16(tiny):
    report = bench(tiny, "fp32,tf32,amp-fp16,amp-bf16,bf16", device="cuda", steps=20)
    for r in report.results:
        assert r.status == "ok", (r.policy, r.reason)
        assert r.memory_method.startswith("cuda")
    scaler = report.result("amp-fp16").scaler
    # every skipped step lowered the scale (GradScaler's backoff) and is listed: the log agrees with itself (the
    # last step's new scale is not logged, so it may add one skip)
    scales = scaler["grad_scale"]
    lowered = sum(b < a for a, b in itertools.pairwise(scales))
    assert len(scales) == 20 and scaler["skipped_steps"] == len(scaler["skips"])
    assert lowered <= scaler["skipped_steps"] <= lowered + 1


def test_range_stats_of_a_cuda_tensor_equal_the_cpu_ones():
    from dtypelab.numerics.rangestats import range_stats

    x = torch.randn(100_000, device="cuda") * 1e-4
    formats = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
    assert range_stats(x, formats, True) == range_stats(x.cpu(), formats, True)


def test_audit_on_cuda_with_amp_fp16(tiny):
    from dtypelab.numerics.auditing import audit

    report = audit(tiny, policy="amp-fp16", steps=3, device="cuda", environment={})
    assert report.status == "ok" and report.layers and report.config.device.startswith("cuda")


def test_trace_on_cuda_names_forward_and_backward_origins():
    # The autograd engine runs CUDA backward on its own thread: the op tracer must still see it.
    import nan_models as nm

    from dtypelab import trace

    f = trace(nm.attention_task(scale=10.0), policy="fp16", device="cuda", environment={}).finding
    assert (f.origin.op, f.origin.module) == ("aten.bmm", "attn")
    f = trace(nm.norm_task(), device="cuda", environment={}).finding
    assert (f.origin.phase, f.origin.op, f.origin.backward_of, f.origin.module) == (
        "backward", "aten.div", "aten.sqrt", "body.1")


def test_trace_amp_fp16_on_cuda_logs_the_scaler(tiny):
    from dtypelab import trace

    r = trace(tiny, policy="amp-fp16", device="cuda", steps=10, environment={})
    assert r.status == "clean" and len(r.scaler["grad_scale"]) == 10


def test_quantized_inference_on_cuda(tiny):
    """torchao's int8/fp8 policies on the GPU; torch.ao's dynamic int8 is CPU-only and says so."""
    report = bench(tiny, "int8-dyn,int8-wo,fp8-wo", mode="infer", device="cuda", steps=5)
    for name in ("int8-dyn", "int8-wo", "fp8-wo"):
        r = report.result(name)
        assert r.status == "ok", r.reason
        # the tiny task's worst sample is near zero, so its cosine is the noisiest figure (int8-dyn on an H100:
        # 36 dB SQNR, worst cosine 0.977): the SQNR carries the check
        assert 15 < r.fidelity["sqnr_db"] < 80 and r.fidelity["cos_min"] > 0.95
    with pytest.raises(Exception, match="CPU only"):
        bench(tiny, "int8-dyn-legacy", mode="infer", device="cuda", steps=2)


def test_profile_on_cuda_times_kernels_and_counts_flops(tiny):
    import dtypelab

    p = dtypelab.profile(tiny, "amp-bf16", device="cuda", steps=3, warmup=3)
    assert not p.error and p.device == "cuda"
    assert sum(p.phases.values()) == pytest.approx(p.step_s, rel=0.05)
    assert p.categories["matmul"] > 0 and p.dtype_flops.get("bfloat16", 0) > 0 and p.utilisation > 0
    assert any(o.category == "matmul" and o.dtypes == "bfloat16" for o in p.ops)


# --- GPU-native formats: float8 training, float8 dynamic and int4 weight-only inference -----------------------------

def _needs(cc: tuple[int, int]) -> None:
    if torch.cuda.get_device_capability() < cc:
        pytest.skip(f"needs compute capability {cc[0]}.{cc[1]} (this GPU: {torch.cuda.get_device_name()})")


class _Wide(torch.nn.Module):
    """Linear layers wide enough that float8 pays by torchao's own thresholds, and int4's group size divides."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.head = (torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 2048),
                                         torch.nn.Linear(2048, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


def wide_task():
    from dtypelab import Task

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2048, 1024, generator=g), torch.randn(1024, 16, generator=g)
    y = (x @ w).argmax(1)

    def evaluate(predict):
        return {"accuracy": (predict(x[:512]).argmax(1) == y[:512]).float().mean().item()}

    def batch(step: int, size: int):
        start = (step * size) % 2048
        return x[start:start + size], y[start:start + size]

    return Task(name="wide", make_model=_Wide, train_batch=batch,
                loss_fn=torch.nn.functional.cross_entropy, evaluate=evaluate, metric="accuracy", steps=30,
                batch_size=256, infer_batch=lambda n: x[:n])


def _converted(policy: str) -> list[str]:
    """The Linear layers of the wide model that the policy's conversion really changed: a float8 training module
    (torchao's Float8Linear), or a weight that is a torchao tensor subclass rather than a plain tensor."""
    from torch import nn

    from dtypelab.core.policies import Precision, get_policy

    model = Precision(get_policy(policy), torch.device("cuda")).convert_module(_Wide().cuda())
    model = getattr(model, "_orig_mod", model)  # float8 training compiles: the names are the model's own
    return sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear) and (
        type(m).__name__ == "Float8Linear" or type(m.weight) not in (torch.Tensor, nn.Parameter)))


def test_float8_training_runs_compiled_and_records_its_layers():
    _needs((8, 9))
    # a Task object (not a file a child process can load) runs in this process
    report = bench(wide_task(), "fp8-tensorwise,fp8-rowwise", device="cuda", steps=20, rounds=0, isolate=False)
    tw = report.result("fp8-tensorwise")
    assert tw.status == "ok", tw.reason
    assert set(tw.conversion["converted"]) == {"up", "down"}  # head: 16 outputs, too small / not a multiple of 16
    # what the record says was converted is what torchao really converted
    assert sorted(tw.conversion["converted"]) == _converted("fp8-tensorwise") == ["down", "up"]
    assert [e["layer"] for e in tw.conversion["left_out"]] == ["head"]
    rw = report.result("fp8-rowwise")  # rowwise pays only above 2048 out and 1024 in: no layer here, and it says so
    assert rw.status == "ok" and rw.conversion["converted"] == [] and len(rw.conversion["left_out"]) == 3
    assert _converted("fp8-rowwise") == []
    assert report.result("fp32+compile") is not None  # its fair baseline beside it


@pytest.mark.parametrize("name", ["fp8-dyn-row", "fp8-dyn-tensor", "int4-wo"])
def test_gpu_quantized_inference(name):
    _needs((8, 9) if name.startswith("fp8") else (8, 0))
    report = bench(wide_task(), name, mode="infer", device="cuda", steps=5, isolate=False)
    r = report.result(name)
    assert r.status == "ok", r.reason
    # per layer, e4m3 on weights and activations gives ~25-30 dB and int4 in groups of 128 ~20 dB; three layers in
    # a row lose some: the floor says the outputs are still the model's; the ceiling is below what a bfloat16 model
    # torchao left unquantized gives (~45 dB), and the weights' own types say what was converted
    assert 10 < r.fidelity["sqnr_db"] < 40, r.fidelity
    assert r.conversion["converted"] == ["up", "down", "head"] and not r.conversion["left_out"]
    assert _converted(name) == ["down", "head", "up"]


@pytest.mark.parametrize("name", ["fp8-tensorwise", "fp8-rowwise", "fp8-dyn-row", "fp8-dyn-tensor", "int4-wo"])
def test_gpu_only_policies_restore_globals(name, tiny):
    import tempfile

    from test_policies import global_state

    from dtypelab.core.policies import get_policy
    from dtypelab.sweep.job import Job, run_job

    plan = get_policy(name)
    _needs((8, 0) if name == "int4-wo" else (8, 9))
    mode = plan.modes[0]
    before = global_state()
    with tempfile.TemporaryDirectory() as wd:
        if mode == "infer":
            run_job(Job(tiny, "fp32", "reference", 3, 8, 1, 0, "cuda", wd))
        result = run_job(Job(tiny, name, mode, 3, 8, 1, 0, "cuda", wd))
    assert result.ran, result.reason
    assert global_state() == before


def test_probe_on_cuda_times_fp8_and_knows_its_rated_peak():
    hw = probe("cuda", budget_s=0.05)
    if hw.cuda_capability >= (8, 9):
        assert hw.gflops["fp8"] > hw.gflops["bfloat16"]  # float8 tensor cores: about twice bfloat16's rate
    if hw.rated_tflops:
        assert 0.2 < hw.gflops["bfloat16"] / hw.rated("bfloat16") < 1.05, hw.gflops


def test_profile_on_cuda_reports_mfu(tiny):
    import dtypelab

    p = dtypelab.profile(tiny, "amp-bf16", device="cuda", steps=3, warmup=3)
    hw = probe("cuda", budget_s=0.02)
    if hw.rated_tflops:
        assert p.mfu is not None and 0 < p.mfu < 1 and p.mfu_key == "bfloat16"


def test_gpt2_full_size_on_the_gpu(monkeypatch):
    from dtypelab.core.task import load_task
    from dtypelab.core.tasks import gpt2

    monkeypatch.delenv("DTYPELAB_GPT2_SIZE", raising=False)  # on a GPU, unless told otherwise: the full size
    assert "GPT-2-small shape" in load_task("gpt2").description
    model = gpt2.GPT(gpt2.FULL).cuda()
    assert sum(p.numel() for p in model.parameters()) == gpt2.FULL.parameters
    x = gpt2.Chain(gpt2.FULL.vocab, gpt2.FULL.seq).sample(2, 0)[:, :-1].cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x)
    assert logits.shape == (2, gpt2.FULL.seq, gpt2.FULL.vocab)


def test_training_state_policies_on_cuda():
    """bf16-sr, bf16-kahan and the low-bit Adam states train on a GPU; float8 state where the GPU has float8 (8.9+).
    The lost-updates task: pure bfloat16 stays put, the state policies do not; 8-bit state is at most 0.3x fp32's."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    task = os.path.join(os.path.dirname(here), "examples", "lost_updates.py") + ":make_task"
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    policies = "fp32,bf16,bf16-sr,bf16-kahan,fp32+adam8bit" + (",fp32+adamfp8" if fp8 else "")
    report = bench(task, policies, device="cuda", rounds=0)
    fit = {r.policy: r.metric("fit") for r in report.results}
    assert all(r.status == "ok" for r in report.results), [(r.policy, r.reason) for r in report.results]
    assert abs(fit["bf16"]) < 0.02 and fit["bf16-sr"] > 0.9 and fit["bf16-kahan"] > 0.98 and fit["fp32"] > 0.99
    assert report.result("bf16").updates[0]["lost"]["bfloat16"] == 1.0


@pytest.mark.parametrize("task,policies", [("gpt2", "fp32,amp-bf16,bf16,bf16-sr+adam8bit"),
                                           ("decoder", "fp32,amp-bf16,bf16-kahan")])
def test_forecast_on_cuda_against_max_memory_allocated(task, policies):
    """The forecast for this GPU (traced on fake CPU tensors, CUDA's 512-byte blocks and foreach updates modelled)
    against the same steps run here: the ledger on real CUDA tensors, and torch.cuda.max_memory_allocated above the
    pre-build baseline (what bench reports), both within 10%."""
    import dtypelab

    report = dtypelab.forecast(task, policies=policies, device="cuda", check=True, batch_search=False,
                               launcher="inline")
    for p in report.policies:
        assert p.status == "ok" and p.check is not None, (p.policy, p.reason, p.notes)
        forecast, measured = p.train.peak_bytes, p.check.train_peak_bytes
        assert abs(forecast / measured - 1) < 0.10, (p.policy, forecast, measured)
        allocated = p.check.process_peak_bytes  # max_memory_allocated: tensors plus cuBLAS's workspace blocks
        assert abs(forecast / allocated - 1) < 0.10, (p.policy, forecast, allocated)
