"""The serving workload's time on a device, from the ops a trace recorded (``core.machine.speed``): on a GPU each
quantized layer as the one kernel its format runs (``kernels.KERNELS``), on this CPU each heavy call timed here and
every op paying the per-op time of the model's own code, measured on one of its blocks."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from dtypelab.core.errors import DtypelabError
from dtypelab.core.footprint import tensor_bytes
from dtypelab.core.machine.power import PowerModel
from dtypelab.core.machine.speed import GPU_BANDWIDTH_SHARE, Op
from dtypelab.core.results import Energy, GenerateFigures, TargetDevice
from dtypelab.core.tasks.hub import at_depth
from dtypelab.forecasting import STORED_WEIGHT_BYTES, StepTimes, largest_batch, rates_for
from dtypelab.serving.fake_serve import (
    MOST_BATCH,
    PolicyRun,
    ServeForecaster,
    Traced,
)
from dtypelab.serving.kernels import kernel_of
from dtypelab.serving.kv import kv_format
from dtypelab.serving.policies import ServePolicy
from dtypelab.serving.workload import Shape, decode, new_cache, prefill


def layer_bytes(model: nn.Module, meta: nn.Module, run: PolicyRun) -> dict[str, int]:
    """Each quantized layer's stored weight bytes: as converted, or, for a stand-in, from its format's layout (the
    one answer training and serving forecasts share, ``STORED_WEIGHT_BYTES``)."""
    assigned = run.policy.plan.assign(meta) if run.stand_in else {}
    out = {}
    for name in run.layers:
        if run.stand_in:
            stored = STORED_WEIGHT_BYTES(assigned[name], meta.get_submodule(name))
            assert stored is not None  # a layer a GPU kernel takes has its layout's bytes
            out[name] = stored
        else:
            weight = model.get_submodule(name).weight
            assert isinstance(weight, torch.Tensor)
            out[name] = tensor_bytes([weight])
    return out


def gpu_ops(ops: tuple[Op, ...], layers: dict[str, str], stored: dict[str, int], engine: str = "static",
            capability: tuple[int, int] | None = None) -> tuple[Op, ...]:
    """The traced ops with each quantized layer's ops as the one kernel its format runs on a GPU in ``engine``
    (``kernels.ENGINES``): its FLOPs at the kernel's rate (as more FLOPs where it reaches less of the GEMM's), the
    activations it reads and writes, and its stored weight read at the kernel's share of bandwidth (as more bytes at
    the bfloat16 GEMM's share)."""
    out: list[Op] = []
    run: list[Op] = []
    serial = [0]

    def flush() -> None:
        if not run:
            return
        name = run[0].module
        kernel = kernel_of(layers[name], engine, capability)
        main = max(run, key=lambda o: o.flops)
        weight = max((b for _, b in main.reads), default=0)
        serial[0] -= 1
        out.append(Op("matmuls", kernel.rate, sum(o.flops for o in run) / kernel.compute, ((serial[0],
                                                                                             main.read - weight),
                      (serial[0] - 10**9, int(stored[name] / kernel.share))), main.writes, main.work,
                      dtype=main.dtype, module=name,
                      variant="rowwise" if layers[name] == "fp8-dynamic-per-channel" else ""))
        run.clear()

    for op in ops:
        if op.module in layers:
            if run and run[0].module != op.module:
                flush()
            run.append(op)
            continue
        flush()
        out.append(op)
    flush()
    return tuple(out)


def kernel_words(key: str, engine: str = "static", capability: tuple[int, int] | None = None) -> str:
    k = kernel_of(key, engine, capability)
    compute = f", {k.compute:.2f} of its FLOP/s" if k.compute != 1.0 else ""
    return (f"{key}: {k.name} ({k.share:.2f} of bf16's bandwidth share{compute}"
            f"{', ' + k.source if k.source else ''})")


def device_ops(run: PolicyRun, ops: tuple[Op, ...], engine: str = "static") -> tuple[Op, ...]:
    """The ops as the target runs them: on a GPU each quantized layer's as its format's kernel in ``engine``, here
    as traced."""
    if run.fc.cuda and run.layers:
        return gpu_ops(ops, run.layers, layer_bytes(*_models(run), run), engine, run.fc.target.capability)
    return ops


def _shares(ops: tuple[Op, ...], seconds: float, rates: Any) -> tuple[float | None, float | None]:
    """The share of the device's bandwidth and of its peak FLOP/s the step's ops reach in ``seconds``."""
    if not seconds or rates is None:
        return None, None
    moved = sum(op.read + op.written for op in ops)
    flops = sum(op.flops for op in ops)
    peak = max((v for k, v in rates.flops.items() if k in {op.rate for op in ops}), default=0.0)
    # of the datasheet's bandwidth on a GPU (the rates hold the achievable share of it), of the measured one here
    datasheet = rates.bandwidth / (1.0 if rates.times_kernels else GPU_BANDWIDTH_SHARE)
    return moved / seconds / (datasheet or 1), (flops / seconds / peak if peak else None)


def policy_figures(fc: ServeForecaster, policy: ServePolicy, shape: Shape, times: StepTimes | None,
                   cache: dict[tuple[Any, ...], Traced], search: bool) -> tuple[GenerateFigures, tuple[str, ...]]:
    """One policy's figures at ``shape`` and what its searches could not answer (a search never costs the answer
    asked for)."""
    run = PolicyRun(fc, policy, cache)
    t = run.traced(shape, timed=times is not None)
    top = t.prefill if t.prefill.peak >= t.decode.peak else t.decode
    limit = fc.target.usable_bytes
    figures = GenerateFigures(
        peak_bytes=t.peak, weights_bytes=t.decode.weights, kv_cache_bytes=t.decode.kv,
        activations_bytes=top.peak - top.weights - top.kv, prefill_peak_bytes=t.prefill.peak,
        decode_peak_bytes=t.decode.peak, fits=None if limit is None else t.peak <= limit,
        kv_bytes_per_token=t.decode.kv // (shape.batch_size * shape.context))
    notes: tuple[str, ...] = ()
    if limit is not None and search:
        figures, notes = _searched(figures, run, shape, limit)
    if times is None:
        return figures, notes
    return _speed_figures(figures, run, t, shape, times), notes


def _searched(figures: GenerateFigures, run: PolicyRun, shape: Shape, limit: int
              ) -> tuple[GenerateFigures, tuple[str, ...]]:
    """The largest batch at this context and the longest context at this batch (up to the positions the model
    serves), each searched on its own: one that cannot be traced is left out, saying why."""
    notes = []
    try:
        batch = largest_batch(lambda b: run.traced(replace(shape, batch_size=b)).peak, limit, shape.batch_size,
                              cap=MOST_BATCH).largest
        figures = replace(figures, largest_batch=batch or 0)  # 0: not even one sequence fits
    except DtypelabError as exc:
        notes.append(f"largest batch not searched: {exc}")
    most = run.fc.served.context - shape.prompt_len
    try:
        gen = largest_batch(lambda g: run.traced(replace(shape, gen_len=g)).peak, limit, min(shape.gen_len, most),
                            cap=most).largest
        figures = replace(figures, longest_context=0 if gen is None else shape.prompt_len + gen)
    except DtypelabError as exc:
        notes.append(f"longest context not searched: {exc}")
    return figures, tuple(notes)


def _speed_figures(figures: GenerateFigures, run: PolicyRun, t: Traced, shape: Shape,
                   times: StepTimes) -> GenerateFigures:
    plan = run.policy.plan
    decode_ops = device_ops(run, t.decode.ops)
    pre = times.of(plan, device_ops(run, t.prefill.ops), "traced")
    dec = times.of(plan, decode_ops, "traced")
    if pre.step_s is None or dec.step_s is None:
        return replace(figures, bound=dec.reason or pre.reason)
    kernels = tuple(dict.fromkeys(kernel_words(k) for k in run.layers.values())) if run.fc.cuda else ()
    bw, fl = _shares(decode_ops, dec.step_s, times.rates)
    return replace(figures, ttft_s=pre.step_s, prefill_tok_s=shape.batch_size * shape.prompt_len / pre.step_s,
                   decode_tok_s=shape.batch_size / dec.step_s, token_latency_s=dec.step_s, bound=dec.bound,
                   prefill_bound=pre.bound, kernels=kernels, bandwidth_share=bw, flops_share=fl,
                   prefill_bounds=dict(pre.bounds), decode_bounds=dict(dec.bounds))


def generation_energy(g: GenerateFigures, model: PowerModel, shape: Shape) -> Energy | None:
    """A forecast generation's energy: its prefill and its decode steps each at the power for what bounds them."""
    if not g.ttft_s or not g.token_latency_s:
        return None
    pre_w, dec_w = model.watts(g.prefill_bounds), model.watts(g.decode_bounds)
    steps = shape.gen_len - 1
    prefill_j, step_j = pre_w * g.ttft_s, dec_w * g.token_latency_s
    joules = prefill_j + steps * step_j
    return Energy(joules, joules / shape.batch_size, "forecast", model.by,
                  joules_per_token=joules / (shape.batch_size * shape.gen_len),
                  watts=joules / (g.ttft_s + steps * g.token_latency_s), idle_watts=model.idle_watts,
                  prefill_joules_per_token=prefill_j / (shape.batch_size * shape.prompt_len),
                  decode_joules_per_token=step_j / shape.batch_size)


def _models(run: PolicyRun) -> tuple[nn.Module, nn.Module]:
    depth = run.fc.layers if not run.deep else run.depths[-1]  # every layer the line's ops name
    return run.fc.converted(run.policy.plan, depth)[0], run.fc.at_depth(depth)[0]


def inference_floor(repeats: int = 200, rounds: int = 25) -> float:
    """The least time one small op takes here in a decode step: a tiny op under ``inference_mode``, timed (the CPU
    probe's per-op time is a training step's, autograd's bookkeeping included, which a decode step does not pay)."""
    x = torch.ones(64)
    best = math.inf
    with torch.inference_mode():
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(repeats):
                x = torch.add(x, 1.0)
            best = min(best, (time.perf_counter() - start) / repeats)
    return best


def program_floor(config: Any, build: Callable[[Any], nn.Module], steps: int = 20) -> float | None:
    """The time one op of this model's decode step takes here, Python and threads included: a decode step of one of
    its blocks (a vocabulary of at most 256) timed, over the ops it runs; None when the model cannot be built so."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's mode is untyped
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    tiny = at_depth(config, 1)  # one block at its real widths (threads split an op as they would), a small vocabulary
    if hasattr(tiny, "vocab_size"):
        tiny.vocab_size = min(tiny.vocab_size, 256)
    shape = Shape(4, steps + 2, 1)
    try:
        with torch.device("cpu"):
            model = build(tiny).eval()
        cache = new_cache(tiny, kv_format(None), shape, torch.float32, torch.device("cpu"))
        with torch.inference_mode():
            token = prefill(model, torch.zeros((1, 4), dtype=torch.long), cache)
            with Count():  # type: ignore[no-untyped-call]
                decode(model, token, cache)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                token = decode(model, token, cache)
                times.append(time.perf_counter() - start)
    except Exception:  # a model whose widths cannot be shrunk alike: the op's time without Python's
        return None
    return sorted(times)[len(times) // 2] / max(Count.ops, 1)


def serving_rates(target: TargetDevice, fc: ServeForecaster | None = None) -> tuple[Any, str]:
    """The target's rates for a decode step: on this CPU, the per-op time its decode step pays (Python, dispatch,
    threads: measured on one of its blocks), else the time of a bare op."""
    rates, why = rates_for(target)
    if rates is not None and rates.times_kernels:
        floor = program_floor(fc.config, fc.build_real) if fc is not None else None
        rates = replace(rates, floor_s=floor or inference_floor())
    return rates, why


