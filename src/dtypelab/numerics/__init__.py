"""Numerics: every format's properties, what a cast does to values and files, exact range statistics, and the range
audit of a training run (``audit``, on ``AuditOptions``; on a training script: ``AuditDiagnosis``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtypelab.core.lazy import exports

__getattr__, __dir__, __all__ = exports(__name__, {
    "audit": "auditing", "AuditOptions": "options", "CastOptions": "options", "FormatsOptions": "options",
    "AuditDiagnosis": "script", "AUDIT_FORMATS": "options", "Format": "catalog", "formats": "catalog",
    "get_format": "catalog", "parse_formats": "catalog", "Recorder": "recording", "build_report": "recording",
    "install_hooks": "recording", "CastFileReport": "castcheck", "CastReport": "castcheck", "ValueCast": "castcheck",
    "analyze_values": "castcheck", "cast_file": "castcheck", "cast_report": "castcheck", "RangeCounter": "rangestats",
    "RangeStats": "rangestats", "range_stats": "rangestats", "formats_doc": "tables", "values_doc": "tables",
    "cast_doc": "tables",
})

if TYPE_CHECKING:  # for type checkers and IDEs; at run time each name loads on first use
    from dtypelab.numerics.auditing import audit
    from dtypelab.numerics.castcheck import (
        CastFileReport,
        CastReport,
        ValueCast,
        analyze_values,
        cast_file,
        cast_report,
    )
    from dtypelab.numerics.catalog import Format, formats, get_format, parse_formats
    from dtypelab.numerics.options import AUDIT_FORMATS, AuditOptions, CastOptions, FormatsOptions
    from dtypelab.numerics.rangestats import RangeCounter, RangeStats, range_stats
    from dtypelab.numerics.recording import Recorder, build_report, install_hooks
    from dtypelab.numerics.script import AuditDiagnosis
    from dtypelab.numerics.tables import cast_doc, formats_doc, values_doc
