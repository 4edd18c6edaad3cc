"""What this machine can do: CPU flags, CUDA capability and measured matmul throughput per dtype."""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from dtypelab.core.disturbance import CpuMeter, describe
from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.devices import rated_peaks
from dtypelab.core.machine.rates_probe import (
    bandwidth_gbs,
    elementwise_gbs,
    kernel_call,
    matmul_gflops,
    onednn_path,
    op_floor_us,
    timed_gflops,
)
from dtypelab.core.results.store import read_json
from dtypelab.core.version import __version__

# CPU flags that decide whether a low-precision format is computed natively or converted around fp32.
RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
                  "amx_bf16", "amx_fp16", "amx_int8", "asimd", "asimddp", "bf16", "fphp", "asimdhp")
PROBE_DTYPES = ("float64", "float32", "bfloat16", "float16")
# The kernels the quantized inference policies run, timed like the dtypes (GFLOP/s counted as 2·n³ per n×n
# product, so they compare with float32's matmul). "int8": the int8 × int8 → int32 matmul torchao's eager
# dynamic-quantization path calls on CPU and CUDA (torch._int_mm: oneDNN with VNNI, else a plain loop);
# "int8-fbgemm": torch.ao's packed dynamic linear; the weight-only ones: weights converted to float32 for
# every call, then a float32 matmul, as torchao 0.18 runs them on CPU.
KERNEL_PROBES = ("fp8", "int8", "int8-fbgemm", "int8-weight-only", "fp8-weight-only")
INT8_KERNELS = ("int8", "int8-fbgemm")  # a CPU's: which oneDNN primitive (if any) runs each is probed
KERNEL_LABELS = {
    "fp8": "float8 e4m3 × e4m3 matmul (torch._scaled_mm: tensor cores, bfloat16 out)",
    "int8": "int8 × int8 matmul (torch._int_mm, torchao's eager path)",
    "int8-fbgemm": "torch.ao dynamic int8 linear (fbgemm/x86)",
    "int8-weight-only": "int8 weight-only linear (weights to float32 per call)",
    "fp8-weight-only": "fp8 weight-only linear (weights to float32 per call)",
}
# A policy whose compute dtype (or kernel) runs below this fraction of fp32 throughput is "pathologically slow".
SLOW_RATIO = 0.1

# the datasheets' dense peaks (what the probe and --profile report achieved FLOP/s against: MFU) live with the device
# table: core.machine.devices.DEVICES (each row's rates)


@dataclass(frozen=True)
class HardwareInfo:
    device: str
    device_name: str
    cpu_name: str
    cpu_flags: tuple[str, ...]
    cpu_capability: str
    cuda_capability: tuple[int, int] | None
    threads: int
    gflops: dict[str, float] = field(default_factory=dict)  # dtype name, "tf32" or a KERNEL_PROBES key -> GFLOP/s
    # What other processes did during the probe when they disturbed it even after re-probing ("" when quiet): its
    # figures then decide nothing on their own (no policy is skipped as slow, nor run because it looked fast).
    disturbed: str = ""
    rated_tflops: dict[str, float] = field(default_factory=dict)  # the datasheet's dense peaks (GPUs it knows)
    rated_source: str = ""  # which datasheet they are from
    # what a forecast of speed on this device is made from, beside the matmul rates: a large copy's bytes read and
    # written per second, and the time of one small op (dispatch and launch); None in probes made before them
    bandwidth_gbs: float | None = None
    op_floor_us: float | None = None
    # a CPU's matmul GFLOP/s at smaller sizes than ``gflops``' (n: GFLOP/s per dtype): how far below its rate small
    # matmuls run there, which a forecast of speed on this CPU reads as its efficiency curve
    small_gflops: dict[str, dict[str, float]] = field(default_factory=dict)  # keyed by str(n): as JSON keeps it
    # a CPU's elementwise GB/s per dtype (an add's bytes read and written): a bfloat16 op does not move its half-size
    # elements twice as fast there when the CPU converts them to compute
    elementwise_gbs: dict[str, float] = field(default_factory=dict)
    # a CPU's int8 kernels (a KERNEL_PROBES key): the oneDNN primitive that ran it ("matmul brg_matmul:avx512_core_amx":
    # its name says whether AMX's or VNNI's int8 units did the work), or "" when none did (torch's loop, fbgemm)
    kernel_paths: dict[str, str] = field(default_factory=dict)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def native(self, dtype: str) -> bool | None:
        """Whether the device computes in this format natively (None: unknown or not an arithmetic type)."""
        if dtype in ("float32", "float64"):
            return True
        fp8 = dtype in ("float8_e4m3fn", "float8_e5m2", "fp8")
        if self.is_cuda:
            cc = self.cuda_capability or (0, 0)
            return {"float16": cc >= (5, 3), "bfloat16": cc >= (8, 0), "tf32": cc >= (8, 0),
                    "int8": cc >= (6, 1)}.get(dtype, cc >= (8, 9) if fp8 else None)
        flags = set(self.cpu_flags)
        if dtype in ("tf32", "fp8", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
            return False  # no CPU instruction set computes these; PyTorch converts around float32
        if dtype in ("int8", "uint8"):  # int8 dot products: VNNI / AMX (torch._int_mm needs them for oneDNN)
            return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"})
        if dtype == "bfloat16":
            return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
        if dtype == "float16":
            return bool(flags & {"avx512_fp16", "amx_fp16", "fphp", "asimdhp"})
        return None

    def rated(self, key: str) -> float | None:
        """The datasheet's dense peak for a probe key, in GFLOP/s (None: not rated, or an unknown device)."""
        t = self.rated_tflops.get(key)
        return t * 1e3 if t else None

    def slow_reason(self, dtype: str) -> str | None:
        """A measured reason why computing in dtype here is pathologically slow, or None."""
        fast, ref = self.gflops.get(dtype), self.gflops.get("float32")
        if fast is None or not ref or fast >= SLOW_RATIO * ref:
            return None
        what = "GPU" if self.is_cuda else "CPU"
        if dtype in KERNEL_LABELS:
            lack = f"the {KERNEL_LABELS[dtype]} is slow on this {what}" + (
                " (no VNNI/AMX int8 instructions)" if self.native(dtype) is False else "")
        else:
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
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}  # a newer file's extra fields
        d["cpu_flags"] = tuple(d.get("cpu_flags", ()))
        cc = d.get("cuda_capability")
        d["cuda_capability"] = tuple(cc) if cc else None
        return cls(**d)


# Variables that change what a built-in task is (its size, where its weights come from): a record keeps those set
TASK_SETTINGS = ("DTYPELAB_GPT2_SIZE", "DTYPELAB_MINILM_DIR")


def environment(hw: HardwareInfo) -> dict[str, Any]:
    """Versions and hardware, kept in every record (and the task settings, when any is set)."""
    settings = {k: os.environ[k] for k in TASK_SETTINGS if os.environ.get(k)}
    return {
        "dtypelab": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "cuda": torch.version.cuda, "hardware": hw.to_dict(),
        # how this process was started: the exact command line for the CLI, the script and its arguments else
        "command": shlex.join([os.path.basename(sys.argv[0]), *sys.argv[1:]]) if sys.argv and sys.argv[0] else "",
        **({"task_settings": settings} if settings else {}),
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


def probe(device: str | torch.device | None = None, budget_s: float = 0.1, speed: bool = False) -> HardwareInfo:
    """Describe the device and measure matmul GFLOP/s per dtype and per quantized kernel (about 1 s on CPU); with
    ``speed``, also what a forecast of step time reads (bandwidth, elementwise rates, small matmuls, per-op time)."""
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    cpu_name, flags = _cpu_info()
    cc, name = None, cpu_name
    if dev.type == "cuda":
        cc = torch.cuda.get_device_capability(dev)
        name = torch.cuda.get_device_name(dev)
    gflops: dict[str, float] = {}
    # a GPU needs large products to approach its peak (launch overhead hides the tensor cores below ~4096)
    n = 8192 if dev.type == "cuda" else 256
    for dtype_name in PROBE_DTYPES:
        size = min(n, 4096) if dtype_name == "float64" else n  # a consumer GPU's float64 is 1/64 rate
        gflops[dtype_name] = matmul_gflops(getattr(torch, dtype_name), dev, size, budget_s)
    small: dict[str, dict[str, float]] = {}
    elementwise: dict[str, float] = {}
    if dev.type == "cpu" and speed:  # the curve below the probe's size: small matmuls run far from a CPU's rate too
        for dtype_name in ("float32", "bfloat16", "float16"):
            elementwise[dtype_name] = round(elementwise_gbs(getattr(torch, dtype_name), dev, budget_s / 2), 2)
            small[dtype_name] = {str(m): round(matmul_gflops(getattr(torch, dtype_name), dev, m, budget_s / 4), 3)
                                 for m in (16, 32, 64, 128)}
    if dev.type == "cuda" and cc >= (8, 0):
        prev = torch.backends.cuda.matmul.fp32_precision
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        try:
            gflops["tf32"] = matmul_gflops(torch.float32, dev, n, budget_s)
        finally:
            torch.backends.cuda.matmul.fp32_precision = prev
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    paths: dict[str, str] = {}
    for key in KERNEL_PROBES:
        try:
            fn = kernel_call(key, dev, n, flags)
            if fn is not None:
                gflops[key] = timed_gflops(fn, n, sync, budget_s)
                if dev.type == "cpu" and key in INT8_KERNELS:  # one call, its log read
                    paths[key] = onednn_path(fn)
        except (RuntimeError, NotImplementedError, AttributeError):
            pass  # this torch build lacks the kernel (no quantized engine, no _int_mm): the policy says so itself
    source, rated = rated_peaks(name) if dev.type == "cuda" else ("", {})
    return HardwareInfo(
        device=str(dev), device_name=name, cpu_name=cpu_name, cpu_flags=flags,
        cpu_capability=torch.backends.cpu.get_cpu_capability(), cuda_capability=cc,
        threads=torch.get_num_threads(), gflops={k: round(v, 3) for k, v in gflops.items()},
        rated_tflops=rated, rated_source=source,
        bandwidth_gbs=round(bandwidth_gbs(dev, sync, budget_s), 2) if speed else None,
        op_floor_us=round(op_floor_us(dev, sync), 3) if speed else None, small_gflops=small,
        elementwise_gbs=elementwise, kernel_paths=paths,
    )


def kernel_path_text(hw: HardwareInfo, key: str) -> str:
    """Whether a CPU's int8 kernel reached its int8 units, in words ("" when it was not probed)."""
    if key not in hw.kernel_paths:
        return ""
    path, flags = hw.kernel_paths[key], set(hw.cpu_flags)
    units = "AMX" if "amx" in path else "VNNI" if "vnni" in path else ""
    if units:
        return f"on {units}'s int8 units (oneDNN {path})"
    missed = "AMX" if "amx_int8" in flags else "VNNI" if flags & {"avx512_vnni", "avx_vnni"} else ""
    ran = f"oneDNN {path}" if path else "no oneDNN primitive: torch's own loop or fbgemm"
    return f"not on {missed}'s int8 units ({ran})" if missed else f"no int8 units here ({ran})"


PROBE_RETRIES = 2  # re-probes while other processes disturb it
PROBE_PAUSE_S = 0.5  # between them: a bursty neighbour may have finished its burst


def measured_probe(device: str | torch.device | None = None, budget_s: float = 0.1,
                   retries: int = PROBE_RETRIES, speed: bool = False) -> HardwareInfo:
    """``probe``, watched for other processes: re-taken while they disturb it, and marked ``disturbed`` when they
    still do, so that its figures are never the sole reason to skip a policy or to run one."""
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    for attempt in range(retries + 1):
        meter = CpuMeter()
        meter.start()
        hw = probe(dev, budget_s, speed)
        busy = meter.stop()
        if busy is None or not busy.disturbed:
            return hw
        if attempt < retries:
            time.sleep(PROBE_PAUSE_S)
    tries = f"{retries + 1} probes" if retries else "the probe"
    return replace(hw, disturbed=f"{describe(busy)} during {tries}")


def load_hardware(path: str) -> HardwareInfo:
    """A saved probe: ``dtypelab hardware --json FILE``, or any dtypelab record (its environment's hardware)."""
    data: Any = read_json(path, "hardware file")
    if isinstance(data, dict) and isinstance(data.get("environment"), dict):
        data = data["environment"].get("hardware")
    if not isinstance(data, dict) or not isinstance(data.get("gflops"), dict) or "device" not in data:
        raise DtypelabError(f"{path} holds no hardware probe (write one with: dtypelab hardware --json FILE)")
    try:
        return HardwareInfo.from_dict(data)
    except TypeError as exc:
        raise DtypelabError(f"{path}: not a hardware probe ({exc})") from None


def hardware_for(device: str | torch.device | None, given: HardwareInfo | str | None = None,
                 budget_s: float = 0.1) -> HardwareInfo:
    """The hardware a command decides with: ``given`` (a HardwareInfo, or a file for ``load_hardware``), else a
    ``measured_probe`` of ``device``. A given probe of another kind of device than the run's is an error."""
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    if given is None:
        return measured_probe(dev, budget_s)
    hw = load_hardware(given) if isinstance(given, str) else given
    if torch.device(hw.device).type != dev.type:
        raise DtypelabError(f"the hardware probe given describes {hw.device} ({hw.device_name}); this run is on "
                            f"{dev}")
    return hw


def probe_notice(hardware: HardwareInfo, what: str = "policy",
                 instead: str = "each policy's own steps decide (a run 10x slower than fp32 stops after a few steps)"
                 ) -> str:
    """What a disturbed probe means for a sweep (or a search: ``what``, ``instead``), or "" when it was quiet."""
    if not hardware.disturbed:
        return ""
    return (f"the hardware probe was disturbed ({hardware.disturbed}): no {what} is skipped as slow on its figures; "
            f"{instead}")
