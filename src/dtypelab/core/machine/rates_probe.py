"""What the hardware probe times: matmuls per dtype and the kernels quantized policies run (GFLOP/s), and for a
forecast of step time a large copy's bandwidth, an elementwise op's bytes per second per dtype, and the time per op
of a tiny training step."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch


def bandwidth_gbs(dev: torch.device, sync: Callable[[], None], budget_s: float) -> float:
    """GB/s a large copy moves (bytes read plus bytes written): 64 MiB on a CPU, past its caches; 1 GiB on a GPU."""
    n = (2**28 if dev.type == "cuda" else 2**24)  # float32 elements
    src, dst = torch.ones(n, device=dev), torch.empty(n, device=dev)
    dst.copy_(src)
    sync()
    reps, start = 0, time.perf_counter()
    while True:
        dst.copy_(src)
        sync()
        reps += 1
        elapsed = time.perf_counter() - start
        if reps >= 3 and elapsed >= budget_s:
            return 2 * 4 * n * reps / elapsed / 1e9


def elementwise_gbs(dtype: torch.dtype, dev: torch.device, budget_s: float) -> float:
    """GB/s an elementwise add of 4 Mi elements moves (two read, one written) in ``dtype``."""
    n = 2**22
    a, b = torch.ones(n, device=dev, dtype=dtype), torch.ones(n, device=dev, dtype=dtype)
    c = torch.empty_like(a)
    torch.add(a, b, out=c)
    reps, start = 0, time.perf_counter()
    while True:
        torch.add(a, b, out=c)
        reps += 1
        elapsed = time.perf_counter() - start
        if reps >= 3 and elapsed >= budget_s:
            return 3 * n * a.element_size() * reps / elapsed / 1e9


def op_floor_us(dev: torch.device, sync: Callable[[], None]) -> float:
    """µs per op of a training step too small for any op to take time of its own: a 3-layer MLP 8 wide, its forward,
    backward and Adam update, timed (median of 9 rounds of 10 steps) and divided by the ops it dispatches. What each
    op costs beyond its arithmetic there (dispatch, allocation, autograd's and the modules' bookkeeping, launch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.n += 1
            return func(*args, **(kwargs or {}))

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 1)).to(dev)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(4, 8, device=dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    for _ in range(3):
        step()
    with Count():
        step()
    times = []
    for _ in range(9):
        sync()
        start = time.perf_counter()
        for _ in range(10):
            step()
        sync()
        times.append((time.perf_counter() - start) / 10)
    return sorted(times)[4] / max(1, Count.n) * 1e6


def matmul_gflops(dtype: torch.dtype, device: torch.device, n: int, budget_s: float) -> float:
    """GFLOP/s of an n×n matmul in ``dtype``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return timed_gflops(lambda: a @ b, n, sync, budget_s)


def timed_gflops(fn: Callable[[], Any], n: int, sync: Callable[[], None], budget_s: float) -> float:
    """GFLOP/s of ``fn`` counted as an n×n matmul, after one warm-up call, over at least ``budget_s``."""
    fn()  # warm-up: kernel selection, lazy init, weight packing
    sync()
    reps, start = 0, time.perf_counter()
    while True:  # at least two reps; stop once the budget is spent, however slow the kernel
        fn()
        sync()
        reps += 1
        elapsed = time.perf_counter() - start
        if reps >= 2 and elapsed >= budget_s:
            return 2 * n**3 * reps / elapsed / 1e9


def kernel_call(key: str, dev: torch.device, n: int, flags: tuple[str, ...]) -> Callable[[], Any] | None:
    """A zero-argument call of the kernel a quantized policy runs, on n×n operands; None where it has none."""
    g = torch.Generator().manual_seed(0)
    if key == "fp8":
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev) < (8, 9):
            return None  # no float8 tensor cores: the fp8 policies say so themselves
        a8 = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
        b8 = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()  # _scaled_mm wants it column-major
        one = torch.ones((), device=dev)
        return lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    if dev.type != "cpu" and key != "int8":
        return None  # the other kernels are CPU paths here; CUDA runs its own
    x = torch.randn(n, n, generator=g).to(dev)
    w8 = torch.randint(-127, 128, (n, n), generator=g, dtype=torch.int8).to(dev)
    scales = (torch.rand(n, generator=g) / 64).to(dev)
    if key == "int8":
        a = torch.randint(-127, 128, (n, n), generator=g, dtype=torch.int8).to(dev)
        rows = scales.unsqueeze(1)
        if dev.type == "cpu" and set(flags) & {"avx512_vnni", "avx_vnni"} and "amx_int8" not in flags:
            # torchao's CPU path on VNNI without AMX: shifted to uint8 (u8s8), the form VNNI multiplies; torch 2.11's
            # _int_mm takes int8 only (it refuses uint8), and then the signed form is what runs
            u8 = (a.to(torch.int32) + 128).to(torch.uint8)
            try:
                torch._int_mm(u8[:32, :32], w8[:32, :32].t())
                a = u8
            except RuntimeError:
                pass
        return lambda: torch._int_mm(a, w8.t()).to(torch.float32) * rows
    if key == "int8-fbgemm":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's quantized tensors are deprecated: that is the point
            packed = torch.ops.quantized.linear_prepack(torch.quantize_per_tensor(x, 0.05, 0, torch.qint8), None)
        return lambda: torch.ops.quantized.linear_dynamic(x, packed)
    if key == "int8-weight-only":
        return lambda: (x @ w8.to(torch.float32).t()) * scales
    if key == "fp8-weight-only":
        w = x.to(torch.float8_e4m3fn)
        return lambda: x @ (w.to(torch.float32) * scales.unsqueeze(1)).t()
    return None


def onednn_path(fn: Callable[[], Any]) -> str:
    """Which oneDNN primitive runs ``fn`` (a CPU kernel call), from oneDNN's own verbose log: "matmul
    brg_matmul:avx512_core_amx" (its implementation names the instructions: amx, vnni, avx2…), or "" when no
    oneDNN primitive ran (torch's own loop, or fbgemm). The log goes to the process's stdout, so that descriptor is
    redirected to a file for the one call."""
    import os
    import sys
    import tempfile

    with tempfile.TemporaryFile(mode="w+b") as log:
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            os.dup2(log.fileno(), 1)
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                fn()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        text = log.read().decode(errors="replace")
    return onednn_primitive(text)


def onednn_primitive(log: str) -> str:
    """The heaviest primitive a oneDNN verbose log shows executed: a matmul or inner product (else the last
    primitive), as "KIND IMPLEMENTATION"; "" when it shows none."""
    ran = []
    for line in log.splitlines():
        fields = line.split(",")
        # onednn_verbose,v1,primitive,exec,cpu,KIND,IMPLEMENTATION,...
        if len(fields) > 6 and fields[0] == "onednn_verbose" and fields[2:4] == ["primitive", "exec"]:
            ran.append((fields[5], fields[6]))
    heavy = [r for r in ran if r[0] in ("matmul", "inner_product", "convolution")] or ran
    return " ".join(heavy[-1]) if heavy else ""
