from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import fake_hardware

from dtypelab import DtypelabError, HardwareInfo, probe
from dtypelab.core.machine.hardware import resolve_device


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
    from dtypelab.core.machine.rates_probe import kernel_call as _kernel
    from dtypelab.core.machine.rates_probe import timed_gflops as _timed_gflops

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
    real, calls = torch._int_mm, []

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append((a.dtype, b.dtype, tuple(a.shape), torch.backends.mkldnn.enabled))
        return real(a, b)

    monkeypatch.setattr(torch, "_int_mm", spy)
    with torch.backends.mkldnn.flags(enabled=False):
        assert _timed_gflops(fn, 128, lambda: None, 0.01) > 0
    # each timed call is torch._int_mm itself on int8 operands of the probe's size, and the probe leaves the oneDNN
    # flag as the caller set it (no CPU flags given: int8 activations)
    assert len(calls) >= 2 and set(calls) == {(torch.int8, torch.int8, (128, 128), False)}


def test_the_int8_kernels_path_is_read_from_onednns_own_log_and_said_against_the_cpus_int8_units():
    from dtypelab.core.machine.hardware import kernel_path_text
    from dtypelab.core.machine.rates_probe import onednn_path, onednn_primitive

    amx = ("onednn_verbose,v1,info,cpu,isa:Intel AVX-512 with AMX\n"
           "onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src:f32 dst:u8,,256x256,0.01\n"
           "onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx512_core_amx,undef,src:s8 wei:s8,,256x256,0.02\n")
    assert onednn_primitive(amx) == "matmul brg_matmul:avx512_core_amx"
    assert onednn_primitive("onednn_verbose,v1,info,cpu,isa:Intel AVX2\n") == ""
    xeon = replace(fake_hardware(), cpu_flags=("avx512f", "avx512_vnni", "amx_int8"))
    assert kernel_path_text(replace(xeon, kernel_paths={"int8": "matmul brg_matmul:avx512_core_amx"}), "int8") == \
        "on AMX's int8 units (oneDNN matmul brg_matmul:avx512_core_amx)"
    assert kernel_path_text(replace(xeon, kernel_paths={"int8": "matmul gemm:jit"}), "int8") == \
        "not on AMX's int8 units (oneDNN matmul gemm:jit)"
    assert kernel_path_text(replace(xeon, kernel_paths={"int8": ""}), "int8").startswith("not on AMX's int8 units")
    assert kernel_path_text(xeon, "int8") == ""  # not probed: nothing said
    # the probe reads the log of a real call: torch.ao's dynamic linear under the oneDNN engine goes through oneDNN
    import warnings

    previous = torch.backends.quantized.engine
    if "onednn" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch build has no oneDNN quantized engine")
    try:
        torch.backends.quantized.engine = "onednn"
        x = torch.randn(64, 64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            packed = torch.ops.quantized.linear_prepack(torch.quantize_per_tensor(x, 0.05, 0, torch.qint8), None)
        assert onednn_path(lambda: torch.ops.quantized.linear_dynamic(x, packed)).startswith(("matmul ",
                                                                                              "inner_product "))
    finally:
        torch.backends.quantized.engine = previous
