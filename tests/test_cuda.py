"""CUDA-only paths: run where a GPU is present, skipped cleanly elsewhere."""

from __future__ import annotations

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
    assert len(scaler["grad_scale"]) == 20 and scaler["skipped_steps"] >= 0


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
