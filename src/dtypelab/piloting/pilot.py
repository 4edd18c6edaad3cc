"""The autopilot's one loop of decisions, the same on a task's loop (``run``) and a script's (``script``): which steps
are read, what a reading moves, what a non-finite step does (the layer its origin lies in moved, or the run stopped
with the diagnosis), and the record. The loops differ only in how they feed it: a task's step is replayed after a
rollback (``tracing.Guard``), a script's cannot be and is dropped."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from dtypelab.core.policies import Config, Precision
from dtypelab.core.results import AutopilotConfig, AutopilotReport, Finding, Move, Rollback, Rules
from dtypelab.piloting.controller import Controller
from dtypelab.piloting.monitor import Monitor
from dtypelab.piloting.moves import FIRST_EVERY, final_plan, interval, label, movable, origin_text, to_move

Emit = Callable[[str, Any], None]  # ("move" | "rollback", the event), as it happens


class Pilot:
    """The state and decisions of one autopilot run on ``model`` trained under ``precision``."""

    def __init__(self, rules: Rules, sample_every: int | None, max_rollbacks: int, precision: Precision,
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, to: Config,
                 emit: Emit | None = None) -> None:
        self.rules, self.fixed_every, self.max_rollbacks = rules, sample_every, max_rollbacks
        self.precision, self.model, self.optimizer, self.to = precision, model, optimizer, to
        self.emit = emit or (lambda kind, event: None)
        self.every = sample_every or FIRST_EVERY
        self.controller = Controller(rules, horizon=rules.horizon or 2 * self.every)
        self.monitor = Monitor(model)
        self.start_name = precision.plan.name
        self.moves: list[Move] = []
        self.rollbacks: list[Rollback] = []
        self.plain_s: list[float] = []
        self.sampled_s: list[float] = []
        self.readings = 0
        self.next_sample = 0
        self.status, self.reason, self.finding = "ok", "", None

    def sampled(self, step: int) -> bool:
        """Whether this step's ranges are read (``monitor.reading()`` around it)."""
        return step >= self.next_sample

    def stepped(self, step: int, elapsed_s: float, sampled: bool, scaled: bool) -> bool:
        """A finished step: its time kept, and after a reading, the layers the rules name moved. True when a layer
        moved (a rollback must restore weights of the dtypes they have now: checkpoint again)."""
        if step:  # the first step is everyone's warm-up: it would be charged to the readings
            (self.sampled_s if sampled else self.plain_s).append(elapsed_s)
        if not sampled:
            return False
        self.readings += 1
        if not self.fixed_every and len(self.plain_s) >= 3 and self.sampled_s:
            self.every = interval(self.sampled_s, self.plain_s)
            self.controller.horizon = self.rules.horizon or 2 * self.every
        self.next_sample = step + self.every
        wanted = to_move(self.controller, step, self.monitor.take(), self.precision, self.model, self.to, scaled)
        for name, cause, evidence, amax, limit in wanted:
            self.move(step, name, cause, evidence, amax, limit)
        return bool(wanted)

    def move(self, step: int, name: str, cause: str, evidence: str, amax: float | None = None,
             limit: float | None = None) -> Move:
        was = label(self.precision, name, self.model)
        self.precision.promote(self.model, name, self.to, self.optimizer)
        m = Move(step, name, was, self.to.label, cause, evidence, amax, limit)
        self.moves.append(m)
        self.emit("move", m)
        return m

    def nonfinite(self, step: int, back: int, trigger: str, finding: Finding, recovered: str,
                  no_origin: str = "") -> bool:
        """A non-finite ``step``, the model back at ``back``: the layer its origin lies in moved (``recovered`` says
        how the step was undone), or the run stopped (False) with why. ``no_origin``: what to say when the trace found
        no origin at all (a script's replayed forward that ran finite)."""
        found = finding.origin is not None or not no_origin
        layer = movable(finding, self.precision, self.model, self.to) if found else ""
        origin = origin_text(finding) if found else no_origin
        self.rollbacks.append(Rollback(step, back, trigger, origin, layer))
        self.emit("rollback", self.rollbacks[-1])
        if not layer or len(self.rollbacks) > self.max_rollbacks:
            self.status, self.finding = "stopped", finding
            self.reason = f"step {step}: {trigger}; " + (
                f"{len(self.rollbacks)} rollbacks did not fix it: {origin}" if layer else
                f"the origin is in no layer that a wider format would fix: {origin}" if found else origin)
            return False
        self.move(step, layer, "non-finite", f"step {step}: {trigger}: {origin}; {recovered}")
        return True

    def config(self, settings: dict[str, Any], **fields: Any) -> AutopilotConfig:
        """The record's configuration: what was asked (``AutopilotOptions``' fields) and what it ran as."""
        return AutopilotConfig(sample_every=int(settings.get("sample_every") or 0), promote_to=self.to.label,
                               max_rollbacks=self.max_rollbacks, rules=self.rules, **fields)

    def report(self, config: AutopilotConfig, environment: dict[str, Any], losses: tuple[float, ...],
               **measured: Any) -> AutopilotReport:
        """The record: the moves and rollbacks, the final plan, the readings' cost, and what the loop measured."""
        median = statistics.median(self.plain_s) if self.plain_s else 0.0
        return AutopilotReport(
            config=config, environment=environment, status=self.status, reason=self.reason, moves=tuple(self.moves),
            rollbacks=tuple(self.rollbacks), final_plan=final_plan(self.precision.plan, config.start,
                                                                   self.moves).to_dict(),
            losses=losses, samples=self.readings,
            sample_s=max(0.0, sum(self.sampled_s) - median * len(self.sampled_s)), sample_every=self.every,
            step_s=median, finding=self.finding, created=time.strftime("%Y-%m-%dT%H:%M:%S"), **measured)
