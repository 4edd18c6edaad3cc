"""Frozen, versioned result records with a JSON round trip. Renderers read only these."""

from __future__ import annotations

from dtypelab.core.results.audit import AUDIT_SCHEMA, AuditConfig, AuditReport, LayerAudit
from dtypelab.core.results.bench import (
    SCHEMA,
    SKIP_KINDS,
    STATUSES,
    LayerFidelity,
    PolicyInfo,
    PolicyResult,
    Report,
    RoundBlock,
    RunConfig,
    ScalerStats,
    SizeInfo,
    SpeedupInterval,
    policy_info,
)
from dtypelab.core.results.distributed import DistStats, ScalingEstimate, ScalingPoint
from dtypelab.core.results.lint import LINT_SCHEMA, LintFinding, LintReport
from dtypelab.core.results.profile import CATEGORIES, CATEGORY_LABELS, PHASES, OpStat, ProfileSummary, SourceOp
from dtypelab.core.results.store import (
    SCHEMA_VERSION,
    Record,
    check_writable,
    default_result_path,
    plain_json,
    read_json,
    reserve_path,
    save_bytes,
    save_report,
    save_text,
)
from dtypelab.core.results.trace import TRACE_SCHEMA, Finding, OpEvent, TensorSummary, TraceConfig, TraceReport
from dtypelab.core.results.tune import TUNE_SCHEMA, LayerChoice, PlanEvaluation, TuneConfig, TuneReport


def load_record(path: str) -> Report | AuditReport | TraceReport | LintReport | TuneReport:
    """A bench, audit, trace, lint or tune record, whichever the file holds."""
    d = read_json(path)
    kind = {AUDIT_SCHEMA: AuditReport, TRACE_SCHEMA: TraceReport, LINT_SCHEMA: LintReport,
            TUNE_SCHEMA: TuneReport}.get(d.get("schema"), Report)
    return kind.from_dict(d)


def load_report(path: str) -> Report:
    """A bench record (any schema version this dtypelab reads)."""
    return Report.from_dict(read_json(path))


__all__ = [
    "AUDIT_SCHEMA",
    "CATEGORIES",
    "CATEGORY_LABELS",
    "LINT_SCHEMA",
    "PHASES",
    "SCHEMA",
    "SCHEMA_VERSION",
    "SKIP_KINDS",
    "STATUSES",
    "TRACE_SCHEMA",
    "TUNE_SCHEMA",
    "AuditConfig",
    "AuditReport",
    "DistStats",
    "Finding",
    "LayerAudit",
    "LayerChoice",
    "LayerFidelity",
    "LintFinding",
    "LintReport",
    "OpEvent",
    "OpStat",
    "PlanEvaluation",
    "PolicyInfo",
    "PolicyResult",
    "ProfileSummary",
    "Record",
    "Report",
    "RoundBlock",
    "RunConfig",
    "ScalerStats",
    "ScalingEstimate",
    "ScalingPoint",
    "SizeInfo",
    "SourceOp",
    "SpeedupInterval",
    "TensorSummary",
    "TraceConfig",
    "TraceReport",
    "TuneConfig",
    "TuneReport",
    "check_writable",
    "default_result_path",
    "load_record",
    "load_report",
    "plain_json",
    "policy_info",
    "read_json",
    "reserve_path",
    "save_bytes",
    "save_report",
    "save_text",
]
