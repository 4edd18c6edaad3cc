"""Precision: a plan applied to one model on one device, as hooks the loop calls (Lightning Fabric's
precision-plugin shape), each made of the plan's kinds' own hooks (``configs.Config``). Order of use in a training
run: ``session()`` around the whole run (process-wide flags), ``convert_module`` once, ``convert_optimizer`` once,
then per step ``convert_input`` -> ``forward_context`` (forward + loss) -> ``backward`` -> ``optimizer_step`` (or, with
several optimizers, ``step`` each and ``update`` once). Audit and trace read the GradScaler through ``grad_scale()``
/ ``grad_scaler()``, never by attribute.

Modules a plan's rules give a config other than their parent's run through a *region*: their parameters
converted to the region's dtype, their floating inputs cast on entry, their forward run under the region's
autocast state (enabled for an autocast region, disabled for a cast region inside autocast), and their
floating outputs cast back to what the surrounding model computes in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dtypelab.core.backends import quiet
from dtypelab.core.errors import DtypelabError
from dtypelab.core.footprint import loss_part
from dtypelab.core.policies.checkpointing import checkpoint_blocks
from dtypelab.core.policies.configs import ActivationPart, Config
from dtypelab.core.policies.loss import logit_width
from dtypelab.core.policies.plan import Plan
from dtypelab.core.policies.regions import Region, RegionModule, floats_to, slot, unwrapped
from dtypelab.core.scaler import ScalerLog


def _merge(conversion: dict[str, Any], report: dict[str, Any]) -> None:
    if "format" in report:
        conversion["format"] = ", ".join(dict.fromkeys(filter(None, [conversion.get("format"), report["format"]])))
    for key in ("converted", "left_out", "notes"):
        if key in report:
            conversion.setdefault(key, []).extend(report[key])
    # a whole-model program's (ExecuTorch): one per plan
    for key in ("delegate", "delegated", "fallback", "planned_bytes", "batch", "max_len", "cache_bytes"):
        if key in report:
            conversion[key] = report[key]


class Precision:
    """A plan's hooks for one model on ``device``: each kind's hooks, combined region by region."""

    def __init__(self, plan: Plan, device: torch.device | str = "cpu", *, traced: bool = False) -> None:
        """``traced``: for a fake-tensor trace of the step's memory (``dtypelab forecast``): no GradScaler, whose
        step reads a value (``found_inf.item()``) that fake tensors do not have, and whose state is two scalars; the
        backward's tensors are the same with or without it."""
        self.plan = plan
        self.device = torch.device(device)
        default = plan.default
        # a pure cast, or a quantized model whose kernels take bfloat16 activations (fp8 dynamic, int4)
        self._cast = getattr(torch, default.facts.storage_dtype) if default.facts.storage_dtype != "float32" else None
        self._conversion: dict[str, Any] = {}
        self._scaler = torch.amp.GradScaler(self.device.type) if plan.uses_scaler and not traced else None
        self._log = ScalerLog() if self._scaler is not None else None
        self._step = 0
        # the kinds with a step of their own (a master copy); none for the built-in ones: their step is the plain one
        self._stepping = [c for c in plan.configs if type(c).optimizer_step is not Config.optimizer_step]
        # ... and those that act through the optimizer at all (its conversion too): nothing for hand-updated weights
        self._through_optimizer = self._stepping or [
            c for c in plan.configs if type(c).convert_optimizer is not Config.convert_optimizer]

    @property
    def name(self) -> str:
        return self.plan.name

    # --- hooks ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Set process-wide state for the run (each kind's) and restore it afterwards."""
        with contextlib.ExitStack() as stack:
            for config in self.plan.configs:
                stack.enter_context(config.session(self.device))
            yield

    def convert_module(self, model: nn.Module) -> nn.Module:
        """The model under the plan: cast, regions wrapped, each kind's own conversion of the modules it covers
        (linear layers quantized, float8), compiled if asked."""
        assigned = self.plan.assign(model)
        if self._cast is not None:
            model = model.to(self._cast)
        elif any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
            model = model.to(torch.float32)  # float32 weights as the plan says, whatever a script built its model in
        outer = self._cast or torch.float32
        modules = dict(model.named_modules(remove_duplicate=False))
        placed = {}
        for name, config in assigned.items():
            parent = assigned.get(name.rpartition(".")[0]) if name else self.plan.default
            region = config.region(parent, outer) if name and config != parent else None
            if region is not None:  # weights in the region's dtype before the kinds convert them (int8 from bf16)
                modules[name].to(getattr(torch, region.facts.storage_dtype))
                placed[name] = region
        for config in self.plan.configs:
            model, report = config.convert_module(model, [n for n, c in assigned.items() if c == config])
            _merge(self._conversion, report)
        for name, region in placed.items():  # around what the kinds made of each layer (a swapped module too)
            self._region(model, name, region, getattr(torch, region.facts.storage_dtype), outer)
        if self.plan.checkpoint:  # around the blocks as the kinds left them (a LoRA layer, a region inside)
            checkpoint_blocks(model, f"{self.plan.name}")
        if self._log is not None:
            self._log.params = list(model.named_parameters())  # to name the parameters on skipped steps
        if self.plan.compiles:
            with quiet():  # also torch.compile's first import of inductor, which warns about torch.jit
                # static shapes: one compile per input shape, rather than a slower dynamic-shape graph
                model = torch.compile(model, dynamic=False)
        return model

    def _region(self, model: nn.Module, name: str, config: Config, dtype: torch.dtype, outer: torch.dtype) -> None:
        """Layer ``name`` in ``config``'s region: its weights in ``dtype``, and a wrapper in its parent's slot that
        casts its inputs and runs it under the region's autocast state (the layer itself is not touched)."""
        parent, leaf = slot(model, name)
        module = unwrapped(parent._modules[leaf])
        module.to(dtype)
        # Under an autocast default, autocast itself mixes dtypes; elsewhere the next layer expects `outer`.
        out_dtype = None if self.plan.default.facts.autocast_dtype is not None else outer
        parent._modules[leaf] = RegionModule.wrap(module, Region(self.device.type, config, dtype, out_dtype, outer))

    def promote(self, model: nn.Module, name: str, config: Config,
                optimizer: torch.optim.Optimizer | None = None) -> Plan:
        """Run module ``name`` of a model this precision converted in ``config`` (a cast or an autocast: the
        autopilot asks a kind whether it may be, ``piloting.adapters.PROMOTABLE``) from now on, while training goes
        on: its weights take the config's dtype and their optimizer state follows them (Adam's moments), its inputs
        are cast to it and its outputs back to what the next layer expects. Returns the plan now in force (the old
        one with a rule for ``name``), which this precision also adopts."""
        module = model.get_submodule(name)
        self._region(model, name, config, getattr(torch, config.facts.storage_dtype), self._cast or torch.float32)
        if optimizer is not None:  # Adam's moments in the old dtype would not match the weights any more
            owned = {id(p) for p in module.parameters()}
            for p, state in optimizer.state.items():
                if id(p) in owned:
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor) and k != "step":
                            state[k] = v.to(p.dtype) if v.is_floating_point() else v
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
        return floats_to(self.input_dtype if every else self._cast, batch)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        return self.plan.default.forward_context(self.device.type)

    def convert_output(self, output: Any) -> Any:
        """A script model's outputs before its own loss, as the plan's default kind says (autocast: float32)."""
        return self.plan.default.convert_output(output)

    def backward(self, loss: torch.Tensor) -> None:
        (self._scaler.scale(loss) if self._scaler is not None else loss).backward()

    def convert_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer ``model`` trains with, through every kind's hook (once, after ``convert_module``)."""
        for config in self.plan.configs:
            optimizer = config.convert_optimizer(optimizer, model)
        return optimizer

    def step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        """One optimizer's step through the kinds' hooks: GradScaler's step under a scaling policy (its update is
        ``update``'s, once every optimizer of the training step has stepped)."""
        if closure is not None:
            refused = self.closure_error(optimizer)
            if refused:
                raise DtypelabError(refused)
            if not self._stepping:
                return optimizer.step(closure)
            # a kind's own step (a master copy) runs around the update alone: the closure's forward and backward
            # first, as Lightning's mixed precision does
            with torch.enable_grad():
                loss = closure()
            self.step(optimizer)
            return loss
        scaler = self._scaler
        if scaler is None and not self._stepping:  # every training step comes here: the plain step stays plain
            return optimizer.step()

        def run() -> Any:
            if scaler is None:
                return optimizer.step()
            scaler.step(optimizer)
            return None

        for config in reversed(self._stepping):  # the default's hook outermost
            run = functools.partial(config.optimizer_step, optimizer, run)
        return run()

    def master_tensors(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """What the kinds keep beside the weights to hold their exact values (``Config.master_tensors``)."""
        return [t for config in self.plan.configs for t in config.master_tensors(optimizer)]

    def activation_parts(self, model: nn.Module) -> list[ActivationPart]:
        """The parts of the activations counted apart: the kinds' (``Config.activation_parts``), and a language
        model's loss (``footprint.loss_part``)."""
        return [part for config in self.plan.configs for part in config.activation_parts(model)] + \
            loss_part(logit_width(model))

    def closure_error(self, optimizer: torch.optim.Optimizer) -> str | None:
        """Why this plan cannot step ``optimizer`` with a closure, or None: GradScaler cannot; a kind with its own
        step runs the closure once before it, which an optimizer that evaluates it again (LBFGS) cannot take."""
        if self._scaler is not None:
            return (f"{self.name}: torch's GradScaler cannot step an optimizer with a closure "
                    f"({type(optimizer).__name__}.step(closure))")
        if self._stepping and isinstance(optimizer, torch.optim.LBFGS):
            return (f"{self.name}: {self._stepping[0].label} runs its own optimizer step, and "
                    f"{type(optimizer).__name__} evaluates its closure inside the step")
        return None

    def hand_update_error(self) -> str | None:
        """Why this plan means nothing for a script that updates its weights by hand (no optimizer), or None: its
        GradScaler, or a kind whose hooks act through the optimizer (its conversion or its step)."""
        if self._scaler is not None:
            return (f"{self.name} scales the loss (GradScaler), and only an optimizer given to lab.setup steps on "
                    "unscaled gradients; this script updates its weights by hand")
        if self._through_optimizer:
            return (f"{self.name}: {self._through_optimizer[0].label} acts through the optimizer (its conversion or "
                    "its step), and this script updates its weights by hand (no optimizer given to lab.setup)")
        return None

    def update(self, step: int | None = None) -> bool:
        """The end of a training step's updates: GradScaler's update. False when the step was skipped (it found
        inf/NaN gradients); ``step`` numbers it in the record (default: the updates so far)."""
        if self._scaler is None:
            return True
        scale = self._scaler.get_scale()
        self._scaler.update()
        skipped = self._log.record(self._step if step is None else step, scale, self._scaler.get_scale())
        self._step += 1
        return not skipped

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the (one) optimizer; False when the step was skipped (GradScaler found inf/NaN gradients)."""
        self.step(optimizer)
        return self.update()

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
