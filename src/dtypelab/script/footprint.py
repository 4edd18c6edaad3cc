"""Where a script's training memory goes (``core.footprint``): the activations one step's forward passes save for
the backward, the gradients as its optimizer is about to consume them, and at the end the weights, the optimizers'
state and the kinds' master copies. A mixin of ``script.handle.Session``, whose state it reads."""

from __future__ import annotations

from typing import Any

from dtypelab.core.footprint import saved_activations, state_memory, tensor_bytes


class Footprint:
    """The session's memory count (``Session`` holds the model, the optimizers, the precision and the job)."""

    ACTIVATIONS_STEP = 1  # the step whose forward's saved tensors are counted (the first may build lazy state)

    def _count_activations(self, start: bool) -> None:
        """Count what the forward passes of step ACTIVATIONS_STEP save for the backward: from the step's start to
        its first optimizer step (or its end, for weights updated by hand). Not under torch.compile, whose graphs
        save tensors out of the hooks' sight."""
        if start:
            if (self._acts is None and len(self.timer.samples) == self.ACTIVATIONS_STEP and self._model is not None
                    and not self.plan.compiles and self.job is not None and self.job.mode == "bench"):
                self._acts = saved_activations(self._model)
                self._acts_count = self._acts.__enter__()
        elif self._acts is not None and self._acts_count is not None and "done" not in self._acts_count:
            self._acts.__exit__(None, None, None)
            self._acts_count["done"] = 1
            # the gradients as the optimizer is about to consume them: a script may set them to None afterwards
            self._count_gradients()

    def _count_gradients(self) -> None:
        """The step's gradients, the most seen: at its first optimizer step, where it ends, or (weights updated by
        hand, whose step is seen to end at the next forward) where the script zeroes them through its model."""
        now = tensor_bytes(p.grad for p in self._model.parameters() if p.grad is not None)
        self._acts_count["gradients"] = max(self._acts_count.get("gradients", 0), now)

    def before_zero_grad(self) -> None:
        """``model.zero_grad()`` on the model setup returned: the counted step's gradients before they go."""
        if self._acts_count is not None and self._model is not None:
            self._count_gradients()

    def _memory(self) -> dict[str, Any] | None:
        if self._model is None:
            return None
        self._count_activations(start=False)  # a run that ended inside the counted step: what it saved so far
        counted = self._acts_count if self._acts_count and "done" in self._acts_count else None
        try:  # a count that fails (a tensor without storage) must not lose the run's measurement
            masters = [t for opt in self._optimizers for t in self.precision.master_tensors(opt)]
            return state_memory(self._model, self._optimizers, masters, counted["bytes"] if counted else None,
                                counted.get("gradients") if counted else None)
        except Exception:
            return None
