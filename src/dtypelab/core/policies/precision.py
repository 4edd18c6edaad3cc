"""Precision: a plan applied to one model on one device, as hooks the loop calls (Lightning Fabric's
precision-plugin shape). Order of use in a training step: ``session()`` around the whole run
(process-wide flags), ``convert_module`` once, then per step ``convert_input`` -> ``forward_context``
(forward + loss) -> ``backward`` -> ``optimizer_step``. Audit and trace read the GradScaler through
``grad_scale()`` / ``grad_scaler()``, never by attribute.

Modules a plan's rules give a config other than their parent's run through a *region*: their parameters
converted to the region's dtype, their floating inputs cast on entry, their forward run under the region's
autocast state (enabled for an autocast region, disabled for a cast region inside autocast), and their
floating outputs cast back to what the surrounding model computes in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtypelab.core.backends import quiet, torchao_module
from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies.configs import TF32, Autocast, Cast, Config
from dtypelab.core.policies.float8 import Float8Train, float8_unfit
from dtypelab.core.policies.plan import Plan
from dtypelab.core.policies.quantize import INT4_GROUP, Quantize
from dtypelab.core.scaler import ScalerLog
from dtypelab.core.task import map_tensors


def _floats_to(dtype: torch.dtype | None, obj: Any) -> Any:
    if dtype is None:
        return obj
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, obj)


@dataclass(frozen=True)
class Region:
    """How a module whose config differs from its parent's runs."""

    device_type: str
    config: Config
    input_dtype: torch.dtype | None
    output_dtype: torch.dtype | None

    def context(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.autocast_dtype is not None:
            return torch.autocast(self.device_type, dtype=getattr(torch, self.config.autocast_dtype))
        return torch.autocast(self.device_type, enabled=False)


def _region_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    region: Region = self._dtypelab_region
    args, kwargs = _floats_to(region.input_dtype, (args, kwargs))
    with region.context():
        out = type(self).forward(self, *args, **kwargs)
    return _floats_to(region.output_dtype, out)


class Precision:
    """A plan's hooks for one model on ``device``."""

    def __init__(self, plan: Plan, device: torch.device | str = "cpu") -> None:
        self.plan = plan
        self.device = torch.device(device)
        default = plan.default
        # a pure cast, or a quantized model whose kernels take bfloat16 activations (fp8 dynamic, int4)
        self._cast = getattr(torch, default.storage_dtype) if default.storage_dtype != "float32" else None
        self._autocast = getattr(torch, default.autocast_dtype) if default.autocast_dtype else None
        self._conversion: dict[str, Any] = {}
        self._scaler = torch.amp.GradScaler(self.device.type) if plan.uses_scaler else None
        self._log = ScalerLog() if self._scaler is not None else None
        self._step = 0

    @property
    def name(self) -> str:
        return self.plan.name

    # --- hooks ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Set process-wide state for the run and restore it afterwards."""
        with contextlib.ExitStack() as stack:
            if isinstance(self.plan.default, TF32):
                stack.enter_context(_tf32())
            if any(isinstance(c, Quantize) and c.compile for c in self.plan.configs):
                # torchao's recommended inductor settings, patched for the run only (its configs would set
                # them process-wide; every config here passes set_inductor_config=False).
                from torch._inductor import config

                stack.enter_context(config.patch(coordinate_descent_tuning=True, force_fuse_int_mm_with_mul=True))
                stack.enter_context(quiet())
            yield

    def convert_module(self, model: nn.Module) -> nn.Module:
        """The model under the plan: cast, regions wrapped, linear layers quantized, compiled if asked."""
        assigned = self.plan.assign(model)
        if self._cast is not None:
            model = model.to(self._cast)
        elif any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
            model = model.to(torch.float32)  # float32 weights as the plan says, whatever a script built its model in
        outer = self._cast or torch.float32
        modules = dict(model.named_modules(remove_duplicate=False))
        for name, config in assigned.items():
            parent = assigned.get(name.rpartition(".")[0]) if name else self.plan.default
            if not name or config == parent or isinstance(config, Float8Train):
                continue  # a float8 layer takes whatever its neighbours compute in
            if isinstance(config, Quantize):
                if config.storage_dtype != "float32" and getattr(torch, config.storage_dtype) != outer:
                    # its kernel takes bfloat16 activations: the layer in bfloat16, its outputs cast back
                    self._region(modules[name], Cast(config.storage_dtype), getattr(torch, config.storage_dtype),
                                 outer)
                continue
            dtype = getattr(torch, config.storage_dtype)
            if isinstance(config, Cast) and dtype == outer and parent.autocast_dtype is None:
                continue  # runs as its parent does already (e.g. a layer excluded from quantization)
            self._region(modules[name], config, dtype, outer)
        model, self._conversion = _float8(model, assigned)
        model = _quantize(model, assigned, self._conversion)
        if self._log is not None:
            self._log.params = list(model.named_parameters())  # to name the parameters on skipped steps
        if self.plan.compiles:
            with quiet():  # also torch.compile's first import of inductor, which warns about torch.jit
                # static shapes: one compile per input shape, rather than a slower dynamic-shape graph
                model = torch.compile(model, dynamic=False)
        return model

    def _region(self, module: nn.Module, config: Config, dtype: torch.dtype, outer: torch.dtype) -> None:
        module.to(dtype)
        # Under an autocast default, autocast itself mixes dtypes; elsewhere the next layer expects `outer`.
        out_dtype = None if self._autocast is not None else outer
        module._dtypelab_region = Region(self.device.type, config, dtype, out_dtype)
        module.forward = types.MethodType(_region_forward, module)

    def promote(self, model: nn.Module, name: str, config: Config,
                optimizer: torch.optim.Optimizer | None = None) -> Plan:
        """Run module ``name`` of a model this precision converted in ``config`` (a Cast or an Autocast) from now on,
        while training goes on: its weights (and their optimizer state) take the config's dtype, its inputs are
        cast to it and its outputs back to what the next layer expects. Returns the plan now in force (the
        old one with a rule for ``name``), which this precision also adopts."""
        if not isinstance(config, (Cast, Autocast)):
            raise DtypelabError(f"a layer can be moved to a cast or an autocast config, not {config.label}")
        module = dict(model.named_modules())[name]
        dtype = getattr(torch, config.dtype) if isinstance(config, Cast) else torch.float32
        self._region(module, config, dtype, self._cast or torch.float32)
        if optimizer is not None:  # Adam's moments in the old dtype would not match the weights any more
            owned = {id(p) for p in module.parameters()}
            for p, state in optimizer.state.items():
                if id(p) in owned:
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step":
                            state[k] = v.to(p.dtype)
        rules = (*((p, c) for p, c in self.plan.rules if p != name), (name, config))
        self.plan = dataclasses.replace(self.plan, rules=rules, name="")
        return self.plan

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype floating inputs are given to the model in (``convert_input``)."""
        return self._cast or torch.float32

    def convert_input(self, batch: Any, every: bool = False) -> Any:
        """Floating inputs (and targets) in the model's dtype under a pure cast; integer ones never change. With
        ``every``, floating inputs of any other dtype go to float32 under a float32 plan too (a script's float64
        data meets its model converted to float32); tasks, whose data is float32, skip that walk every step."""
        return _floats_to(self.input_dtype if every else self._cast, batch)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        if self._autocast is not None:
            return torch.autocast(self.device.type, dtype=self._autocast)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (self._scaler.scale(loss) if self._scaler is not None else loss).backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; False when the step was skipped (GradScaler found inf/NaN gradients)."""
        if self._scaler is None:
            optimizer.step()
            return True
        scale = self._scaler.get_scale()
        self._scaler.step(optimizer)
        self._scaler.update()
        skipped = self._log.record(self._step, scale, self._scaler.get_scale())
        self._step += 1
        return not skipped

    # --- what audit, trace and the record read ----------------------------------------------------
    def grad_scale(self) -> float:
        """The factor the current gradients are multiplied by (1.0 without a GradScaler)."""
        return self._scaler.get_scale() if self._scaler is not None else 1.0

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler, for a guard that checkpoints and watches its state; None when there is none."""
        return self._scaler

    def stats(self) -> dict[str, Any]:
        """Measurements to keep in the record (the GradScaler's history)."""
        return self._log.stats() if self._log is not None else {}

    def conversion(self) -> dict[str, Any]:
        """Which layers a float8 / int4 conversion took and which it left out, each with why (its shape): what the
        record says when such a policy gains less than its format promises. Empty for every other plan."""
        return dict(self._conversion)


@contextlib.contextmanager
def _tf32() -> Iterator[None]:
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = (matmul.fp32_precision, conv.fp32_precision)
    matmul.fp32_precision, conv.fp32_precision = "tf32", "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision, conv.fp32_precision = saved


def _float8(model: nn.Module, assigned: dict[str, Config]) -> tuple[nn.Module, dict[str, Any]]:
    """The linear layers the plan gives a ``Float8Train`` config, converted to torchao's ``Float8Linear`` where
    their shape pays (``Float8Train.left_out``); the rest stay as they are. Returns the model and what was done."""
    groups = _linear_names(model, assigned, Float8Train)
    if not groups:
        return model, {}
    float8 = torchao_module("float8")
    modules = dict(model.named_modules())
    converted: list[str] = []
    left_out: list[dict[str, str]] = []
    for config, names in groups.items():
        chosen = set()
        for name in names:
            why = config.left_out(modules[name].out_features, modules[name].in_features)
            if why:
                left_out.append({"layer": name, "why": why})
            else:
                chosen.add(name)
        if chosen:
            with quiet():
                model = float8.convert_to_float8_training(
                    model, config=float8.Float8LinearConfig.from_recipe_name(config.recipe),
                    module_filter_fn=lambda m, fqn, chosen=chosen: fqn in chosen)
        converted += sorted(chosen)
    formats = ", ".join(f"float8 training ({c.recipe})" for c in groups)
    return model, {"format": formats, "converted": converted, "left_out": left_out}


def _unfit(config: Quantize, layer: nn.Linear) -> str | None:
    """Why a GPU format's kernel cannot take this layer (torchao would leave it as it is, silently), or None."""
    n, k = layer.out_features, layer.in_features
    if config.scheme == "int4-weight-only" and (k % INT4_GROUP or n % 8):  # tinygemm: whole groups, tiles of 8
        return f"{n}×{k}: int4 needs the input width a multiple of {INT4_GROUP} (its group size) and the outputs of 8"
    return float8_unfit(n, k) if config.scheme == "fp8-dynamic" else None


def _quantize(model: nn.Module, assigned: dict[str, Config], conversion: dict[str, Any]) -> nn.Module:
    """Each quantize config applied to exactly the linear layers the plan gives it; a GPU format's layers its kernel
    cannot take are left out, and ``conversion`` says so."""
    groups = _linear_names(model, assigned, Quantize)
    modules = dict(model.named_modules())
    for config, names in groups.items():
        if config.gpu_only:
            unfit = {n: why for n in names if (why := _unfit(config, modules[n]))}
            groups[config] = [n for n in names if n not in unfit]
            conversion.setdefault("format", config.label)
            conversion.setdefault("converted", []).extend(groups[config])
            conversion.setdefault("left_out", []).extend({"layer": n, "why": why} for n, why in unfit.items())
    torchao = {c: names for c, names in groups.items() if c.library == "torchao"}
    legacy = {c: names for c, names in groups.items() if c.library == "torch.ao"}
    if torchao:
        quantization = torchao_module("quantization")
        with quiet():
            for config, names in torchao.items():
                chosen = set(names)
                quantization.quantize_(model, config.torchao_config(),
                                       filter_fn=lambda m, fqn, chosen=chosen: fqn in chosen)
    if legacy:
        with warnings.catch_warnings():
            # its deprecation notices (and torch.jit's, from its packed modules): the policy's summary says so
            warnings.simplefilter("ignore")
            from torch.ao import quantization as tq

            spec = {name: tq.per_channel_dynamic_qconfig if c.granularity == "per-channel" else
                    tq.default_dynamic_qconfig for c, names in legacy.items() for name in names}
            model = tq.quantize_dynamic(model, spec, dtype=torch.qint8)
    return model


def _linear_names(model: nn.Module, assigned: dict[str, Config], kind: type[Config]) -> dict[Config, list[str]]:
    """The ``nn.Linear`` modules assigned a config of ``kind``, grouped by config."""
    out: dict[Config, list[str]] = {}
    for name, module in model.named_modules():
        config = assigned.get(name)
        if isinstance(module, nn.Linear) and isinstance(config, kind):
            out.setdefault(config, []).append(name)
    return out
