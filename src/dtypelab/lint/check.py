"""Linting files and source: select the rules, find the Python files, run the checker, honour suppressions."""

from __future__ import annotations

import ast
import os
import re
import time
import tokenize
from collections.abc import Callable, Iterable

from dtypelab.core.errors import DtypelabError
from dtypelab.core.results import LintFinding, LintReport
from dtypelab.lint.catalog import RULES, Rule
from dtypelab.lint.names import Imports
from dtypelab.lint.rules import Checker

_IGNORE = re.compile(r"#\s*dtypelab:\s*ignore(?:\[([A-Za-z0-9_,\s-]*)\])?(?!-)")
_IGNORE_FILE = re.compile(r"#\s*dtypelab:\s*ignore-file\b")
_SKIP_DIRS = {"__pycache__", "node_modules", "site-packages", "build", "dist"}


def select_rules(select: str | Iterable[str] | None = None, ignore: str | Iterable[str] | None = None) -> set[str]:
    """Rule codes after --select / --ignore; each item is a code, a code prefix (DTL1) or a rule name."""
    def expand(items: str | Iterable[str]) -> set[str]:
        parts = [p.strip() for p in (items.split(",") if isinstance(items, str) else items) if p.strip()]
        codes: set[str] = set()
        for p in parts:
            hit = {c for c, r in RULES.items() if c.startswith(p.upper()) or r.name == p.lower()}
            if not hit:
                raise DtypelabError(f"unknown rule {p!r}: use a code ({', '.join(RULES)}), a prefix such as DTL1, "
                                    "or a rule name (dtypelab lint --list-rules)")
            codes |= hit
        return codes
    chosen = expand(select) if select else set(RULES)
    return chosen - (expand(ignore) if ignore else set())


def _suppressed(line: str, code: str) -> bool:
    m = _IGNORE.search(line)
    if not m:
        return False
    codes = m.group(1)
    return codes is None or code in {c.strip().upper() for c in codes.split(",")}


def lint_source(source: str, path: str = "<string>", rules: set[str] | None = None) -> tuple[list[LintFinding], int]:
    """Findings in one file's text, and how many were suppressed by comments."""
    rules = set(RULES) if rules is None else rules
    try:
        tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError) as exc:  # ValueError: source with NUL bytes
        line, col = getattr(exc, "lineno", None) or 1, getattr(exc, "offset", None) or 1
        msg = f"syntax error: {getattr(exc, 'msg', str(exc))}"
        return ([_finding(path, line, col, "DTL900", msg)] if "DTL900" in rules else []), 0
    if _IGNORE_FILE.search(source):
        return [], 0
    checker = Checker(Imports(tree))
    checker.visit(tree)
    lines = source.splitlines()
    found, suppressed = [], 0
    for line, col, code, message, fix in checker.finish():
        if code not in rules:
            continue
        if 0 < line <= len(lines) and _suppressed(lines[line - 1], code):
            suppressed += 1
            continue
        found.append(_finding(path, line, col, code, message, fix))
    return found, suppressed


def _finding(path: str, line: int, col: int, code: str, message: str, fix: str = "") -> LintFinding:
    rule: Rule = RULES[code]
    return LintFinding(path=path, line=line, col=col, code=code, rule=rule.name, message=message,
                       fix=fix or rule.fix)


def python_files(paths: Iterable[str]) -> list[str]:
    """Every .py file under the given files and directories (hidden and build directories skipped)."""
    out: list[str] = []
    for p in paths:
        if os.path.isfile(p):
            out.append(p)
        elif os.path.isdir(p):
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS
                                 and not os.path.exists(os.path.join(root, d, "pyvenv.cfg")))
                out += [os.path.join(root, f) for f in sorted(files) if f.endswith(".py")]
        else:
            raise DtypelabError(f"no such file or directory: {p}")
    return out


def lint_paths(paths: Iterable[str], select: str | Iterable[str] | None = None,
               ignore: str | Iterable[str] | None = None,
               progress: Callable[[int, int], None] | None = None) -> LintReport:
    """Lint files and directories; see the module docstring for suppression comments."""
    rules = select_rules(select, ignore)
    files = python_files(list(paths))
    findings: list[LintFinding] = []
    lines = suppressed = 0
    start = time.perf_counter()
    for i, path in enumerate(files):
        try:
            with tokenize.open(path) as f:  # honours PEP 263 encoding declarations
                source = f.read()
        except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
            if "DTL900" in rules:
                findings.append(_finding(path, 1, 1, "DTL900", f"cannot decode the file: {exc}"))
            continue
        except OSError as exc:
            raise DtypelabError(f"cannot read {path}: {exc.strerror}") from None
        lines += source.count("\n") + (not source.endswith("\n") and bool(source))
        found, hidden = lint_source(source, path, rules)
        findings += found
        suppressed += hidden
        if progress:
            progress(i + 1, len(files))
    return LintReport(findings=tuple(findings), files=len(files), lines=lines,
                      seconds=time.perf_counter() - start, suppressed=suppressed)


__all__ = ["RULES", "Rule", "lint_paths", "lint_source", "python_files", "select_rules"]
