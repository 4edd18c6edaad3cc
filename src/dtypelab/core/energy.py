"""Energy measured where the hardware counts it: a cumulative counter read at the edges of a window of work.

- NVIDIA: the driver's total-energy counter (``nvmlDeviceGetTotalEnergyConsumption``, millijoules since the driver
  loaded; Volta and newer), through nvidia-ml-py. The driver refreshes it about every 100 ms, so one reading can be
  up to one refresh stale at each edge: a window must span many refreshes (``MIN_UPDATES``) for its joules to mean
  anything. Power readings (``nvmlDeviceGetPowerUsage``, ``torch.cuda.power_draw``) are one-second averages on
  recent cards: they are not used.
- CPU: RAPL's package domains under ``/sys/class/powercap`` (Intel, and AMD since Zen), microjoules, each wrapping at
  its ``max_energy_range_uj``. Containers and VMs often do not expose it, and Linux 5.10 made it root-only
  (CVE-2020-8694): then no energy is measured and one line says why; never a zero.
- Zeus (ml-energy/zeus, optional: ``pip install zeus``), where neither counter is available and Zeus is installed: it
  adds AMD GPUs (torch's "cuda" on ROCm, where NVML is absent) and CPUs whose RAPL it reaches through its privileged
  daemon, through its ``ZeusMonitor`` windows (zeus/monitor/energy.py: a window's GPUs in ``gpu_energy``, its CPU
  packages in ``cpu_energy``; an SoC's parts, Apple silicon's, are not read here).

Edges are synchronized: the device finishes its queued work before each reading, so a window holds exactly the work
between them.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dtypelab.core.errors import DtypelabError
from dtypelab.core.results import EnergySource

NVML_UPDATE_S = 0.1  # the driver's refresh of the total-energy counter (NVML docs; ML.ENERGY's measurements)
RAPL_UPDATE_S = 0.001  # RAPL's MSRs refresh about every millisecond
ZEUS_UPDATE_S = 0.1  # what Zeus's slowest backends (AMD SMI, Apple) refresh at, taken as the floor for all of them
# A window spans at least this many counter refreshes: each edge may be one refresh stale, so the joules of a
# window of work at constant power are within 2/MIN_UPDATES (10%) of the truth, and the mean over windows closer.
MIN_UPDATES = 20
IDLE_S = 2.0  # the idle window, at least (and at least the counter's own minimum window)
POWERCAP = "/sys/class/powercap"
POWERCAP_ENV = "DTYPELAB_POWERCAP"  # another place for the powercap tree (a container that mounts it elsewhere)


@dataclass(frozen=True)
class Reading:
    """The energy of one window of work."""

    joules: float
    seconds: float

    @property
    def watts(self) -> float:
        return self.joules / self.seconds if self.seconds > 0 else 0.0


class Counter(Protocol):
    """A cumulative energy counter, in joules, that never goes backwards while it is read often enough."""

    name: str  # what the record says measured it
    update_s: float  # how often the hardware refreshes it

    def read(self) -> float: ...


class NoEnergy(Exception):
    """Why this machine measures no energy, in one line."""


class NvmlCounter:
    """One GPU's total-energy counter through nvidia-ml-py (millijoules, 64 bits: it does not wrap in practice)."""

    update_s = NVML_UPDATE_S

    def __init__(self, nvml: Any, handle: Any, name: str) -> None:
        self.nvml, self.handle, self.name = nvml, handle, name

    def read(self) -> float:
        return float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)) / 1000.0


class RaplCounter:
    """RAPL's package domains, summed. Each raw counter wraps at its own range; read at least once per wrap (minutes
    at full power), the total keeps counting."""

    update_s = RAPL_UPDATE_S

    def __init__(self, zones: list[str]) -> None:
        self.zones = zones
        self.name = "RAPL " + " + ".join(_zone_name(z) for z in zones)
        self.ranges = [_read_int(os.path.join(z, "max_energy_range_uj")) for z in zones]
        self.last = [_read_int(os.path.join(z, "energy_uj")) for z in zones]
        self.total_uj = 0

    def read(self) -> float:
        for i, zone in enumerate(self.zones):
            raw = _read_int(os.path.join(zone, "energy_uj"))
            step = raw - self.last[i]
            self.total_uj += step if step >= 0 else step + self.ranges[i]  # wrapped once since the last read
            self.last[i] = raw
        return self.total_uj / 1e6


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read().strip())


def _zone_name(zone: str) -> str:
    try:
        with open(os.path.join(zone, "name")) as f:
            return f.read().strip()
    except OSError:
        return os.path.basename(zone)


@dataclass(frozen=True)
class Edge:
    """One synchronized reading of a counter: when, and its joules so far."""

    seconds: float
    joules: float


class Meter:
    """Windows of work measured by a counter (NVML, RAPL or Zeus), whatever reads them: ``begin()`` opens a
    ``Window`` at a synchronized edge, its ``end()`` closes it at another; ``edge()`` alone marks a moment (a script
    run marks every step and measures the window between two of its marks)."""

    def __init__(self, counter: Counter, sync: Callable[[], None] | None = None) -> None:
        self.counter, self.sync = counter, sync or (lambda: None)
        self.name, self.update_s = counter.name, counter.update_s

    @property
    def min_window_s(self) -> float:
        return MIN_UPDATES * self.update_s

    def edge(self) -> Edge:
        self.sync()
        return Edge(time.perf_counter(), self.counter.read())

    def begin(self) -> Window:
        return Window(self, self.edge())

    def between(self, start: Edge, stop: Edge) -> tuple[Reading | None, str]:
        """The window between two edges, or None and why it says nothing (too short for the counter, a counter that
        went backwards: the driver reloaded)."""
        seconds, used = stop.seconds - start.seconds, stop.joules - start.joules
        if used < 0:
            return None, f"the {self.name} counter went backwards (it was reset)"
        if seconds < self.min_window_s:
            return None, (f"a window of {seconds:.2g} s is shorter than {MIN_UPDATES} refreshes of the {self.name} "
                          f"counter ({self.min_window_s:g} s)")
        return Reading(used, seconds), ""

    def idle(self, seconds: float | None = None) -> Reading | None:
        """The device's power doing nothing, over one window (``IDLE_S``, and at least the counter's minimum)."""
        window = self.begin()
        time.sleep(max(IDLE_S if seconds is None else seconds, self.min_window_s))
        return window.end()[0]


@dataclass(frozen=True)
class Window:
    """A window of work opened at ``start``: ``end()`` reads it to now, ``to(edge)`` to an edge marked since."""

    meter: Meter
    start: Edge

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start.seconds

    def end(self) -> tuple[Reading | None, str]:
        return self.meter.between(self.start, self.meter.edge())

    def to(self, stop: Edge) -> tuple[Reading | None, str]:
        return self.meter.between(self.start, stop)


class ZeusCounter:
    """Zeus's ``ZeusMonitor`` as a cumulative counter, for hardware the counters above do not reach: one Zeus window
    is open at a time; each read ends it, adds its joules to the total and opens the next, so a ``Meter``'s windows
    are judged alike whatever reads them (a script run marks every step: every window but the last is closed). A
    window with none of the device's parts (an SoC's, not read here) raises ``NoEnergy``."""

    update_s = ZEUS_UPDATE_S

    def __init__(self, monitor: Any, name: str) -> None:
        self.monitor, self.name = monitor, name
        self.total, self._n = 0.0, 0
        self._open()

    def _open(self) -> None:
        self._n += 1
        self.monitor.begin_window(f"dtypelab-{self._n}", sync_execution=True)

    def read(self) -> float:
        m = self.monitor.end_window(f"dtypelab-{self._n}", sync_execution=True)
        self._open()
        # Zeus's ``total_energy`` sums the GPUs only: a CPU's packages are in ``cpu_energy``
        parts = {**(m.gpu_energy or {}), **{f"cpu{i}": j for i, j in (m.cpu_energy or {}).items()}}
        if not parts:
            raise NoEnergy("Zeus measured none of this device's energy (an SoC's parts are not read)")
        self.total += float(sum(parts.values()))
        return self.total


def _nvml(device: Any) -> Meter:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        raise NoEnergy("GPU energy is not measured: nvidia-ml-py is not installed (pip install nvidia-ml-py)") from None
    try:
        pynvml.nvmlInit()
        handle = _handle(pynvml, device)
        counter = NvmlCounter(pynvml, handle, f"NVML total energy ({pynvml.nvmlDeviceGetName(handle)})")
        counter.read()
    except pynvml.NVMLError as exc:
        what = "no permission to read it" if isinstance(exc, pynvml.NVMLError_NoPermission) else \
            "this GPU has no energy counter (Volta or newer has one)" if isinstance(
                exc, pynvml.NVMLError_NotSupported) else str(exc)
        raise NoEnergy(f"GPU energy is not measured: NVML's total-energy counter: {what}") from None
    import torch

    return Meter(counter, lambda: torch.cuda.synchronize(device))


def _handle(nvml: Any, device: Any) -> Any:
    """The NVML handle of torch's device: by PCI bus id (CUDA_VISIBLE_DEVICES renumbers torch's devices, not NVML's)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        try:
            return nvml.nvmlDeviceGetHandleByPciBusId(
                f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0")
        except nvml.NVMLError:  # a bus id NVML does not know (a VM's passthrough): the index, as CUDA numbers it
            pass
    return nvml.nvmlDeviceGetHandleByIndex(device.index or 0)


def rapl_zones(root: str | None = None) -> list[str]:
    """The package domains (``intel-rapl:N``; their subzones, ``intel-rapl:N:M``, are parts of them) under the
    powercap tree, or NoEnergy saying why there are none."""
    root = root or os.environ.get(POWERCAP_ENV) or POWERCAP
    if not os.path.isdir(root):
        raise NoEnergy(f"CPU energy is not measured: no {root} here (RAPL is not exposed in this container or VM)")
    zones = sorted(z for z in glob.glob(os.path.join(root, "intel-rapl:*")) if os.path.basename(z).count(":") == 1)
    if not zones:
        raise NoEnergy(f"CPU energy is not measured: {root} has no RAPL package domain (intel-rapl:N)")
    for zone in zones:
        path = os.path.join(zone, "energy_uj")
        if not os.access(path, os.R_OK):
            raise NoEnergy(f"CPU energy is not measured: {path} is readable by root only (Linux 5.10 and later, "
                           "CVE-2020-8694): run as root, or make it readable (chmod o+r)")
    return zones


def _rapl(root: str | None = None) -> Meter:
    try:
        return Meter(RaplCounter(rapl_zones(root)))
    except PermissionError as exc:  # readable by os.access, refused on open (an LSM policy)
        raise NoEnergy(f"CPU energy is not measured: {exc.filename}: permission denied") from None


def _zeus(device: Any) -> Meter | None:
    """Zeus's monitor for this device, when Zeus is installed; None otherwise."""
    try:
        from zeus.monitor import ZeusMonitor
    except ImportError:
        return None
    try:
        counter: ZeusCounter
        if device.type == "cpu":
            counter = ZeusCounter(ZeusMonitor(gpu_indices=[], cpu_indices=[0]), "Zeus (CPU)")
        else:
            counter = ZeusCounter(ZeusMonitor(gpu_indices=[device.index or 0], cpu_indices=[]), "Zeus (GPU)")
        counter.read()  # one window read whole, as the native readers read their counter once when opened
    except Exception:
        return None
    return Meter(counter)  # Zeus synchronizes the devices it reads (sync_execution)


def open_meter(device: Any) -> tuple[Meter | None, str]:
    """(the meter of this device, "") or (None, why it measures no energy, in one line). A CUDA device reads NVML, a
    CPU reads RAPL; where they fail and Zeus is installed, Zeus."""
    try:
        if device.type == "cuda":
            return _nvml(device), ""
        if device.type == "cpu":
            return _rapl(), ""
        why = f"{device.type} energy is not measured: no counter dtypelab reads"
    except NoEnergy as exc:
        why = str(exc)
    zeus = _zeus(device)
    if zeus is not None:
        return zeus, ""
    return None, why + ("" if device.type == "cuda" else " (nor is Zeus installed)")


def measuring(device: Any) -> tuple[Meter | None, EnergySource]:
    """This device's meter and what the record says of it, its idle power read over one window first; (None, why
    nothing measures it) where no counter does."""
    meter, why = open_meter(device)
    if meter is None:
        return None, EnergySource(why=why)
    idle = meter.idle()
    return meter, EnergySource(meter.name, idle_watts=idle.watts if idle else None, update_s=meter.update_s,
                               min_window_s=meter.min_window_s)


def counter_of(device: Any) -> tuple[str, str]:
    """(the name of the counter that would measure ``device``, "") or ("", why none would): the launcher's side,
    before its workers open their own."""
    try:
        meter, why = open_meter(device)
    except Exception as exc:
        return "", f"energy is not measured: {exc}"
    return (meter.name, "") if meter is not None else ("", why)


def require_counter(device: Any) -> None:
    """For ``--objective energy``: a one-line error, before anything runs, where no counter measures ``device``."""
    counter, why = counter_of(device)
    if not counter:
        raise DtypelabError(f"--objective energy chooses by measured joules, and nothing measures them here: {why}")


__all__ = [
    "IDLE_S",
    "MIN_UPDATES",
    "Edge",
    "Meter",
    "NoEnergy",
    "NvmlCounter",
    "RaplCounter",
    "Reading",
    "Window",
    "ZeusCounter",
    "counter_of",
    "measuring",
    "open_meter",
    "rapl_zones",
    "require_counter",
]
