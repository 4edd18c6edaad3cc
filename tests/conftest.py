from __future__ import annotations

import os
import sys

import pytest
import torch

from dtypelab.core.hardware import HardwareInfo

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "tiny_task.py")
sys.path.insert(0, HERE)


def fake_hardware(fp16_gflops: float = 0.5, device: str = "cpu", **kernels: float) -> HardwareInfo:
    """A CPU like the build machines: fast bf16, no native fp16. Skips the ~1 s probe in tests. ``kernels``:
    quantized kernels' GFLOP/s by probe key (``int8=2.0``; dashes as underscores)."""
    gflops = {"float64": 40.0, "float32": 100.0, "bfloat16": 250.0, "float16": fp16_gflops}
    gflops.update({k.replace("_", "-"): v for k, v in kernels.items()})
    return HardwareInfo(device=device, device_name="test cpu", cpu_name="test cpu",
                        cpu_flags=("avx512f", "avx512_bf16"), cpu_capability="AVX512",
                        cuda_capability=None, threads=torch.get_num_threads(), gflops=gflops)


@pytest.fixture
def hw() -> HardwareInfo:
    return fake_hardware()


@pytest.fixture
def tiny() -> str:
    return f"{TINY}:make_task"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
