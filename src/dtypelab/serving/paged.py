"""A paged engine's forecast (``--engine vllm``) around ``engine``'s arithmetic: the engine resolved for the card
(``engine_of``); one policy's memory as the engine accounts it, from the weights its trace holds, and its steady state
at the concurrency asked and along ``engine.STEPS``, from two decode traces at the mean context, each quantized layer
as the engine's kernel (``paged_figures``); a steady step's energy (``paged_energy``); where each format stops paying
(``with_stops_paying``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies.registry import KV_FORMATS
from dtypelab.core.results import CurvePoint, Energy, GenerateFigures, GeneratePolicy, TargetDevice
from dtypelab.forecasting import ForecastOptions, StepTimes
from dtypelab.serving.engine import (
    KV_DTYPES,
    STEPS,
    Engine,
    EngineMemory,
    Steady,
    engine_memory,
    resolve,
    stops_paying,
)
from dtypelab.serving.fake_serve import PolicyRun, ServeForecaster, Traced
from dtypelab.serving.kernels import kernel_of
from dtypelab.serving.kv import NATIVE, text_config
from dtypelab.serving.policies import ServePolicy
from dtypelab.serving.speed import device_ops, kernel_words
from dtypelab.serving.workload import Shape


def engine_policy(policy: ServePolicy, engine: Engine) -> ServePolicy:
    """The policy with the engine's KV cache format: ``--kv-cache-dtype``'s, else the policy's own, which must be
    one the engine stores."""
    flag = KV_DTYPES[engine.kv_cache_dtype]
    if flag is not None:
        if policy.kv is not NATIVE and policy.kv.label != flag:
            raise DtypelabError(f"{policy.name} names its own KV format ({policy.kv.label}) and --kv-cache-dtype "
                                f"{engine.kv_cache_dtype} another: give one")
        return replace(policy, kv=KV_FORMATS[flag])
    if policy.kv is not NATIVE and policy.kv.label not in KV_DTYPES.values():
        raise DtypelabError(f"vLLM has no {policy.kv.label} KV cache (its --kv-cache-dtype: "
                            f"{', '.join(KV_DTYPES)})")
    return policy


def _no_kernel(run: PolicyRun, engine: Engine) -> str:
    """Why the engine cannot run one of the policy's formats on the card ("" when it can)."""
    cc = run.fc.target.capability
    for key in dict.fromkeys(run.layers.values()):
        kernel = kernel_of(key, engine.name, cc)
        if cc is not None and tuple(cc) < kernel.capability:
            return (f"vLLM has no {kernel.name} on {run.fc.target.label} (compute capability "
                    f"{cc[0]}.{cc[1]}; it needs {kernel.capability[0]}.{kernel.capability[1]})")
    return ""


def paged_figures(fc: ServeForecaster, policy: ServePolicy, shape: Shape, times: StepTimes | None,
                  cache: dict[tuple[Any, ...], Traced], engine: Engine, link_gbs: float | None) -> GenerateFigures:
    """One policy's memory, KV capacity and concurrency under the engine, and with ``times`` its steady state at
    ``shape.batch_size`` concurrent requests and its curve."""
    run = PolicyRun(fc, engine_policy(policy, engine), cache)
    mean = shape.prompt_len + shape.gen_len // 2  # tokens a request holds half-way through its generation
    one = run.traced(Shape(mean, 1, 1), timed=times is not None)
    if why := _no_kernel(run, engine):
        raise DtypelabError(why)
    element = run.policy.kv.element_bytes or torch.empty((), dtype=one.dtype).element_size()
    total = fc.target.memory_bytes
    if total is None:
        raise DtypelabError("--engine vllm takes a share of a card's memory: name the card (--device)")
    mem = engine_memory(fc.config, one.decode.weights, element, engine, total)
    figures = _memory_figures(mem, engine)
    if times is None or mem.blocks == 0:
        return figures
    two = run.traced(Shape(mean, 1, 2), timed=True)
    return _speed(figures, run, one, two, shape, times, engine, mem, link_gbs)


def _memory_figures(mem: EngineMemory, engine: Engine) -> GenerateFigures:
    return GenerateFigures(
        peak_bytes=mem.requested, weights_bytes=mem.weights, kv_cache_bytes=max(mem.kv_pool, 0),
        activations_bytes=mem.activation, fits=not mem.why, kv_capacity_tokens=mem.tokens,
        max_concurrency=mem.concurrency, kv_bytes_per_token=mem.page_bytes // engine.block_size,
        engine_memory={"requested": mem.requested, "weights": mem.weights, "activation": mem.activation,
                       "non_torch": mem.non_torch, "kv_pool": mem.kv_pool, "page": mem.page_bytes,
                       "blocks": mem.blocks})


def _speed(figures: GenerateFigures, run: PolicyRun, one: Traced, two: Traced, shape: Shape, times: StepTimes,
           engine: Engine, mem: EngineMemory, link_gbs: float | None) -> GenerateFigures:
    plan = run.policy.plan

    def timer(ops: Any) -> tuple[float, dict[str, float]]:
        t = times.of(plan, ops, "traced")
        if t.step_s is None:
            raise DtypelabError(t.reason or "the step could not be timed")
        return t.step_s, dict(t.bounds)

    mean = shape.prompt_len + shape.gen_len // 2
    prefill_s, prefill_bounds = timer(device_ops(run, one.prefill.ops, engine.name))
    text = text_config(run.fc.config)
    steady = Steady(device_ops(run, one.decode.ops, engine.name), device_ops(run, two.decode.ops, engine.name),
                    prefill_s / mean, {k: v / mean for k, v in prefill_bounds.items()}, shape.prompt_len,
                    shape.gen_len, int(text.hidden_size), run.fc.layers, engine, link_gbs,
                    mem.blocks // -(-mean // engine.block_size))  # the requests its pages hold at the mean
    point = steady.at(shape.batch_size, timer)
    curve = tuple(CurvePoint(p.concurrency, p.running, p.tok_s, dict(p.bounds))
                  for p in (steady.at(c, timer) for c in STEPS if c <= engine.max_num_seqs))
    cc = run.fc.target.capability
    kernels = tuple(dict.fromkeys(kernel_words(k, engine.name, cc) for k in run.layers.values()))
    bound = max(point.bounds, key=lambda k: point.bounds[k]) if point.bounds else ""
    return replace(figures, ttft_s=steady.ttft_s(point), decode_tok_s=point.tok_s, token_latency_s=point.step_s,
                   prefill_tok_s=shape.prompt_len / steady.ttft_s(point), bound=bound, kernels=kernels,
                   decode_bounds=dict(point.bounds), prefill_bounds=dict(steady.prefill_bounds), curve=curve)


def paged_energy(g: GenerateFigures, model: Any) -> GenerateFigures:
    """A steady step's energy per generated token (its decode and its prefill chunks at the power for what bounds
    them), and each point's of the curve."""
    watts = model.watts(g.decode_bounds)
    step = g.token_latency_s or 0.0
    running = (g.decode_tok_s or 0.0) * step
    per_token = watts * step / running if running else None
    energy = Energy(watts * step, watts * step / max(running, 1), "forecast", model.by, joules_per_token=per_token,
                    watts=watts, idle_watts=model.idle_watts, decode_joules_per_token=per_token)
    curve = tuple(replace(p, joules_per_token=model.watts(p.step_bounds) / p.tok_s) for p in g.curve)
    return replace(g, energy=energy, curve=curve)


def engine_of(opts: ForecastOptions, target: TargetDevice, context: int) -> tuple[Engine, float | None]:
    """The engine asked for, its settings resolved for the card, and the card's interconnect (tensor parallel)."""
    if opts.engine == "static":
        return Engine(), None
    from dtypelab.core.machine.devices import device_spec

    if target.kind != "cuda" or target.memory_bytes is None:
        raise DtypelabError("--engine vllm forecasts a GPU: name one with --device (vLLM does not run on this CPU; "
                            "bench --mode generate measures the static engine here)")
    engine = resolve(Engine("vllm", opts.gpu_memory_utilization or 0.9, opts.max_num_batched_tokens or 0,
                            opts.max_num_seqs or 0, opts.block_size or 16, opts.kv_cache_dtype or "auto",
                            opts.max_model_len or 0, opts.tensor_parallel_size or 1), target, context)
    if engine.max_model_len > context:
        raise DtypelabError(f"--max-model-len {engine.max_model_len:,} is longer than the model's context "
                            f"({context:,} positions)")
    link = None  # a memory size, or a lent card the table does not know
    for name in (target.name, target.label):  # a card of the table by its name, a lent one by torch's
        try:
            link = device_spec(name).link_gbs
            break
        except DtypelabError:
            continue
    if engine.tensor_parallel_size > 1 and link is None:
        raise DtypelabError(f"--tensor-parallel-size {engine.tensor_parallel_size}: no interconnect bandwidth is "
                            f"known for {target.label}: name a card of the table (--device)")
    return engine, link


def with_stops_paying(results: list[GeneratePolicy], error: float) -> list[GeneratePolicy]:
    """Each format's concurrency from which it no longer beats bfloat16's (the first policy storing bfloat16
    weights) by more than the forecast's ``error`` (a tie within it does not pay), in tokens a second and in joules
    per token."""
    base = next((r for r in results if r.policy.split("+")[0] == "bf16" and r.generate and r.generate.curve), None)
    if base is None or base.generate is None:
        return results
    tok = tuple((p.concurrency, p.tok_s) for p in base.generate.curve)
    joules = tuple((p.concurrency, p.joules_per_token) for p in base.generate.curve if p.joules_per_token)
    out = []
    for r in results:
        g = r.generate
        if r is base or g is None or not g.curve:
            out.append(r)
            continue
        mine_j = tuple((p.concurrency, p.joules_per_token) for p in g.curve if p.joules_per_token)
        paying = {"tok/s": stops_paying(tuple((p.concurrency, p.tok_s) for p in g.curve), tok, error=error),
                  "J/token": stops_paying(mine_j, joules, False, error) if mine_j and joules else None}
        out.append(replace(r, generate=replace(g, stops_paying=paying)))
    return out


__all__ = ["engine_of", "engine_policy", "paged_energy", "paged_figures", "with_stops_paying"]
