from __future__ import annotations

import pytest
import torch
from conftest import fake_hardware

from dtypelab import DtypelabError, HardwareInfo, probe
from dtypelab.core.hardware import resolve_device


def test_probe_measures_every_dtype_quickly():
    hw = probe("cpu", budget_s=0.01)
    assert set(hw.gflops) >= {"float64", "float32", "bfloat16", "float16"}
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
