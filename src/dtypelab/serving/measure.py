"""One serving policy measured here: a ``Work`` of ``dtypelab.run`` (it runs in a child process of its own).

The model is converted by the policy's own kinds (``Precision.convert_module``: casts, quantized weights), its
cache made in the policy's KV format, then: one generation counted by the ledger on real tensors (the peak of the
prefill and of a decode step, by what holds it: weights, cache, the rest); one untimed generation (warm-up; a
compiled policy compiles there); ``repeats`` timed ones (medians); and the held-out text read through the cache.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from dtypelab.core.disturbance import CpuMeter
from dtypelab.core.energy import Meter, measuring
from dtypelab.core.loop import threads
from dtypelab.core.measure import device_sync
from dtypelab.core.pairing import block_energy
from dtypelab.core.policies import Plan, Precision
from dtypelab.core.results import Energy, EnergySource, GenerateFigures, RoundBlock
from dtypelab.forecasting import Ledger, Peak
from dtypelab.run import Reporter
from dtypelab.serving.kv import cache_bytes, kv_format
from dtypelab.serving.served import config_of, load_served
from dtypelab.serving.workload import Shape, compute_dtype, decode, generate, new_cache, prefill, score

WEIGHTS = ("parameters", "frozen_weights")
ENERGY_WINDOWS = 3  # windows of whole generations (and of prefills) the energy counter reads, per policy


@dataclass(frozen=True)
class GenerateJob:
    """Everything a child needs, picklable: the model travels as its spec and is built there."""

    spec: str
    plan: Plan
    kv: str  # a KV format's label (``serving.kv.FORMATS``), or kv-native
    label: str  # the policy as named: PLAN[+KV]
    shape: Shape
    repeats: int
    quality_sequences: int
    quality_len: int
    seed: int
    device: str
    threads: int | None = None

    @property
    def name(self) -> str:
        return self.label

    def __call__(self, report: Reporter) -> dict[str, Any]:
        with threads(self.threads):
            return measure(self, report)


def prompts(text: Any, shape: Shape) -> torch.Tensor:
    """``batch_size`` prompts from the held-out text (repeated when it has fewer windows than that)."""
    ids = text(shape.batch_size, shape.context)[:, :shape.prompt_len]
    while len(ids) < shape.batch_size:
        ids = torch.cat([ids, ids])[:shape.batch_size]
    return ids


def counted(model: Any, config: Any, job: GenerateJob, ids: torch.Tensor, dtype: torch.dtype,
            device: torch.device) -> dict[str, Any]:
    """The prefill's and one decode step's peaks, by what holds them (a static cache: every decode step holds the
    same), counted on real tensors."""
    fmt = kv_format(job.kv)
    with Ledger() as ledger:
        ledger.claim(model.parameters(), "parameters")
        ledger.claim(model.buffers(), "parameters")
        with ledger.phase_of("cache", default="buffers"):
            cache = new_cache(config, fmt, job.shape, dtype, device)
        with ledger.phase_of("prefill"):
            token = prefill(model, ids, cache)
        with ledger.phase_of("decode"):
            decode(model, token, cache)
        weights = sum(ledger.current[k] for k in WEIGHTS)
        return {"weights": weights, "kv": cache_bytes(cache), "prefill": ledger.phases["prefill"],
                "decode": ledger.phases["decode"]}


def with_speeds(figures: GenerateFigures, shape: Shape, ttft_s: float, decode_s: float) -> GenerateFigures:
    """``figures`` with the speeds of a generation that took ``ttft_s`` to its first token, ``decode_s`` the rest."""
    steps = shape.gen_len - 1
    return replace(figures, ttft_s=ttft_s, prefill_tok_s=shape.batch_size * shape.prompt_len / ttft_s,
                   decode_tok_s=shape.batch_size * steps / decode_s if steps and decode_s > 0 else None,
                   token_latency_s=decode_s / steps if steps else None)


def figures(memory: dict[str, Any], runs: list[Any], shape: Shape) -> GenerateFigures:
    prefill_peak: Peak = memory["prefill"]
    decode_peak: Peak = memory["decode"]
    top = max(prefill_peak, decode_peak, key=lambda p: p.total)
    measured = GenerateFigures(
        peak_bytes=top.total, weights_bytes=memory["weights"], kv_cache_bytes=memory["kv"],
        activations_bytes=top.total - memory["weights"] - memory["kv"], prefill_peak_bytes=prefill_peak.total,
        decode_peak_bytes=decode_peak.total, kv_bytes_per_token=memory["kv"] // (shape.batch_size * shape.context),
        ttft_runs_s=tuple(r.ttft_s for r in runs), decode_runs_s=tuple(r.decode_s for r in runs))
    return with_speeds(measured, shape, statistics.median(measured.ttft_runs_s),
                       statistics.median(measured.decode_runs_s))


def measure(job: GenerateJob, report: Reporter) -> dict[str, Any]:
    served = load_served(job.spec)
    device = torch.device(job.device)
    torch.manual_seed(job.seed)
    model = served.make_model().eval()
    config = config_of(model)
    precision = Precision(job.plan, device)
    model = precision.convert_module(model.to(device))
    sync = device_sync(device) or (lambda: None)
    total = job.repeats + 3
    with precision.session(), torch.inference_mode():
        dtype = compute_dtype(model, config, device)
        ids = prompts(served.text, job.shape).to(device)
        memory = counted(model, config, job, ids, dtype, device)
        report.step(1, total)
        cache = new_cache(config, kv_format(job.kv), job.shape, dtype, device)
        generate(model, ids, job.shape.gen_len, cache, sync)  # warm-up (and a compiled policy's compile)
        report.step(2, total)
        runs, disturbed = [], 0
        for i in range(job.repeats):
            cache.reset()
            cpu = CpuMeter()
            cpu.start()
            runs.append(generate(model, ids, job.shape.gen_len, cache, sync))
            seen = cpu.stop()
            disturbed += seen is not None and seen.disturbed
            report.step(3 + i, total)
        joules = measured_energy(model, ids, cache, job.shape, device, sync)
        scored = quality(model, config, job, served, dtype, device)
        report.step(total, total)
    measured = replace(figures(memory, runs, job.shape), disturbed_runs=disturbed)
    if joules[0] is not None:
        measured = replace(measured, energy=joules[0], energy_runs=joules[1])
    return {"figures": measured, "tokens": runs[0].tokens.tolist(), "nats": scored[0],
            "argmax": scored[1], "sequences": scored[2], "energy_source": joules[2]}


def _windows(meter: Meter, work: Any) -> tuple[RoundBlock, ...]:
    """``ENERGY_WINDOWS`` windows, each of as many whole ``work()`` calls as fill the counter's shortest window, as the
    rounds' blocks are kept (a window the counter could not read is left out)."""
    out = []
    for i in range(ENERGY_WINDOWS):
        edge, calls = meter.begin(), 0
        while calls == 0 or time.perf_counter() - edge[0] < meter.min_window_s:
            work()
            calls += 1
        reading, _ = meter.end(edge)
        if reading is not None:
            out.append(RoundBlock(round=i, median_s=reading.seconds / calls, n=calls, joules=reading.joules,
                                  window_s=reading.seconds))
    return tuple(out)


def measured_energy(model: Any, ids: torch.Tensor, cache: Any, shape: Shape, device: torch.device,
                    sync: Any) -> tuple[Energy | None, tuple[float, ...], EnergySource]:
    """Joules per generated token over whole generations, and the prefill's per prompt token, each from windows of
    whole calls at synchronized edges; (None, (), why) where no counter measures this device."""
    meter, source = measuring(device)
    if meter is None:
        return None, (), source

    def whole() -> None:
        cache.reset()
        generate(model, ids, shape.gen_len, cache, sync)

    def first() -> None:
        cache.reset()
        prefill(model, ids, cache)

    gens, pres = _windows(meter, whole), _windows(meter, first)
    generated, prompt = shape.batch_size * shape.gen_len, shape.batch_size * shape.prompt_len
    whole_e = block_energy(gens, shape.batch_size, generated, meter.name, source.idle_watts)
    prefill_e = block_energy(pres, shape.batch_size, prompt, meter.name, source.idle_watts)
    if whole_e is None or prefill_e is None:
        return None, (), EnergySource(meter.name, why=f"the {meter.name} counter could not be read over a window")
    steps = shape.batch_size * (shape.gen_len - 1)
    energy = replace(whole_e, prefill_joules_per_token=prefill_e.joules_per_token, decode_joules_per_token=(
        (whole_e.joules_per_step - prefill_e.joules_per_step) / steps if steps else None))
    per_token = tuple(b.joules / b.n / generated for b in gens)  # type: ignore[operator]
    return energy, per_token, source


def quality(model: Any, config: Any, job: GenerateJob, served: Any, dtype: torch.dtype,
            device: torch.device) -> tuple[float, list[list[int]], int]:
    """The held-out windows read through the cache in batches of the job's size: mean nats per continuation token,
    each position's argmax, and how many windows."""
    windows = served.text(job.quality_sequences, job.quality_len)
    split = min(job.shape.prompt_len, job.quality_len // 2)
    nats, argmax = 0.0, []
    for i in range(0, len(windows), job.shape.batch_size):
        chunk = windows[i:i + job.shape.batch_size].to(device)
        cache = new_cache(config, kv_format(job.kv), Shape(split, job.quality_len - split, len(chunk)), dtype, device)
        got = score(model, chunk, split, cache)
        nats += got.nats * len(chunk)
        argmax += got.argmax.tolist()
    return nats / len(windows), argmax, len(windows)


__all__ = ["GenerateJob", "measure", "with_speeds"]
