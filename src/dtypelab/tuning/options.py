"""What ``tune`` is asked to do, validated once (the CLI's flags are made from these fields)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dtypelab.core.options import (
    Budget,
    Options,
    batch_size_field,
    budget_field,
    calibration_field,
    calibration_samples_field,
    device_field,
    hardware_field,
    json_field,
)
from dtypelab.core.tolerance import Tolerance

DEFAULT_CANDIDATES = {"infer": "int8-dyn", "train": "bf16,amp-bf16", "generate": "w4a16-gptq,w8a16-gptq"}


class TuneOptions(Options):
    mode: Literal["infer", "train", "generate"] = Field(
        "infer", description="infer (per-layer fp32 or a candidate), train (a candidate with fp32 islands) or generate "
                             "(a served language model: per layer bf16 or a weight format, within --kl-budget, for "
                             "--gpu)")
    gpu: str | None = Field(None, description="generate: the GPU the plan is served on (its bandwidth and kernels) "
                                              "[default: H100]")
    kl_budget: float = Field(0.01, gt=0, description="generate: the most KL divergence (nats, mean per token) from "
                                                      "the bfloat16 model the plan may cost")
    goal: Literal["speed", "memory"] = Field("speed", description="generate: the most forecast decode tokens/s, or "
                                                                  "the least weight memory, within the budget")
    calibration: str | None = calibration_field("generate")
    calibration_samples: int = calibration_samples_field("generate")
    candidates: str | None = Field(None, description="configs to choose from, comma-separated (names or your own "
                                                     "kinds' FILE.py:NAME) [default: int8-dyn for infer, "
                                                     "bf16,amp-bf16 for train]")
    min_cosine: float = Field(0.999, gt=0, le=1, description="infer: lowest worst-sample output cosine vs fp32 to "
                                                             "accept")
    tolerance: str = Field("1%", description="train: allowed metric change vs fp32: 1% or an absolute 0.005")
    steps: int | None = Field(None, ge=2, description="train: steps of each full evaluation [default: the task's]")
    probe_steps: int | None = Field(None, ge=2, description="train: steps of each layer's probe [default: steps/4]")
    output: str | None = Field(None, description="write the chosen plan here (JSON)", json_schema_extra={"short": "-o"})
    json_path: str | None = json_field("the tune record (every evaluation)")
    batch_size: int | None = batch_size_field("samples per batch")
    device: str | None = device_field()
    weights: str | None = Field(None, description="fp32 state dict [default: the task's model as built]")
    seed: int = Field(0, description="seed of the model's initial weights and the batches")
    force: bool = Field(False, description="search with candidates measured to be pathologically slow here")
    budget: Budget = budget_field("10m", "time for the whole command: the search, beside its count (L + 2·log2 L), "
                                         "starts no full evaluation expected to end past it, and the plan is the "
                                         "best measured by then")
    hardware: Any = hardware_field()

    @model_validator(mode="after")
    def _generate_fields(self) -> TuneOptions:
        """A field of one mode given to another is refused, not ignored."""
        only = {"gpu", "kl_budget", "goal", "calibration", "calibration_samples"}
        fields = type(self).model_fields
        given = {n for n in self.model_fields_set if getattr(self, n) != fields[n].default}
        wrong = sorted(only & given) if self.mode != "generate" else sorted(
            given & {"min_cosine", "tolerance", "steps", "probe_steps", "weights", "batch_size", "budget"})
        if wrong:
            flags = ", ".join("--" + w.replace("_", "-") for w in wrong)
            raise ValueError(f"{flags}: not read by --mode {self.mode}")
        return self

    @field_validator("tolerance")
    @classmethod
    def _tolerance(cls, v: str) -> str:
        Tolerance.parse(v)
        return v
