"""One task's forecasts, policy by policy: each policy's training and inference peaks, traced; the largest batch
that fits; the predicted step time; and, with ``--check``, the same steps run here on real tensors.

When a trace cannot be made, what is said instead is stated in the record (``method``):

- ``stand-in``: a conversion that needs hardware this machine lacks (fp8 and int4 inference need CUDA) is traced
  with its stored dtype in place of the converted weights, whose bytes come from the kind's layout
  (``forecasting.adapters.STORED_WEIGHT_BYTES``);
- ``measured``: a step that cannot be traced on fake tensors (a data-dependent op: ``.item()``, ``nonzero``) is run
  here at two small batch sizes, counted by the same ledger, and extrapolated along the line through them, when the
  model fits this machine;
- ``state-only``: neither: the weights, gradients and one optimizer step traced alone; activations not counted.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import nn

from dtypelab.core.errors import DtypelabError, Unsupported, describe_exception
from dtypelab.core.machine.speed import Rates
from dtypelab.core.policies import Plan, Precision, emulated_version
from dtypelab.core.results import CheckResult, FitForecast, PeakForecast, PolicyForecast, TimeForecast
from dtypelab.core.task import Task
from dtypelab.forecasting import local_run
from dtypelab.forecasting.batch import infer_batch_shape, train_batch_shape
from dtypelab.forecasting.depth import SHALLOW, linear, linear_time, read_off
from dtypelab.forecasting.fake import fresh, meta_model
from dtypelab.forecasting.fake_step import Run, Target, Traced, joined, peak_forecast, shifted
from dtypelab.forecasting.layouts import conversion_notes, layout, stand_in
from dtypelab.forecasting.ranks import FakeRanks
from dtypelab.forecasting.search import largest_batch
from dtypelab.forecasting.timing import StepTimes


class Job(local_run.HostJob, Protocol):
    """What a forecaster reads of its job (``forecasting.job.ForecastJob``), named here so that the job imports the
    forecaster and not the other way round."""

    @property
    def target(self) -> str: ...
    @property
    def rates(self) -> Rates | None: ...
    @property
    def nproc(self) -> int: ...
    @property
    def limit(self) -> int | None: ...
    @property
    def search(self) -> bool: ...


class Untraceable(Exception):
    """The step could not be traced on fake tensors (a data-dependent op, an op without a fake kernel)."""


UNTRACED = "the step could not be traced nor run here: no peak, fit or time (its state alone is counted)"


class Forecaster:
    """One task's forecasts: its model built once on the meta device; each policy's converted once and copied for
    each trace; an inference pass traced once for policies whose converted models are the same."""

    def __init__(self, job: Job, task: Task) -> None:
        self.job, self.task = job, task
        self.target = Target(job.target, timed=job.rates is not None)
        self.meta, self.build_note = meta_model(task, job.seed)
        # a deep stack of identical blocks: traced with one and two, the rest read off the line (forecasting.depth)
        self.blocks = task.blocks if task.with_blocks is not None and read_off(task.blocks) else 0
        self._metas: dict[int | None, nn.Module] = {None: self.meta}
        self.trains = not task.inference_only
        self.train_shape = train_batch_shape(task) if self.trains else None
        self.infer_shape = infer_batch_shape(task)
        self._ranks = FakeRanks(job.nproc)
        self._hardware: Any = None
        # (plan, depth) -> (converted meta model, the plan traced, extra bytes)
        self._converted: dict[tuple[str, int | None], tuple[nn.Module, Plan, int]] = {}
        self._conversion_notes: dict[str, list[str]] = {}  # plan -> what its own conversion took and left out
        # what policies share: a forward and backward (training) or a forward (inference) per converted layout and
        # batch size (bf16, bf16-kahan and bf16-sr+adam8bit convert the model alike); each policy's own update
        self._passes: dict[tuple[Any, ...], Traced] = {}
        self._updates: dict[tuple[str, int | None], Traced] = {}
        # (plan, train) -> steps run here when one could not be traced, and their batch sizes (``local_run.fallback``)
        self.measured: dict[tuple[str, bool], tuple[list[Traced], tuple[int, ...]]] = {}
        self._timed: dict[tuple[str, bool], tuple[Traced, str]] = {}  # (plan, train) -> its step, the method
        self.times = StepTimes(job.rates) if job.rates is not None else None

    def hardware_here(self) -> Any:
        if self._hardware is None:
            from dtypelab.core.machine.hardware import hardware_for

            self._hardware = hardware_for(torch.device(self.job.check_device), None, budget_s=0.02)
        return self._hardware

    def close(self) -> None:
        self._ranks.close()

    def wrap(self, plan: Plan) -> Any:
        """How ``plan``'s model is wrapped for its ranks (FSDP2 on a fake process group), or None."""
        return self._ranks.wrap(plan)

    # --- one policy ---------------------------------------------------------------------------------
    def policy(self, plan: Plan) -> PolicyForecast:
        start = time.perf_counter()
        notes = [self.build_note] if self.build_note else []
        if plan.uses_scaler:
            notes.append("GradScaler's state (two scalars) is not traced: its step reads a value fake tensors do not "
                         "have; the backward's tensors are the same with or without it")
        if plan.compiles:
            notes.append("traced eagerly: torch.compile may fuse temporaries away and recompute activations rather "
                         "than keep them, so the compiled step can peak lower")
        try:
            train = infer = None
            train_fit = infer_fit = None
            method = "traced"
            if self.trains and "train" in plan.modes:
                train, method = self.peak(plan, self.job.batch_size, True, notes)
                train_fit = self.fit(plan, True, train, method)
            if plan.distributed is None and ("infer" in plan.modes or train is not None):
                infer, infer_method = self.peak(plan, self.job.infer_batch_size, False, notes)
                method = method if train is not None else infer_method
                # the largest batch for serving: asked of the inference formats; a training policy's is its training's
                infer_fit = self.fit(plan, False, infer, infer_method, search=train is None)
            notes += self._conversion_notes.get(plan.name, [])
            if method == "state-only":  # a lower bound of the peak: no fit, no time can be said from it
                train_fit = infer_fit = None
                timed = None if self.job.rates is None else TimeForecast(None, reason=UNTRACED)
            else:
                timed = self.time(plan, train is not None) if train is not None or not self.trains else (
                    None if self.job.rates is None else
                    TimeForecast(None, reason="an inference format: its pass is not a training step to compare"))
            check = None
            if self.job.check:
                try:  # a check that fails keeps the forecast it was checking
                    check = self.check(plan, notes)
                    if timed is not None and timed.step_s is not None and not self.times_here:
                        timed = replace(timed, measured_s=local_run.step_seconds(
                            self.task, plan, self.job.check_device, self.job_size(train is not None),
                            train is not None, self.job.seed))
                except Exception as exc:
                    notes.append(f"--check: running the steps here failed ({describe_exception(exc)})")
        except Unsupported as exc:  # no variant of the task's optimizer: the policy means nothing here
            return PolicyForecast(plan.name, plan.describe(), "skipped", reason=str(exc),
                                  seconds=time.perf_counter() - start)
        except Exception as exc:
            return PolicyForecast(plan.name, plan.describe(), "failed", reason=describe_exception(exc),
                                  notes=tuple(notes), seconds=time.perf_counter() - start)
        return PolicyForecast(plan.name, plan.describe(), "ok", method=method, notes=tuple(dict.fromkeys(notes)),
                              train=train, infer=infer, train_fit=train_fit, infer_fit=infer_fit, check=check,
                              seconds=time.perf_counter() - start, time=timed)

    @property
    def times_here(self) -> bool:
        """The target is this machine: its kernels (and --check's steps) are timed here, where others may run."""
        return self.job.rates is not None and self.job.rates.times_kernels

    def time(self, plan: Plan, train: bool) -> TimeForecast | None:
        """The step's predicted time on the target from the ops its trace recorded (None: no rates to time with)."""
        traced, method = self._timed.get((plan.name, train), (None, ""))
        if self.times is None:
            return None
        if traced is not None and traced.shallow is not None:
            one, two, depth = traced.shallow
            return linear_time(self.times.of(plan, one, method), self.times.of(plan, two, method), depth)
        return self.times.of(plan, traced.ops if traced is not None else (), method)

    def fit(self, plan: Plan, train: bool, peak: PeakForecast, method: str, search: bool = True,
            ) -> FitForecast | None:
        """Against the usable memory per rank: the headroom, and the largest batch that fits (searched with traces,
        from the size already traced; not for a state-only estimate, whose peak leaves out what grows)."""
        limit = self.job.limit
        if limit is None:
            return None
        fits, headroom = peak.peak_bytes <= limit, limit - peak.peak_bytes
        if not (search and self.job.search) or method == "state-only":
            return FitForecast(fits, headroom)

        def peak_at(b: int) -> int:
            return self.peak(plan, b, train, [])[0].peak_bytes

        # what each sample adds, by the traced peak: its activations, loss and temporaries, when it is in a pass
        grows = None
        if peak.phase in ("batch", "forward", "backward"):
            grows = sum(peak.breakdown.get(k, 0) for k in ("activations", "loss", "temporaries")) / peak.batch_size
        found = largest_batch(peak_at, limit, peak.batch_size, known={peak.batch_size: peak.peak_bytes},
                              per_sample=grows)
        largest = None if found.largest is None else found.largest * self.job.nproc
        return FitForecast(fits, headroom, largest, found.capped, len(found.traced) - 1)

    def peak(self, plan: Plan, batch_size: int, train: bool, notes: list[str]) -> tuple[PeakForecast, str]:
        """The training (or inference) peak at ``batch_size`` per rank, and how it was had."""
        try:
            traced, method = self.trace(plan, batch_size, train)
        except Untraceable as exc:
            twin = emulated_version(plan)
            if twin is None:
                traced, method = self.fallback(plan, batch_size, train, str(exc), notes)
            else:  # a GPU format whose kernels this machine lacks: its emulation stores the same layout
                traced, method = self.trace(twin, batch_size, train)[0], "stand-in"
                notes.append(f"traced as {twin.name}, its emulation here ({exc}): the same stored layout; the real "
                             "kernels' temporaries may differ")
        if plan.distributed is not None and plan.distributed.strategy == "ddp":
            traced = shifted(traced, traced.most["gradients"], "gradients")
        if batch_size == self.job_size(train):
            self._timed[(plan.name, train)] = (traced, method)
        return peak_forecast(traced, batch_size, train), method

    def job_size(self, train: bool) -> int:
        """The batch size per rank the job forecasts (the search traces others)."""
        return self.job.batch_size if train else self.job.infer_batch_size

    def meta_at(self, depth: int | None) -> nn.Module:
        """The model on the meta device, with ``depth`` blocks (None: as the task builds it)."""
        if depth not in self._metas:
            torch.manual_seed(self.job.seed)
            with torch.device("meta"):
                self._metas[depth] = self.task.with_blocks(depth)
        return self._metas[depth]

    def converted(self, plan: Plan, depth: int | None = None) -> tuple[nn.Module, Plan, int]:
        """A copy of the plan's converted meta model (with ``depth`` blocks), the plan it was converted under (a
        stand-in's, when this machine cannot make the conversion: the kind's stored dtype in place of its converted
        weights) and the bytes its converted weights take beyond the stand-in's
        (``forecasting.adapters.STORED_WEIGHT_BYTES``)."""
        key = (plan.name, depth)
        if key not in self._converted:
            meta = self.meta_at(depth)
            try:
                precision = Precision(plan, "cpu", traced=True)
                model, stand, extra = precision.convert_module(fresh(meta)), plan, 0
                if depth is None or depth == SHALLOW[-1]:
                    self._conversion_notes[plan.name] = conversion_notes(precision, plan)
            except (Unsupported, DtypelabError):
                raise
            except Exception as exc:
                twin = emulated_version(plan)
                if twin is not None:  # a GPU format's emulation here stores the same layout
                    stand, extra = twin, 0
                    self._conversion_notes[plan.name] = [
                        f"converted as {twin.name}, its emulation here ({describe_exception(exc)}): the same stored "
                        "layout; the real kernels' temporaries may differ"]
                else:
                    stand, extra = stand_in(plan, meta, exc, self.target.round_to)
                model = Precision(stand, "cpu", traced=True).convert_module(fresh(meta))
            self._converted[key] = (model, stand, extra)
        model, stand, extra = self._converted[key]
        return fresh(model), stand, extra

    def trace(self, plan: Plan, batch_size: int, train: bool) -> tuple[Traced, str]:
        """The plan's training step (or inference pass) at ``batch_size``, and the method (traced, or a stand-in's);
        a deep stack of blocks from its traces with three and four (``forecasting.depth``)."""
        if self.blocks and plan.distributed is None:
            one, method, extra_one = self.trace_at(plan, batch_size, train, SHALLOW[0])
            two, _, extra_two = self.trace_at(plan, batch_size, train, SHALLOW[1])
            line = linear(one, two, self.blocks, (extra_one, extra_two), train)
            if line is not None:
                return line, method
        traced, method, extra = self.trace_at(plan, batch_size, train, None)
        return shifted(traced, extra, "parameters"), method

    def trace_at(self, plan: Plan, batch_size: int, train: bool, depth: int | None) -> tuple[Traced, str, int]:
        """The step with ``depth`` blocks: its forward and backward as the converted layout's (traced once per
        layout and size), joined to its own update (traced once); and the bytes its weights hold beyond the trace
        (a stand-in's layout)."""
        model, stand, extra = self.converted(plan, depth)
        method = "traced" if stand is plan else "stand-in"
        key = (layout(model, stand), plan.distributed, train, batch_size)
        try:
            if key not in self._passes:
                run = Run(self.task, stand, model, self.target, wrap=self.wrap(plan), converted=True,
                          moments=depth is not None, timed=batch_size == self.job_size(train))
                self._passes[key] = run.train(self.train_shape, batch_size, update=False) if train else \
                    run.infer(self.infer_shape, batch_size)
            traced = self._passes[key]
            if train:
                if (plan.name, depth) not in self._updates:
                    model, _, _ = self.converted(plan, depth)
                    run = Run(self.task, stand, model, self.target, wrap=self.wrap(plan), converted=True)
                    self._updates[(plan.name, depth)] = run.state()
                traced = joined(traced, self._updates[(plan.name, depth)])
        except (Unsupported, DtypelabError):
            raise
        except Exception as exc:
            raise Untraceable(describe_exception(exc)) from exc
        return traced, method, extra

    # --- what runs here (forecasting.local_run) --------------------------------------------------------------------
    def fallback(self, plan: Plan, batch_size: int, train: bool, why: str, notes: list[str]) -> tuple[Traced, str]:
        return local_run.fallback(self, plan, batch_size, train, why, notes)

    def run_here(self, plan: Plan, batch_size: int, train: bool, steps: int, device: str = "cpu") -> Traced:
        return local_run.run_here(self, plan, batch_size, train, steps, device)

    def check(self, plan: Plan, notes: list[str]) -> CheckResult | None:
        return local_run.check(self, plan, notes)


__all__ = ["Forecaster", "Untraceable"]
