"""What travels between ranks, counted where it is sent: every ``torch.distributed`` collective that DDP's
communication hooks and FSDP2 call (they call them through the ``torch.distributed`` module, so wrapping its
attributes for the duration of the timed steps sees each one with its real tensor), and the link measured.

Bytes are the *payload*: the tensor a rank hands to the collective (for all-gather the gathered whole, for
reduce-scatter the whole input). What a ring algorithm then puts on each rank's link is a multiple of it that
depends on the number of ranks (``wire_factor``): 2(N−1)/N for an all-reduce, (N−1)/N for the other two.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dtypelab.core.measure import StepTimer, device_sync

# name -> (kind, index of the tensor argument that is the payload)
WRAPPED = {"all_reduce": ("all_reduce", 0), "all_gather_into_tensor": ("all_gather", 0),
           "all_gather_single": ("all_gather", 0), "reduce_scatter_tensor": ("reduce_scatter", 1),
           "reduce_scatter_single": ("reduce_scatter", 1), "broadcast": ("broadcast", 0),
           # DDP's per-step buffer broadcast (BatchNorm statistics) goes through this one, from C++ otherwise
           "_broadcast_coalesced": ("broadcast", 1)}


def wire_factor(kind: str, n: int) -> float:
    """Bytes a ring algorithm sends per rank, per byte of payload, on ``n`` ranks."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


def _payload(args: tuple[Any, ...], kwargs: dict[str, Any], index: int) -> int | None:
    names = ("tensor", "output_tensor", "output") if index == 0 else ("input_tensor", "input", "tensors")
    t = args[index] if len(args) > index else next((kwargs[k] for k in names if k in kwargs), None)
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)) and all(isinstance(x, torch.Tensor) for x in t):
        return sum(x.numel() * x.element_size() for x in t)
    return None


@dataclass
class Step:
    """One training step's collectives: payload bytes per kind, their count, and their time in flight."""

    bytes: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    in_flight_s: float = 0.0


class Counter:
    """Counts the collectives issued inside each ``step()`` while ``active()``."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self._lock = threading.Lock()
        self._recording = False

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One training step: what its collectives send is counted as one ``Step``."""
        self.steps.append(Step())
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def _record(self, step: Step, kind: str, nbytes: int) -> None:
        with self._lock:
            step.bytes[kind] = step.bytes.get(kind, 0) + nbytes
            step.calls += 1

    def _done(self, step: Step, start: float) -> None:
        with self._lock:
            step.in_flight_s += time.perf_counter() - start

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        saved = {name: getattr(dist, name) for name in WRAPPED if hasattr(dist, name)}

        def wrap(name: str, fn: Any) -> Any:
            kind, index = WRAPPED[name]

            def counted(*args: Any, **kwargs: Any) -> Any:
                if not self._recording:
                    return fn(*args, **kwargs)
                step, start = self.steps[-1], time.perf_counter()
                nbytes = _payload(args, kwargs, index)
                if nbytes is not None:
                    self._record(step, kind, nbytes)
                work = fn(*args, **kwargs)
                if not hasattr(work, "get_future"):
                    self._done(step, start)
                else:  # async: done when its future completes (the time overlaps the backward pass)
                    work.get_future().then(lambda fut: self._done(step, start))
                return work

            return counted

        for name, fn in saved.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)

    def summary(self, skip: int = 0) -> dict[str, Any]:
        """Medians over the steps after ``skip`` (warm-up; PowerSGD's plain all-reduce steps)."""
        steps = self.steps[skip:] or self.steps
        if not steps:
            return {"bytes": {}, "calls": 0, "in_flight_s": 0.0}
        kinds = sorted({k for s in steps for k in s.bytes})
        return {"bytes": {k: int(statistics.median(s.bytes.get(k, 0) for s in steps)) for k in kinds},
                "calls": int(statistics.median(s.calls for s in steps)),
                "in_flight_s": statistics.median(s.in_flight_s for s in steps)}


def measure_link(device: torch.device, group: Any = None, nbytes: int = 8 << 20, reps: int = 7) -> dict[str, float]:
    """The link between these ranks, from timed all-reduces: latency (a 4-byte all-reduce) and the bandwidth in
    Gbit/s a ring all-reduce of ``nbytes`` achieves (wire bytes per rank / time). All ranks must call it."""
    n = dist.get_world_size(group)

    def timed(t: torch.Tensor) -> float:
        dist.all_reduce(t, group=group)  # warm-up
        timer = StepTimer(sync=device_sync(device))
        for _ in range(reps):
            dist.barrier(group=group)
            timer.start()
            dist.all_reduce(t, group=group)
            timer.stop()
        # the slowest rank's median: a collective ends when the last rank is done
        mine = torch.tensor([statistics.median(timer.samples)], dtype=torch.float64, device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
        return float(mine)

    latency = timed(torch.zeros(1, device=device))
    big = timed(torch.zeros(nbytes // 4, device=device))
    wire = wire_factor("all_reduce", n) * nbytes
    return {"latency_s": latency, "gbps": wire * 8 / max(big - latency, 1e-9) / 1e9, "probe_bytes": nbytes}
