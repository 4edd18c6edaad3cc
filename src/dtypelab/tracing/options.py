"""What ``trace`` is asked to do, validated once (the CLI's flags are made from these fields)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from dtypelab.core.options import Options


class TraceOptions(Options):
    policy: str = Field("fp32", description="precision policy to train under", json_schema_extra={"short": "-p"})
    force: bool = Field(False, description="run a policy measured to be pathologically slow here")
    steps: int | None = Field(None, ge=1, description="training steps [default: the task's]")
    checkpoint_every: int | None = Field(None, ge=1, description="steps between checkpoints [default: chosen so "
                                                                 "they cost ~2% of the time]")
    stop_on_skip: bool = Field(False, description="amp-fp16: trace the first step GradScaler skips (default: log "
                                                  "skips, stop only when the scale collapses below 1)")
    batch_size: int | None = Field(None, ge=1, description="samples per step [default: the task's]",
                                   json_schema_extra={"short": "-b"})
    seed: int = Field(0, description="seed of the initial weights, batches and dropout")
    device: str | None = Field(None, description="cpu, cuda, cuda:N [default: cuda if present]")
    threads: int | None = Field(None, ge=1, description="torch threads [default: torch's]")
    json_path: str | None = Field(None, description="result file [default: dtypelab-results/…]",
                                  json_schema_extra={"flag": "--json"})
    hardware: Any = Field(None, description="decide with this saved hardware probe instead of probing",
                          json_schema_extra={"cli_type": "str", "envvar": "DTYPELAB_HARDWARE"})
    script_args: tuple[str, ...] = Field((), description="a training script's own arguments (after --)",
                                         json_schema_extra={"cli": False})
