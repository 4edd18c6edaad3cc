"""Lint records: findings with their location, rule and suggested fix."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

LINT_SCHEMA = "dtypelab.lint"


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
class LintReport:
    findings: tuple[LintFinding, ...]
    files: int
    lines: int
    seconds: float
    suppressed: int = 0

    def to_json(self) -> str:
        return json.dumps({"schema": LINT_SCHEMA, **asdict(self)}, indent=1)
