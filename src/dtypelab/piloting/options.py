"""What ``autopilot`` is asked to do, validated once (the CLI's flags are made from these fields)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from dtypelab.core.options import TrainingOptions, script_args_field
from dtypelab.core.results import Rules


class AutopilotOptions(TrainingOptions):
    start: Any = Field("amp-fp16", description="the precision training starts in: amp-fp16, amp-bf16, fp16, bf16, a "
                                               "plan file (.json) or your own kind's FILE.py:NAME; from Python also a "
                                               "Plan",
                       json_schema_extra={"short": "-s", "cli_type": "str"})
    steps: int | None = Field(None, ge=1, description="training steps [default: the task's]")
    sample_every: int | None = Field(None, ge=1, description="steps between two readings of every layer's ranges "
                                                             "[default: 10, widened up to 100 so that they cost ~2% "
                                                             "of the time]")
    promote_to: Literal["auto", "fp32", "bf16", "amp-bf16"] = Field(
        "auto", description="what a moved layer runs in: fp32, bf16, amp-bf16, or auto (amp-bf16 on a GPU with "
                            "bf16, from an fp16 start; else fp32)")
    headroom: float = Field(Rules.headroom, gt=0, lt=1, description="move a layer whose largest value passes this "
                            "share of its format's limit on two readings in a row")
    horizon: int | None = Field(None, ge=1, description="move a layer whose rising trend crosses the limit within this "
                                                        "many steps [default: 2 readings]")
    trend_from: float = Field(Rules.trend_from, ge=0, lt=1, description="the trend rule looks only at a layer whose "
                              "largest value has passed this share of its format's limit")
    trend_keep: float = Field(Rules.trend_keep, gt=0, le=1, description="the trend rule fires only while the growth "
                              "keeps up: the latest readings' log-growth at least this share of the earlier readings' "
                              "(growth that levels off moves nothing)")
    max_rollbacks: int = Field(3, ge=0, description="non-finite steps to recover from before stopping with the "
                                                    "trace's diagnosis")
    checkpoint_every: int | None = Field(None, ge=1, description="steps between in-memory checkpoints [default: "
                                                                 "chosen so they cost ~2% of the time]")
    plan_out: str | None = Field(None, description="write the final plan here (a plan file bench and apply_plan take)",
                                 json_schema_extra={"flag": "--plan-out"})
    force: bool = Field(False, description="run a start policy measured to be pathologically slow here")
    script_args: tuple[str, ...] = script_args_field()
