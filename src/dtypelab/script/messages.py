"""What a script's session and its launcher say to each other, typed: the job the session is sent (``ScriptJob``) and
its last word, what it measured (``ScriptResult``) or why the policy could not run (``ScriptSkip``). They travel
pickled over ``dtypelab.run``'s channel."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from dtypelab.core.loop import DIVERGED_PATIENCE


@dataclass(frozen=True)
class ScriptJob:
    """A script session's work: the policy (``Plan.to_dict()``), the seed and device, what else to do (``mode``:
    bench, or the diagnosis's name with the ``diagnosis`` object), and bench's pace for its in-run protections (the
    divergence ``patience``; fp32's step and step count for the slow check, None when not checked)."""

    plan: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    device: str = ""
    mode: str = "bench"
    script: str = ""
    task_name: str = ""
    diagnosis: Any = None
    patience: int = DIVERGED_PATIENCE
    slow_step_s: float | None = None
    baseline_step_s: float | None = None
    slow_span_s: float = 0.0
    baseline_steps: int = 0

    @classmethod
    def of(cls, sent: ScriptJob | dict[str, Any]) -> ScriptJob:
        """What the launcher sent (a plain dict from a hand-made launcher is read by its keys)."""
        if isinstance(sent, ScriptJob):
            return sent
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in sent.items() if k in known})


@dataclass(frozen=True)
class ScriptSkip:
    """The policy cannot run here (``skip``: unsupported, or slow with what was measured until the check)."""

    reason: str
    skip: str = "unsupported"
    step_times_s: tuple[float, ...] = ()
    losses: tuple[float, ...] = ()
    disturbance: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ScriptResult:
    """What the session measured on the script's run, and what it saw of the script (for the table's notes)."""

    policy: str
    step_times_s: tuple[float, ...]
    losses: tuple[float, ...]
    first_nonfinite_step: int | None
    metrics: dict[str, float]
    metric: str
    higher_is_better: bool
    higher_guessed: bool
    peak_memory_bytes: int | None
    load_peak_memory_bytes: int | None
    memory_method: str
    model_bytes: int | None
    init_fingerprint: str
    scaler: dict[str, Any]
    setup_called: bool
    batch_size: int
    disturbance: dict[str, Any]
    stopped: str
    forwards: int  # training forwards through the wrapped model
    optimizers: int  # optimizers given to lab.setup
    framework: bool  # Lightning's or Hugging Face's Trainer ran the loop (attach): it steps its own optimizers
    script_autocast: tuple[str, ...]  # the script's own autocast found on around the model
    built_in: tuple[str, ...]  # the floating dtypes the script built its model in
    script_settings: tuple[str, ...] = ()  # what the script's configuration set that each policy set as named
    memory: dict[str, Any] | None = None  # where the training memory went (core.footprint), counted at the end
    # the energy counter over the timed steps (after the warm-up): (joules, seconds, steps) between the synchronized
    # ends of the last warm-up step and of the last step; None where nothing measured it (the launcher's
    # ``counter_of`` says why)
    energy: tuple[float, float, int] | None = None
    energy_counter: str = ""
