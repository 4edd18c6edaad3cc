"""What the commands that only show records are asked (``show``, ``report``), and the two that describe this
machine (``policies``, ``hardware``): validated like every command's options, importable without torch."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from dtypelab.core.options import Options


class ShowOptions(Options):
    fmt: str = Field("table", description="table, markdown, html or json", json_schema_extra={"flag": "--format"})
    top: int = Field(0, ge=0, description="audit: rows to show, riskiest first (0: all)")


class ReportOptions(Options):
    output: str = Field("report.html", description="the HTML file to write", json_schema_extra={"short": "-o"})
    title: str = Field("dtypelab report", description="the page's title")
    layer: str | None = Field(None, description="audit: regular expression on tensor-family names to draw binade "
                                                "histograms for [default: the riskiest of each kind]")

    @field_validator("layer")
    @classmethod
    def _layer(cls, v: str | None) -> str | None:
        if v:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"{v!r} is not a valid regular expression: {exc}") from None
        return v


class PoliciesOptions(Options):
    device: str | None = Field(None, description="cpu, cuda, cuda:N [default: cuda if present]")


class HardwareOptions(Options):
    device: str | None = Field(None, description="cpu, cuda, cuda:N [default: cuda if present]")
    json_path: str | None = Field(None, description="also save the probe here, for --hardware FILE (bench, tune) or "
                                                    "DTYPELAB_HARDWARE", json_schema_extra={"flag": "--json"})
