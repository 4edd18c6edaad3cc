"""What the rest of the machine did while something was timed: other processes' CPU time, CPU pressure, steal.

Two threaded torch processes on 2 cores slow each other 10-30x, so every timing dtypelab takes (a policy's steps,
a round's block, the hardware probe, a tune evaluation) is watched by a ``CpuMeter``.

The counters have a resolution that matters for short windows: machine-wide CPU time (``/proc/stat``) and a
process's own (``/proc/self/stat``) advance in clock ticks (10 ms where ``CLK_TCK`` is 100), so over a 37 ms block
of timed steps one tick of rounding alone reads as 0.27 of a core. That is how a quiet machine was once called
busy. The meter therefore discounts the ticks' resolution from other processes' CPU time, and for windows too
short for CPU time to tell, also takes the kernel's CPU pressure (``/proc/pressure/cpu``, microseconds: the time
runnable tasks waited for a CPU): another process that really competes makes ours wait.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

# Cores of CPU time other processes used, on average, while something was timed, from which its timing is not
# trusted: on 2 cores one busy process slows a threaded torch run 10-30x.
DISTURBED_CORES = 0.25
# Fraction of the window in which runnable tasks waited for a CPU that marks a window as disturbed when other
# processes also used CPU time in it (short windows, where CPU time is below its resolution).
STALLED = 0.5


def _tick_s() -> float:
    try:
        return 1.0 / os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError, AttributeError):
        return 0.01


TICK_S = _tick_s()
# Each reading of machine-wide time can be a tick off on every CPU, and this process's own time by one more.
RESOLUTION_S = ((os.cpu_count() or 1) + 1) * TICK_S


class CpuReading(NamedTuple):
    wall_s: float
    busy_s: float  # every process's CPU time on the machine (user, nice, system, irq, softirq)
    own_s: float  # this process's, its reaped children's included
    steal_s: float  # time the hypervisor gave this machine's CPUs to someone else
    pressure_s: float | None  # /proc/pressure/cpu "some": time runnable tasks waited for a CPU (None: no PSI)
    involuntary: int  # this process's involuntary context switches


def read_cpu() -> CpuReading:
    import psutil

    sys_t, proc = psutil.cpu_times(), psutil.Process()
    own = proc.cpu_times()
    pressure = None
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/pressure/cpu") as f:
        pressure = int(f.readline().split("total=")[1]) / 1e6
    return CpuReading(time.monotonic(), sys_t.user + sys_t.nice + sys_t.system + getattr(sys_t, "irq", 0.0)
                      + getattr(sys_t, "softirq", 0.0), own.user + own.system + own.children_user
                      + own.children_system, getattr(sys_t, "steal", 0.0), pressure,
                      proc.num_ctx_switches().involuntary)


@dataclass(frozen=True)
class Disturbance:
    """What the rest of the machine did during one window. ``other_cpu_s`` and ``steal_s`` are already less the
    counters' resolution, so a quiet machine reads 0, not a tick's worth of "other processes"."""

    wall_s: float
    other_cpu_s: float  # CPU time of every other process (machine-wide busy time less this process's)
    steal_s: float
    pressure_s: float | None
    involuntary_switches: int
    raw_other_cpu_s: float = 0.0  # before the resolution was discounted
    resolution_s: float = RESOLUTION_S

    @property
    def other_cores(self) -> float:
        return self.other_cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def stolen(self) -> float:
        return self.steal_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def stalled(self) -> float | None:
        """Fraction of the window in which runnable tasks waited for a CPU (None where the kernel has no PSI)."""
        return self.pressure_s / self.wall_s if self.pressure_s is not None and self.wall_s > 0 else None

    @property
    def disturbed(self) -> bool:
        if self.other_cores >= DISTURBED_CORES or self.stolen >= DISTURBED_CORES:
            return True
        # a window shorter than the counters' resolution: CPU time cannot tell, so waiting tasks decide, when
        # some other process did run meanwhile (our own threads never make PSI count someone else)
        stalled = self.stalled
        return stalled is not None and stalled >= STALLED and self.raw_other_cpu_s > 0

    def to_dict(self) -> dict[str, float | int | bool | None]:
        return {"wall_s": self.wall_s, "other_cpu_s": self.other_cpu_s, "other_cores": self.other_cores,
                "steal_s": self.steal_s, "pressure_s": self.pressure_s,
                "involuntary_switches": self.involuntary_switches, "resolution_s": self.resolution_s,
                "disturbed": self.disturbed}


def was_disturbed(d: Mapping[str, Any] | None) -> bool:
    """A record's disturbance reading (``Disturbance.to_dict()``), judged; older records carry no verdict, only
    other processes' cores."""
    if not d:
        return False
    if "disturbed" in d:
        return bool(d["disturbed"])
    return float(d.get("other_cores") or 0.0) >= DISTURBED_CORES


def describe(d: Disturbance | Mapping[str, Any], subject: bool = True) -> str:
    """'other processes used 0.96 of a core, tasks waited for a CPU 80% of the time' (without its first three
    words when not ``subject``)."""
    if isinstance(d, Disturbance):
        d = d.to_dict()
    parts = [f"{'other processes used ' if subject else ''}{float(d.get('other_cores') or 0.0):.2f} of a core"]
    wall, pressure, steal = d.get("wall_s") or 0.0, d.get("pressure_s"), d.get("steal_s") or 0.0
    if pressure and wall:
        parts.append(f"tasks waited for a CPU {pressure / wall:.0%} of the time")
    if steal and wall and steal / wall >= 0.05:
        parts.append(f"the hypervisor took {steal / wall:.0%} of the CPUs (steal)")
    return ", ".join(parts)


class CpuMeter:
    """``start()`` ... ``stop()`` around timed work: how much CPU other processes took meanwhile. ``read`` is
    injectable for tests."""

    def __init__(self, read: Callable[[], CpuReading] = read_cpu, resolution_s: float = RESOLUTION_S) -> None:
        self.read, self.resolution_s, self._start = read, resolution_s, None

    def start(self) -> None:
        try:
            self._start = self.read()
        except Exception:  # no psutil reading on this platform: the run is measured, its context is not
            self._start = None

    def stop(self) -> Disturbance | None:
        if self._start is None:
            return None
        try:
            end = self.read()
        except Exception:
            return None
        a, res = self._start, self.resolution_s
        pressure = end.pressure_s - a.pressure_s if a.pressure_s is not None and end.pressure_s is not None else None
        raw = max(0.0, (end.busy_s - a.busy_s) - (end.own_s - a.own_s))
        return Disturbance(wall_s=end.wall_s - a.wall_s, other_cpu_s=max(0.0, raw - res),
                           steal_s=max(0.0, end.steal_s - a.steal_s - res), pressure_s=pressure,
                           involuntary_switches=end.involuntary - a.involuntary, raw_other_cpu_s=raw,
                           resolution_s=res)


def until_quiet(one_round: Callable[[], None], rounds: int, budget_s: float | None = None
                ) -> tuple[int, Disturbance | None]:
    """``one_round()`` up to ``rounds`` times, each watched by a ``CpuMeter``, stopping after the first round in which
    the machine was quiet (or once ``budget_s`` is spent): what re-timing in interleaved rounds rests on, since
    another process's burst slows a timed call and never speeds one. Returns (the rounds run, the least disturbed
    round's disturbance: None when one was quiet, or when none could be watched)."""
    start, quietest = time.monotonic(), None
    for done in range(1, rounds + 1):
        meter = CpuMeter()
        meter.start()
        one_round()
        busy = meter.stop()
        if busy is None or not busy.disturbed:
            return done, None
        quietest = busy if quietest is None or busy.other_cores < quietest.other_cores else quietest
        if budget_s is not None and time.monotonic() - start > budget_s:
            return done, quietest
    return rounds, quietest
