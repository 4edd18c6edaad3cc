"""What a call of a wrapped object does under the session's policy (``script.wrap`` routes each call here): the
model's forward (timed as part of a training step, inputs converted, the policy's forward context with the script's
own autocast turned off inside it), the optimizer's step (GradScaler's step and update, a closure timed around all
its calls), the script's own GradScaler handed to ``setup`` (the policy's loss scaling), and the refusal of one that
was not. A part of ``script.handle.Session``."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch import nn

from dtypelab.core.errors import DtypelabError
from dtypelab.core.loop import to_device
from dtypelab.core.task import tensors
from dtypelab.script.wrap import unwrap


class Routes:
    """The session's side of the wrappers: ``setup`` hands this part to them as their ``lab``. It reads and writes
    the step's and the run's state (``script.session_state``) and calls the session to begin and end a step."""

    def __init__(self, lab: Any) -> None:  # the Session (script.handle), which composes this part
        self.lab, self.precision = lab, lab.precision
        self.step, self.run = lab.step_state, lab.run_state
        self._eager: tuple[Any, Any] | None = None  # _enter and _leave as a compiled model calls them
        self._autocast_kinds = tuple(dict.fromkeys(("cpu", lab.device.type)))  # where a script's autocast can be

    def forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call of the wrapped model: timed as part of a training step, inputs on the device and in the
        policy's dtype, under the policy's forward context (the script's own autocast turned off inside it),
        floating outputs back in float32 under autocast and back on the inputs' device."""
        enter, leave = self._bookkeeping()
        args, kwargs, source, context = enter(module, args, kwargs)
        with context:
            out = module(*args, **kwargs)
        return leave(out, source)

    def optimizer_step(self, opt: torch.optim.Optimizer, closure: Any = None) -> Any:
        """``optimizer.step()`` through the policy's hooks (``Precision.step``: the kinds' own, GradScaler's step
        under a scaling policy; once every optimizer stepped, ``Precision.update``). With a closure (LBFGS) the step
        is timed around all the closure's calls and its loss is the first value the closure returned (the loss at
        the step's starting weights)."""
        self._foreign_scaler()
        opt = self.run.converted.get(id(opt), opt)  # the script's own (a GradScaler's step): as the kinds made it
        if not self.step.stepped:
            self.lab.diag.before_step()
            self.lab.footprint.count_activations(start=False)  # the forward passes are done: what they saved is counted
        if closure is not None:
            refused = self.precision.closure_error(opt)
            if refused:
                self.lab.unsupported(refused)
            result = self._closure_step(opt, closure)
        else:
            result = self.precision.step(opt)
        self.step.stepped.add(id(opt))
        if len(self.step.stepped) >= len(self.run.optimizers):  # every optimizer of the step has stepped
            self.precision.update(len(self.lab.losses))
            self.lab.end_step()
        return result

    def scale_loss(self, outputs: Any) -> Any:
        """The script's ``scaler.scale(loss)`` (its GradScaler given to ``setup``): the loss recorded, and scaled
        only under a policy with a GradScaler."""
        if isinstance(outputs, torch.Tensor):
            self.note_loss(outputs)
            self.lab.diag.backward(outputs)
        scaler = self.precision.grad_scaler()
        return scaler.scale(outputs) if scaler is not None else outputs

    def unscale(self, opt: torch.optim.Optimizer) -> None:
        """Gradients back to their true values before the script reads them (clipping): once per step."""
        scaler = self.precision.grad_scaler()
        opt = unwrap(opt)
        if scaler is not None and id(opt) not in self.step.unscaled:
            scaler.unscale_(opt)
            self.step.unscaled.add(id(opt))

    def before_zero_grad(self) -> None:
        """``model.zero_grad()`` on the wrapped model: the memory count sees the gradients before they go."""
        self.lab.footprint.before_zero_grad()

    def _bookkeeping(self) -> tuple[Any, Any]:
        """``_enter`` and ``_leave``; while torch.compile traces the model (torch.compile after setup), the versions
        dynamo leaves to Python rather than tracing. Not decorated up front: importing torch._dynamo costs about a
        second, which a script run on its own must not pay, and the wrappers cost every eager call."""
        if not torch.compiler.is_compiling():
            return self._enter, self._leave
        if self._eager is None:
            from torch._dynamo import disable

            self._eager = (disable(self._enter), disable(self._leave))
        return self._eager

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.step.active and not self.run.optimizers and not self.step.in_closure:
            self._by_hand()
            self.lab.end_step()  # weights updated by hand: the step ran until the model is called again
        # one walk through the arguments (the batch size, device and dtypes); none for the usual model(x, y)
        flat = not kwargs and all(isinstance(a, torch.Tensor) for a in args)
        found = list(args) if flat else tensors((args, kwargs))
        if module.training and torch.is_grad_enabled():
            self.lab.step_begin()
            self.run.forwards += 1
            self.step.samples += next((int(t.shape[0]) for t in found if t.dim() > 0), 0)
        source = found[0].device if found else None
        if source is not None and source != self.lab.device:  # a script written for the CPU runs on the GPU unchanged
            args, kwargs = to_device(args, self.lab.device), to_device(kwargs, self.lab.device)
        target = self.precision.input_dtype
        if any(t.dtype != target and t.is_floating_point() for t in found):
            convert = self.precision.convert_input
            args, kwargs = convert(args, every=True), convert(kwargs, every=True)
        own = [k for k in self._autocast_kinds if torch.is_autocast_enabled(k)] if self.lab.driven else []
        if not own:
            return args, kwargs, source, self.precision.forward_context()
        context = contextlib.ExitStack()  # the policy decides the precision: the script's own autocast is off inside
        for kind in own:
            self.run.script_autocast.add(f"{str(torch.get_autocast_dtype(kind)).removeprefix('torch.')} on {kind}")
            context.enter_context(torch.autocast(kind, enabled=False))
        context.enter_context(self.precision.forward_context())
        return args, kwargs, source, context

    def _leave(self, out: Any, source: torch.device | None) -> Any:
        out = self.precision.convert_output(out)  # the script's loss runs outside the forward context
        # outputs go back where the inputs came from, so the script's own targets and metrics still match
        return to_device(out, source) if source is not None and source != self.lab.device else out

    def _closure_step(self, opt: torch.optim.Optimizer, closure: Any) -> Any:
        self.lab.step_begin()
        self.step.in_closure = True
        returned: list[float] = []

        def counted() -> Any:
            value = closure()
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                returned.append(float(value.detach()))
            elif isinstance(value, (int, float)):
                returned.append(float(value))
            return value

        try:
            result = self.precision.step(opt, counted)
        finally:
            self.step.in_closure = False
        self.step.pending[:] = self.step.pending[:1] or returned[:1]
        return result

    def note_loss(self, loss: torch.Tensor) -> None:
        if not self.run.optimizers:
            self._by_hand()
        self.lab.step_begin()
        self.step.pending.append(float(loss.detach()))

    def _by_hand(self) -> None:
        """A script that updates its weights by hand: refused where the policy acts through the optimizer."""
        refused = self.precision.hand_update_error()
        if refused:
            self.lab.unsupported(refused)

    def _foreign_scaler(self) -> None:
        """Refuse the script's own GradScaler stepping the optimizer where it would change what is measured: when
        it scales (its ``enabled``) or the policy scales too. Given to ``lab.setup`` it is the policy's instead."""
        frame = sys._getframe(3)  # above LabOptimizer.step
        for _ in range(3):
            if frame is None:
                return
            # GradScaler.step calls optimizer.step itself when disabled, through _maybe_opt_step when enabled; only
            # there are its locals read (reading f_locals copies them)
            scaler_frame = frame.f_globals.get("__name__") == "torch.amp.grad_scaler"
            owner = frame.f_locals.get("self") if scaler_frame else None
            if isinstance(owner, torch.amp.GradScaler):
                if owner.is_enabled() or self.precision.grad_scaler() is not None:
                    message = ("the script steps its optimizer through its own GradScaler: pass it to lab.setup "
                               "(model, optimizer, scaler = lab.setup(model, optimizer, scaler)) so that each "
                               "policy decides the loss scaling")
                    if owner.is_enabled():
                        raise DtypelabError(message)
                    self.lab.unsupported(f"{self.lab.plan.name}: {message}")
                return
            frame = frame.f_back

