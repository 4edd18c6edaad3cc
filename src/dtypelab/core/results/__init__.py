"""Frozen, versioned result records with a JSON round trip. Renderers read only these."""

from __future__ import annotations

from dtypelab.core.results.audit import AUDIT_SCHEMA, AuditConfig, AuditReport, LayerAudit
from dtypelab.core.results.bench import SCHEMA, STATUSES, PolicyResult, Report, RunConfig
from dtypelab.core.results.lint import LINT_SCHEMA, LintFinding, LintReport
from dtypelab.core.results.store import SCHEMA_VERSION, from_json_safe, json_safe, read_json, save_text
from dtypelab.core.results.trace import TRACE_SCHEMA, Finding, OpEvent, TensorSummary, TraceConfig, TraceReport


def load_record(path: str) -> Report | AuditReport | TraceReport:
    """A bench, audit or trace record, whichever the file holds."""
    d = read_json(path)
    kind = {AUDIT_SCHEMA: AuditReport, TRACE_SCHEMA: TraceReport}.get(d.get("schema"), Report)
    return kind.from_dict(d)


def load_report(path: str) -> Report:
    return Report.from_dict(read_json(path))


__all__ = [
    "AUDIT_SCHEMA",
    "LINT_SCHEMA",
    "SCHEMA",
    "SCHEMA_VERSION",
    "STATUSES",
    "TRACE_SCHEMA",
    "AuditConfig",
    "AuditReport",
    "Finding",
    "LayerAudit",
    "LintFinding",
    "LintReport",
    "OpEvent",
    "PolicyResult",
    "Report",
    "RunConfig",
    "TensorSummary",
    "TraceConfig",
    "TraceReport",
    "from_json_safe",
    "json_safe",
    "load_record",
    "load_report",
    "read_json",
    "save_text",
]
