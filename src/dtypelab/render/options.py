"""What the commands that only show records are asked (``show``, ``report``), and the two that describe this
machine (``policies``, ``hardware``): validated like every command's options, importable without torch."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from dtypelab.core.options import Options, check_regex, device_field, format_field, hardware_field, json_field


class ShowOptions(Options):
    fmt: str = format_field()
    top: int = Field(0, ge=0, description="audit: rows to show, riskiest first (0: all)")


class ReportOptions(Options):
    output: str = Field("report.html", description="the HTML file to write", json_schema_extra={"short": "-o"})
    title: str = Field("dtypelab report", description="the page's title")
    layer: str | None = Field(None, description="audit: regular expression on tensor-family names to draw binade "
                                                "histograms for [default: the riskiest of each kind]")

    @field_validator("layer")
    @classmethod
    def _layer(cls, v: str | None) -> str | None:
        return check_regex(v)


class PoliciesOptions(Options):
    device: str | None = device_field()
    hardware: Any = hardware_field("say what runs on this saved hardware probe (dtypelab hardware --json FILE, or any "
                                   "record) instead of probing")


class HardwareOptions(Options):
    device: str | None = device_field()
    json_path: str | None = json_field("also save the probe here, for --hardware FILE (bench, tune) or "
                                          "DTYPELAB_HARDWARE")
