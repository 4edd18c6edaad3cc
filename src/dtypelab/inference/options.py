"""What ``export`` is asked to do, validated once (the CLI's flags are made from these fields)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dtypelab.core.options import Options, calibration_field


class ExportOptions(Options):
    policy: str = Field(description="e.g. int8-dyn, fp8-wo, bf16, or a plan file (dtypelab tune -o plan.json)",
                        json_schema_extra={"short": "-p", "aliases": ["--plan"]})
    output: str = Field(description="file: .safetensors (.pt for int8-dyn-legacy*; .pte for et-*, with its "
                                    "metadata beside it as FILE.pte.json)", json_schema_extra={"short": "-o"})
    weights: str | None = Field(None, description="fp32 state dict to convert [default: pretrained, or train the "
                                                  "task's fp32 model here]")
    seed: int = Field(0, description="seed of the model's initial weights (and its fp32 training)")
    format: Literal["auto", "safetensors", "compressed-tensors"] = Field(
        "auto", description="safetensors (dtypelab's own, any policy) or compressed-tensors (a folder transformers and "
                            "vLLM load: w4a16-*/w8a16-* policies and tune --mode generate plans) [default: "
                            "compressed-tensors for those, safetensors otherwise]")
    calibration: str | None = calibration_field("compressed-tensors")
