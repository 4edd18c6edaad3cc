"""The forecast's work, in a worker process: each policy's training and inference peaks, traced; the largest batch
that fits; and, with ``--check``, the same steps run here on real tensors. A ``Work`` of ``dtypelab.run``.

When a trace cannot be made, what is said instead is stated in the record (``method``):

- ``stand-in``: a conversion that needs hardware this machine lacks (fp8 and int4 inference need CUDA) is traced
  with its stored dtype in place of the converted weights, whose bytes come from the kind's layout
  (``Config.stored_weight_bytes``);
- ``measured``: a step that cannot be traced on fake tensors (a data-dependent op: ``.item()``, ``nonzero``) is run
  here at two small batch sizes, counted by the same ledger, and extrapolated along the line through them, when the
  model fits this machine;
- ``state-only``: neither: the weights, gradients and one optimizer step traced alone; activations not counted.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from dtypelab.core.errors import DtypelabError, Unsupported, describe_exception
from dtypelab.core.footprint import tensor_bytes
from dtypelab.core.policies import Cast, Config, Plan, Precision, emulated_version, get_policy
from dtypelab.core.results import CheckResult, FitForecast, PeakForecast, PolicyForecast
from dtypelab.core.task import Task, load_task
from dtypelab.forecasting.ledger import Peak
from dtypelab.forecasting.search import largest_batch
from dtypelab.forecasting.trace import (
    Run,
    Target,
    Traced,
    fresh,
    infer_batch_shape,
    joined,
    meta_model,
    train_batch_shape,
)

CHECK_STEPS = 3  # --check: real steps, the first making the optimizer's state


class Untraceable(Exception):
    """The step could not be traced on fake tensors (a data-dependent op, an op without a fake kernel)."""


@dataclass(frozen=True)
class ForecastJob:
    """Some policies' forecasts, run where a launcher puts it (picklable: the task travels as its spec)."""

    task_spec: str
    plans: tuple[Plan, ...]  # grouped into families (``groups``), the largest first
    batch_size: int  # per rank
    infer_batch_size: int
    target: str  # cuda or cpu
    nproc: int = 1
    seed: int = 0
    limit: int | None = None  # usable bytes per rank: search the largest batch that fits
    search: bool = True
    check: bool = False
    check_device: str = "cpu"  # --check runs here, on this device
    part: int = 0
    device: str = "cpu"  # where the work runs (the launcher forks CPU work from its zygote)
    groups: tuple[int, ...] = ()  # how many plans each family has, in order (none: one family each)
    claims: str | None = None  # a folder shared with the other workers: each family is taken by whoever is free

    def __post_init__(self) -> None:
        object.__setattr__(self, "plans", tuple(get_policy(p) for p in self.plans))

    @property
    def name(self) -> str:
        return f"forecast-{self.part}"

    def __call__(self, report: Any) -> tuple[int, list[PolicyForecast]]:
        """(the model's parameter count, each policy's forecast)."""
        forecaster = Forecaster(self, load_task(self.task_spec))
        count = sum(p.numel() for p in {id(p): p for p in forecaster.meta.parameters()}.values())
        out: list[PolicyForecast] = []
        try:
            for family in self._families():
                if not self._claim(family[0].name):
                    continue  # another worker took it
                for plan in family:
                    result = forecaster.policy(plan)
                    report.send(f"policy:{plan.name}", result)  # kept by the launcher even if a later one crashes
                    out.append(result)
                    report.step(len(out), len(self.plans))
        finally:
            forecaster.close()
        return count, out

    def _families(self) -> list[list[Plan]]:
        sizes = self.groups or (1,) * len(self.plans)
        out, i = [], 0
        for n in sizes:
            out.append(list(self.plans[i:i + n]))
            i += n
        return out

    def _claim(self, name: str) -> bool:
        """Take a family for this worker (whoever creates its file first); always, without a claims folder."""
        if self.claims is None:
            return True
        try:
            fd = os.open(os.path.join(self.claims, name.replace("/", "_")), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, str(self.part).encode())
        os.close(fd)
        return True


def _peak(traced: Traced, batch_size: int, activations: bool) -> PeakForecast:
    p = traced.peak
    return PeakForecast(batch_size=batch_size, peak_bytes=p.total,
                        breakdown={k: int(v) for k, v in p.breakdown.items()}, phase=p.phase, module=p.module,
                        activations_bytes=traced.most["activations"] if activations else None,
                        parameter_bytes=traced.parameter_bytes)


def _shifted(traced: Traced, extra: int, category: str) -> Traced:
    """``traced`` with ``extra`` bytes held all along in ``category`` (weights by their layout, DDP's buckets)."""
    if not extra:
        return traced
    breakdown = dict(traced.peak.breakdown)
    breakdown[category] += extra
    most = dict(traced.most)
    most[category] += extra
    params = traced.parameter_bytes + (extra if category == "parameters" else 0)
    return Traced(Peak(traced.peak.total + extra, breakdown, traced.peak.phase, traced.peak.module), most, params)


class Forecaster:
    """One task's forecasts: its model built once on the meta device; each policy's converted once and copied for
    each trace; an inference pass traced once for policies whose converted models are the same."""

    def __init__(self, job: ForecastJob, task: Task) -> None:
        self.job, self.task = job, task
        self.target = Target(job.target)
        self.meta, self.build_note = meta_model(task, job.seed)
        self.trains = not task.inference_only
        self.train_shape = train_batch_shape(task) if self.trains else None
        self.infer_shape = infer_batch_shape(task)
        self._mesh: Any = None
        self._hardware: Any = None
        self._converted: dict[str, tuple[nn.Module, Plan, int]] = {}  # plan -> (converted meta model, traced, extra)
        # what policies share: a forward and backward (training) or a forward (inference) per converted layout and
        # batch size (bf16, bf16-kahan and bf16-sr+adam8bit convert the model alike); each policy's own update
        self._passes: dict[tuple[Any, ...], Traced] = {}
        self._updates: dict[str, Traced] = {}
        self._measured: dict[tuple[str, bool], tuple[list[Traced], tuple[int, ...]]] = {}

    def _here(self) -> Any:
        if self._hardware is None:
            from dtypelab.core.hardware import hardware_for

            self._hardware = hardware_for(torch.device(self.job.check_device), None, budget_s=0.02)
        return self._hardware

    def close(self) -> None:
        if self._mesh is not None:
            from torch import distributed as dist

            dist.destroy_process_group()
            self._mesh = None

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
            notes += self._conversion_notes(plan)
            check = None
            if self.job.check:
                try:  # a check that fails keeps the forecast it was checking
                    check = self.check(plan, notes)
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
                              seconds=time.perf_counter() - start)

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

        grows = None  # what each sample adds, by the traced peak: its activations and temporaries, when it is in a pass
        if peak.phase in ("batch", "forward", "backward"):
            grows = (peak.breakdown["activations"] + peak.breakdown["temporaries"]) / peak.batch_size
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
            traced = _shifted(traced, traced.most["gradients"], "gradients")
        return _peak(traced, batch_size, train), method

    def converted(self, plan: Plan) -> tuple[nn.Module, Plan, int]:
        """A copy of the plan's converted meta model, the plan it was converted under (a stand-in's, when this
        machine cannot make the conversion: the kind's stored dtype in place of its converted weights) and the bytes
        its converted weights take beyond the stand-in's (``Config.stored_weight_bytes``)."""
        if plan.name not in self._converted:
            try:
                model, stand, extra = Precision(plan, "cpu", traced=True).convert_module(fresh(self.meta)), plan, 0
            except (Unsupported, DtypelabError):
                raise
            except Exception as exc:
                stand, extra = self._stand_in(plan, exc)
                model = Precision(stand, "cpu", traced=True).convert_module(fresh(self.meta))
            self._converted[plan.name] = (model, stand, extra)
        model, stand, extra = self._converted[plan.name]
        return fresh(model), stand, extra

    def trace(self, plan: Plan, batch_size: int, train: bool) -> tuple[Traced, str]:
        """The plan's training step (or inference pass) at ``batch_size``, and the method (traced, or a stand-in's):
        its forward and backward as the converted layout's (traced once per layout and size), joined to its own
        update (traced once)."""
        model, stand, extra = self.converted(plan)
        method = "traced" if stand is plan else "stand-in"
        key = (_layout(model, stand), plan.distributed, train, batch_size)
        try:
            if key not in self._passes:
                run = Run(self.task, stand, model, self.target, wrap=self._wrap(plan), converted=True)
                self._passes[key] = run.train(self.train_shape, batch_size, update=False) if train else \
                    run.infer(self.infer_shape, batch_size)
            traced = self._passes[key]
            if train:
                if plan.name not in self._updates:
                    model, _, _ = self.converted(plan)
                    run = Run(self.task, stand, model, self.target, wrap=self._wrap(plan), converted=True)
                    self._updates[plan.name] = run.state()
                traced = joined(traced, self._updates[plan.name])
        except (Unsupported, DtypelabError):
            raise
        except Exception as exc:
            raise Untraceable(describe_exception(exc)) from exc
        return _shifted(traced, extra, "parameters"), method

    def _conversion_notes(self, plan: Plan) -> list[str]:
        """What the kinds' conversions took and left out (float8 leaves small layers in bfloat16)."""
        if plan.name not in self._converted or self._converted[plan.name][1] is not plan:
            return []
        report = Precision(plan, "cpu", traced=True)
        report.convert_module(fresh(self.meta))
        conv = report.conversion()
        if not conv.get("left_out"):
            return []
        why = conv["left_out"][0]["why"]
        return [f"{conv.get('format', plan.name)}: {len(conv.get('converted', []))} layers converted, "
                f"{len(conv['left_out'])} left as they are ({conv['left_out'][0]['layer']}: {why})"]

    def _stand_in(self, plan: Plan, exc: Exception) -> tuple[Plan, int]:
        """The plan with each config whose conversion failed here replaced by a cast to its stored dtype, and the
        bytes its converted weights take beyond that cast's (from ``Config.stored_weight_bytes``)."""
        layout = [c for c in plan.configs if type(c).stored_weight_bytes is not Config.stored_weight_bytes]
        if not layout:
            raise DtypelabError(f"converting the model failed: {describe_exception(exc)}") from exc
        swap = {c: Cast(c.storage_dtype) for c in layout}
        stand = Plan(swap.get(plan.default, plan.default), tuple((p, swap.get(c, c)) for p, c in plan.rules),
                     name=plan.name, distributed=plan.distributed, state=plan.state)
        model = fresh(self.meta)
        assigned = plan.assign(model)
        modules = dict(model.named_modules(remove_duplicate=False))
        extra = 0
        for name, config in assigned.items():
            stored = config.stored_weight_bytes(modules[name]) if config in swap else None
            if stored is not None:
                weight = modules[name].weight
                extra += stored - weight.numel() * getattr(torch, config.storage_dtype).itemsize
                if self.target.round_to > 1:  # each of the layout's tensors is a block of its own
                    extra += self.target.round_to
        return stand, extra

    def _wrap(self, plan: Plan) -> Any:
        """FSDP2 on a fake process group of ``nproc`` ranks (one process plays rank 0); DDP shards nothing."""
        if plan.distributed is None or plan.distributed.strategy != "fsdp":
            return None
        if self._mesh is None:
            from torch import distributed as dist
            from torch.distributed._tools import fake_collectives  # noqa: F401  the collectives' fake kernels
            from torch.distributed.device_mesh import init_device_mesh
            from torch.testing._internal.distributed.fake_pg import FakeStore  # the "fake" backend's store

            if dist.is_initialized():
                raise DtypelabError("forecast --nproc runs in a process of its own (torch.distributed is already "
                                    "initialized here)")
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.job.nproc)
            self._mesh = init_device_mesh("cpu", (self.job.nproc,))  # outside the fake tensors: it reads its ranks
        from dtypelab.distributed import wrap_fsdp

        spec, mesh = plan.distributed, self._mesh
        return lambda model: wrap_fsdp(model, spec, torch.device("cpu"), mesh=mesh)

    # --- when the step cannot be traced ----------------------------------------------------------
    def fallback(self, plan: Plan, batch_size: int, train: bool, why: str, notes: list[str]) -> tuple[Traced, str]:
        room = _available_bytes()
        weights = tensor_bytes(self.meta.parameters())
        if room is not None and 8 * weights < room and plan.distributed is None:
            sizes = (batch_size,) if batch_size <= 4 else (2, 4)
            key = (plan.name, train)
            if key not in self._measured or (self._measured[key][1] != sizes and len(sizes) == 1):
                self._measured[key] = ([self._real(plan, b, train, steps=2) for b in sizes], sizes)
            runs, sizes = self._measured[key]
            notes.append(f"the step could not be traced on fake tensors ({why}); it was run here on real tensors at "
                         f"batch size {' and '.join(map(str, sizes))}" + (
                             " and extrapolated along the line through them" if len(sizes) > 1 else ""))
            return (runs[0] if len(runs) == 1 else _extrapolate(runs, sizes, batch_size)), "measured"
        model, stand, extra = self.converted(plan)
        run = Run(self.task, stand, model, self.target, wrap=self._wrap(plan), converted=True)
        if not train:
            notes.append(f"the inference pass could not be traced on fake tensors ({why}), and the model is too large "
                         "to run here: its weights alone are counted, so its peak is at least this")
            return _shifted(run.weights(), extra, "parameters"), "state-only"
        notes.append(f"the step could not be traced on fake tensors ({why}), and the model is too large to run "
                     "here: its weights, gradients and optimizer state are traced alone; activations are not "
                     "counted, so the peak is at least this")
        return _shifted(run.state(), extra, "parameters"), "state-only"

    def _real(self, plan: Plan, batch_size: int, train: bool, steps: int, device: str = "cpu") -> Traced:
        torch.manual_seed(self.job.seed)
        model = self.task.make_model()
        run = Run(self.task, plan, model, self.target, fake=False, device=device)
        if train:
            return run.train(lambda step: self.task.train_batch(step, batch_size), batch_size, steps=steps)
        return run.infer(lambda step: self.task.inference_inputs(batch_size), batch_size)

    # --- --check ------------------------------------------------------------------------------------------
    def check(self, plan: Plan, notes: list[str]) -> CheckResult | None:
        """The same steps on real tensors here: the ledger's peak over CHECK_STEPS steps, and the process peak as
        bench measures it."""
        if plan.distributed is not None:
            notes.append("--check: a distributed policy is measured by bench --nproc, not here")
            return None
        avail = plan.availability(self._here())
        if not avail.ok:
            notes.append(f"--check: it cannot run here ({avail.reason})")
            return None
        room, weights = _available_bytes(), tensor_bytes(self.meta.parameters())
        if room is not None and 8 * weights > room:
            notes.append("--check: the model does not fit this machine's memory")
            return None
        device = self.job.check_device
        train = self._real(plan, self.job.batch_size, True, CHECK_STEPS, device) if self.trains and \
            "train" in plan.modes else None
        infer = self._real(plan, self.job.infer_batch_size, False, 1, device) if "infer" in plan.modes or \
            train is not None else None
        process, method = _process_peak(self.task, plan, device, self.job.batch_size, train is not None, self.job.seed)
        return CheckResult(CHECK_STEPS if train is not None else 1,
                           train.peak.total if train is not None else None,
                           infer.peak.total if infer is not None else None, process, method)


def _layout(model: nn.Module, plan: Plan) -> tuple[Any, ...]:
    """What decides an inference pass's memory, from the converted model: every module's type and region, every
    parameter's and buffer's type, dtype and shape, and the forward's autocast; two plans with the same layout (bf16,
    bf16-sr, bf16-kahan: the optimizer aside) run the same inference."""
    def region(m: nn.Module) -> str:
        r = getattr(m, "_dtypelab_region", None)
        return r.config.label if r is not None else ""

    def tensor(t: torch.Tensor) -> tuple[Any, ...]:
        # a quantized weight's subclass says in its flatten context how it runs (int8-dyn and int8-wo store the same
        # Int8Tensor; only the first quantizes the activations too)
        ctx = repr(t.__tensor_flatten__()[1]) if is_traceable_wrapper_subclass(t) else ""
        return type(t).__name__, str(t.dtype), tuple(t.shape), t.requires_grad, ctx

    modules = tuple((n, type(m).__name__, region(m)) for n, m in model.named_modules())
    tensors = tuple((n, *tensor(t)) for n, t in [*model.named_parameters(), *model.named_buffers()])
    kind = type(plan.default)
    return (modules, tensors, plan.default.autocast_dtype, plan.default.storage_dtype,
            kind.forward_context.__qualname__, kind.convert_output.__qualname__)


def _extrapolate(runs: list[Traced], sizes: tuple[int, ...], batch_size: int) -> Traced:
    """The peak at ``batch_size`` on the line through two measured ones, category by category."""
    (a, b), (sa, sb) = runs, sizes
    t = (batch_size - sa) / (sb - sa)
    breakdown = {k: max(0, round(a.peak.breakdown[k] + t * (b.peak.breakdown[k] - a.peak.breakdown[k])))
                 for k in a.peak.breakdown}
    most = {k: max(0, round(a.most[k] + t * (b.most[k] - a.most[k]))) for k in a.most}
    return Traced(Peak(sum(breakdown.values()), breakdown, b.peak.phase, b.peak.module), most, b.parameter_bytes)


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _process_peak(task: Task, plan: Plan, device: str, batch_size: int, train: bool, seed: int,
                  ) -> tuple[int | None, str]:
    """The run's peak as ``bench`` measures it (``MemoryMeter``): CHECK_STEPS training steps (or one inference
    pass) above the memory in use before the model was built."""
    from dtypelab.core.loop import build_model, build_trainable, forward, prime, to_device, train_step
    from dtypelab.core.measure import MemoryMeter
    from dtypelab.core.policies import Precision

    dev = torch.device(device)
    if dev.type == "cpu":
        prime(task, plan, dev, batch_size, train=train)
    precision = Precision(plan, dev)
    meter = MemoryMeter(dev)
    meter.start()
    model: nn.Module = build_model(task, seed)
    model, optimizer = build_trainable(task, precision, dev, model=model, train=train)
    meter.open_window()
    with precision.session():
        if train:
            for step in range(CHECK_STEPS):
                inputs, target = to_device(task.batch(step, batch_size), dev)
                train_step(task, model, precision, optimizer, inputs, target)
        else:
            with torch.no_grad():
                forward(model, precision, to_device(task.inference_inputs(batch_size), dev))
    peak = meter.peak_bytes()
    del model, optimizer
    return peak, meter.method


__all__ = ["ForecastJob", "Forecaster", "Untraceable"]
