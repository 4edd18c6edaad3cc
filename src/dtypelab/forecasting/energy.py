"""A forecast's energy: each policy's predicted step at the target GPU's power for what bounds it
(``core.machine.power``), optionally calibrated by a record measured on the same GPU (``--energy-from``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.devices import DEVICES, DeviceSpec, device_spec
from dtypelab.core.machine.power import PowerModel, calibrated, power_model, step_energy
from dtypelab.core.measure import tokens_of
from dtypelab.core.records import load_record
from dtypelab.core.results import GenerateReport, PolicyForecast, Report, TargetDevice


@dataclass(frozen=True)
class Measured:
    """What a measured record says of power on its GPU: its idle watts, and each policy's measured watts."""

    path: str
    idle_watts: float | None
    watts: dict[str, float]


def _spec(device: TargetDevice) -> DeviceSpec | None:
    """The table's row of the target (a GPU named, or this machine's GPU by the name its label holds); None
    otherwise."""
    if device.kind != "cuda" or not device.name:
        return None
    if device.name.startswith("cuda"):
        return next((d for d in DEVICES if re.search(d.matches, device.label)), None)
    try:
        return device_spec(device.name)
    except DtypelabError:  # a memory size, not a device
        return None


def _measured_on(record: Any) -> str:
    hw = (record.environment or {}).get("hardware") or {}
    return str(hw.get("device_name") or "")


def read_measured(path: str, device: TargetDevice) -> Measured:
    """The measured power in a bench or generate record of the target's GPU; a one-line error for any other file."""
    record = load_record(path)
    if not isinstance(record, (Report, GenerateReport)):
        what = getattr(record, "schema", "").removeprefix("dtypelab.") or "another kind of"
        raise DtypelabError(f"--energy-from {path}: a bench record (dtypelab bench, any --mode) is needed, not a "
                            f"{what} record")
    spec, name = _spec(device), _measured_on(record)
    if spec is None or not re.search(spec.matches, name):
        raise DtypelabError(f"--energy-from {path}: measured on {name or 'an unnamed device'}, not on "
                            f"{device.label or device.name}: a power calibration needs the same GPU")
    source = record.energy_source
    if source is None or not source.counter:
        raise DtypelabError(f"--energy-from {path}: the record holds no measured energy"
                            f"{' (' + source.why + ')' if source and source.why else ''}")
    if isinstance(record, Report):
        watts = {r.policy: r.energy.watts for r in record.results if r.energy and r.energy.watts}
    else:
        watts = {p.policy: p.generate.energy.watts for p in record.policies
                 if p.generate and p.generate.energy and p.generate.energy.watts}
    return Measured(path, source.idle_watts, watts)


def target_power(device: TargetDevice) -> tuple[PowerModel | None, str]:
    """The target GPU's power model, or None and why no energy is forecast."""
    spec = _spec(device)
    model = power_model(spec) if spec is not None else None
    if model is not None:
        return model, ""
    what = device.label or device.name or "no device"
    return None, f"no power model for {what} (a GPU of the table has one): no energy is forecast"


def calibrate(model: PowerModel, measured: Measured | None, bounds: dict[str, dict[str, float]]) -> PowerModel:
    """The model calibrated by the measured record, pairing its policies with the forecast's by name."""
    if measured is None:
        return model
    pairs = [(w, bounds[name]) for name, w in measured.watts.items() if name in bounds]
    return calibrated(model, measured.idle_watts, pairs, measured.path)


def with_energy(results: list[PolicyForecast], model: PowerModel | None, samples: int, tokens: int | None,
                measured: Measured | None = None) -> list[PolicyForecast]:
    """Each timed policy with its step's forecast energy."""
    if model is None:
        return results
    model = calibrate(model, measured, {r.policy: r.time.bounds for r in results if r.time and r.time.step_s})
    return [replace(r, energy=step_energy(r.time, model, samples, tokens)) if r.time else r for r in results]


def tokens_per_step(task: Any, batch: int) -> int | None:
    """A training batch's tokens, where its inputs are token ids (batch x positions of integers)."""
    try:
        return tokens_of(task.batch(0, batch)[0])
    except Exception:
        return None


__all__ = ["Measured", "calibrate", "read_measured", "target_power", "tokens_per_step", "with_energy"]
