"""Reading any record file: its kind from its "schema", migrated to this version, and, for a bench record written
before records carried their decision, judged once here, so that every reader finds the decision in the record."""

from __future__ import annotations

from dtypelab.core.judging import judged
from dtypelab.core.results import KINDS, Record, Report, read_json


def finished(record: Record) -> Record:
    """The record as this dtypelab writes it: a bench record has its recommendation."""
    if isinstance(record, Report) and record.recommendation is None:
        return judged(record)
    return record


def load_record(path: str) -> Record:
    """A record of any kind (bench, audit, trace, lint, tune, autopilot...), whichever the file holds."""
    d = read_json(path)
    return finished(KINDS.get(d.get("schema"), Report).from_dict(d))


def load_report(path: str) -> Report:
    """A bench record (any schema version this dtypelab reads)."""
    return finished(Report.from_dict(read_json(path)))


def save_judged(report: Report, path: str | None) -> Report:
    """The report judged (its recommendation made from the results so far), written to ``path`` when given: what a
    sweep does after every policy, so that an interrupted run's file holds a decision too."""
    report = judged(report)
    if path:
        report.save(path)
    return report
