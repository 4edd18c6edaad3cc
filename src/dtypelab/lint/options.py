"""What ``lint`` is asked to do, validated once (the CLI's flags are made from these fields)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dtypelab.core.options import Options


class LintOptions(Options):
    select: str | None = Field(None, description="rules to run: codes, prefixes (DTL1) or names")
    ignore: str | None = Field(None, description="rules to skip: codes, prefixes or names")
    fmt: Literal["text", "json"] = Field("text", description="text or json", json_schema_extra={"flag": "--format"})
    list_rules: bool = Field(False, description="print every rule and exit")
