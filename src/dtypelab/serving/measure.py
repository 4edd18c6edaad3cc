"""One serving policy measured here: a ``Work`` of ``dtypelab.run`` (it runs in a child process of its own).

The model is converted by the policy's own kinds (``Precision.convert_module``: casts, quantized weights), its
cache made in the policy's KV format, then: one generation counted by the ledger on real tensors (the peak of the
prefill and of a decode step, by what holds it: weights, cache, the rest), its greedy tokens, and the held-out text
read through the cache. Its speed and energy are timed beside every other policy's, in interleaved rounds
(``rounds``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dtypelab.core.calibration import calibrating
from dtypelab.core.executorch_lm import Generation, PteLM, generating, write_program
from dtypelab.core.loop import threads
from dtypelab.core.measure import device_sync
from dtypelab.core.policies import Plan, Precision
from dtypelab.core.results import GenerateFigures
from dtypelab.forecasting import Ledger, Peak
from dtypelab.run import Reporter
from dtypelab.serving.kv import cache_bytes, kv_format, kv_scales
from dtypelab.serving.quality import PerPosition, chunk_path, joined, per_position, write_reference
from dtypelab.serving.served import config_of, load_served
from dtypelab.serving.workload import Shape, compute_dtype, decode, generate, new_cache, prefill, score

WEIGHTS = ("parameters", "frozen_weights")


@dataclass(frozen=True)
class GenerateJob:
    """Everything a child needs, picklable: the model travels as its spec and is built there."""

    spec: str
    plan: Plan
    kv: str  # a KV format's label (``serving.kv.FORMATS``), or kv-native
    label: str  # the policy as named: PLAN[+KV]
    shape: Shape
    quality_sequences: int
    quality_len: int
    seed: int
    device: str
    threads: int | None = None
    reference: str = ""  # a folder for the baseline's log-probabilities (safetensors files): the baseline writes them
    writes_reference: bool = False
    calibration: list[list[int]] | None = None  # token ids calibrated methods read (GPTQ, AWQ): plain lists, since
    # a tensor crosses to the child through torch's shared-memory reducer, which a spawned child cannot always reach
    scales: list[tuple[float, float]] | None = None  # a calibrated KV format's per-layer scales, once calibrated

    @property
    def name(self) -> str:
        return self.label

    def __call__(self, report: Reporter) -> Measured:
        with threads(self.threads):
            return measure(self, report)


@dataclass(frozen=True)
class Measured:
    """What a policy's process measured (typed, across the process boundary): its memory (the figures' bytes), its
    greedy continuation, and the held-out text's mean nats and argmax through its cache, and its figures at every
    position (against the baseline's log-probabilities)."""

    figures: GenerateFigures
    tokens: list[list[int]]
    nats: float
    argmax: list[list[int]]
    sequences: int
    positions: PerPosition | None = None
    split: int = 0  # the first continuation position's context length
    kv_scales: list[tuple[float, float]] | None = None  # a calibrated KV format's per-layer (key, value) scales
    conversion: dict[str, Any] = field(default_factory=dict)  # a generation program's: its delegation, its shape


def prompts(text: Any, shape: Shape) -> torch.Tensor:
    """``batch_size`` prompts from the held-out text (repeated when it has fewer windows than that)."""
    ids: torch.Tensor = text(shape.batch_size, shape.context)[:, :shape.prompt_len]
    while len(ids) < shape.batch_size:
        ids = torch.cat([ids, ids])[:shape.batch_size]
    return ids


def counted(model: Any, config: Any, job: GenerateJob, ids: torch.Tensor, dtype: torch.dtype,
            device: torch.device) -> dict[str, Any]:
    """The prefill's and one decode step's peaks, by what holds them (a static cache: every decode step holds the
    same), counted on real tensors."""
    if isinstance(model, PteLM):
        return program_memory(model)
    fmt = kv_format(job.kv)
    with Ledger() as ledger:
        ledger.claim(model.parameters(), "parameters")
        ledger.claim(model.buffers(), "parameters")
        with ledger.phase_of("cache", default="buffers"):
            cache = new_cache(config, fmt, job.shape, dtype, device, job.scales, model)
        with ledger.phase_of("prefill"):
            token = prefill(model, ids, cache)
        with ledger.phase_of("decode"):
            decode(model, token, cache)
        weights = sum(ledger.current[k] for k in WEIGHTS)
        return {"weights": weights, "kv": cache_bytes(cache), "prefill": ledger.phases["prefill"],
                "decode": ledger.phases["decode"]}


def program_memory(model: PteLM) -> dict[str, Any]:
    """A generation program's memory, known from the program (the runtime allocates outside torch, where the
    ledger cannot see): its bytes (weights and their packing), and the arena its memory planning sizes for the
    longest call, the cache inside it; every call holds the same arena."""
    lowered = model.lowered
    weights, arena = len(lowered.program), lowered.planned_bytes
    peak = Peak(weights + arena, phase="program")
    return {"weights": weights, "kv": lowered.cache_bytes, "prefill": peak, "decode": peak,
            "kv_per_token": lowered.cache_bytes // (lowered.batch * lowered.max_len)}


def calibrated_scales(model: Any, config: Any, job: GenerateJob, device: torch.device
                      ) -> list[tuple[float, float]] | None:
    """A KV format calibrated on text: each layer's scales from the job's calibration windows (None otherwise, or
    without text: the format then takes them from the prompt)."""
    fmt = kv_format(job.kv)
    if not getattr(fmt, "calibrated_by_text", False) or job.calibration is None:
        return None
    return kv_scales(model, config, fmt, torch.tensor(job.calibration, device=device))


def with_speeds(figures: GenerateFigures, shape: Shape, ttft_s: float, decode_s: float) -> GenerateFigures:
    """``figures`` with the speeds of a generation that took ``ttft_s`` to its first token, ``decode_s`` the rest."""
    steps = shape.gen_len - 1
    return replace(figures, ttft_s=ttft_s, prefill_tok_s=shape.batch_size * shape.prompt_len / ttft_s,
                   decode_tok_s=shape.batch_size * steps / decode_s if steps and decode_s > 0 else None,
                   token_latency_s=decode_s / steps if steps else None)


def memory_figures(memory: dict[str, Any], shape: Shape) -> GenerateFigures:
    prefill_peak: Peak = memory["prefill"]
    decode_peak: Peak = memory["decode"]
    top = max(prefill_peak, decode_peak, key=lambda p: p.total)
    return GenerateFigures(
        peak_bytes=top.total, weights_bytes=memory["weights"], kv_cache_bytes=memory["kv"],
        activations_bytes=top.total - memory["weights"] - memory["kv"], prefill_peak_bytes=prefill_peak.total,
        decode_peak_bytes=decode_peak.total,
        kv_bytes_per_token=memory.get("kv_per_token", memory["kv"] // (shape.batch_size * shape.context)))


def measure(job: GenerateJob, report: Reporter) -> Measured:
    served = load_served(job.spec)
    device = torch.device(job.device)
    with calibrating(None if job.calibration is None else torch.tensor(job.calibration, device=device)):
        model, config, precision = built(served, job.plan, job.seed, device, program_shape(job.shape,
                                                                                              job.quality_len))
    if isinstance(model, PteLM) and job.reference:  # the rounds time this very program
        write_program(model.lowered, program_path(job.reference, job.label))
    sync = device_sync(device) or (lambda: None)
    with precision.session(), torch.inference_mode():
        dtype = compute_dtype(model, config, device)
        scales = calibrated_scales(model, config, job, device)
        job = replace(job, scales=scales)
        ids = prompts(served.text, job.shape).to(device)
        memory = counted(model, config, job, ids, dtype, device)
        report.step(1, 3)
        cache = new_cache(config, kv_format(job.kv), job.shape, dtype, device, job.scales, model)
        tokens = generate(model, ids, job.shape.gen_len, cache, sync).tokens
        report.step(2, 3)
        scored = quality(model, config, job, served, dtype, device)
        report.step(3, 3)
    return Measured(memory_figures(memory, job.shape), tokens.tolist(), *scored, kv_scales=job.scales,
                    conversion=precision.conversion() if isinstance(model, PteLM) else {})


def program_path(folder: str, policy: str) -> str:
    """Where a policy's measured program waits for the timing rounds."""
    return os.path.join(folder, f"program-{policy}.pte")


def program_shape(shape: Shape, quality_len: int) -> Generation:
    """What a generation program is exported for: the batch, and the longest context the bench reads through one
    cache (the generation's, or the held-out windows')."""
    return Generation(shape.batch_size, max(shape.context, quality_len))


def built(served: Any, plan: Plan, seed: int, device: torch.device,
          program: Generation | None = None) -> tuple[Any, Any, Precision]:
    """The served model, seeded, converted by the plan's kinds on ``device`` (a program kind exports it for
    ``program``): (model, its config, the precision)."""
    torch.manual_seed(seed)
    model = served.make_model().eval()
    config = config_of(model)
    precision = Precision(plan, device)
    if program is None:
        return precision.convert_module(model.to(device)), config, precision
    with generating(program.batch, program.max_len):
        return precision.convert_module(model.to(device)), config, precision


def quality(model: Any, config: Any, job: GenerateJob, served: Any, dtype: torch.dtype,
            device: torch.device) -> tuple[float, list[list[int]], int, PerPosition, int]:
    """The held-out windows read through the cache in batches of the job's size: mean nats per continuation token,
    each position's argmax, how many windows, every position's figures (the baseline writes its log-probabilities,
    batch by batch, for the others to read), and where the continuation starts."""
    windows = served.text(job.quality_sequences, job.quality_len)
    split = min(job.shape.prompt_len, job.quality_len // 2)
    nats, argmax, parts = 0.0, [], []
    for k, i in enumerate(range(0, len(windows), job.shape.batch_size)):
        chunk = windows[i:i + job.shape.batch_size]
        cache = new_cache(config, kv_format(job.kv), Shape(split, job.quality_len - split, len(chunk)), dtype, device,
                          job.scales, model)
        got = score(model, chunk.to(device), split, cache)
        nats += got.nats * len(chunk)
        argmax += got.argmax.tolist()
        path = chunk_path(job.reference, k) if job.reference else None
        if job.writes_reference and path:
            write_reference(path, got.logprobs)
        parts.append(per_position(got.logprobs, chunk, None if job.writes_reference else path))
    return nats / len(windows), argmax, len(windows), joined(parts), split


__all__ = ["GenerateJob", "Measured", "built", "measure", "memory_figures", "program_memory", "program_path",
           "program_shape", "prompts", "with_speeds"]
