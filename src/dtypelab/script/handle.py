"""The handle a user's own training script calls: ``lab = dtypelab.session()``.

Run on its own (``python train.py``) it hands the script's objects back untouched: the script trains exactly as
before. Run by ``dtypelab bench train.py``, the session is the worker of ``dtypelab.run``'s script launcher: it
connects to the launcher's channel (named in its environment), is sent its job (the policy, and what else to do: a
trace, an audit), reports its steps, and sends what it measured when the script calls ``lab.finish(...)``.

The shape is Lightning Fabric's: ``setup`` returns the model, optimizers and GradScaler *wrapped*
(``script.wrap``; the script's own objects are never changed): the model's calls run under the policy (inputs
converted, its forward context, the script's own autocast off inside it), ``optimizer.step`` steps through the
policy's GradScaler, ``backward`` scales the loss, ``clip_gradients`` unscales before clipping. A step is timed from
its first forward (or from ``step(closure)``) to the optimizer step that ends it, so data loading between steps is
outside the timer; with gradient accumulation one step spans its micro-batches. A script that updates its weights
by hand (no optimizer) has each step end where the model is next called, or at ``lab.step_end()``.
"""

from __future__ import annotations

import atexit
import math
import statistics
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dtypelab.core.disturbance import CpuMeter
from dtypelab.core.energy import open_meter
from dtypelab.core.errors import DtypelabError, Unsupported
from dtypelab.core.loop import fingerprint
from dtypelab.core.measure import MemoryMeter, StepTimer, device_sync, slow_verdict
from dtypelab.core.policies import BASELINE, Plan, Precision, get_policy, plan_from_dict
from dtypelab.core.wrapping import LabModule
from dtypelab.inference import serialize
from dtypelab.run import Done, Note, Step, connect, heavy_modules
from dtypelab.script.diagnose import Diagnosis
from dtypelab.script.footprint import Footprint
from dtypelab.script.frameworks import Frameworks, record_metrics
from dtypelab.script.messages import ScriptJob, ScriptResult, ScriptSkip
from dtypelab.script.routes import Routes
from dtypelab.script.session_state import RunState, ScriptEnergy, StepState, lower_is_better, warmup_steps
from dtypelab.script.wrap import LabOptimizer, LabScaler, unwrap

PROGRESS_EVERY_S = 0.25
class Session:
    """Measures one training run of a user's script under the policy the parent chose (fp32 when none). Its parts:
    ``routes`` (what the wrapped objects' calls do), ``frameworks`` (what Lightning's and Hugging Face's
    integrations call), ``footprint`` (the memory count); its state, explicit: ``step_state`` and ``run_state``."""

    def __init__(self, seed: int | None = None, device: str | None = None, *, plan: str | Plan | None = None,
                 diagnosis: Diagnosis | None = None) -> None:
        if seed is not None:
            warnings.warn("dtypelab.session(seed=...) no longer seeds anything: run by dtypelab, every policy's "
                          "process is seeded before your script starts (bench --seed N), and your own seeding "
                          "still wins; run on its own, your script trains exactly as without dtypelab",
                          DeprecationWarning, stacklevel=3)
        connected = connect()  # None: the script runs on its own
        self._conn, sent = connected if connected is not None else (None, None)
        self.driven = sent is not None
        self.job: ScriptJob | None = ScriptJob.of(sent) if self.driven else None
        # run on its own, the caller may choose the policy and a diagnosis (the autopilot's session); driven, the job
        # brings both
        # (the job's plan was built by this run: a user's kind in it is loaded from the file they named)
        self.plan: Plan = (plan_from_dict(self.job.plan, load_source=True) if self.job is not None
                           else get_policy(plan or BASELINE))
        wrong = self.plan.mode_error("train")
        if wrong:
            raise DtypelabError(wrong)
        want = (self.job.device if self.job is not None else "") or device
        self.device = torch.device(want or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.seed = self.job.seed if self.job is not None else 0
        self.precision = Precision(self.plan, self.device)
        self._globals = self.precision.session()
        self._globals.__enter__()  # tf32 flags and the like, restored at finish()
        self.meter = MemoryMeter(self.device)
        if self.driven:  # only a driven run reports its peak; run alone, the script's memory is left as it is
            self.meter.start()
        self.timer = StepTimer(sync=device_sync(self.device))
        self.energy: ScriptEnergy | None = None  # a bench run's energy counter, opened at its first step's end
        self.losses: list[float] = []
        self.step_samples: list[int] = []
        self.finished = False
        self.step_state, self.run_state = StepState(), RunState()
        self.footprint = Footprint(self.run_state, self.precision, self.timer,
                                   self.job is not None and self.job.mode == "bench")
        self.routes, self.frameworks = Routes(self), Frameworks(self)
        # trace / audit modes: the guard or the range audit on this loop, as the job says (their capabilities')
        self.diag: Diagnosis = (self.job.diagnosis if self.job is not None else diagnosis) or Diagnosis()
        if self.driven or diagnosis is not None:  # on its own, a diagnosis still reports a run that never finished
            atexit.register(self._at_exit)

    @property
    def wraps(self) -> bool:
        """Whether ``setup`` wraps anything: driven by dtypelab, or with a diagnosis on the script's own run."""
        return self.driven or type(self.diag) is not Diagnosis

    # --- what the script calls -----------------------------------------------------------------
    def setup(self, model: nn.Module, *objects: Any) -> Any:
        """The model, optimizers and (optionally) the script's own GradScaler, each wrapped for the policy: the
        model's calls run under it and are timed, ``optimizer.step`` (with or without a closure) steps through it,
        the GradScaler's calls become the policy's loss scaling. Returns ``model`` alone, or ``(model, *objects)``
        in the order given. The script's own objects are wrapped, never changed (``torch.save(model)``,
        ``copy.deepcopy``, ``state_dict`` keys and LR schedulers behave as without dtypelab). Run on its own
        (``python train.py``) the script gets its objects back untouched and trains exactly as before."""
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        scalers = [o for o in objects if isinstance(o, torch.amp.GradScaler)]
        wrong = [type(o).__name__ for o in objects if o not in optimizers and o not in scalers]
        if wrong:
            raise DtypelabError(f"lab.setup takes the model, its optimizers and optionally its GradScaler; got "
                                f"{', '.join(wrong)}")
        if not self.wraps:  # on its own, with nothing to do: the script's objects, as they are
            return (model, *objects) if objects else model
        model = unwrap(model)
        run = self.run_state
        first = run.model is None
        if first:
            run.init = fingerprint(model)
            run.built_in = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                                   if p.is_floating_point()})
            if self.driven:  # said at once: a run that fails later still tells the launcher the script's own dtype
                self._conn.send(Note("built_in", (tuple(run.built_in),)))
        model = self.precision.convert_module(model.to(self.device))
        if first:
            run.model = model
        wrapped: list[Any] = []
        for obj in objects:
            obj = unwrap(obj)
            if isinstance(obj, torch.optim.Optimizer):
                if id(obj) not in run.converted:  # the kinds' optimizer hook, once per optimizer
                    try:
                        run.converted[id(obj)] = self.precision.convert_optimizer(obj, model)
                    except Unsupported as exc:  # no low-bit variant of this optimizer: a skip that says so
                        self.unsupported(str(exc))
                    run.optimizers.append(run.converted[id(obj)])
                wrapped.append(LabOptimizer.wrap(run.converted[id(obj)], self.routes))
            else:
                wrapped.append(LabScaler(obj, self.routes))
        front = LabModule.wrap(model, self.routes)
        if first:  # the diagnosis replays forwards as the script makes them: through the wrapper, under the policy
            self.diag.setup(front, list(run.optimizers), self.precision, self._emit if self.driven else None)
            self.open_memory_window()
        return (front, *wrapped) if wrapped else front

    def open_memory_window(self) -> None:
        """The model is built and converted: that is not the run's peak (a driven run's; alone, nothing is read)."""
        if self.driven:
            self.meter.open_window()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled under a GradScaler policy; the loss is recorded for the loss curve (a step's
        loss is the sum of its micro-batches' values, as their gradients add up)."""
        self.routes.note_loss(loss)
        self.precision.backward(loss)
        self.diag.backward(loss)

    def clip_gradients(self, parameters: nn.Module | Iterable[torch.Tensor], max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        """``clip_grad_norm_`` on true gradients: under a GradScaler they are unscaled first (once per step)."""
        for opt in self.run_state.optimizers:
            self.routes.unscale(opt)
        params = parameters.parameters() if isinstance(parameters, nn.Module) else parameters
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def finish(self, metrics: dict[str, float] | None = None, *, higher_is_better: bool | None = None,
               **named: float) -> None:
        """End the run with its metrics (the first is the primary one), e.g. ``lab.finish(accuracy=acc)``.
        Whether higher is better is guessed from the name (loss, error, perplexity, … are lower) unless given."""
        given = {**(metrics or {}), **named}
        if not given:
            raise DtypelabError("lab.finish() needs the metric, e.g. lab.finish(accuracy=0.93)")
        record_metrics(self.run_state, given, higher_is_better)
        if self.step_state.active and not self.run_state.optimizers:  # weights updated by hand: it ends here
            self.end_step()
        self.close()

    def unsupported(self, reason: str) -> None:
        """The policy cannot run in this framework here: the run is recorded as skipped with ``reason`` and the
        script stops (only when dtypelab drives it; run on its own this is an error)."""
        if not self.driven:
            raise DtypelabError(reason)
        self.finished = True
        self._globals.__exit__(None, None, None)
        self._done(ScriptSkip(reason, "inapplicable"))
        raise SystemExit(0)

    def step_end(self, loss: float | None = None) -> None:
        """The step ends here: a script that updates its weights by hand (no optimizer given to ``lab.setup``) may
        call it after the update; without it such a step ends where the model is next called."""
        if loss is not None:
            self.step_state.pending.append(loss)
        self.end_step()

    def step_begin(self) -> None:
        """A training step begins here, unless one is in progress: the timer starts."""
        step, run = self.step_state, self.run_state
        if not step.active:
            if run.cpu is None:
                run.cpu = CpuMeter()
                run.cpu.start()
            step.active = True
            self.diag.begin(len(self.losses), self.precision.grad_scale())
            self.footprint.count_activations(start=True)
            self.timer.start()

    def end_step(self) -> None:
        """The step in progress ends: its time, loss and samples are kept, and bench's protections look at it."""
        step, run = self.step_state, self.run_state
        if step.active:
            self.timer.stop()
            step.active = False
            self._energy_mark()
        self.footprint.count_activations(start=False)
        self.diag.end(len(self.losses), list(step.pending))
        if step.pending:
            self.losses.append(sum(step.pending))
        if step.samples:
            self.step_samples.append(step.samples)
        step.samples = 0
        step.pending.clear()
        step.stepped.clear()
        step.unscaled.clear()
        now = time.monotonic()
        if self.driven and now - run.last_progress >= PROGRESS_EVERY_S:
            run.last_progress = now
            self._conn.send(Step(len(self.timer.samples), 0))
        if self.diag.stop:  # the trace found its step, the audit has its steps, the autopilot had to stop
            self.close()
            raise SystemExit(0 if self.driven else self.diag.stop_code)
        if self.job is not None and self.job.mode == "bench":
            self._guard()

    def _guard(self) -> None:
        """bench's protections, as a task run has them: stop a run whose loss stayed non-finite for
        DIVERGED_PATIENCE steps, and one measured 10x slower per step than fp32 (``core.measure.slow_verdict``).
        Either ends the script here, with what was measured so far."""
        job, run = self.job or ScriptJob(), self.run_state
        if self.losses:
            run.nonfinite_run = 0 if math.isfinite(self.losses[-1]) else run.nonfinite_run + 1
        if run.nonfinite_run >= job.patience:
            run.stopped = f"stopped after {run.nonfinite_run} non-finite steps"
            self.close()
            raise SystemExit(0)
        samples = self.timer.samples
        slow = slow_verdict(samples, warmup_steps(job.baseline_steps or len(samples)), job.slow_step_s,
                            job.baseline_steps, job.baseline_step_s, job.slow_span_s)
        if slow and not self._busy():  # slowed by other processes, seen: not the policy's own pace
            self.finished = True
            self._globals.__exit__(None, None, None)
            self._done(ScriptSkip(slow, "slow", tuple(samples), tuple(self.losses), self._disturbance()))
            raise SystemExit(0)

    def _busy(self) -> bool:
        """Whether other processes took the CPU while this run was timed (from its first step to now)."""
        d = self.run_state.cpu.stop() if self.run_state.cpu is not None else None
        return d is not None and d.disturbed

    def _disturbance(self) -> dict[str, Any]:
        d = self.run_state.cpu.stop() if self.run_state.cpu is not None else None
        return d.to_dict() if d is not None else {}

    def close(self) -> None:
        """End the run: the globals restored, the diagnosis's record kept, and (driven) the result sent."""
        if self.finished:
            return
        self.finished = True
        self._globals.__exit__(None, None, None)
        run = self.run_state
        record = self.diag.record(self.job or ScriptJob(), self.losses, self.precision.stats(), run.metrics)
        if not self.driven:
            if record is not None:
                self.diag.keep(record)
            return
        if record is not None:
            self._conn.send(Note("record", (record,)))
        peak = self.meter.peak_bytes()
        first_bad = next((i for i, v in enumerate(self.losses) if not math.isfinite(v)), None)
        higher = run.higher if run.higher is not None else not lower_is_better(run.metric)
        self._done(ScriptResult(
            policy=self.plan.name, step_times_s=tuple(self.timer.samples), losses=tuple(self.losses),
            first_nonfinite_step=first_bad, metrics=dict(run.metrics), metric=run.metric, higher_is_better=higher,
            higher_guessed=run.higher is None, peak_memory_bytes=peak, load_peak_memory_bytes=self.meter.load_peak,
            memory_method=self.meter.method,
            model_bytes=len(serialize(run.model)[0]) if run.model is not None else None,
            init_fingerprint=run.init, scaler=self.precision.stats(), setup_called=run.model is not None,
            batch_size=int(statistics.median_low(self.step_samples)) if self.step_samples else 0,
            disturbance=self._disturbance(), stopped=run.stopped, forwards=run.forwards,
            optimizers=len(run.optimizers), framework=run.framework,
            script_autocast=tuple(sorted(run.script_autocast)), built_in=tuple(run.built_in),
            script_settings=tuple(sorted(run.script_settings)),
            memory=self.footprint.memory(), **self._energy_fields(len(self.timer.samples))))

    def _energy_mark(self) -> None:
        """A bench run reads its energy counter at each step's (synchronized) end."""
        if self.job is None or self.job.mode != "bench":
            return
        if self.energy is None:
            self.energy = ScriptEnergy(open_meter(self.device)[0])
        self.energy.mark()

    def _energy_fields(self, steps: int) -> dict[str, Any]:
        if self.energy is None:
            return {}
        return {"energy": self.energy.window(warmup_steps(steps)), "energy_counter": self.energy.name}

    def _at_exit(self) -> None:
        # driven: an integration recorded metrics, they are the result; on its own: the diagnosis's summary
        if not self.finished and (self.run_state.metrics or not self.driven):
            self.close()

    def _emit(self, kind: str, *payload: Any) -> None:
        """A diagnosis's own message to the launcher, as it happens (the autopilot's moves)."""
        self._conn.send(Note(kind, payload))

    def _done(self, data: ScriptResult | ScriptSkip) -> None:
        """The run's last word to the launcher: what it measured, or why it was skipped (after which heavy
        libraries the script imported, which the launcher's zygote then keeps for the next run)."""
        self._conn.send(Note("modules", (heavy_modules(),)))
        self._conn.send(Done(data))


def session(seed: int | None = None, device: str | None = None) -> Session:
    """The handle for measuring your own training script: ``lab = dtypelab.session()`` at its top. It touches no
    global state of the script's: run by ``dtypelab bench``, each policy's process is seeded before the script
    starts (``bench --seed``), so every policy sees the same shuffle and initial weights unless the script seeds
    itself (then its seed holds). ``seed`` is accepted for old scripts and ignored, with a warning."""
    return Session(seed, device)
