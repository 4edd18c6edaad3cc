"""Where a script's training memory goes (``core.footprint``): the activations one step's forward passes save for
the backward, the gradients as its optimizer is about to consume them, and at the end the weights, the optimizers'
state and the kinds' master copies. A part of ``script.handle.Session``: it reads the run's state and keeps its own
count."""

from __future__ import annotations

from typing import Any

from dtypelab.core.footprint import ActivationPart, part_records, saved_activations, state_memory, tensor_bytes
from dtypelab.core.measure import StepTimer
from dtypelab.core.policies import Precision
from dtypelab.script.session_state import RunState


class Footprint:
    """The session's memory count of one bench run."""

    ACTIVATIONS_STEP = 1  # the step whose forward's saved tensors are counted (the first may build lazy state)

    def __init__(self, run: RunState, precision: Precision, timer: StepTimer, bench: bool) -> None:
        self.run, self.precision, self.timer = run, precision, timer
        self.bench = bench and not precision.plan.compiles  # torch.compile's graphs save out of the hooks' sight
        self._acts: Any = None  # counting one step's saved activations (core.footprint.saved_activations)
        self._count: dict[str, int] | None = None
        self._parts: list[ActivationPart] = []  # what the kinds count apart among the activations

    def count_activations(self, start: bool) -> None:
        """Count what the forward passes of step ACTIVATIONS_STEP save for the backward: from the step's start to
        its first optimizer step (or its end, for weights updated by hand)."""
        if start:
            if (self._acts is None and len(self.timer.samples) == self.ACTIVATIONS_STEP
                    and self.run.model is not None and self.bench):
                self._parts = self.precision.activation_parts(self.run.model)  # LoRA's adapters, the loss
                self._acts = saved_activations(self.run.model, self._parts)
                self._count = self._acts.__enter__()
        elif self._acts is not None and self._count is not None and "done" not in self._count:
            self._acts.__exit__(None, None, None)
            self._count["done"] = 1
            # the gradients as the optimizer is about to consume them: a script may set them to None afterwards
            self._count_gradients()

    def _count_gradients(self) -> None:
        """The step's gradients, the most seen: at its first optimizer step, where it ends, or (weights updated by
        hand, whose step is seen to end at the next forward) where the script zeroes them through its model."""
        now = tensor_bytes(p.grad for p in self.run.model.parameters() if p.grad is not None)
        self._count["gradients"] = max(self._count.get("gradients", 0), now)

    def before_zero_grad(self) -> None:
        """``model.zero_grad()`` on the model setup returned: the counted step's gradients before they go."""
        if self._count is not None and self.run.model is not None:
            self._count_gradients()

    def memory(self) -> dict[str, Any] | None:
        if self.run.model is None:
            return None
        self.count_activations(start=False)  # a run that ended inside the counted step: what it saved so far
        counted = self._count if self._count and "done" in self._count else None
        optimizers = [*self.run.optimizers, *self.run.watched]
        try:  # a count that fails (a tensor without storage) must not lose the run's measurement
            masters = [t for opt in optimizers for t in self.precision.master_tensors(opt)]
            memory = state_memory(self.run.model, optimizers, masters, counted["bytes"] if counted else None,
                                  counted.get("gradients") if counted else None)
            parts = part_records(self._parts, counted) if counted and self._parts else []
            return {**memory, "parts": parts} if parts else memory
        except Exception:
            return None
