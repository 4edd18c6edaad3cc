"""What ``trace`` is asked to do, validated once (the CLI's flags are made from these fields)."""

from __future__ import annotations

from pydantic import Field

from dtypelab.core.options import (
    TrainingOptions,
    script_args_field,
)


class TraceOptions(TrainingOptions):
    policy: str = Field("fp32", description="precision policy to train under", json_schema_extra={"short": "-p"})
    force: bool = Field(False, description="run a policy measured to be pathologically slow here")
    steps: int | None = Field(None, ge=1, description="training steps [default: the task's]")
    checkpoint_every: int | None = Field(None, ge=1, description="steps between checkpoints [default: chosen so "
                                                                 "they cost ~2% of the time]")
    stop_on_skip: bool = Field(False, description="amp-fp16: trace the first step GradScaler skips (default: log "
                                                  "skips, stop only when the scale collapses below 1)")
    every_step: bool = Field(False, description="script: trace every step in one run (several times slower) instead "
                                                "of running it again traced from the step that went non-finite")
    script_args: tuple[str, ...] = script_args_field()
