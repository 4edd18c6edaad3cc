"""Numerics: every format's properties, what a cast does to values and files, exact range statistics, and the range
audit of a training run (``audit``)."""

from dtypelab.numerics.audit import AUDIT_FORMATS, Recorder, audit, build_report, install_hooks
from dtypelab.numerics.castcheck import CastFileReport, CastReport, ValueCast, analyze_values, cast_file, cast_report
from dtypelab.numerics.formats import Format, formats, get_format, parse_formats
from dtypelab.numerics.rangestats import RangeCounter, RangeStats, range_stats

__all__ = ["AUDIT_FORMATS", "CastFileReport", "CastReport", "Format", "RangeCounter", "RangeStats", "Recorder",
           "ValueCast", "analyze_values", "audit", "build_report", "cast_file", "cast_report", "formats", "get_format",
           "install_hooks", "parse_formats", "range_stats"]
