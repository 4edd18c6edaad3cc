"""The script session's state, explicit: the training step in progress (``StepState``) and what the run met and
measured beyond its steps' times and losses (``RunState``). The session's parts (``routes``, ``frameworks``,
``footprint``) each take the state they read and write, rather than sharing the session's attributes. With them, the
run's conventions: the steps left out of its timing, and whether its metric is better lower."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dtypelab.core.disturbance import CpuMeter
from dtypelab.core.energy import Edge, Meter, Window


@dataclass
class StepState:
    """The training step in progress: timed from its first forward (or ``step(closure)``) to the optimizer step that
    ends it; with gradient accumulation it spans its micro-batches."""

    active: bool = False  # a step has begun and not ended
    in_closure: bool = False  # inside optimizer.step(closure): the closure's forwards belong to this step
    pending: list[float] = field(default_factory=list)  # losses of the micro-batches since the last optimizer step
    samples: int = 0  # samples the training forwards of this step saw (micro-batches added up)
    stepped: set[int] = field(default_factory=set)  # optimizers (by id) that stepped in this step
    unscaled: set[int] = field(default_factory=set)  # optimizers whose gradients were unscaled in this step


@dataclass
class RunState:
    """What the run met: the script's model and optimizers as setup saw them, its metrics, and why it stopped."""

    model: nn.Module | None = None  # the model setup converted (the first one given)
    init: str = ""  # its fingerprint as the script built it
    built_in: list[str] = field(default_factory=list)  # the floating dtypes of the script's model as it built it
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)  # as the kinds' hook made them
    converted: dict[int, torch.optim.Optimizer] = field(default_factory=dict)  # the script's optimizer -> its own
    framework: bool = False  # a framework's Trainer runs the loop (attach), not the script's own code
    # the optimizers a framework made and steps itself (the Hugging Face Trainer's): counted, never stepped here
    watched: list[torch.optim.Optimizer] = field(default_factory=list)
    forwards: int = 0  # training forwards through the wrapped model
    script_autocast: set[str] = field(default_factory=set)  # the script's own autocast, found around the forward
    # what the script's own configuration set that each policy sets as named instead (a Trainer's bf16=True, its
    # gradient checkpointing: TRL's SFTConfig turns it on by default)
    script_settings: set[str] = field(default_factory=set)
    metrics: dict[str, float] = field(default_factory=dict)
    metric: str = ""  # the primary one
    higher: bool | None = None  # whether higher is better, when said
    nonfinite_run: int = 0  # consecutive non-finite step losses (bench: the run stops at DIVERGED_PATIENCE)
    stopped: str = ""  # why the session ended the run early
    cpu: CpuMeter | None = None  # what other processes did from the first step to the end
    last_progress: float = 0.0  # when the launcher last heard of a step


# a metric whose name says it is an error is better lower; anything else is taken as better higher
LOWER_IS_BETTER = ("loss", "error", "err", "perplexity", "ppl", "mse", "mae", "rmse", "bpc", "bits", "wer", "cer")


class ScriptEnergy:
    """A script run's energy counter, read at every step's synchronized end: the window from the last warm-up step's
    end to the last step's holds exactly the timed steps and what the loop did between them (loading, logging)."""

    def __init__(self, meter: Meter | None) -> None:
        self.meter = meter
        self.name = meter.name if meter is not None else ""
        self.marks: list[Edge] = []

    def mark(self) -> None:
        if self.meter is not None:
            self.marks.append(self.meter.edge())

    def window(self, warmup: int) -> tuple[float, float, int] | None:
        """(joules, seconds, steps) after the warm-up; None when there is none the counter can speak for (too short,
        or the counter went backwards)."""
        if self.meter is None or len(self.marks) < warmup + 1 or warmup < 1:
            return None
        reading, _ = Window(self.meter, self.marks[warmup - 1]).to(self.marks[-1])
        return (reading.joules, reading.seconds, len(self.marks) - warmup) if reading is not None else None


def lower_is_better(metric: str) -> bool:
    words = metric.lower().replace("-", "_").split("_")
    return any(w in LOWER_IS_BETTER for w in words)


def warmup_steps(n: int) -> int:
    """Steps left out of a script run's timing: a tenth, at least 1 and at most 10."""
    return max(1, min(10, n // 10)) if n > 1 else 0


__all__ = ["RunState", "ScriptEnergy", "StepState", "lower_is_better", "warmup_steps"]
