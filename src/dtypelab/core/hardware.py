"""What this machine can do: CPU flags, CUDA capability and measured matmul throughput per dtype."""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dtypelab.core.errors import DtypelabError

# CPU flags that decide whether a low-precision format is computed natively or converted around fp32.
RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
                  "amx_bf16", "amx_fp16", "amx_int8", "asimd", "asimddp", "bf16", "fphp", "asimdhp")
PROBE_DTYPES = ("float64", "float32", "bfloat16", "float16")
# A policy whose compute dtype runs below this fraction of fp32 throughput is "pathologically slow".
SLOW_RATIO = 0.1


@dataclass(frozen=True)
class HardwareInfo:
    device: str
    device_name: str
    cpu_name: str
    cpu_flags: tuple[str, ...]
    cpu_capability: str
    cuda_capability: tuple[int, int] | None
    threads: int
    gflops: dict[str, float] = field(default_factory=dict)  # dtype name (or "tf32") -> GFLOP/s

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def native(self, dtype: str) -> bool | None:
        """Whether the device computes in this format natively (None: unknown or not an arithmetic type)."""
        if dtype in ("float32", "float64"):
            return True
        fp8 = dtype in ("float8_e4m3fn", "float8_e5m2")
        if self.is_cuda:
            cc = self.cuda_capability or (0, 0)
            return {"float16": cc >= (5, 3), "bfloat16": cc >= (8, 0), "tf32": cc >= (8, 0),
                    "int8": cc >= (6, 1)}.get(dtype, cc >= (8, 9) if fp8 else None)
        flags = set(self.cpu_flags)
        if dtype in ("tf32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
            return False  # no CPU instruction set computes these; PyTorch converts around float32
        if dtype in ("int8", "uint8"):  # int8 dot products: VNNI / AMX
            return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"})
        if dtype == "bfloat16":
            return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
        if dtype == "float16":
            return bool(flags & {"avx512_fp16", "amx_fp16", "fphp", "asimdhp"})
        return None

    def slow_reason(self, dtype: str) -> str | None:
        """A measured reason why computing in dtype here is pathologically slow, or None."""
        fast, ref = self.gflops.get(dtype), self.gflops.get("float32")
        if fast is None or not ref or fast >= SLOW_RATIO * ref:
            return None
        what = "GPU" if self.is_cuda else "CPU"
        lack = f"this {what} has no native {dtype} arithmetic" if self.native(dtype) is False else (
            f"{dtype} is slow on this {what}")
        return f"{lack} (measured {fast:.3g} GFLOP/s vs {ref:.3g} for float32, {ref / fast:.0f}x slower)"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (lists, not tuples), so a record equals its own JSON round trip."""
        d = asdict(self)
        d["cpu_flags"] = list(self.cpu_flags)
        d["cuda_capability"] = list(self.cuda_capability) if self.cuda_capability else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HardwareInfo:
        d = dict(d)
        d["cpu_flags"] = tuple(d.get("cpu_flags", ()))
        cc = d.get("cuda_capability")
        d["cuda_capability"] = tuple(cc) if cc else None
        return cls(**d)


def environment(hw: HardwareInfo) -> dict[str, Any]:
    """Versions and hardware, kept in every record."""
    from dtypelab import __version__

    return {
        "dtypelab": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "cuda": torch.version.cuda, "hardware": hw.to_dict(),
    }


def resolve_device(device: str | None) -> torch.device:
    """The device to measure on: the one asked for, else CUDA when present, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise DtypelabError(f"invalid device {device!r}: use cpu, cuda or cuda:N") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DtypelabError("--device cuda asked for, but this torch build sees no CUDA GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DtypelabError(f"no CUDA device {dev.index}: this machine has {torch.cuda.device_count()}")
    elif dev.type != "cpu":
        raise DtypelabError(f"unsupported device {device!r}: dtypelab measures on cpu or cuda")
    return dev


def _cpu_info() -> tuple[str, tuple[str, ...]]:
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and not name:
                    name = value.strip()
                elif key in ("flags", "Features"):
                    flags.update(value.split())
    except OSError:
        pass  # not Linux: flags unknown, the measured throughput still decides
    return name or platform.processor() or platform.machine(), tuple(f for f in RELEVANT_FLAGS if f in flags)


def _matmul_gflops(dtype: torch.dtype, device: torch.device, n: int, budget_s: float) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # warm-up: kernel selection, lazy init
    sync()
    reps, start = 0, time.perf_counter()
    while True:  # at least two reps; stop once the budget is spent, however slow the dtype
        a @ b
        sync()
        reps += 1
        elapsed = time.perf_counter() - start
        if reps >= 2 and elapsed >= budget_s:
            return 2 * n**3 * reps / elapsed / 1e9


def probe(device: str | torch.device | None = None, budget_s: float = 0.15) -> HardwareInfo:
    """Describe the device and measure matmul GFLOP/s per dtype (about 1 s on CPU)."""
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    cpu_name, flags = _cpu_info()
    cc, name = None, cpu_name
    if dev.type == "cuda":
        cc = torch.cuda.get_device_capability(dev)
        name = torch.cuda.get_device_name(dev)
    gflops: dict[str, float] = {}
    n = 2048 if dev.type == "cuda" else 256
    for dtype_name in PROBE_DTYPES:
        gflops[dtype_name] = _matmul_gflops(getattr(torch, dtype_name), dev, n, budget_s)
    if dev.type == "cuda" and cc >= (8, 0):
        prev = torch.backends.cuda.matmul.fp32_precision
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        try:
            gflops["tf32"] = _matmul_gflops(torch.float32, dev, n, budget_s)
        finally:
            torch.backends.cuda.matmul.fp32_precision = prev
    return HardwareInfo(
        device=str(dev), device_name=name, cpu_name=cpu_name, cpu_flags=flags,
        cpu_capability=torch.backends.cpu.get_cpu_capability(), cuda_capability=cc,
        threads=torch.get_num_threads(), gflops={k: round(v, 3) for k, v in gflops.items()},
    )
