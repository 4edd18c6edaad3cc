"""What the rules see through: names resolved through imports and through simple local assignments, a few levels
deep (``e = torch.exp(x); e / e.sum()`` is still a naive softmax), the scopes they live in, and which call a node
is (exp, log, sum, softmax, sigmoid, in function or method form). ``rules.Checker`` builds on it."""

from __future__ import annotations

import ast

from dtypelab.lint.names import Imports
from dtypelab.lint.patterns import FUNCS, METHODS, MODULE_CALLS


class Resolver(ast.NodeVisitor):
    """Scopes and bindings while visiting a file, and the expressions a name stands for."""

    def __init__(self, imports: Imports) -> None:
        self.im = imports
        self.scopes: list[dict[str, ast.AST]] = [{}]
        self.scope_nodes: list[ast.AST | None] = [None]
        self.autocast_depth = 0

    def deref(self, node: ast.AST, depth: int = 3) -> ast.AST:
        """A local name's assigned expression (a few levels), else the node itself."""
        while depth and isinstance(node, ast.Name):
            bound = next((s[node.id] for s in reversed(self.scopes) if node.id in s), None)
            if bound is None:
                break
            node, depth = bound, depth - 1
        return node

    def op(self, node: ast.AST) -> tuple[str, ast.AST | None, str] | None:
        """(kind, operand, namespace) for exp/log/sum/softmax/sigmoid calls in function or method form."""
        if not isinstance(node, ast.Call):
            return None
        f, first = node.func, node.args[0] if node.args else None
        if isinstance(f, ast.Call) and self.im.qualname(f.func) in MODULE_CALLS:  # nn.Softmax(dim=1)(x)
            return MODULE_CALLS[self.im.qualname(f.func)], first, "torch"
        q = self.im.qualname(f)
        if q is not None:
            kind = next((k for k, names in FUNCS.items() if q in names), None)
            if q == "math.log" and len(node.args) > 1:
                return None  # log with a base
            return (kind, first, q.split(".")[0]) if kind else None
        if (isinstance(f, ast.Attribute) and f.attr in METHODS and not self.im.rooted_in_module(f)
                and not (isinstance(f.value, ast.Name) and f.value.id == "self")):
            if f.attr in ("exp", "log", "sigmoid") and (node.args or node.keywords):
                return None
            return f.attr, f.value, "torch"
        return None

    def kind(self, node: ast.AST | None) -> str | None:
        o = self.op(self.deref(node)) if node is not None else None
        return o[0] if o else None

    def operand(self, node: ast.AST) -> ast.AST | None:
        o = self.op(self.deref(node))
        return o[1] if o else None

    def shifted(self, exp_node: ast.AST) -> bool:
        """exp(x - m): the stable form. Any subtraction counts: m is a max in every real case seen, often
        computed by a helper or rebound (masked_fill of the max), and a false alarm is worse than a miss."""
        arg = self.deref(self.operand(exp_node) or exp_node)
        return isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Sub)

    def sum_of_exp(self, node: ast.AST) -> ast.AST | None:
        if self.kind(node) != "sum":
            return None
        inner = self.operand(node)
        return inner if inner is not None and self.kind(inner) == "exp" else None

    # --- scopes and bindings -------------------------------------------------------------------
    def _scoped(self, node: ast.AST) -> None:
        depth, self.autocast_depth = self.autocast_depth, 0
        self.scopes.append({})
        self.scope_nodes.append(node)
        self.generic_visit(node)
        self.scope_nodes.pop()
        self.scopes.pop()
        self.autocast_depth = depth

    def _key(self, who: str) -> tuple:
        """Where a name lives: `self.x` belongs to the class (converted in __init__, trained in another
        method), any other name to the innermost function, so two functions' `model`s never mix."""
        if who.startswith("self."):
            cls = next((n for n in reversed(self.scope_nodes) if isinstance(n, ast.ClassDef)), None)
            return id(cls), who
        return id(self.scope_nodes[-1]), who

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = visit_ClassDef = _scoped
