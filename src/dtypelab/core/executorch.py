"""A model on PyTorch's path to the device: ``torch.export``, quantized where the scheme asks (PT2E with ExecuTorch's
``XNNPACKQuantizer`` for int8; torchao's 8-bit-dynamic-activation 4-bit-weight config for ``8da4w``), lowered to
the XNNPACK delegate, serialized as a ``.pte`` program and run by ExecuTorch's runtime (its Python bindings) on this
CPU, as a phone or board runs it. ``PteModule`` is that program as an ``nn.Module``: what the sweep times and
compares, and what ``export`` writes.

A ``.pte`` has static shapes here (what a device app compiles against): the example batch the task's inputs give.
A call with fewer rows is padded to it and the padding's outputs dropped; one with more runs in chunks.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from dtypelab.core.backends import quiet
from dtypelab.core.errors import DtypelabError

VERSION = "1.5"  # the ExecuTorch series the extra pins (its wheels are built against torchao 0.18)
SETUP = "pip install -c constraints.txt -e '.[device]'"
SCHEMES = {
    "fp32": "float32 through XNNPACK",
    "fp16": "float16 weights and activations through XNNPACK",
    "int8-dyn": "int8 weights per channel × int8 activations quantized per call (PT2E, XNNPACKQuantizer, dynamic)",
    "int8": "int8 weights per channel × int8 activations with scales calibrated on the task's inputs (PT2E, "
            "XNNPACKQuantizer, static)",
    "8da4w": "4-bit weights in groups of 32 × int8 activations quantized per token (torchao's "
             "Int8DynamicActivationIntxWeightConfig, as ExecuTorch's LLM export)",
}
GROUP = 32  # 8da4w's weight group: ExecuTorch's LLM export default
_INT_SCALAR_OPS = ("add", "mul")


def missing() -> str | None:
    """Why ExecuTorch cannot run here, in one line; None when it can."""
    if importlib.util.find_spec("executorch") is None:
        return f"ExecuTorch is not installed: {SETUP} (ExecuTorch {VERSION}, its XNNPACK delegate and runtime)"
    try:
        _runtime()
    except Exception as exc:  # a wheel built for another torch fails here, with the linker's or loader's words
        return f"ExecuTorch cannot be loaded ({type(exc).__name__}: {str(exc).splitlines()[0]}); {SETUP}"
    return None


def _runtime() -> Any:
    with quiet():
        return importlib.import_module("executorch.runtime").Runtime.get()


@contextlib.contextmanager
def _native_log_held() -> Iterator[None]:
    """ExecuTorch's runtime logs from C++ on the process's stderr as XNNPACK starts (its CPU probe's file reads, once
    per process): held back, and shown only when the call fails, where it may say why."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def load_forward(program: bytes) -> Any:
    """The program's ``forward`` method, loaded by ExecuTorch's runtime."""
    with _native_log_held():
        return _runtime().load_program(program).load_method("forward")


def _module(name: str) -> Any:
    with quiet():
        return importlib.import_module(name)


# --- the example calls -----------------------------------------------------------------------------------------
class _Recorder(nn.Module):
    """The model, recording each call's arguments: the calibration feed's calls are the export's example and the
    static scheme's calibration batches."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t,
                                          (args, kwargs)))
        return self.inner(*args, **kwargs)


def example_calls(model: nn.Module, feed: Callable[[Any], None] | None) -> list[tuple[tuple[Any, ...],
                                                                                      dict[str, Any]]]:
    if feed is None:
        raise DtypelabError("an ExecuTorch policy exports the model with example inputs, and none were given: "
                            "it runs under bench/tune --mode infer and export, which give the task's")
    recorder = _Recorder(model)
    with torch.no_grad():
        feed(recorder)
    if not recorder.calls:
        raise DtypelabError("an ExecuTorch policy needs example inputs: the task's feed called the model 0 times")
    return recorder.calls


# --- export, quantize, lower -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lowered:
    """A ``.pte`` program and what calling it needs: its pytree specs (JSON), the batch it was exported at, the float
    dtype of its inputs; and how it was delegated."""

    program: bytes
    in_spec: str
    out_spec: str
    batch: int
    float_dtype: str
    delegated: int = 0  # XNNPACK subgraphs
    fallback: dict[str, int] = field(default_factory=dict)  # operator -> calls left to ExecuTorch's portable kernels
    # the arena ExecuTorch's memory planning gives the program's activations (its non-constant buffers), known
    # without the device; the delegate's own scratch (XNNPACK's workspace) is not in it
    planned_bytes: int = 0
    # a language model's program (``executorch_lm``): the positions its key/value cache holds (0: not one), and the
    # cache's bytes, part of the planned arena (its mutable buffers)
    max_len: int = 0
    cache_bytes: int = 0

    def metadata(self) -> dict[str, Any]:
        return {"in_spec": self.in_spec, "out_spec": self.out_spec, "batch": self.batch,
                "float_dtype": self.float_dtype, "delegated": self.delegated, "fallback": self.fallback,
                "planned_bytes": self.planned_bytes, "max_len": self.max_len, "cache_bytes": self.cache_bytes}

    @classmethod
    def from_metadata(cls, program: bytes, meta: dict[str, Any]) -> Lowered:
        try:
            return cls(program, str(meta["in_spec"]), str(meta["out_spec"]), int(meta["batch"]),
                       str(meta["float_dtype"]), int(meta.get("delegated", 0)),
                       {str(k): int(v) for k, v in dict(meta.get("fallback", {})).items()},
                       int(meta.get("planned_bytes", 0)), int(meta.get("max_len", 0)),
                       int(meta.get("cache_bytes", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise DtypelabError(f"the .pte's dtypelab metadata is incomplete ({type(exc).__name__}: {exc})") from None


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, obj)


def _batch_of(call: tuple[tuple[Any, ...], dict[str, Any]]) -> int:
    tensors = [t for t in pytree.tree_leaves(call) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not tensors:
        raise DtypelabError("an ExecuTorch policy needs tensor inputs with a batch dimension")
    return int(tensors[0].shape[0])


def _integer_scalars_kept(gm: torch.fx.GraphModule) -> None:
    """ExecuTorch 1.5's XNNPACKQuantizer turns the scalar of every ``add``/``mul`` into a float tensor, those of
    integer index arithmetic too (transformers' attention masks: ``arange + 0``), which then fails as an index; as
    ``add.Scalar``/``mul.Scalar`` the integer ones are out of its reach and compute the same."""
    ops = {getattr(torch.ops.aten, op).Tensor: getattr(torch.ops.aten, op).Scalar for op in _INT_SCALAR_OPS}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if (node.op == "call_function" and node.target in ops and isinstance(val, torch.Tensor)
                and not val.dtype.is_floating_point and not isinstance(node.args[1], torch.fx.Node)):
            node.target = ops[node.target]
    gm.recompile()


@dataclass(frozen=True)
class Exporter:
    """How the model is exported: its example call, the dimensions left dynamic, and whether through Dynamo
    (``strict``: transformers' static-cache recipe exports that way; a plain model, non-strict)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    dynamic: dict[str, Any] | None = None
    strict: bool = False

    def __call__(self, model: nn.Module, strict: bool | None = None) -> Any:
        return torch.export.export(model, self.args, self.kwargs, dynamic_shapes=self.dynamic,
                                   strict=self.strict if strict is None else strict)


Calibrate = Callable[[nn.Module], None]  # runs calibration inputs through a prepared (observed) model


def _pt2e(model: nn.Module, scheme: str, export: Exporter, calibrate: Calibrate) -> nn.Module:
    """int8 through PT2E: XNNPACKQuantizer on the linear layers (weights per channel; activations per call, or
    calibrated by ``calibrate``)."""
    xq = _module("executorch.backends.xnnpack.quantizer.xnnpack_quantizer")
    pt2e = _module("torchao.quantization.pt2e.quantize_pt2e")
    config = xq.get_symmetric_quantization_config(is_per_channel=True, is_dynamic=scheme == "int8-dyn")
    quantizer = xq.XNNPACKQuantizer().set_module_type(nn.Linear, config)
    with quiet():
        gm = export(model).module()
    _integer_scalars_kept(gm)
    prepared = pt2e.prepare_pt2e(gm, quantizer)
    with torch.no_grad():
        if scheme == "int8":
            calibrate(prepared)
        else:  # dynamic: one call gives the graph its observers' shapes
            prepared(*export.args, **export.kwargs)
    converted: nn.Module = pt2e.convert_pt2e(prepared)
    return converted


def _8da4w(model: nn.Module) -> nn.Module:
    quant = _module("torchao.quantization")
    granularity = _module("torchao.quantization.granularity")
    config = quant.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,  # type: ignore[attr-defined]
                                                         weight_granularity=granularity.PerGroup(GROUP))
    with quiet():
        quant.quantize_(model, config, filter_fn=lambda m, _: isinstance(m, nn.Linear)
                        and m.in_features % GROUP == 0)
    return model


def float_dtype(scheme: str) -> torch.dtype:
    if scheme not in SCHEMES:
        raise DtypelabError(f"executorch: unknown scheme {scheme!r}; use one of {', '.join(SCHEMES)}")
    return torch.float16 if scheme == "fp16" else torch.float32


DYNAMIC = ("int8-dyn", "8da4w")  # activations quantized per call


def _partitioners(scheme: str, llm: bool) -> list[Any]:
    """XNNPACK's partitioners as ExecuTorch's recipes use them: one pass for a model (its XNNPACK examples'); for a
    language model with dynamically quantized linears, those first, then everything else it takes (its LLM
    export's order: in one pass XNNPACK 1.5 can cut the quantization chain Q, K and V share into partitions that
    depend on each other, and the lowering fails)."""
    xp = _module("executorch.backends.xnnpack.partition.xnnpack_partitioner")
    first = [xp.XnnpackDynamicallyQuantizedPartitioner()] if llm and scheme in DYNAMIC else []
    return [*first, xp.XnnpackPartitioner()]


@dataclass(frozen=True)
class Program:
    """A lowered program's bytes and how it was delegated (``Lowered``'s fields from ``to_program``)."""

    ep: Any  # the exported program before lowering: its call spec
    buffer: bytes
    delegated: int
    fallback: dict[str, int]
    planned_bytes: int
    state_bytes: int = 0  # the buffers the program writes (a language model's cache), part of the planned arena


def to_program(model: nn.Module, scheme: str, export: Exporter, calibrate: Calibrate, llm: bool = False) -> Program:
    """``model`` (in ``scheme``'s float dtype, eval) quantized as ``scheme`` asks, exported by ``export`` and lowered
    to XNNPACK as a .pte program (``llm``: partitioned as ExecuTorch's LLM export partitions)."""
    if scheme in ("int8", "int8-dyn"):
        model = _pt2e(model, scheme, export, calibrate)
    elif scheme == "8da4w":
        model = _8da4w(model)
    with quiet(), torch.no_grad():
        # a PT2E-converted model is a graph module already: exported as it is, without Dynamo
        ep = export(model, strict=False) if isinstance(model, torch.fx.GraphModule) else export(model)
        edge = _module("executorch.exir").to_edge_transform_and_lower(ep, partitioner=_partitioners(scheme, llm))
        info = _module("executorch.devtools.backend_debug").get_delegation_info(
            edge.exported_program().graph_module)
        mutated = set(edge.exported_program().graph_signature.buffers_to_mutate.values())
        manager = edge.to_executorch()
        # buffer 0 is reserved (the constants'): the rest are the arenas the runtime allocates for activations
        planned = sum(sum(plan.non_const_buffer_sizes[1:]) for plan in manager.executorch_program.execution_plan)
    fallback = {op: n.non_delegated for op, n in sorted(info.delegation_by_operator.items())
                if n.non_delegated and op not in ("getitem", "sym_size")}
    state = sum(t.untyped_storage().nbytes() for name, t in ep.named_buffers() if name in mutated)
    return Program(ep, bytes(manager.buffer), int(info.num_delegated_subgraphs), fallback, int(planned), state)


def lower(model: nn.Module, scheme: str, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> Lowered:
    """``model`` (float32, eval) as a ``.pte`` under ``scheme``, exported at the first call's shapes."""
    dtype = float_dtype(scheme)
    calls = [_cast(c, dtype) for c in calls]

    def calibrate(prepared: nn.Module) -> None:
        for a, k in calls:
            prepared(*a, **k)

    p = to_program(model.to(dtype).eval(), scheme, Exporter(*calls[0]), calibrate)
    return Lowered(p.buffer, pytree.treespec_dumps(p.ep.call_spec.in_spec),
                   pytree.treespec_dumps(p.ep.call_spec.out_spec), _batch_of(calls[0]), str(dtype).split(".")[-1],
                   p.delegated, p.fallback, p.planned_bytes)


# --- the program as a module -----------------------------------------------------------------------------------
class PteModule(nn.Module):
    """A ``.pte`` program run by ExecuTorch's runtime, called as the model was: the same arguments (their floats cast
    to the program's dtype), the same output structure (floats back in float32). No parameters: its weights live in
    the program."""

    def __init__(self, lowered: Lowered) -> None:
        super().__init__()
        self.lowered = lowered
        self._in_spec = pytree.treespec_loads(lowered.in_spec)
        self._out_spec = pytree.treespec_loads(lowered.out_spec)
        self._dtype = getattr(torch, lowered.float_dtype)
        self._method = load_forward(lowered.program)

    @property
    def program(self) -> bytes:
        return self.lowered.program

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise DtypelabError(f"the .pte was exported for calls shaped {self._in_spec}, not {spec}")
        rows = _batch_of((args, kwargs))
        outs = [self._run(leaves, i, min(rows, i + self.lowered.batch)) for i in range(0, rows, self.lowered.batch)]
        flat = [torch.cat(parts) if isinstance(parts[0], torch.Tensor) and parts[0].dim() else parts[0]
                for parts in zip(*outs, strict=True)]
        return pytree.tree_unflatten(flat, self._out_spec)

    def _run(self, leaves: list[Any], start: int, end: int) -> list[Any]:
        """Rows start..end through the program, padded to its batch with the last row."""
        batch = self.lowered.batch

        def rows(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                return t
            part = t[start:end]
            if end - start < batch:
                part = torch.cat([part, part[-1:].expand(batch - (end - start), *part.shape[1:])])
            return part.to(self._dtype).contiguous() if part.is_floating_point() else part.contiguous()

        with quiet():
            got = self._method.execute([rows(t) for t in leaves])
        return [o[:end - start].float() if isinstance(o, torch.Tensor) and o.dim() and o.is_floating_point()
                else o[:end - start] if isinstance(o, torch.Tensor) and o.dim() else o for o in got]


__all__ = ["GROUP", "SCHEMES", "SETUP", "Calibrate", "Exporter", "Lowered", "Program", "PteModule", "example_calls",
           "float_dtype", "load_forward", "lower", "missing", "to_program"]
