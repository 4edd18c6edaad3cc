"""``dtypelab lint``: static checks for numeric-precision hazards in PyTorch code (one AST pass: rules, import-alias
resolution, files and suppressions).

Suppress one line with ``# dtypelab: ignore`` or ``# dtypelab: ignore[DTL001,DTL004]``; a whole file with
``# dtypelab: ignore-file``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtypelab.core.lazy import exports

__getattr__, __dir__, __all__ = exports(__name__, {
    "lint_paths": "check", "lint_source": "check", "python_files": "check", "select_rules": "check",
    "LintOptions": "options", "RULES": "catalog", "Rule": "catalog",
})

if TYPE_CHECKING:  # for type checkers and IDEs; at run time each name loads on first use
    from dtypelab.lint.catalog import RULES, Rule
    from dtypelab.lint.check import lint_paths, lint_source, python_files, select_rules
    from dtypelab.lint.options import LintOptions
