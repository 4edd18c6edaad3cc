"""A forecast's times: the target's rates for the time model (a GPU of the table, this machine's GPU, this CPU), each
policy's speedup against the baseline, and the fastest policy predicted to fit, in a sentence."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from dtypelab.core.bands import band, overlaps
from dtypelab.core.disturbance import describe
from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.devices import device_spec, rated_peaks
from dtypelab.core.machine.hardware import HardwareInfo, measured_probe
from dtypelab.core.machine.speed import (
    GEMM_EFFICIENCY,
    GPU_FLOOR_S,
    ROWWISE_EFFICIENCY,
    NoRate,
    Op,
    Rates,
    attention_efficiency,
    cpu_rates,
    float8_layers,
    fuse,
    gpu_rates,
    step_time,
)
from dtypelab.core.policies import BASELINE, Plan
from dtypelab.core.results import PolicyForecast, TargetDevice, TimeForecast
from dtypelab.forecasting.kernels import retime, time_kernels


@functools.lru_cache(maxsize=2)
def speed_probe(device: str) -> HardwareInfo:
    """This machine's rates for the time model, probed once per process (about 1 s on a CPU)."""
    return measured_probe(torch.device(device), budget_s=0.05, speed=True)


def rates_for(device: TargetDevice) -> tuple[Rates | None, str]:
    """The target's rates for the time model, or None and why there are none."""
    try:
        if device.kind == "cpu":
            return cpu_rates(speed_probe("cpu")), ""
        if device.name == "cuda":  # this machine's GPU: its datasheet peaks, the bandwidth its probe measured
            local = speed_probe("cuda")
            source, peaks = rated_peaks(local.device_name)
            if not peaks or not local.bandwidth_gbs:
                return None, f"no datasheet peaks for {local.device_name}: no time is forecast"
            return Rates(local.device_name, {k: v * 1e12 for k, v in peaks.items()}, local.bandwidth_gbs * 1e9,
                         GPU_FLOOR_S, {"*": GEMM_EFFICIENCY}, f"{source}; {local.bandwidth_gbs:g} GB/s measured here",
                         variants={"rowwise": ROWWISE_EFFICIENCY},
                         attention=attention_efficiency(torch.cuda.get_device_capability())), ""
        if device.name and device.kind == "cuda":
            try:
                spec = device_spec(device.name)
            except DtypelabError:  # a memory size (--memory), not a device: nothing to time against
                return None, f"{device.label} is a memory size, not a device: no time is forecast"
            return gpu_rates(spec), ""
    except NoRate as exc:
        return None, str(exc)
    return None, "no device named (--device): no time is forecast"


def with_speedups(results: list[PolicyForecast], baseline: str | None) -> tuple[list[PolicyForecast], str]:
    """Each policy's time with its speedup against the baseline's (the one named, else the default baseline when
    forecast, else the first timed)."""
    timed = {r.policy: r.time for r in results if r.time is not None and r.time.step_s}
    base = baseline or (BASELINE if BASELINE in timed else next(iter(timed), ""))
    ref = timed.get(base)
    if ref is None:
        return results, base
    out = []
    for r in results:
        t = r.time
        if t is not None and t.step_s:
            t = replace(t, speedup=ref.step_s / t.step_s,
                        measured_speedup=ref.measured_s / t.measured_s if ref.measured_s and t.measured_s else None)
            r = replace(r, time=t)
        out.append(r)
    return out, base


# The error of a predicted speedup the evidence supports: on a GPU, the band of the validation set's held-out training
# speed cases (core.bands: the largest error among them, docs/validation.md); on this CPU, the self-check's bound
# (benchmarks/speed_forecast.py --part cpu: 20%). Two predictions whose bands overlap are a tie.
CPU_SPEEDUP_ERROR = 0.20


def speedup_error(device: TargetDevice) -> float:
    return band("train-speed", 0.20) if device.kind == "cuda" else CPU_SPEEDUP_ERROR


def memory_error(device: TargetDevice) -> float:
    """The band of a training peak on a GPU (the validation set's fine-tuning and training peaks); 0 on a CPU, where
    no published peak was held against it (``--check`` there measures the step instead)."""
    return band("train-peak") if device.kind == "cuda" else 0.0


def _mantissa(dtype: str) -> int:
    """The bits a compute format keeps of each value's mantissa (tf32: 10): the safer numerics keep more."""
    if dtype == "tf32":
        return 10
    try:
        return round(-math.log2(torch.finfo(getattr(torch, dtype)).eps))  # eps = 2^-mantissa bits
    except (AttributeError, TypeError):  # not a floating format (an int8 kernel's float32 policy): float32's
        return 23


def safer(plan: Plan) -> tuple[bool, int]:
    """How bench breaks a tie between policies whose speeds cannot be told apart (the metric aside, which a forecast
    has not): float32 weights first, then the wider compute format."""
    return plan.default.facts.storage_dtype in ("float32", "float64"), _mantissa(plan.compute_dtype)


def speed_answer(results: list[PolicyForecast], device: TargetDevice, baseline: str, task: str, rates: Rates | None,
                 no_rates: str, plans: dict[str, Plan] | None = None) -> tuple[str, str]:
    """(the fastest policy predicted to fit and run there, that answer in a sentence). Predictions within each
    other's band (``speedup_error``) are a tie, broken by the safer numerics (``safer``), and the answer says so."""
    if rates is None:
        return "", no_rates[:1].upper() + no_rates[1:] + "." if no_rates else ""
    busy = next((r.time.disturbed for r in results if r.time is not None and r.time.disturbed), "")
    if busy:
        return "", (f"No fastest policy is named: {busy}, so the times here say nothing reliable; re-run the "
                    "forecast on a quiet machine.")
    fit = [r for r in results if r.status == "ok" and r.time is not None and r.time.step_s and not r.runs_there
           and r.method != "stand-in"  # its time is the stand-in's kernels', not the policy's
           and all(f is None or f.fits for f in (r.train_fit if r.train is not None else r.infer_fit,))]
    if not fit:
        return "", f"No policy is predicted to fit and run on {rates.device}."
    error = speedup_error(device)
    fastest = min(fit, key=lambda r: r.time.step_s)
    tied = [r for r in fit if r is not fastest and overlaps(r.time.step_s or 0.0, fastest.time.step_s or 0.0, error)]
    best = fastest
    if tied and plans:
        best = max([fastest, *tied], key=lambda r: (*safer(plans[r.policy]), -r.time.step_s))
    t = best.time
    against = f"{t.speedup:.2f}x {baseline}'s speed" if t.speedup and best.policy != baseline else "the baseline"
    head = (f"Fastest predicted on {rates.device}: {best.policy}, {against} ({t.step_s * 1e3:.3g} ms a step, "
            f"{t.bound}-bound; the forecast's error: ±{error:.0%}).")
    if tied:
        others = [r for r in (fastest, *tied) if r is not best]
        head += (f" Within that error of it: {', '.join(_speed(r) for r in others)}: a tie"
                 + (f", broken by the safer numerics ({_why_safer(best, others, plans)})" if plans else "") + ".")
    return best.policy, (head + f" Its numerics are not forecast: `dtypelab bench {task} -p {best.policy}` measures "
                         "them (with --emulate where this machine cannot run it).")


def _speed(r: PolicyForecast) -> str:
    return f"{r.policy} ({r.time.speedup:.2f}x)" if r.time is not None and r.time.speedup else r.policy


def _why_safer(best: PolicyForecast, others: list[PolicyForecast], plans: dict[str, Plan]) -> str:
    mine = safer(plans[best.policy])
    if any(not safer(plans[r.policy])[0] for r in others) and mine[0]:
        return f"{best.policy} keeps float32 weights"
    if any(safer(plans[r.policy])[1] < mine[1] for r in others):
        return f"{best.policy} computes in a wider format ({plans[best.policy].compute_dtype})"
    return f"as safe as each other: the faster, {best.policy}"


KERNEL_BUDGET_S = 60.0  # the most a forecast spends timing its kernels here (this CPU), over all its policies


class StepTimes:
    """Each policy's predicted step time on the target, from the ops its trace recorded; where the target is this
    machine, its heavy kernels timed here once per forecast (``forecasting.kernels``), within ``KERNEL_BUDGET_S``."""

    def __init__(self, rates: Rates) -> None:
        self.rates = rates
        self._kernel_s: dict[tuple, float] = {}  # a heavy call -> its time here (rates that time kernels)
        self._spent = 0.0  # seconds spent timing them
        self.disturbed = ""  # after ``settle``: what kept the machine busy through every round ("" if quiet)

    def settle(self) -> str:
        """Every kernel timed so far, timed again in interleaved rounds (``kernels.retime``): the policies' times
        then rest on the same quiet moments. Returns, and keeps, what kept the machine busy through every round."""
        if not (self.rates.times_kernels and self._kernel_s):
            return ""
        started = time.perf_counter()
        _, busy = retime(self._kernel_s, max(KERNEL_BUDGET_S - self._spent, KERNEL_BUDGET_S / 4))
        self._spent += time.perf_counter() - started
        self.disturbed = "" if busy is None else (
            f"the machine was busy in every round of timing its kernels ({describe(busy)})")
        return self.disturbed

    def of(self, plan: Plan, ops: Sequence[Op], method: str) -> TimeForecast:
        if plan.numerics_only and not all(c.facts.gpu_kernel for c in plan.configs if c.facts.numerics_only):
            return TimeForecast(None, reason="emulated numerics: its kernels are not the real ones (the policy "
                                             "without -emu is timed)")
        if not ops:
            why = {"measured": "the step could not be traced (it was measured here): no ops to time",
                   "state-only": "the step could not be traced: no ops to time"}.get(method, "no ops were traced")
            return TimeForecast(None, reason=why)
        if any(c.facts.process_wide and c.facts.compute_dtype == "tf32" for c in plan.configs):
            # TF32 is a process-wide flag, not a layout: the trace it shares with fp32 shows float32 matmuls
            ops = tuple(replace(op, rate="tf32") if op.rate == "float32" else op for op in ops)
        rates, untimed = self.rates, ""
        if rates.times_kernels:  # this machine: each matmul, attention and convolution timed at its own call
            calls = {op.kernel for op in ops if op.kernel}
            started = time.perf_counter()
            time_kernels(calls, self._kernel_s, max(0.0, KERNEL_BUDGET_S - self._spent))
            self._spent += time.perf_counter() - started
            rates = replace(rates, kernels=self._kernel_s)
            if left := len(calls - self._kernel_s.keys()):
                untimed = (f"{left} of its {len(calls)} matmul, attention and convolution calls were not timed here "
                           f"(too large, or past {KERNEL_BUDGET_S:g} s of timing): the rate model times those")
        timing = step_time(ops, rates, compiled=plan.compiles)
        if timing.missing:
            return TimeForecast(None, reason=f"no {'/'.join(timing.missing)} rate on {rates.device}: the policy "
                                             "cannot run there at that speed (no such tensor cores)")
        note = ("traced with a stand-in (a cast in place of kernels this machine lacks): the time is the stand-in's "
                "kernels'" if method == "stand-in" else float8_note(fuse(ops) if plan.compiles else ops, rates,
                                                                      plan.compiles))
        return TimeForecast(timing.step_s, bound=timing.bound, breakdown=dict(timing.groups),
                            bounds=dict(timing.bounds), kernels=timing.kernels,
                            reason="; ".join(n for n in (note, untimed) if n), disturbed=self.disturbed)


def float8_note(ops: Sequence[Op], rates: Rates, compiled: bool) -> str:
    """Which float8 layers pay and which lose (their casts fused as the compiled step runs them), when there are."""
    pays, loses = float8_layers(ops, rates)
    if not pays and not loses:
        return ""

    def named(layers: list[tuple[str, float]]) -> str:
        shown = ", ".join(f"{m} ({s * 1e6:+.0f} µs)" for m, s in layers[:3])
        return shown + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")

    how = "fused, as compiled" if compiled else "eager"
    return (f"float8 layers, their matmuls' saving net of their own casts ({how}): {len(pays)} pay"
            + (f" ({named(pays)})" if pays else "") + f", {len(loses)} lose" + (f" ({named(loses)})" if loses else ""))


__all__ = ["KERNEL_BUDGET_S", "StepTimes", "float8_note", "rates_for", "speed_answer", "speed_probe", "with_speedups"]
