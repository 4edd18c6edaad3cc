"""Gates on the code's shape that no linter holds: a function a reader takes in at once."""

from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "dtypelab")
MOST_LINES = 60  # a function longer than a screen is split where its steps are (forecast() was 65)


def _functions() -> list[tuple[str, str, int]]:
    out = []
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    tree = ast.parse(f.read())
                out += [(os.path.relpath(path, ROOT), node.name, node.end_lineno - node.lineno + 1)
                        for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                        and node.end_lineno is not None]
    return out


def test_no_function_is_longer_than_a_screen():
    functions = _functions()
    assert len(functions) > 1000  # the walk found the package
    longer = [f"{path}: {name} ({lines} lines)" for path, name, lines in functions if lines > MOST_LINES]
    assert not longer, f"split these (at most {MOST_LINES} lines): {'; '.join(longer)}"
