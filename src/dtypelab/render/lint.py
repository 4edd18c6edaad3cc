"""The lint record's section of the report page: each finding with its fix."""

from __future__ import annotations

from dtypelab.core.results import LintReport
from dtypelab.render.html import record_section
from dtypelab.render.tables import html_fragment
from dtypelab.render.views import section


@section(LintReport)
def _lint(report: LintReport, key: str, layers: str | None = None) -> str:
    rows = [[f.location, f.code, f.rule, f.message, f.fix] for f in report.findings]
    notes = [f"{len(report.findings)} finding{'s' if len(report.findings) != 1 else ''} in {report.files} "
             f"file{'s' if report.files != 1 else ''} ({report.lines:,} lines)"
             + (f", {report.suppressed} suppressed" if report.suppressed else "")]
    table = html_fragment(["where", "code", "rule", "what", "fix"], rows, notes, classes=True)
    return record_section("dtypelab lint", table, {}, "", key)
