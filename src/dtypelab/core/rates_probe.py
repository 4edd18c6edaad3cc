"""What the hardware probe measures for a forecast of step time, beside its matmul rates: a large copy's bandwidth,
an elementwise op's bytes per second per dtype, and the time per op of a tiny training step."""

from __future__ import annotations

import time
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
