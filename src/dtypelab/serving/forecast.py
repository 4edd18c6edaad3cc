"""``forecast TASK --mode generate``: each serving policy's memory and speed on a device, traced on fake tensors.

For each policy the model is built on the meta device, converted by the policy's kinds (on a GPU target its
weights in bfloat16 first, as a GPU serves them; a format whose conversion needs a GPU is traced with bfloat16
weights in its place and its weights' bytes taken from its layout: ``kernels.stored_bytes``), given fake tensors,
and two passes are traced by the ledger: the prefill of ``batch`` prompts into a cache allocated for the whole
context, and one decode step with the cache full (a static cache: every step reads all of it, as the measured
workload does, so the step at the full context is every step's). Each quantity is exact as traced: the weights,
the cache (whatever the attention layout: grouped-query attention stores its key/value heads only), the
activations, and the logits the program materializes (the prefill keeps the last position's only).

A model deeper than ``DEEP`` blocks is traced with 3 and 4 of them and every quantity read off the line through
the two (bytes and seconds are linear in the depth). The largest batch and the longest context that fit come from
the line through two sizes (the peak is linear in both) and are traced again to confirm.

Speed: the traced ops against the device's rates (``core.speed``); on a GPU each quantized layer's ops are one
kernel of its format (``kernels.KERNELS``: the rate its FLOPs run at, and the share of bandwidth it reaches in
decode relative to a bfloat16 GEMM, from a published table named with it); on this CPU the ops as they run here,
each matmul timed here.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from dtypelab.core.errors import DtypelabError, describe_exception
from dtypelab.core.policies import Plan, Precision
from dtypelab.core.results import GenerateConfig, GenerateFigures, GeneratePolicy, GenerateReport, TargetDevice
from dtypelab.core.speed import GPU_BANDWIDTH_SHARE, Op
from dtypelab.forecasting import CUDA_BLOCK, Ledger, StepTimes, eager, faked, fresh, materialize, rates_for
from dtypelab.serving.kernels import KERNELS, kernel_key, stored_bytes
from dtypelab.serving.kv import KVFormat, cache_bytes, kv_format
from dtypelab.serving.policies import DEFAULT_FORECAST, ServePolicy, serve_policies
from dtypelab.serving.served import Served, config_of, load_served
from dtypelab.serving.workload import Shape, compute_dtype, decode, new_cache, prefill

SHALLOW = (3, 4)
MOST_BATCH = 4096  # the largest batch searched
DEEP = 6  # deeper stacks are read off two shallow traces
WEIGHTS = ("parameters", "frozen_weights")
ACTIVE = ("activations", "loss", "temporaries")


@dataclass(frozen=True)
class Pass:
    """One traced pass: its peak and what held it, and its ops."""

    peak: int
    weights: int
    kv: int
    ops: tuple[Op, ...]

    def line(self, other: Pass, depth: int, at: int) -> Pass:
        """This pass (at ``depth`` blocks) and ``other`` (one block deeper) read at ``at`` blocks."""
        k = at - depth

        def lin(a: int, b: int) -> int:
            return a + (b - a) * k

        return Pass(lin(self.peak, other.peak), lin(self.weights, other.weights), lin(self.kv, other.kv),
                    self.ops + tuple(op for _ in range(k) for op in _block_ops(self.ops, other.ops)))


def _block_ops(one: tuple[Op, ...], two: tuple[Op, ...]) -> tuple[Op, ...]:
    """The ops one more block adds: the deeper trace's ops beyond the shallower's count, from the first block that
    differs (the blocks' ops are alike; what follows the stack, the head, is in both)."""
    extra = len(two) - len(one)
    first = next((i for i, (a, b) in enumerate(zip(one, two, strict=False)) if a.module != b.module), len(one))
    return two[first:first + extra]


@dataclass
class Traced:
    prefill: Pass
    decode: Pass
    dtype: Any = None  # the compute dtype the model handed its cache

    @property
    def peak(self) -> int:
        return max(self.prefill.peak, self.decode.peak)


class ServeForecaster:
    """One model's serving forecasts: its meta model built once per depth, each policy's converted once per depth."""

    def __init__(self, served: Served, target: TargetDevice, seed: int) -> None:
        self.served, self.target, self.seed = served, target, seed
        self._meta: nn.Module | None = None
        self.config = served.config if served.config is not None else config_of(self.meta)
        self.layers = int(self.config.num_hidden_layers)
        self.cuda = target.kind == "cuda"
        self._metas: dict[int, tuple[nn.Module, Any]] = {}
        self._converted: dict[tuple[str, int], tuple[nn.Module, int, dict[str, str]]] = {}
        self._dtypes: dict[tuple[str, int], torch.dtype] = {}

    @property
    def meta(self) -> nn.Module:
        """The whole model on the meta device (built when first asked: a deep one is traced at 3 and 4 blocks)."""
        if self._meta is None:
            torch.manual_seed(self.seed)
            with torch.device("meta"):
                self._meta = self.served.make_model()
        return self._meta

    def build(self, config: Any) -> nn.Module:
        with torch.device("meta"):
            return self.build_real(config)

    def build_real(self, config: Any) -> nn.Module:
        """The model from ``config``, on the current device."""
        if self.served.config is not None:
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_config(config)
        return type(self.meta)(config)

    def parameters(self) -> int:
        """The model's parameter count (each once), off the line through its shallow versions when it is deep."""
        if self.layers <= DEEP:
            return sum(p.numel() for p in self.meta.parameters())
        one, two = (sum(p.numel() for p in self.at_depth(d)[0].parameters()) for d in SHALLOW)
        return one + (two - one) * (self.layers - SHALLOW[0])

    def at_depth(self, depth: int) -> tuple[nn.Module, Any]:
        if depth not in self._metas:
            if depth == self.layers:
                self._metas[depth] = (self.meta, self.config)
            else:
                config = copy.deepcopy(self.config)
                config.num_hidden_layers = depth
                if isinstance(getattr(config, "layer_types", None), list):
                    config.layer_types = config.layer_types[:depth]
                self._metas[depth] = (self.build(config), config)
        return self._metas[depth]

    def converted(self, plan: Plan, depth: int) -> tuple[nn.Module, int, dict[str, str]]:
        """The converted meta model, the bytes its weights store beyond the trace's (a stand-in's layout), and each
        quantized layer's kernel key."""
        key = (plan.name, depth)
        if key not in self._converted:
            meta, _ = self.at_depth(depth)
            self._converted[key] = convert(plan, meta, self.cuda)
        model, extra, layers = self._converted[key]
        return fresh(model), extra, layers

    def dtype_of(self, plan: Plan, depth: int, model: nn.Module) -> dict[int, torch.dtype]:
        """The compute dtype of the plan's model (found once per plan and depth), keyed by this copy's id."""
        key = (plan.name, depth)
        return {id(model): self._dtypes[key]} if key in self._dtypes else {}

    def remember(self, plan: Plan, depth: int, model: nn.Module, dtype: torch.dtype) -> None:
        self._dtypes[(plan.name, depth)] = dtype


def _quantized(plan: Plan, model: nn.Module) -> dict[str, str]:
    """Each layer a quantize kind covers, with its kernel key."""
    out = {}
    for name, config in plan.assign(model).items():
        scheme = getattr(config, "scheme", None)
        if scheme is not None and isinstance(model.get_submodule(name) if name else model, nn.Linear):
            out[name] = kernel_key(scheme, getattr(config, "granularity", "per-channel"))
    return out


def convert(plan: Plan, meta: nn.Module, cuda: bool) -> tuple[nn.Module, int, dict[str, str]]:
    """The model as the policy serves it; on a GPU, weights in bfloat16 before any quantization (torchao's weight
    formats keep their activations in the weights' dtype). A conversion this machine cannot make (an int4 or fp8
    matmul's layout) leaves bfloat16 weights in its place and counts the format's bytes from its layout."""
    layers = _quantized(plan, meta)
    try:
        if not (cuda and layers):
            return Precision(plan, "cpu", traced=True).convert_module(fresh(meta)), 0, layers
        model = fresh(meta).to(torch.bfloat16)
        for config in plan.configs:
            names = [n for n, c in plan.assign(model).items() if c == config]
            model, _ = config.convert_module(model, names)
        return model, 0, layers
    except Exception as exc:
        if not layers or not cuda:
            raise DtypelabError(f"converting the model failed: {describe_exception(exc)}") from exc
    model = fresh(meta).to(torch.bfloat16)
    extra = 0
    for name, key in layers.items():
        rows, cols = _shape_of(meta, name)
        extra += stored_bytes(key, rows, cols) - rows * cols * 2 + (CUDA_BLOCK if cuda else 0)
    return model, extra, layers


def _shape_of(model: nn.Module, name: str) -> tuple[int, int]:
    """A Linear layer's weight shape (out, in)."""
    layer = model.get_submodule(name)
    assert isinstance(layer, nn.Linear)
    return layer.out_features, layer.in_features


def trace(model: nn.Module, config: Any, fmt: KVFormat, shape: Shape, cuda: bool, timed: bool,
          dtypes: dict[int, torch.dtype] | None = None) -> Traced:
    """The prefill and one decode step at the full context, on fake tensors (``dtypes``: the compute dtype found
    for each model before, by its id)."""
    cpu = torch.device("cpu")
    round_to = CUDA_BLOCK if cuda else 1
    dtypes = {} if dtypes is None else dtypes
    with eager(), faked() as mode, torch.no_grad():
        materialize(model, mode, cpu)
        dtype = dtypes.get(id(model)) or compute_dtype(model, config, cpu)
        ids = torch.zeros((shape.batch_size, shape.prompt_len), dtype=torch.long)
        with Ledger(round_to=round_to, ops=[] if timed else None, calls=not cuda) as ledger:
            ledger.claim(model.parameters(), "parameters")
            ledger.claim(model.buffers(), "parameters")
            with ledger.phase_of("cache", default="buffers"):
                cache = new_cache(config, fmt, shape, dtype, cpu)
            with ledger.phase_of("forward"):
                token = prefill(model, ids, cache)
            first = _pass(ledger, cache)
        for layer in cache.layers:
            layer.cumulative_length.fill_(shape.context - 1)
        with Ledger(round_to=round_to, ops=[] if timed else None, calls=not cuda) as ledger:
            ledger.claim(model.parameters(), "parameters")
            ledger.claim(model.buffers(), "parameters")
            ledger.claim([t for layer in cache.layers for t in layer.tensors()], "buffers")
            token = token.clone()
            with ledger.phase_of("forward"):
                decode(model, token, cache)
            return Traced(first, _pass(ledger, cache), dtype)


def _pass(ledger: Any, cache: Any) -> Pass:
    peak = ledger.phases["forward"]
    return Pass(peak.total, sum(ledger.current[k] for k in WEIGHTS), cache_bytes(cache), tuple(ledger.ops or ()))


# --- speed ------------------------------------------------------------------------------------------------------
def _weight_bytes(w: torch.Tensor) -> int:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(w):
        names, _ = w.__tensor_flatten__()
        return sum(_weight_bytes(getattr(w, n)) for n in names if getattr(w, n) is not None)
    return w.numel() * w.element_size()


def layer_bytes(model: nn.Module, meta: nn.Module, layers: dict[str, str], stand_in: bool) -> dict[str, int]:
    """Each quantized layer's stored weight bytes: as converted, or from its format's layout for a stand-in."""
    out = {}
    for name, key in layers.items():
        weight = model.get_submodule(name).weight
        assert isinstance(weight, torch.Tensor)
        out[name] = stored_bytes(key, *_shape_of(meta, name)) if stand_in else _weight_bytes(weight)
    return out


def gpu_ops(ops: tuple[Op, ...], layers: dict[str, str], stored: dict[str, int]) -> tuple[Op, ...]:
    """The traced ops with each quantized layer's ops as the one kernel its format runs on a GPU (``KERNELS``): its
    FLOPs at the kernel's rate, the activations it reads and writes, and its stored weight read at the kernel's
    share of bandwidth (as more bytes at the bfloat16 GEMM's share)."""
    out: list[Op] = []
    run: list[Op] = []
    serial = [0]

    def flush() -> None:
        if not run:
            return
        name = run[0].module
        kernel = KERNELS[layers[name]]
        main = max(run, key=lambda o: o.flops)
        weight = max((b for _, b in main.reads), default=0)
        serial[0] -= 1
        out.append(Op("matmuls", kernel.rate, sum(o.flops for o in run), ((serial[0], main.read - weight),
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


# --- one policy ---------------------------------------------------------------------------------------------------
class PolicyRun:
    """One serving policy's traces: at the job's shape and, for the searches, at other batch sizes and contexts;
    a deep model from its traces at 3 and 4 blocks."""

    def __init__(self, fc: ServeForecaster, policy: ServePolicy, cache: dict[tuple[Any, ...], Traced]) -> None:
        self.fc, self.policy, self.cache = fc, policy, cache
        self.deep = fc.layers > DEEP
        self.depths = SHALLOW if self.deep else (fc.layers,)
        self.extra: dict[int, int] = {}
        self.layers: dict[str, str] = {}
        self.stand_in = False
        self.block: int | None = None  # a block's weights, once its share of the peaks is known exact (0: not)

    def traced(self, shape: Shape, timed: bool = False) -> Traced:
        """Both passes at ``shape`` (read off the line through the shallow traces for a deep model), with the
        stand-in's weights at their format's bytes. Once a block's share of both peaks is known to be its weights
        and its cache exactly (``_block``), a search's sizes are traced at 3 blocks only and the rest added."""
        if not self.deep:
            return self._at(self.depths[0], shape, timed)
        at, k = self.fc.layers, self.fc.layers - SHALLOW[0]
        if not timed and self.block:
            one = self._at(SHALLOW[0], shape, False)
            rounded, stored = self._block_kv(shape, one.dtype)
            w = self.block

            def more(p: Pass) -> Pass:
                return Pass(p.peak + k * (w + rounded), p.weights + k * w, p.kv + k * stored, ())

            return Traced(more(one.prefill), more(one.decode), one.dtype)
        one, two = (self._at(depth, shape, timed) for depth in SHALLOW)
        if self.block is None:
            self.block = self._block(one, two, shape)
        return Traced(one.prefill.line(two.prefill, SHALLOW[0], at), one.decode.line(two.decode, SHALLOW[0], at),
                      one.dtype)

    def _block_kv(self, shape: Shape, dtype: Any) -> tuple[int, int]:
        """One layer's cache at ``shape``: its bytes as the allocator rounds each tensor, and as stored."""
        text = self.fc.config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        fmt = self.policy.kv
        element = fmt.element_bytes or torch.empty((), dtype=dtype).element_size()
        cells = shape.batch_size * kv_heads * shape.context
        sizes = [cells * head_dim * element] * 2
        sizes += [cells * 4] * 2 if fmt.scaled == "token" else [kv_heads * 4] * 2 if fmt.scaled == "head" else []
        block = CUDA_BLOCK if self.fc.cuda else 1
        position = 8  # the layer's count of tokens written (an int64 tensor), held beside its keys and values
        return sum(-(-n // block) * block for n in (*sizes, position)), sum(sizes)

    def _block(self, one: Traced, two: Traced, shape: Shape) -> int:
        """A block's weights, when one more block adds exactly its weights and its cache to both peaks (0: it adds
        something else too, and every size is traced at both depths)."""
        w = two.decode.weights - one.decode.weights
        rounded, stored = self._block_kv(shape, one.dtype)
        exact = all(b.peak - a.peak == w + rounded and b.kv - a.kv == stored
                    for a, b in ((one.prefill, two.prefill), (one.decode, two.decode)))
        return w if exact else 0

    def _at(self, depth: int, shape: Shape, timed: bool) -> Traced:
        model, extra, layers = self.fc.converted(self.policy.plan, depth)
        self.extra[depth] = extra
        self.layers.update(layers)  # every depth's quantized layers (the line's ops name the deepest's)
        self.stand_in = bool(extra)
        # a stand-in's weights are bfloat16's: its traces are bf16's, shifted by its layout's bytes
        layout = ("bf16" if extra else self.policy.plan.name, self.policy.kv.label, depth, shape)
        if layout not in self.cache or (timed and not self.cache[layout].prefill.ops):
            _, config = self.fc.at_depth(depth)
            dtypes = self.fc.dtype_of(self.policy.plan, depth, model)
            self.cache[layout] = trace(model, config, self.policy.kv, shape, self.fc.cuda, timed, dtypes)
            if self.cache[layout].dtype is not None:
                self.fc.remember(self.policy.plan, depth, model, self.cache[layout].dtype)
        t = self.cache[layout]
        return Traced(_shift(t.prefill, extra), _shift(t.decode, extra), t.dtype)


def _shift(p: Pass, extra: int) -> Pass:
    return Pass(p.peak + extra, p.weights + extra, p.kv, p.ops)


def largest(peak: Callable[[int], int], limit: int, at: int, most: int) -> int | None:
    """The largest size up to ``most`` whose peak fits ``limit`` (None: not even 1), each size tried traced:
    ``most`` itself when it fits; else the boundary between a size that fits and one that does not, found by
    interpolating between them (the peak is close to linear in the batch and the context: the first guess is
    usually the answer, confirmed by the size after it failing), halving the bracket when interpolation stalls."""
    top = peak(most)
    if top <= limit:
        return most
    lo, p_lo, hi, p_hi = 0, None, most, top  # lo fits (0: none known), hi does not
    a = peak(at) if at < most else top
    if a <= limit:
        lo, p_lo = at, a
    else:
        hi, p_hi = at, a
    stalls = 0
    while hi - lo > 1:
        if p_lo is None or stalls >= 2:
            guess = (lo + hi) // 2 if p_lo is not None or hi <= 2 else max(1, hi // 2)
            stalls = 0
        else:
            guess = lo + int((limit - p_lo) * (hi - lo) // max(p_hi - p_lo, 1))
            guess = min(max(guess, lo + 1), hi - 1)
        got = peak(guess)
        width = hi - lo
        if got <= limit:
            lo, p_lo = guess, got
            if guess + 1 < hi:  # the boundary is usually right after the interpolated size
                after = peak(guess + 1)
                if after > limit:
                    return guess
                lo, p_lo = guess + 1, after
        else:
            hi, p_hi = guess, got
        stalls = stalls + 1 if hi - lo > width // 2 else 0
    return lo or None


def _time(times: StepTimes, plan: Plan, ops: tuple[Op, ...], run: PolicyRun, cuda: bool) -> Any:
    if cuda and run.layers:
        ops = gpu_ops(ops, run.layers, layer_bytes(*_models(run), run.layers, run.stand_in))
    return times.of(plan, ops, "traced")


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
                   cache: dict[tuple[Any, ...], Traced], search: bool) -> GenerateFigures:
    run = PolicyRun(fc, policy, cache)
    t = run.traced(shape, timed=times is not None)
    top = t.prefill if t.prefill.peak >= t.decode.peak else t.decode
    limit = fc.target.usable_bytes
    figures = GenerateFigures(
        peak_bytes=t.peak, weights_bytes=t.decode.weights, kv_cache_bytes=t.decode.kv,
        activations_bytes=top.peak - top.weights - top.kv, prefill_peak_bytes=t.prefill.peak,
        decode_peak_bytes=t.decode.peak, fits=None if limit is None else t.peak <= limit,
        kv_bytes_per_token=t.decode.kv // (shape.batch_size * shape.context))
    if limit is not None and search:
        batch = largest(lambda b: run.traced(replace(shape, batch_size=b)).peak, limit, shape.batch_size, MOST_BATCH)
        most = fc.served.context - shape.prompt_len
        gen = largest(lambda g: run.traced(replace(shape, gen_len=g)).peak, limit, shape.gen_len, most)
        # 0: not even one sequence (or one token more than the prompt) fits
        figures = replace(figures, largest_batch=batch or 0, longest_context=0 if gen is None else
                          shape.prompt_len + gen)
    if times is None:
        return figures
    return _speed_figures(figures, run, t, shape, times)


def _speed_figures(figures: GenerateFigures, run: PolicyRun, t: Traced, shape: Shape,
                   times: StepTimes) -> GenerateFigures:
    plan, cuda = run.policy.plan, run.fc.cuda
    pre = _time(times, plan, t.prefill.ops, run, cuda)
    dec = _time(times, plan, t.decode.ops, run, cuda)
    if pre.step_s is None or dec.step_s is None:
        return replace(figures, bound=dec.reason or pre.reason)
    kernels = tuple(dict.fromkeys(f"{k}: {KERNELS[k].name} ({KERNELS[k].share:.2f} of bf16's bandwidth share, "
                                  f"{KERNELS[k].source})" for k in run.layers.values())) if cuda else ()
    bw, fl = _shares(gpu_ops(t.decode.ops, run.layers, layer_bytes(*_models(run), run.layers, run.stand_in))
                     if cuda and run.layers else t.decode.ops, dec.step_s, times.rates)
    return replace(figures, ttft_s=pre.step_s, prefill_tok_s=shape.batch_size * shape.prompt_len / pre.step_s,
                   decode_tok_s=shape.batch_size / dec.step_s, token_latency_s=dec.step_s, bound=dec.bound,
                   prefill_bound=pre.bound, kernels=kernels, bandwidth_share=bw, flops_share=fl)


def _models(run: PolicyRun) -> tuple[nn.Module, nn.Module]:
    depth = run.fc.layers if not run.deep else SHALLOW[-1]  # every layer the line's ops name
    return run.fc.converted(run.policy.plan, depth)[0], run.fc.at_depth(depth)[0]


Progress = Callable[[str, int, int], None]


def serve_forecast(spec: str, shape: Shape, target: TargetDevice, policies: str | None = None, *, seed: int = 0,
                   search: bool = True, check: bool = False, speed: bool = True, json_path: str | None = None,
                   on_progress: Progress | None = None, launcher: str = "process") -> GenerateReport:
    """Each serving policy forecast for ``target``: memory, whether it fits, the largest batch and longest context,
    and tokens per second; with ``check``, the same workload measured here beside it."""
    from dtypelab.serving.bench import check_shape

    start = time.perf_counter()
    here = "cuda" if torch.cuda.is_available() else "cpu"
    if check and target.kind != here:
        raise DtypelabError(f"--check runs the workload here ({here}): forecast for --device {here}, or leave out "
                            "--check")
    # a worker's imports run while this process reads the model; none for this CPU, whose kernels are timed here with
    # nothing beside them
    workers = _prestart(launcher) if target.kind == "cuda" else []
    served = load_served(spec)
    check_shape(shape, served.context, served.name, served.config)
    chosen = serve_policies(policies, DEFAULT_FORECAST if target.kind == "cuda" else DEFAULT_FORECAST_CPU)
    rates, no_rates = serving_rates(target) if speed else (None, "")
    parts = _parts(chosen, target, rates, len(workers))
    outcomes = _run_parts([ForecastPart(spec, shape, target, part, seed, search, speed) for part in parts],
                          workers, on_progress, len(chosen))
    found = {r.policy: r for out in outcomes if out.status == "ok" for r in out.value[0]}
    params = next((out.value[1] for out in outcomes if out.status == "ok"), 0)
    died = "; ".join(dict.fromkeys(out.reason or out.status for out in outcomes if out.status != "ok"))
    results = [found.get(p.name) or GeneratePolicy(p.name, p.describe(), "failed", died or "not reported")
               for p in chosen]
    if check:
        results = _checked(spec, shape, results, chosen, seed)
    fc = ServeForecaster(served, target, seed)
    best, sentence = _answer(results, target, shape)
    longest = max((r for r in results if r.generate and r.generate.longest_context),
                  key=lambda r: r.generate.longest_context or 0, default=None)  # type: ignore[union-attr]
    notes = [n for n in (no_rates, _notes(shape, target), _eager(chosen, fc)) if n]
    report = GenerateReport(
        GenerateConfig(spec, served.name, "forecast", shape.prompt_len, shape.gen_len, shape.batch_size, target,
                       parameters=params, context_limit=served.context),
        tuple(results), _environment(), sentence, best, longest.policy if longest else "", tuple(notes),
        time.perf_counter() - start, time.strftime("%Y-%m-%dT%H:%M:%S"), rates=rates.source if rates else "")
    if json_path:
        report.save(json_path)
    return report


DEFAULT_FORECAST_CPU = ("fp32", "bf16", "int8-wo", "fp32+kv-int8", "fp32+kv-fp8")
WORKERS = 2  # processes tracing at once (two cores)


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
            out.append(_forecast_one(fc, serve_policies(name, ())[0], self.shape, times, cache, self.search))
            report.step(i + 1, len(self.names))
        return out, fc.parameters()


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
    """The time one op of this model's decode step takes here, Python included: its decode step timed at the same
    depth with every width shrunk to a few numbers (so that no kernel costs anything) over the ops it runs; None
    when the model cannot be shrunk so."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    tiny = copy.deepcopy(config)
    heads = getattr(tiny, "num_attention_heads", 4)
    for name, value in (("hidden_size", 16 * heads), ("intermediate_size", 32), ("vocab_size", 64),
                        ("head_dim", 16)):
        if hasattr(tiny, name):
            setattr(tiny, name, value)
    shape = Shape(4, steps + 2, 1)
    try:
        with torch.device("cpu"):
            model = build(tiny).eval()
        cache = new_cache(tiny, kv_format(None), shape, torch.float32, torch.device("cpu"))
        with torch.inference_mode():
            token = prefill(model, torch.zeros((1, 4), dtype=torch.long), cache)
            with Count():
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
    the model's own code: measured on the model shrunk to no width), else the time of a bare op."""
    from dataclasses import replace as copy_with

    rates, why = rates_for(target)
    if rates is not None and rates.times_kernels:
        floor = program_floor(fc.config, fc.build_real) if fc is not None else None
        rates = copy_with(rates, floor_s=floor or inference_floor())
    return rates, why


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
    """The worker processes beside this one (none inline), started now with the libraries a trace needs."""
    from dtypelab.run import ProcessLauncher

    if launcher == "inline":
        return []
    workers = [ProcessLauncher() for _ in range(WORKERS - 1)]
    for worker in workers:
        worker.prestart((__name__, *PRELOAD))
    return workers


def _run_parts(parts: list[ForecastPart], workers: list[Any], on_progress: Progress | None, total: int) -> list[Any]:
    """The first part in this process (its libraries are imported already), the others in the workers, at once:
    their outcomes (without workers, one after another here)."""
    from concurrent.futures import ThreadPoolExecutor

    from dtypelab.run import LAUNCHERS

    done = [0] * len(parts)

    def run(i: int) -> Any:
        def step(n: int, _total: int) -> None:
            done[i] = n
            if on_progress is not None:
                on_progress(parts[i].names[n - 1], sum(done), total)

        chosen = workers[i - 1] if 0 < i <= len(workers) else LAUNCHERS["inline"]
        return chosen.run(parts[i], 24 * 3600, step)

    if not workers:  # one tracing thread per process: the dispatch modes a trace enters are global
        return [run(i) for i in range(len(parts))]
    with ThreadPoolExecutor(len(parts)) as pool:  # this process traces one part; the workers the others
        return list(pool.map(run, range(len(parts))))


def _forecast_one(fc: ServeForecaster, p: ServePolicy, shape: Shape, times: StepTimes | None,
                  cache: dict[tuple[Any, ...], Traced], search: bool) -> GeneratePolicy:
    start = time.perf_counter()
    try:
        figures = policy_figures(fc, p, shape, times, cache, search)
    except DtypelabError as exc:
        return GeneratePolicy(p.name, p.describe(), "failed", str(exc), seconds=time.perf_counter() - start)
    except Exception as exc:
        return GeneratePolicy(p.name, p.describe(), "failed", f"tracing it failed: {describe_exception(exc)}",
                              seconds=time.perf_counter() - start)
    return GeneratePolicy(p.name, p.describe(), "ok", generate=figures, seconds=time.perf_counter() - start)


def _answer(results: list[GeneratePolicy], target: TargetDevice, shape: Shape) -> tuple[str, str]:
    ok = [r for r in results if r.status == "ok" and r.generate is not None]
    fits = [r for r in ok if r.generate.fits is not False]  # type: ignore[union-attr]
    if not ok:
        return "", "no policy could be forecast"
    timed = [r for r in fits if r.generate.decode_tok_s]  # type: ignore[union-attr]
    if timed:
        best = max(timed, key=lambda r: r.generate.decode_tok_s or 0.0)  # type: ignore[union-attr]
        g = best.generate
        assert g is not None
        return best.policy, (f"{best.policy}: the fastest decode that fits {target.label} at batch {shape.batch_size}"
                             f", {shape.context:,} tokens of context: {g.decode_tok_s:,.0f} tokens/s "
                             f"({g.bound}-bound), peak {(g.peak_bytes or 0) / 2**30:.3g} GiB")
    if fits:
        small = min(fits, key=lambda r: r.generate.peak_bytes or 0)  # type: ignore[union-attr]
        return small.policy, f"{len(fits)} of {len(ok)} policies fit {target.label}; the smallest peak: {small.policy}"
    small = min(ok, key=lambda r: r.generate.peak_bytes or 0)  # type: ignore[union-attr]
    return "", f"no policy fits {target.label}: the smallest peak is {small.policy}'s"


def _notes(shape: Shape, target: TargetDevice) -> str:
    return (f"decode at the full context ({shape.context:,} tokens): a static cache is read whole at every step, so "
            "every step of the generation costs the same; the prefill keeps the last position's logits only")


def _eager(chosen: list[ServePolicy], fc: ServeForecaster) -> str:
    """On a GPU: what an eager policy's time leaves out, and how its quantized layers are timed."""
    eager = [p.name for p in chosen if not p.plan.compiles]
    if not fc.cuda or not eager:
        return ""
    return (f"eager ({', '.join(eager)}): each op a kernel of its own, at least {5} µs each; the launch overhead "
            "of eager PyTorch beyond that is not modelled (NAME+compile fuses the ops); a quantized layer is timed as "
            "the one kernel its format runs compiled (torch.compile fuses the dequantization into the GEMM)")


def _environment() -> dict[str, Any]:
    from dtypelab.core.hardware import environment, hardware_for

    return environment(hardware_for(torch.device("cpu"), None, budget_s=0.02))


def _checked(spec: str, shape: Shape, results: list[GeneratePolicy], chosen: list[ServePolicy],
             seed: int) -> list[GeneratePolicy]:
    """The forecast beside the same workload measured here (this CPU): each policy that runs here."""
    from dtypelab.serving.bench import serve_bench

    names = ",".join(p.name for p in chosen)
    measured = serve_bench(spec, shape, names, baseline=chosen[0].name, seed=seed)
    out = []
    for r in results:
        m = next((x for x in measured.policies if x.policy == r.policy), None)
        out.append(replace(r, check=m.generate if m is not None and m.status == "ok" else None,
                           notes=r.notes + ((f"--check: {m.reason}",) if m is not None and m.status != "ok" else ())))
    return out
