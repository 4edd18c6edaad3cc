"""Presentation: tables, Markdown, HTML and JSON, and the offline HTML report page (``report``). Renderers read
records only: every decision they show is in the record."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtypelab.core.lazy import exports

__getattr__, __dir__, __all__ = exports(__name__, {
    "report": "page", "ReportInfo": "page", "ShowOptions": "options", "ReportOptions": "options",
    "PoliciesOptions": "options", "HardwareOptions": "options",
})

if TYPE_CHECKING:  # for type checkers and IDEs; at run time each name loads on first use
    from dtypelab.render.options import HardwareOptions, PoliciesOptions, ReportOptions, ShowOptions
    from dtypelab.render.page import ReportInfo, report
