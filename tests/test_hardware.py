from __future__ import annotations

import pytest
import torch
from conftest import fake_hardware

from dtypelab import DtypelabError, HardwareInfo, probe
from dtypelab.core.hardware import resolve_device


def test_probe_measures_every_dtype_quickly():
    hw = probe("cpu", budget_s=0.01)
    assert set(hw.gflops) >= {"float64", "float32", "bfloat16", "float16"}
    # the quantized inference policies' kernels, measured like the dtypes
    assert set(hw.gflops) >= {"int8", "int8-fbgemm", "int8-weight-only", "fp8-weight-only"}
    assert all(v > 0 for v in hw.gflops.values())
    assert hw.device == "cpu" and hw.threads == torch.get_num_threads()
    assert HardwareInfo.from_dict(hw.to_dict()) == hw


def test_native_format_detection_from_flags():
    hw = fake_hardware()
    assert hw.native("bfloat16") is True and hw.native("float16") is False
    gpu = HardwareInfo("cuda:0", "gpu", "cpu", (), "AVX2", (7, 0), 1, {})
    assert gpu.native("float16") is True and gpu.native("bfloat16") is False and gpu.native("tf32") is False


def test_slow_reason_only_below_a_tenth_of_fp32():
    assert fake_hardware(fp16_gflops=11.0).slow_reason("float16") is None
    reason = fake_hardware(fp16_gflops=0.4).slow_reason("float16")
    assert reason == ("this CPU has no native float16 arithmetic "
                      "(measured 0.4 GFLOP/s vs 100 for float32, 250x slower)")


def test_resolve_device_errors():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DtypelabError, match="invalid device"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(DtypelabError, match="sees no CUDA GPU"):
            resolve_device("cuda")


def test_a_slow_int8_kernel_is_explained_with_its_figures():
    hw = fake_hardware(int8=3.0, int8_fbgemm=150.0)
    reason = hw.slow_reason("int8")
    assert reason.startswith("the int8 × int8 matmul (torch._int_mm, torchao's eager path) is slow on this CPU")
    assert "measured 3 GFLOP/s vs 100 for float32, 33x slower" in reason
    assert hw.slow_reason("int8-fbgemm") is None


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_int8_kernel_probe_follows_torch_int_mm_when_onednn_is_off(monkeypatch):
    """Without oneDNN, torch._int_mm runs a plain loop (what a CPU without VNNI gets whatever the flag): the probe
    times torch._int_mm itself, on the operands torchao's path gives it, so it sees whatever oneDNN does (the speed
    difference itself, 3 vs 500 GFLOP/s on a VNNI CPU, is a benchmark's: benchmarks/int8_minilm.py)."""
    from dtypelab.core.rates_probe import kernel_call as _kernel
    from dtypelab.core.rates_probe import timed_gflops as _timed_gflops

    fn = _kernel("int8", torch.device("cpu"), 128, ())
    # the operands the probe draws (its seeded generator, in its order): what torch._int_mm must give for them
    g = torch.Generator().manual_seed(0)
    torch.randn(128, 128, generator=g)
    w8 = torch.randint(-127, 128, (128, 128), generator=g, dtype=torch.int8)
    rows = (torch.rand(128, generator=g) / 64).unsqueeze(1)
    a = torch.randint(-127, 128, (128, 128), generator=g, dtype=torch.int8)
    exact = (a.to(torch.int64) @ w8.to(torch.int64).t()).to(torch.float32) * rows
    assert torch.equal(fn(), exact)  # the probe times the int8 x int8 matmul itself, exactly
    with torch.backends.mkldnn.flags(enabled=False):
        assert torch.equal(fn(), exact)  # the same numbers from the plain loop
    assert torch.backends.mkldnn.enabled  # the flag is restored
    real, calls = torch._int_mm, []

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append((a.dtype, torch.backends.mkldnn.enabled))
        return real(a, b)

    monkeypatch.setattr(torch, "_int_mm", spy)
    assert _timed_gflops(fn, 128, lambda: None, 0.01) > 0
    with torch.backends.mkldnn.flags(enabled=False):
        fn()
    # each timed call is torch._int_mm itself, under the flag in force (no CPU flags given: int8 activations)
    assert {d for d, _ in calls} == {torch.int8} and len(calls) >= 2
    assert calls[-1][1] is False and all(on for _, on in calls[:-1])
