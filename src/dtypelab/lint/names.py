"""Resolve names in a file to what they import: ``F.softmax`` -> ``torch.nn.functional.softmax``."""

from __future__ import annotations

import ast

BUILTINS = {"sum", "float"}


class Imports:
    """Alias table built from every import statement in a file (any scope: imports inside functions are
    common in training scripts, and rebinding one name to two different modules is rare)."""

    def __init__(self, tree: ast.AST) -> None:
        self.alias: dict[str, str] = {}
        self.modules: set[str] = set()  # names bound to modules (not to functions or classes)
        self.from_imports: list[tuple[ast.ImportFrom, str]] = []  # (node, qualified name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.alias[a.asname] = a.name
                        self.modules.add(a.asname)
                    else:  # `import torch.nn` binds `torch`
                        root = a.name.split(".")[0]
                        self.alias[root] = root
                        self.modules.add(root)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    local = a.asname or a.name
                    qual = f"{node.module}.{a.name}"
                    self.alias[local] = qual
                    self.from_imports.append((node, qual))
                    if qual in ("torch.nn.functional", "torch.nn", "torch.optim", "torch.special", "torch.amp",
                                "torch.cuda.amp", "numpy.linalg"):
                        self.modules.add(local)

    def qualname(self, node: ast.AST) -> str | None:
        """Dotted name an expression refers to, through the import aliases; None if not a name chain
        rooted in an import (or a builtin such as ``sum``)."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        root = self.alias.get(node.id)
        if root is None:
            if node.id in BUILTINS and not parts:
                return f"builtins.{node.id}"
            return None
        return ".".join([root, *reversed(parts)])

    def rooted_in_module(self, node: ast.AST) -> bool:
        """Whether an attribute chain starts at a module name (``torch.x``, ``F.x``), not at a value."""
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id in self.modules
