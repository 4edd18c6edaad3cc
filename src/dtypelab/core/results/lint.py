"""Lint records: findings with their location, rule and suggested fix."""

from __future__ import annotations

from dataclasses import dataclass

from dtypelab.core.results.store import Record

LINT_SCHEMA = "dtypelab.lint"
LINT_VERSION = 2


@dataclass(frozen=True)
class LintFinding:
    path: str
    line: int
    col: int
    code: str  # e.g. "DTL001"
    rule: str  # e.g. "naive-softmax"
    message: str
    fix: str

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"


@dataclass(frozen=True)
class LintReport(Record):
    findings: tuple[LintFinding, ...]
    files: int
    lines: int
    seconds: float
    suppressed: int = 0

    schema_version: int = LINT_VERSION

    schema = LINT_SCHEMA
    version = LINT_VERSION
