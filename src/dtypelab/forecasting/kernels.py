"""The heavy kernels of a traced step, timed on this machine at their own calls.

Where the forecast's device is the machine it runs on (``--device cpu``), a matmul's, an attention's or a
convolution's time is not read off a rate: the call the trace saw (``Op.kernel``: the aten op, its overload, each
argument with every tensor as its shape, strides and dtype) is run here on random tensors and timed. A kernel's
speed on a CPU depends on its shape and dtype far more than one rate says (a bfloat16 flash-attention backward ran
10x slower than float32's on a Xeon whose bfloat16 matmuls run at 0.44x), so the rest of the time model (bytes,
fusion, the per-kernel floor) is what the CPU check then checks.

A call is timed once per process, whichever policy's trace saw it; calls whose tensors would not fit in ``MAX_BYTES``
and any left when the time budget runs out keep the rate model's time (the caller says how many). Once every policy
is traced, ``retime`` times them all again in interleaved rounds under a ``CpuMeter``: each keeps its fastest call
(another process's burst slows calls, never speeds one), and no policy's kernels are timed in one burst while
another's are timed in quiet; the rounds say whether the machine stayed too busy to time at all.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_map

from dtypelab.core.disturbance import Disturbance, until_quiet

MAX_BYTES = 1 << 30  # the most a kernel's tensors may take to be timed here (bytes)
REPEATS = 5  # timed calls per kernel, at most (the fastest is kept)
ROUNDS = 3  # ``retime``'s interleaved rounds over every kernel, at most
ENOUGH_S = 0.05  # fewer calls once this much time was spent on one kernel


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument as the trace saw it: enough to make one like it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True) if n)
        return span * self.dtype.itemsize if all(self.shape) else 0


def _frozen(x: Any) -> Any:
    """A hashable copy of an argument: tensors as their specs, lists as tuples."""
    if isinstance(x, torch.Tensor):
        if type(x) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) and not isinstance(x, FakeTensor):
            raise TypeError("a tensor subclass")  # its kernel is its inner tensors' ops (the trace records those)
        return TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_frozen(v) for v in x)
    if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.memory_format, torch.layout)):
        return x
    if isinstance(x, torch.device):
        return None  # replayed on this machine's CPU
    raise TypeError(type(x).__name__)


def signature(func: Any, args: Any, kwargs: dict[str, Any]) -> tuple:
    """The call as a hashable, picklable key that ``replay`` can run again; () for one it cannot (a tensor subclass,
    an argument of another kind)."""
    try:
        return (func.name(), func._overloadname, _frozen(tuple(args)), tuple(sorted(
            (k, _frozen(v)) for k, v in kwargs.items() if k != "device")))
    except TypeError:
        return ()


def _make(spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    t = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype)
    if spec.dtype.is_floating_point and spec.dtype.itemsize >= 2:
        t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
    elif spec.dtype.is_floating_point:  # float8: made from float32
        t.copy_((torch.randn(t.shape, generator=gen) * 0.1).to(spec.dtype))
    elif spec.dtype == torch.bool:
        t.fill_(True)
    else:
        t.copy_(torch.randint(-4, 4, t.shape, generator=gen).to(spec.dtype))
    return t


def _bytes(key: tuple) -> int:
    leaves, _ = tree_flatten((key[2], key[3]))
    return sum(x.nbytes for x in leaves if isinstance(x, TensorSpec))


def replay(key: tuple) -> Any:
    """A function that runs the call again on random tensors of its specs (made once)."""
    name, overload, args, kwargs = key
    namespace, op = name.split("::")
    func = getattr(getattr(getattr(torch.ops, namespace), op), overload)
    gen = torch.Generator().manual_seed(0)
    real_args, real_kwargs = tree_map(lambda x: _make(x, gen) if isinstance(x, TensorSpec) else x,
                                      (_thawed(args), dict(kwargs)))
    return lambda: func(*real_args, **real_kwargs)


def _thawed(x: Any) -> Any:
    """Tuples back to lists (an aten schema's int[], bool[] and Tensor[] all take one)."""
    return [_thawed(v) for v in x] if isinstance(x, tuple) else x


def time_kernels(keys: Iterable[tuple], done: dict[tuple, float], budget_s: float) -> tuple[int, int]:
    """Time each key not already in ``done`` (seconds per call, the fastest of up to ``REPEATS`` after one warm-up),
    until ``budget_s`` is spent. Returns (timed now, left untimed)."""
    start = time.perf_counter()
    timed = left = 0
    with torch.no_grad():
        for key in dict.fromkeys(keys):
            if not key or key in done:
                continue
            if time.perf_counter() - start > budget_s or _bytes(key) > MAX_BYTES:
                left += 1
                continue
            try:
                call = replay(key)
                t0 = time.perf_counter()
                call()  # warm-up: the first call may pick or pack a kernel
                first = time.perf_counter() - t0
                runs = []
                while len(runs) < REPEATS and (sum(runs) < ENOUGH_S or len(runs) < 2) and first < budget_s:
                    t0 = time.perf_counter()
                    call()
                    runs.append(time.perf_counter() - t0)
                done[key] = min(runs or [first])
                timed += 1
            except Exception:  # a call that cannot run again here: the rate model times it
                left += 1
    return timed, left


def retime(done: dict[tuple, float], budget_s: float, rounds: int = ROUNDS, seed: int = 0,
           ) -> tuple[int, Disturbance | None]:
    """Every kernel of ``done`` timed again, once a round in a shuffled order, for up to ``rounds`` rounds within
    ``budget_s``; each keeps its fastest call. Returns (the rounds done, the disturbance of the quietest round: None
    when one was quiet, or when none could be watched)."""
    order, rng = list(done), random.Random(seed)

    def one_round() -> None:
        rng.shuffle(order)
        for key in order:
            try:
                call = replay(key)  # the tensors made outside the timed call
                t0 = time.perf_counter()
                call()
                done[key] = min(done[key], time.perf_counter() - t0)
            except Exception:  # timed once already; it cannot run again now: its first time stands
                continue

    with torch.no_grad():
        return until_quiet(one_round, rounds, budget_s)


__all__ = ["ROUNDS", "TensorSpec", "replay", "retime", "signature", "time_kernels"]
