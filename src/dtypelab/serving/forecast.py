"""``forecast TASK --mode generate``: each serving policy's memory, fit and speed on a device, nothing run.

The policies are split between this process and a worker started at once (those that share traces together; for
this CPU, whose kernels are timed here, one process alone); each is traced (``tracing``) and timed (``speed``), and
the record says which policy decodes fastest among those that fit, and which fits the longest context. ``--check``
runs the same workload here (``bench``) beside the forecast.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dtypelab.core.bands import band, overlaps
from dtypelab.core.errors import DtypelabError, describe_exception
from dtypelab.core.judging.generate import objective_value
from dtypelab.core.machine.speed import GPU_FLOOR_S
from dtypelab.core.objectives import objective as objective_of
from dtypelab.core.results import GenerateConfig, GenerateFigures, GeneratePolicy, GenerateReport, TargetDevice
from dtypelab.core.tasks.hub import quantized_note
from dtypelab.forecasting import (
    INTERRUPTED,
    ForecastOptions,
    Measured,
    StepTimes,
    calibrate,
    rates_for,
    read_measured,
    run_parts,
    target_power,
    worker_count,
)
from dtypelab.run import Outcome
from dtypelab.serving.engine import VLLM_VERSION, Engine
from dtypelab.serving.fake_serve import ServeForecaster, Traced
from dtypelab.serving.measure import with_speeds
from dtypelab.serving.paged import engine_of, paged_energy, paged_figures, with_stops_paying
from dtypelab.serving.policies import DEFAULT_FORECAST, DEFAULT_FORECAST_CPU, ServePolicy, serve_policies
from dtypelab.serving.served import load_served
from dtypelab.serving.speed import generation_energy, policy_figures, serving_rates
from dtypelab.serving.workload import Shape

Progress = Callable[[str, int, int], None]


def serve_forecast(spec: str, options: ForecastOptions | None = None, *, on_progress: Progress | None = None,
                   **settings: Any) -> GenerateReport:
    """Each serving policy forecast for the options' device: memory, whether it fits, the largest batch and longest
    context, and tokens per second; with ``check``, the same workload measured here beside it. ``options``
    (``ForecastOptions``, its mode ``generate``) or its fields as keywords."""
    from dtypelab.forecasting import target_device
    from dtypelab.serving.bench import check_shape

    opts = ForecastOptions.build(options, **{"mode": "generate", **settings})
    start = time.perf_counter()
    target = target_device(opts.device, opts.memory, opts.reserve)
    shape = Shape(opts.prompt_len, opts.gen_len, opts.batch_size or 1)
    measured = read_measured(opts.energy_from, target) if opts.energy_from else None  # its errors come first
    _check_here(opts.check, target.kind)
    chosen = _no_programs(serve_policies(opts.policies, DEFAULT_FORECAST if target.kind == "cuda" else
                                         DEFAULT_FORECAST_CPU))
    # a worker's imports run while this process reads the model; none for this CPU, whose kernels are timed here with
    # nothing beside them
    workers = _prestart(opts.launcher or "process") if target.kind == "cuda" else []
    served = load_served(spec)
    check_shape(shape, served.context, served.name, served.config)
    engine, link = engine_of(opts, target, served.context)
    rates, no_rates = rates_for(target) if opts.speed else (None, "")  # the source; each part times with its own
    parts = _parts(chosen, target, rates, len(workers))
    jobs = [ForecastPart(spec, shape, target, part, opts.seed, opts.batch_search, opts.speed, engine, link)
            for part in parts]
    outcomes, interrupted = _run_parts(jobs, workers, on_progress, len(chosen))
    found = {r.policy: r for job in jobs for r in job.kept}  # the parts run here
    found.update({r.policy: r for out in outcomes for r in _reported(out)})
    params = next((out.value[1] for out in outcomes if out.status == "ok"), 0)
    died = "; ".join(dict.fromkeys(out.reason or out.status for out in outcomes if out.status != "ok"))
    results = [found.get(p.name) or (GeneratePolicy(p.name, p.describe(), "interrupted", INTERRUPTED) if interrupted
                                     else GeneratePolicy(p.name, p.describe(), "failed", died or "not reported"))
               for p in chosen]
    if opts.check:
        results = _checked(spec, shape, results, chosen, opts.seed)
    results, energy_note = _with_energy(results, target, shape, measured)
    results = with_stops_paying(results, band("engine-speed"))  # a paged engine's curves; nothing without them
    objective = opts.objective or "decode"
    best, sentence = _answer(results, target, shape, objective, engine)
    longest = max((r for r in results if r.generate and r.generate.longest_context),
                  key=lambda r: r.generate.longest_context or 0, default=None)  # type: ignore[union-attr]
    notes = [n for n in (quantized_note(served.config), no_rates, _notes(shape, engine),
                         "" if engine.paged else _eager(chosen, target)) if n]
    report = GenerateReport(
        GenerateConfig(spec, served.name, "forecast", shape.prompt_len, shape.gen_len, shape.batch_size, target,
                       objective=objective, parameters=params, context_limit=served.context, engine=engine.name,
                       engine_settings=engine.settings()),
        tuple(results), _environment(), sentence, best, longest.policy if longest else "", tuple(notes),
        time.perf_counter() - start, time.strftime("%Y-%m-%dT%H:%M:%S"), rates=rates.source if rates else "",
        energy_note=energy_note)
    bands = _bands(target, rates is not None, bool(energy_note), engine)
    report = replace(report, speed_error=bands[0], ratio_error=bands[1], memory_error=bands[2], energy_error=bands[3])
    if opts.json_path:
        report.save(opts.json_path)
    if interrupted:  # what finished is saved: the caller says so
        raise KeyboardInterrupt
    return report


def _reported(out: Outcome) -> list[GeneratePolicy]:
    """A part's forecasts: all of them, or, of a part stopped before it returned, those it had reported."""
    if out.status == "ok":
        return list(out.value[0])
    return [m[0] for k, m in out.messages.items() if k.startswith("policy:")]


def _with_energy(results: list[GeneratePolicy], target: TargetDevice, shape: Shape, measured: Measured | None
                 ) -> tuple[list[GeneratePolicy], str]:
    """Each timed policy's generation energy on the target (the power model, calibrated by ``measured`` where given),
    and the model in words (or why there is no energy)."""
    model, why = target_power(target)
    timed = {r.policy: r.generate for r in results if r.generate and r.generate.token_latency_s}
    if not timed:
        return results, ""  # no time (--no-speed): nothing to say of energy either
    if model is None:
        return results, why
    model = calibrate(model, measured, {name: _generation_bounds(g, shape) for name, g in timed.items()
                                        if g is not None})
    out = [replace(r, generate=_energy_of(g, model, shape))
           if r.policy in timed and (g := r.generate) is not None else r for r in results]
    return out, model.by


def _energy_of(g: GenerateFigures, model: Any, shape: Shape) -> GenerateFigures:
    """A generation's energy (static), or a paged engine's steady step's per generated token, and each point's of
    its curve."""
    return paged_energy(g, model) if g.curve else replace(g, energy=generation_energy(g, model, shape))


def _generation_bounds(g: GenerateFigures, shape: Shape) -> dict[str, float]:
    """A whole generation's seconds by bound: the prefill's and every decode step's."""
    out = dict(g.prefill_bounds)
    for bound, seconds in g.decode_bounds.items():
        out[bound] = out.get(bound, 0.0) + (shape.gen_len - 1) * seconds
    return out




@dataclass(frozen=True)
class ForecastPart:
    """Some of a forecast's policies, traced in a worker of their own (``dtypelab.run``)."""

    spec: str
    shape: Shape
    target: TargetDevice
    names: tuple[str, ...]
    seed: int
    search: bool
    speed: bool
    engine: Engine = field(default_factory=Engine)
    link_gbs: float | None = None  # the card's interconnect, GB/s each way (tensor parallel)
    # its forecasts as they finish, in the process that made it: what a part run here and stopped by Ctrl-C leaves
    kept: list[GeneratePolicy] = field(default_factory=list, compare=False, repr=False)

    @property
    def name(self) -> str:
        return f"serving-forecast-{self.names[0]}"

    def __call__(self, report: Any) -> tuple[list[GeneratePolicy], int]:
        fc = ServeForecaster(load_served(self.spec), self.target, self.seed)
        rates, _ = serving_rates(self.target, fc) if self.speed else (None, "")
        times = StepTimes(rates) if rates is not None else None
        cache: dict[tuple[Any, ...], Traced] = {}
        out = []
        for i, name in enumerate(self.names):
            out.append(_forecast_one(fc, serve_policies(name, ())[0], self.shape, times, cache, self))
            report.send(f"policy:{name}", out[-1])  # kept should a worker be stopped before it returns
            self.kept.append(out[-1])
            report.step(i + 1, len(self.names))
        return out, fc.parameters()


def _check_here(check: bool, kind: str) -> None:
    here = "cuda" if torch.cuda.is_available() else "cpu"
    if check and kind != here:
        raise DtypelabError(f"--check runs the workload here ({here}): forecast for --device {here}, or leave out "
                            "--check")


def _no_programs(chosen: list[ServePolicy]) -> list[ServePolicy]:
    """``chosen``, none of them a device program (refused in one line)."""
    programs = [p for p in chosen if p.plan.program]
    if programs:
        raise DtypelabError(f"{', '.join(p.name for p in programs)}: a {programs[0].plan.program} generation program "
                            "is measured by bench --mode generate on this CPU (its .pte, its cache and its planned "
                            "memory); forecast traces eager PyTorch, and a device's latency is not forecast")
    return chosen


def _parts(chosen: list[ServePolicy], target: TargetDevice, rates: Any, workers: int) -> list[tuple[str, ...]]:
    """The policies split between the workers: those sharing traces (a weight format's KV variants; on a GPU the
    formats traced with bfloat16 weights in their place) kept together; kernels timed here by one worker alone."""
    if rates is not None and rates.times_kernels:
        return [tuple(p.name for p in chosen)]
    families: dict[tuple[str, str], list[str]] = {}
    for p in chosen:
        stand_in = target.kind == "cuda" and p.plan.gpu_only
        layout = "bf16" if stand_in or p.plan.name == "bf16" else p.plan.name
        families.setdefault((layout, p.kv.label), []).append(p.name)
    parts: list[list[str]] = [[] for _ in range(min(workers + 1, len(families)))]
    for family in sorted(families.values(), key=len, reverse=True):
        min(parts, key=len).extend(family)
    return [tuple(part) for part in parts if part]


PRELOAD = ("transformers.modeling_utils", "transformers.activations", "transformers.models.auto.modeling_auto")


def _prestart(launcher: str) -> list[Any]:
    """The worker processes beside this one (none inline; as many as the forecasts' pool runs at once), started now
    with the libraries a trace needs."""
    from dtypelab.run import ProcessLauncher

    if launcher == "inline":
        return []
    workers = [ProcessLauncher() for _ in range(worker_count(None, len(DEFAULT_FORECAST)) - 1)]
    for worker in workers:
        worker.prestart((__name__, *PRELOAD))
    return workers


def _run_parts(parts: list[ForecastPart], workers: list[Any], on_progress: Progress | None, total: int
               ) -> tuple[list[Outcome], bool]:
    """The first part in this process (its libraries are imported already), the others in the workers, at once, on
    the workers training's forecast shares (``forecasting.pool``); (outcomes, whether Ctrl-C stopped them)."""
    from dtypelab.run import LAUNCHERS

    done = [0] * len(parts)

    def step(i: int, n: int) -> None:
        done[i] = n
        if on_progress is not None:
            on_progress(parts[i].names[n - 1], sum(done), total)

    launchers = [workers[i - 1] if 0 < i <= len(workers) else LAUNCHERS["inline"] for i in range(len(parts))]
    return run_parts(parts, launchers, step, together=bool(workers))


def _forecast_one(fc: ServeForecaster, p: ServePolicy, shape: Shape, times: StepTimes | None,
                  cache: dict[tuple[Any, ...], Traced], part: ForecastPart) -> GeneratePolicy:
    start = time.perf_counter()
    notes: tuple[str, ...] = ()
    try:
        if part.engine.paged:
            figures = paged_figures(fc, p, shape, times, cache, part.engine, part.link_gbs)
        else:
            figures, notes = policy_figures(fc, p, shape, times, cache, part.search)
    except DtypelabError as exc:
        return GeneratePolicy(p.name, p.describe(), "failed", str(exc), seconds=time.perf_counter() - start)
    except Exception as exc:
        return GeneratePolicy(p.name, p.describe(), "failed", f"tracing it failed: {describe_exception(exc)}",
                              seconds=time.perf_counter() - start)
    return GeneratePolicy(p.name, p.describe(), "ok", generate=figures, notes=notes,
                          seconds=time.perf_counter() - start)


def _answer(results: list[GeneratePolicy], target: TargetDevice, shape: Shape, objective: str,
            engine: Engine | None = None) -> tuple[str, str]:
    """The policy best at ``objective`` among those that fit (every one, with no memory to fit), in a sentence."""
    ok = [r for r in results if r.status == "ok" and r.generate is not None]
    if not ok:
        return "", "no policy could be forecast"
    limited = target.usable_bytes is not None
    fits = [r for r in ok if r.generate.fits is not False]  # type: ignore[union-attr]
    timed = [r for r in fits if r.generate is not None and objective_value(r.generate, objective, shape.gen_len)]
    where = f"that fits {target.label}" if limited else "(no memory to fit: give --device or --memory)"
    if timed:
        paged = engine is not None and engine.paged
        error = 0.0 if target.kind != "cuda" else band("engine-speed") if paged else band(
            objective_of(objective).band)  # the evidence is GPUs'
        best, tied = _tied(timed, objective, shape, error)
        g = best.generate
        assert g is not None
        at = (f"{shape.batch_size} concurrent requests of {shape.prompt_len:,} + {shape.gen_len:,} tokens (vLLM)"
              if paged else f"batch {shape.batch_size}, {shape.context:,} tokens of context")
        said = (f"{best.policy}: {objective_of(objective).best_at} {where} at {at}: {_figure(g, objective, shape)}, "
                f"peak {(g.peak_bytes or 0) / 2**30:.3g} GiB")
        if tied:
            said += (f"; within the forecast's error of it (±{error:.0%}, docs/validation.md): "
                     f"{', '.join(r.policy for r in tied)}: a tie, broken by the wider weights (the safer numerics)")
        return best.policy, said
    if not fits:
        small = min(ok, key=lambda r: r.generate.peak_bytes or 0)  # type: ignore[union-attr]
        return "", f"no policy fits {target.label}: the smallest peak is {small.policy}'s"
    small = min(fits, key=lambda r: r.generate.peak_bytes or 0)  # type: ignore[union-attr]
    if not limited:
        return small.policy, f"the smallest peak: {small.policy} (no memory to fit: give --device or --memory)"
    return small.policy, f"{len(fits)} of {len(ok)} policies fit {target.label}; the smallest peak: {small.policy}"


def _bands(target: TargetDevice, timed: bool, energy: bool, engine: Engine
           ) -> tuple[float, float, float, float]:
    """The record's bands (decode tok/s, one format over another, peak, joules): the validation set's, for a GPU (its
    cases are all GPUs'); none on this CPU, whose kernels are timed here (``--check`` measures the rest). A paged
    engine's: its KV pool's and its format-over-bfloat16 ratios' families; none claimed for its absolute tokens a
    second or joules, which no published case checks."""
    gpu = target.kind == "cuda"
    if engine.paged:
        return 0.0, band("engine-speed") if timed else 0.0, band("kv-capacity"), 0.0
    return (band("serve-tok-s") if gpu and timed else 0.0, band("serve-speed") if gpu and timed else 0.0,
            band("serve-peak") if gpu else 0.0, band("energy") if gpu and energy else 0.0)


def _tied(timed: list[GeneratePolicy], objective: str, shape: Shape, error: float
          ) -> tuple[GeneratePolicy, list[GeneratePolicy]]:
    """The best at ``objective`` and those whose band overlaps its: the tie goes to the one storing the most bytes of
    weights (the widest format, the safest numerics), as ``forecast`` breaks a tie by the safer numerics."""
    def value(r: GeneratePolicy) -> float:
        assert r.generate is not None
        return objective_value(r.generate, objective, shape.gen_len)

    top = max(timed, key=value)
    close = [r for r in timed if overlaps(value(r), value(top), error)]
    best = max(close, key=lambda r: (r.generate.weights_bytes or 0, value(r)))  # type: ignore[union-attr]
    return best, [r for r in close if r is not best]


def _figure(g: GenerateFigures, objective: str, shape: Shape) -> str:
    if objective == "prefill":
        return f"{g.prefill_tok_s:,.0f} prompt tokens/s ({g.prefill_bound}-bound)"
    if objective == "latency":
        total = (g.ttft_s or 0.0) + (shape.gen_len - 1) * (g.token_latency_s or 0.0)
        return f"the whole generation (first token and {shape.gen_len - 1} more) in {total:.3g} s"
    if objective_of(objective).counts_joules and g.energy is not None and g.energy.joules_per_token:
        return f"{g.energy.joules_per_token:.3g} J per generated token"
    return f"{g.decode_tok_s:,.0f} tokens/s ({g.bound}-bound)"


def _notes(shape: Shape, engine: Engine) -> str:
    if engine.paged:
        return (f"{VLLM_VERSION}: memory as its start-up accounts it, the KV cache in pages; steady state at "
                f"{shape.batch_size} concurrent requests, each half-way through its generation ({shape.prompt_len:,}"
                f" + {shape.gen_len // 2:,} tokens cached), the prompts of new requests prefilled in chunks inside "
                "the same steps; each format as vLLM's kernel for it")
    return (f"decode at the full context ({shape.context:,} tokens): a static cache is read whole at every step, so "
            "every step of the generation costs the same; the prefill keeps the last position's logits only")


def _eager(chosen: list[ServePolicy], target: TargetDevice) -> str:
    """On a GPU: what an eager policy's time leaves out, and how its quantized layers are timed."""
    eager = [p.name for p in chosen if not p.plan.compiles]
    if target.kind != "cuda" or not eager:
        return ""
    return (f"eager ({', '.join(eager)}): each op a kernel of its own, at least {GPU_FLOOR_S * 1e6:g} µs each; the "
            "launch overhead of eager PyTorch beyond that is not modelled (NAME+compile fuses the ops); a quantized "
            "layer is timed as the one kernel its format runs compiled (torch.compile fuses the dequantization into "
            "the GEMM)")


def _environment() -> dict[str, Any]:
    from dtypelab.core.machine.hardware import environment, hardware_for

    return environment(hardware_for(torch.device("cpu"), None, budget_s=0.02))


CHECK_ROUNDS = 5


def _fastest(g: GenerateFigures | None, shape: Shape) -> GenerateFigures | None:
    """Measured figures with the speeds of the fastest round (each round's median generation)."""
    if g is None or not g.ttft_runs_s or not g.decode_runs_s:
        return g
    return with_speeds(g, shape, min(g.ttft_runs_s), min(g.decode_runs_s))


def _checked(spec: str, shape: Shape, results: list[GeneratePolicy], chosen: list[ServePolicy],
             seed: int) -> list[GeneratePolicy]:
    """The forecast beside the same workload measured here (this CPU): each policy that runs here, its speed the
    fastest of its rounds (the least disturbed: the forecast is of an undisturbed machine)."""
    from dtypelab.serving.bench import serve_bench

    names = ",".join(p.name for p in chosen)
    measured = serve_bench(spec, policies=names, baseline=chosen[0].name, seed=seed, rounds=CHECK_ROUNDS,
                           prompt_len=shape.prompt_len, gen_len=shape.gen_len, batch_size=shape.batch_size)
    out = []
    for r in results:
        m = next((x for x in measured.policies if x.policy == r.policy), None)
        out.append(replace(r, check=_fastest(m.generate, shape) if m is not None and m.status == "ok" else None,
                           notes=r.notes + ((f"--check: {m.reason}",) if m is not None and m.status != "ok" else ())))
    return out
