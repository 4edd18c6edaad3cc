"""The energy of a forecast step: the GPU's power between its idle draw and its power limit, driven by what the time
model says bounds the step, times the step's predicted time.

    watts = idle + (limit - idle) x sum over bounds b of (share of the step's time bound by b) x ACTIVITY[b]

- compute-bound time (tensor cores busy) draws near the limit: ``ACTIVITY["compute"]`` is the median of four
  published nvidia-smi readings of busy cards (H200 607 W of 700 at 100% utilization; RTX 4090 435 of 450 at 90%;
  A100-SXM4-80GB 312 of 400 at 87%; A10 150 of 150 at 92%), each as (watts - idle) / (limit - idle);
- memory-bound time (HBM streaming weights and cache, the SMs mostly waiting) draws part of the way:
  ``ACTIVITY["memory"]`` is fitted to one published measurement, batch-1 decode of Mistral-7B in bfloat16 on an
  H100 (2.64 J per token: 732 µWh, the "Alice" energy benchmark, vLLM, NVML at 100 ms), and checked against the
  others held out (the validation set's energy cases, ``benchmarks/validate.py``);
- overhead-bound time (launches, the host) draws little above idle: ``ACTIVITY["overhead"]`` is a prior, not fitted.

The model's error against every published measurement it was compared with is in docs/validation.md (energy).
A measured record from the same GPU calibrates it (``calibrated``): its idle power replaces the table's, and its
policies' measured power over the model's scales the part above idle.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtypelab.core.machine.devices import DeviceSpec
from dtypelab.core.results import Energy, TimeForecast

ACTIVITY = {"compute": 0.90, "memory": 0.74, "overhead": 0.10}
IDLE_SHARE = 0.10  # idle as a share of the limit where no reading was found (H100 SXM 70/700, H200 74/700)


@dataclass(frozen=True)
class PowerModel:
    """One GPU's power between idle and its limit, and where those figures come from."""

    device: str
    idle_watts: float
    limit_watts: float
    by: str  # the model, in words, for the record's ``energy.by``
    scale: float = 1.0  # a measured record's calibration of the part above idle

    def watts(self, bounds: dict[str, float]) -> float:
        """The mean power over a step whose seconds are split by bound as ``bounds`` says."""
        total = sum(bounds.values())
        if total <= 0:
            return self.idle_watts
        activity = sum(seconds / total * ACTIVITY.get(bound, ACTIVITY["overhead"]) for bound, seconds in bounds.items())
        return min(self.limit_watts, self.idle_watts + self.scale * (self.limit_watts - self.idle_watts) * activity)


def power_model(spec: DeviceSpec) -> PowerModel | None:
    """The table's power figures for ``spec``; None without a power limit."""
    if spec.limit_watts is None:
        return None
    idle = spec.idle_watts if spec.idle_watts is not None else IDLE_SHARE * spec.limit_watts
    said = (f"idle {idle:g} W ({spec.idle_from})" if spec.idle_watts is not None else
            f"idle {idle:g} W (a tenth of the limit: no published reading)")
    return PowerModel(spec.label, idle, spec.limit_watts,
                      f"power model: {said} to the {spec.limit_watts:g} W limit, by what bounds the step "
                      f"(dtypelab.core.machine.power)")


def calibrated(model: PowerModel, idle_watts: float | None, pairs: list[tuple[float, dict[str, float]]],
               record: str) -> PowerModel:
    """``model`` calibrated by a measured record of the same GPU: its idle power, and the median over its policies of
    (measured watts - idle) over the model's (watts - idle) for the same steps' bounds (``pairs``: measured watts,
    the forecast's bounds)."""
    idle = idle_watts if idle_watts is not None else model.idle_watts
    base = PowerModel(model.device, idle, model.limit_watts, model.by)
    ratios = sorted((w - idle) / (base.watts(b) - idle) for w, b in pairs if base.watts(b) > idle)
    scale = ratios[len(ratios) // 2] if ratios else 1.0
    how = (f"calibrated by {record}: idle {idle:.0f} W measured, the part above idle x{scale:.2f} "
           f"(median over {len(ratios)} measured polic{'y' if len(ratios) == 1 else 'ies'})") if ratios else \
        f"idle {idle:.0f} W measured in {record} (no policy of it forecast here: the activity is the model's)"
    return PowerModel(model.device, idle, model.limit_watts, f"{model.by}; {how}", scale)


def step_energy(time: TimeForecast | None, model: PowerModel | None, samples: int,
                tokens: int | None = None) -> Energy | None:
    """A forecast step's energy: its predicted time at the model's power for its bounds."""
    if time is None or not time.step_s or model is None:
        return None
    watts = model.watts(time.bounds)
    joules = watts * time.step_s
    return Energy(joules, joules / max(samples, 1), "forecast", model.by,
                  joules_per_token=joules / tokens if tokens else None, watts=watts, idle_watts=model.idle_watts)


__all__ = ["ACTIVITY", "PowerModel", "calibrated", "power_model", "step_energy"]
