"""A script run's outcome as its policy's result: measured, skipped (with why), failed (the session never started,
never finished, never set up the model, timed no step), diverged; with the notes the table should carry."""

from __future__ import annotations

import math

from dtypelab.core.policies import Plan, policy_info
from dtypelab.core.results import Energy, PolicyResult
from dtypelab.run import Outcome
from dtypelab.script.messages import ScriptResult, ScriptSkip
from dtypelab.script.session_state import warmup_steps

NEVER_STARTED = ("the script never created a dtypelab session: add `lab = dtypelab.session()` near its top (or use "
                 "dtypelab.lightning.Trainer / dtypelab.hf.Trainer)")
NEVER_FINISHED = ("the script ended without calling lab.finish(...): add `lab.finish(accuracy=...)` (your metric) "
                  "after its evaluation")

Primary = tuple[str, bool] | None  # the run's primary metric and whether higher is better



def script_result(out: Outcome, plan: Plan, own_precision: bool = False) -> tuple[PolicyResult, Primary]:
    """A run's outcome as the policy's result (and its primary metric), or why there is none. ``own_precision``:
    this policy is the baseline because it is the precision the script builds its model in (fp64)."""
    if not out.ok:
        return PolicyResult(plan.name, out.status, out.reason, wall_s=out.wall_s), None
    d = out.value
    if d is None:
        return PolicyResult(plan.name, "failed", NEVER_FINISHED if out.started else NEVER_STARTED,
                            wall_s=out.wall_s), None
    if isinstance(d, ScriptSkip):
        times = d.step_times_s
        return PolicyResult(plan.name, "skipped", d.reason, skip=d.skip, wall_s=out.wall_s, step_times_s=times,
                            warmup=warmup_steps(len(times)) if times else 0, losses=tuple(map(float, d.losses)),
                            disturbance=d.disturbance), None
    if not isinstance(d, ScriptResult):
        return PolicyResult(plan.name, "failed", f"the session sent {type(d).__name__}, not its result",
                            wall_s=out.wall_s), None
    if not d.setup_called:
        return PolicyResult(plan.name, "failed", "the script never called lab.setup(model, optimizer): the policy "
                                                 "was not applied to its model", wall_s=out.wall_s), None
    times = d.step_times_s
    if not times:
        return PolicyResult(plan.name, "failed", untimed(d), wall_s=out.wall_s, metrics=d.metrics,
                            info=policy_info(plan)), None
    losses = tuple(map(float, d.losses))
    first_bad = d.first_nonfinite_step
    diverged = first_bad is not None and losses and not math.isfinite(losses[-1])
    reason = f"loss non-finite from step {first_bad}" if diverged else ""
    if diverged and d.stopped:
        reason += f"; {d.stopped}"
    result = PolicyResult(
        policy=plan.name, status="diverged" if diverged else "ok", batch_size=d.batch_size, reason=reason,
        warmup=warmup_steps(len(times)), step_times_s=times, losses=losses, first_nonfinite_step=first_bad,
        metrics=d.metrics, peak_memory_bytes=d.peak_memory_bytes, load_peak_memory_bytes=d.load_peak_memory_bytes,
        memory_method=d.memory_method, model_bytes=d.model_bytes, init_fingerprint=d.init_fingerprint,
        scaler=d.scaler, info=policy_info(plan), wall_s=out.wall_s, disturbance=d.disturbance,
        notes=tuple(run_notes(d, own_precision)), memory=d.memory, energy=run_energy(d))
    return result, (d.metric, d.higher_is_better)


def run_energy(d: ScriptResult) -> Energy | None:
    """The run's energy over its timed steps (one window: a run is one replicate), where a counter measured it."""
    if d.energy is None:
        return None
    joules, seconds, steps = d.energy
    per_step = joules / steps
    return Energy(per_step, per_step / d.batch_size if d.batch_size else per_step, "measured", d.energy_counter,
                  watts=joules / seconds, windows=1)


def untimed(d: ScriptResult) -> str:
    """Why a run that finished timed no step: what the session saw, and the line that makes it time them."""
    if not d.forwards:
        return ("no training step was timed: the model lab.setup returned was never called in training mode with "
                "gradients on; call the model it returns (model, optimizer = lab.setup(model, optimizer))")
    return ("no training step was timed: the model ran forward but no step ended (give the optimizer to lab.setup, "
            "or call lab.step_end() after updating the weights by hand)")


FLOAT64_NOTE = ("the script builds its model in float64, so fp64 (its own precision) is the baseline every policy is "
                "judged against (--baseline NAME names another)")


def run_notes(d: ScriptResult, own_precision: bool = False) -> list[str]:
    """What a script's run did that the table should say: its own autocast turned off inside the model, the dtype
    it builds its model in (the baseline's reason when that is float64 and the baseline ``own_precision``), its
    steps timed from one call of the model to the next (weights updated by hand)."""
    notes = []
    if d.script_autocast:
        notes.append(f"the script's own autocast ({', '.join(d.script_autocast)}) was on around the model; "
                     "dtypelab turned it off inside the model's forward so that each policy runs as named")
    if d.script_settings:
        notes.append(f"the script's own arguments set {', '.join(d.script_settings)}; each policy set its own as "
                     "named (activation checkpointing only under +ckpt)")
    built = [t for t in d.built_in if t != "float32"]
    if own_precision and "float64" in built:
        notes.append(FLOAT64_NOTE)
    elif built:
        notes.append(f"the script builds its model in {', '.join(built)}; each policy converts it as named (fp32: to "
                     "float32 weights)")
    if d.optimizers == 0 and not d.framework and d.step_times_s:
        notes.append("no optimizer was given to lab.setup (weights updated by hand): each step is timed from one "
                     "training call of the model to the next, the update and the script's own work between steps "
                     "included")
    return notes


__all__ = ["FLOAT64_NOTE", "NEVER_FINISHED", "NEVER_STARTED", "Primary", "run_notes", "script_result", "untimed"]
