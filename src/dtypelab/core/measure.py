"""Timing, memory and size measurements. The clock and the sync are injectable for testing. (Their robust
statistics, ``Summary`` and ``summarize``, are in ``core.stats``: records use them without torch.)"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

# an interleaved round's block of inference work (bench's passes, generations): enough of it to take this long, at
# least one; a pass or generation that long is its own median, and a shorter one is timed warm
ROUND_BLOCK_S = 0.25

class StepTimer:
    """Times steps with ``clock``; ``sync`` (e.g. cuda.synchronize) runs before each clock read so
    asynchronous device work is counted in the step that launched it."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 sync: Callable[[], None] | None = None) -> None:
        self.clock, self.sync = clock, sync or (lambda: None)
        self.samples: list[float] = []
        self._start: float | None = None

    def start(self) -> None:
        self.sync()
        self._start = self.clock()

    def stop(self) -> float:
        if self._start is None:
            raise RuntimeError("StepTimer.stop() without start()")
        self.sync()
        elapsed = self.clock() - self._start
        self._start = None
        self.samples.append(elapsed)
        return elapsed


SLOW_AFTER = 3  # timed steps after warm-up before a run can be judged pathologically slow
SLOW_SAVES_S = 5.0  # ... and it is stopped only when the steps left would take at least this long at its pace
# fp32 timed under disturbance: its fastest step is the bar's base, and a run is judged by its own fastest step over
# timed steps covering at least this long (a burst of other work that slows every step it covers is shorter)
SLOW_SPAN_S = 5.0


def slow_base(samples: Sequence[float], warmup: int, disturbed: bool) -> tuple[float, float] | None:
    """From fp32's step times: (its reference step, the span later runs are judged over: 0 for "the median of the
    first SLOW_AFTER timed steps"). Quiet: its median. Disturbed: its fastest step (other processes only ever add
    time), with SLOW_SPAN_S. None: nothing timed."""
    timed = list(samples[warmup:])
    if not timed:
        return None
    return (min(timed), SLOW_SPAN_S) if disturbed else (sorted(timed)[len(timed) // 2], 0.0)


def slow_verdict(samples: Sequence[float], warmup: int, limit_s: float | None, steps_total: int,
                 baseline_s: float | None = None, span_s: float = 0.0) -> str:
    """Why a run should stop now as pathologically slow on the model itself, or "": the median of its timed steps
    (at least SLOW_AFTER after ``warmup``) is past ``limit_s`` (10x fp32's step: SLOW_RATIO), and the steps left
    of ``steps_total`` would take SLOW_SAVES_S or more. With ``span_s`` (fp32 was timed under disturbance) its
    fastest step is judged instead, once its timed steps cover ``span_s``. Catches what a matmul probe cannot (a
    dtype whose matmuls are native but whose convolutions are not) and what a disturbed probe let through."""
    timed = list(samples[warmup:])
    if limit_s is None or len(timed) < SLOW_AFTER or sum(timed) < span_s:
        return ""
    pace = min(timed) if span_s else sorted(timed)[len(timed) // 2]
    # a tiny model's 0.5 ms is 10x its fp32 0.05 ms: stopping it would save nothing and lose its metric
    if pace <= limit_s or pace * (steps_total - len(samples)) < SLOW_SAVES_S:
        return ""
    fastest = "fastest " if span_s else ""
    base = (f" vs {baseline_s * 1e3:.3g} ms for fp32's {fastest}step, {pace / baseline_s:.0f}x slower"
            if baseline_s else "")
    what = (f"its fastest step of {len(timed)} timed ({sum(timed):.0f} s; other processes were busy) took "
            f"{pace * 1e3:.3g} ms" if span_s else
            f"{pace * 1e3:.3g} ms per step over its first {len(timed)} timed steps")
    return f"measured pathologically slow on this model: {what}{base}; stopped there"


def tokens_of(x: Any) -> int | None:
    """A batch's tokens, where its inputs are token ids (an integer tensor of batch x positions, or a Hugging Face
    model's keyword inputs holding one as ``input_ids``)."""
    if isinstance(x, dict):
        x = x.get("input_ids")
    if isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point() and x.dtype != torch.bool:
        return x.numel()
    return None


def device_sync(device: torch.device) -> Callable[[], None] | None:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


# --- memory --------------------------------------------------------------------------------------

def _reset_rss_hwm() -> bool:
    # Linux >= 4.0: writing 5 to clear_refs resets the peak-RSS high-water mark to the current RSS.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_parts_kib() -> dict[str, int]:
    parts = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    parts[key] = int(value.split()[0])
    except OSError:
        pass
    return parts


def release_free_memory() -> None:
    """Return freed heap pages to the OS (glibc malloc_trim) so RSS reflects memory in use."""
    gc.collect()
    # Not glibc: RSS may include freed-but-kept heap, and the figure is then an upper bound.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@contextlib.contextmanager
def young_heap() -> Iterator[None]:
    """The objects alive now are left out of the garbage collections inside the block (gc.freeze).

    Each memory window collects garbage so that RSS is what is in use. In a large process (a notebook with
    transformers loaded, the test suite) a full collection walks every object, 0.1-0.4 s a time: most of a small
    run. What was alive before the run is not the run's garbage: left uncollected, it is part of the baseline and of
    every reading alike. On exit the block's own garbage is collected while the rest is still frozen (a walk of the
    run's objects only), then the freeze is undone, so the caller's collector is as it was. A freeze already in
    place (the zygote's, for its forked workers) is left as it is.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.collect()
        gc.unfreeze()


def _current_rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import psutil

        return psutil.Process().memory_info().rss


class MemoryMeter:
    """Peak memory of a run above the memory in use before its model was built.

    ``start()`` takes the baseline before the model exists. Building, loading and converting the model
    create temporaries (the freshly initialised weights a load replaces, an fp32 copy a cast or a
    quantization replaces); ``open_window()`` records that load peak apart, releases freed memory and resets
    the high-water mark, so ``peak_bytes()`` is what the run itself holds at its worst: weights, optimizer
    state, activations, gradients, allocator slack. Both are measured against the same pre-build baseline.

    CUDA: ``torch.cuda.max_memory_allocated`` (tensors only, not the allocator's cache).
    CPU: the process's peak resident set size (VmHWM, reset via /proc/self/clear_refs) less its file-backed
    pages (shared-library code that PyTorch pages in on first use of a kernel), above the anonymous memory in
    use at ``start()``. The job runs throwaway steps before ``start()`` so that PyTorch's lazily created
    runtime state (thread pools, kernel caches) is not charged to the policy. Where the peak cannot be
    reset, ru_maxrss is used and the figure is an upper bound (including the load).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = 0
        self.method = ""
        self.load_peak: int | None = None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            self.method = "cuda max_memory_allocated above the pre-build baseline"
        else:
            release_free_memory()
            parts = _rss_parts_kib()
            exact = _reset_rss_hwm() and "RssAnon" in parts
            self.baseline = parts["RssAnon"] * 1024 if exact else _current_rss()
            self.method = ("peak RSS less file-backed pages, above the pre-build baseline" if exact
                           else "ru_maxrss above baseline (upper bound)")

    def open_window(self) -> None:
        """The model is built: keep the load peak, then measure only what follows."""
        self.load_peak = self.peak_bytes()
        self.reset()

    def reset(self) -> None:
        """Forget the high-water mark so far (the baseline stays): what follows is measured on its own."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.method.startswith("peak RSS"):
            release_free_memory()
            _reset_rss_hwm()

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return max(0, torch.cuda.max_memory_allocated(self.device) - self.baseline)
        parts = _rss_parts_kib()
        if self.method.startswith("peak RSS"):
            peak = (parts["VmHWM"] - parts.get("RssFile", 0) - parts.get("RssShmem", 0)) * 1024
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(0, peak - self.baseline)
