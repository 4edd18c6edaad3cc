"""What ``audit`` is asked to do, validated once (the CLI's flags are made from these fields)."""

from __future__ import annotations

from pydantic import Field, field_validator

from dtypelab.core.options import (
    Options,
    TrainingOptions,
    check_regex,
    device_field,
    format_field,
    script_args_field,
)

AUDIT_FORMATS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")  # the audit's default candidates


class AuditOptions(TrainingOptions):
    policy: str = Field("fp32", description="precision policy to train under", json_schema_extra={"short": "-p"})
    steps: int = Field(20, ge=1, description="training steps")
    every: int = Field(1, ge=1, description="measure every N-th step (hooks stay idle on the others)")
    layers: str | None = Field(None, description="regular expression on module / parameter names")
    formats: str | tuple[str, ...] = Field(",".join(AUDIT_FORMATS), description="candidate formats, comma-separated",
                                           json_schema_extra={"short": "-f", "cli_type": "str"})
    force: bool = Field(False, description="run a policy measured to be pathologically slow here")
    updates: bool = Field(False, description="also count, per parameter, the share of each measured step's updates "
                                             "that round away with the weight stored in float32, bfloat16 and float16")
    script_args: tuple[str, ...] = script_args_field()

    @field_validator("layers")
    @classmethod
    def _layers(cls, v: str | None) -> str | None:
        return check_regex(v)

    @field_validator("formats")
    @classmethod
    def _formats(cls, v: str | tuple[str, ...]) -> tuple[str, ...]:
        # the formats registry loads torch and ml_dtypes: imported when options are built, not when the CLI starts
        from dtypelab.numerics.catalog import parse_formats

        return tuple(f.name for f in parse_formats(v))


class FormatsOptions(Options):
    value: tuple[float, ...] = Field((), description="show how this value is stored in each format (repeatable)",
                                     json_schema_extra={"short": "-v", "cli_type": "floats"})
    formats: str | None = Field(None, description="comma-separated formats [default: all]",
                                json_schema_extra={"short": "-f"})
    device: str | None = device_field("device whose native support is shown")
    fmt: str = format_field()

    @field_validator("value", mode="before")
    @classmethod
    def _values(cls, v: object) -> object:
        return () if v is None else v


class CastOptions(Options):
    to: str = Field(description="target format, e.g. fp16, bf16, fp8, int8", json_schema_extra={"short": "-t"})
    fmt: str = format_field()
