"""The precision-hazard rules: one AST pass per file, with names resolved through imports and through
simple local assignments (``e = torch.exp(x); e / e.sum()`` is still a naive softmax)."""

from __future__ import annotations

import ast

from dtypelab.lint.catalog import RULES
from dtypelab.lint.names import Imports
from dtypelab.lint.patterns import (
    AUTOCAST,
    BCE,
    CONVERTS,
    DEPRECATED,
    FP16,
    LOSSES,
    NAN,
    NP_ARRAY,
    NP_FLOAT64,
    SCALERS,
    TORCH_FROM_ARRAY,
    column,
    constant,
    has_float_literal,
    is_one,
    literal_floats,
    vector,
)
from dtypelab.lint.resolve import Resolver

# tensor factories whose dtype= fixes what they make, and the floating dtypes a policy would change
TENSOR_FACTORIES = frozenset({"zeros", "ones", "empty", "full", "rand", "randn", "tensor", "as_tensor", "arange",
                              "linspace", "eye", "zeros_like", "ones_like", "empty_like", "full_like", "randn_like",
                              "rand_like"})
FLOAT_DTYPES = frozenset(f"torch.{n}" for n in ("float64", "double", "float32", "float", "float16", "half",
                                                "bfloat16"))


class Checker(Resolver):
    """The rules, on top of the resolver's names and scopes: each visit checks what its node can show, and
    ``finish`` the rules that need the whole file (a model trained in half precision, a scaler never used)."""

    def __init__(self, imports: Imports) -> None:
        super().__init__(imports)
        self.found: list[tuple[int, int, str, str, str]] = []  # (line, col, code, message, fix)
        self.half_sites: list[tuple[ast.AST, str, tuple]] = []  # (call, receiver text, scope key)
        self.trained: set[tuple] = set()  # scope keys of models that are trained
        self.called: set[tuple] = set()  # scope keys of names called like a model: `model(x)`
        self.backward_scopes: set[int] = set()  # functions that call `.backward()`
        self.bce_sites: list[tuple[ast.AST, bool]] = []  # (call, its input is visibly a sigmoid)
        self.sigmoid = False
        self.scaler_sites: list[ast.AST] = []
        self.autocast_dtypes: list[str | None] = []
        self.early_tensors: list[ast.AST] = []  # torch.tensor(<float literals>) without a dtype
        self.default_f64: list[int] = []  # lines of torch.set_default_dtype(torch.float64)
        self.converted: set[int] = set()  # ids of from_numpy calls converted right away (.float())

    # --- helpers -------------------------------------------------------------------------------
    def add(self, node: ast.AST, code: str, message: str = "", fix: str = "") -> None:
        self.found.append((node.lineno, node.col_offset + 1, code, message or RULES[code].why, fix or RULES[code].fix))

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for t in node.targets:
            self.visit(t)
            if isinstance(t, ast.Name):
                self.scopes[-1][t.id] = node.value
        self._half(node.value, node.targets[0] if len(node.targets) == 1 else None)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            self.scopes[-1].pop(node.target.id, None)

    # --- rules ---------------------------------------------------------------------------------
    def visit_BinOp(self, node: ast.BinOp) -> None:
        if (isinstance(node.op, ast.Div) and self.kind(node.left) == "exp"
                and self.sum_of_exp(node.right) is not None and not self.shifted(node.left)):
            self.add(node, "DTL001")
        if isinstance(node.op, ast.Sub) and is_one(node.right) and self.kind(node.left) == "exp":
            self.add(node, "DTL005")
        if isinstance(node.op, ast.Sub):
            a, b = self.deref(node.left), self.deref(node.right)
            if (column(a) and vector(b)) or (vector(a) and column(b)):
                self.add(node, "DTL109")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        o = self.op(node)
        if o and o[0] == "log" and o[1] is not None:
            self._log(node, o[1], o[2])
        if o and o[0] == "sigmoid":
            self.sigmoid = True
        q = self.im.qualname(node.func)
        if q == "torch.nn.BCELoss":  # the module form is judged with the file's sigmoids in finish()
            self.bce_sites.append((node, False))
        elif q in BCE and node.args and self.kind(node.args[0]) == "sigmoid":
            self.bce_sites.append((node, True))
        elif q in SCALERS:
            self.scaler_sites.append(node)
        elif q == "torch.nn.Sigmoid":
            self.sigmoid = True
        elif q in AUTOCAST:
            self.autocast_dtypes.append(self._autocast_dtype(node, q))
        if self.autocast_depth and ((isinstance(node.func, ast.Attribute) and node.func.attr == "backward")
                                    or q == "torch.autograd.backward"):
            self.add(node, "DTL101")
        self._float64(node, q)
        self._fixed_dtype(node, q)
        self._broadcast(node, q)
        self._trained(node, q)
        self._half(node, None)  # `m = model.half()` is seen here (receiver) and by visit_Assign (target)
        self.generic_visit(node)

    def _np_float64(self, node: ast.AST) -> bool:
        """A NumPy array that is float64: a float64-by-default constructor, or np.array of float literals,
        without a dtype keyword."""
        node = self.deref(node)
        if not isinstance(node, ast.Call) or any(k.arg == "dtype" for k in node.keywords):
            return False
        q = self.im.qualname(node.func)
        return q in NP_FLOAT64 or (q in NP_ARRAY and bool(node.args) and has_float_literal(node.args[0]))

    def _float64(self, node: ast.Call, q: str | None) -> None:
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in CONVERTS and isinstance(f.value, ast.Call):
            self.converted.add(id(f.value))  # torch.from_numpy(a).float(): converted at once
        if (q in TORCH_FROM_ARRAY and node.args and id(node) not in self.converted
                and not any(k.arg == "dtype" for k in node.keywords) and self._np_float64(node.args[0])):
            self.add(node, "DTL106")
        if isinstance(f, ast.Attribute) and f.attr == "double" and not node.args and not self.im.rooted_in_module(f):
            self.add(node, "DTL107")
        if q == "torch.set_default_dtype" and node.args and self.im.qualname(node.args[0]) in (
                "torch.float64", "torch.double"):
            self.default_f64.append(node.lineno)
        if (q == "torch.tensor" and node.args and not any(k.arg == "dtype" for k in node.keywords)
                and literal_floats(node.args[0])):
            self.early_tensors.append(node)

    def _fixed_dtype(self, node: ast.Call, q: str | None) -> None:
        """``torch.zeros(..., dtype=torch.double)`` in a module's ``forward``: a dtype the policy cannot change."""
        scope = next((s for s in reversed(self.scope_nodes) if s is not None), None)
        if not (isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and scope.name == "forward"):
            return
        if q is None or not q.startswith("torch.") or q.rpartition(".")[2] not in TENSOR_FACTORIES:
            return
        dtype = next((k.value for k in node.keywords if k.arg == "dtype"), None)
        if dtype is not None and self.im.qualname(dtype) in FLOAT_DTYPES:
            self.add(node, "DTL110")

    def _broadcast(self, node: ast.Call, q: str | None) -> None:
        if q in LOSSES and len(node.args) >= 2:
            a, b = self.deref(node.args[0]), self.deref(node.args[1])
            if (column(a) and vector(b)) or (vector(a) and column(b)):
                self.add(node, "DTL109")

    def _log(self, node: ast.Call, arg: ast.AST, ns: str) -> None:
        inner = self.deref(arg)
        k = self.kind(inner)
        if k == "softmax":
            self.add(node, "DTL002")
        elif k == "sigmoid":
            self.add(node, "DTL007")
        elif self.sum_of_exp(inner) is not None and not self.shifted(self.sum_of_exp(inner)):
            self.add(node, "DTL003")
        elif isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Add) and (is_one(inner.left) or
                                                                                 is_one(inner.right)):
            other = inner.right if is_one(inner.left) else inner.left
            if constant(other):
                return
            if self.kind(other) == "exp":
                self.add(node, "DTL004", "log(1 + exp(x)) overflows for large x (exp is inf above 88.7 in float32)",
                         "use F.softplus(x) (torch.nn.functional.softplus)")
            else:
                fn = {"torch": "torch.log1p(x)", "numpy": "np.log1p(x)", "math": "math.log1p(x)"}.get(ns, "log1p(x)")
                self.add(node, "DTL004", fix=f"use {fn}")

    def _autocast_dtype(self, node: ast.Call, q: str) -> str | None:
        kw = {k.arg: k.value for k in node.keywords}
        if "dtype" in kw:
            d = self.im.qualname(kw["dtype"])
            return "bf16" if d == "torch.bfloat16" else ("fp16" if d in FP16 else None)
        if q == "torch.cuda.amp.autocast":
            return "fp16"
        device = kw.get("device_type", node.args[0] if node.args else None)
        if isinstance(device, ast.Constant):
            return {"cuda": "fp16", "cpu": "bf16"}.get(str(device.value).split(":")[0])
        return None

    def visit_With(self, node: ast.With) -> None:
        active = any(self.im.qualname(i.context_expr.func) in AUTOCAST and not any(
            k.arg == "enabled" and isinstance(k.value, ast.Constant) and k.value.value is False
            for k in i.context_expr.keywords) for i in node.items if isinstance(i.context_expr, ast.Call))
        for item in node.items:
            self.visit(item)
        self.autocast_depth += active
        for stmt in node.body:
            self.visit(stmt)
        self.autocast_depth -= active

    visit_AsyncWith = visit_With

    def visit_Compare(self, node: ast.Compare) -> None:
        if (any(isinstance(o, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)) for o in node.ops)
                and any(self._is_nan(x) for x in [node.left, *node.comparators])):
            self.add(node, "DTL006")
        self.generic_visit(node)

    def _is_nan(self, node: ast.AST) -> bool:
        if self.im.qualname(node) in NAN:
            return True
        return (isinstance(node, ast.Call) and self.im.qualname(node.func) == "builtins.float" and len(node.args) == 1
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).strip().lower() == "nan")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        q = self.im.qualname(node)
        if q in DEPRECATED and self.im.rooted_in_module(node):
            self.add(node, "DTL105", f"{q} is deprecated", f"use {DEPRECATED[q]}")
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for imported, qual in self.im.from_imports:
            if imported is node and qual in DEPRECATED:
                self.add(node, "DTL105", f"{qual} is deprecated", f"use {DEPRECATED[qual]}")

    # --- whole-model fp16 training -------------------------------------------------------------
    def _half(self, value: ast.AST, target: ast.AST | None) -> None:
        if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Attribute):
            return
        f, args = value.func, [*value.args, *(k.value for k in value.keywords if k.arg == "dtype")]
        if (f.attr == "half" and not value.args) or (f.attr == "to" and any(self.im.qualname(a) in FP16 for a in args)):
            pass
        else:
            return
        who = target if target is not None else f.value
        if isinstance(who, (ast.Name, ast.Attribute)):
            text = ast.unparse(who)
            self.half_sites.append((value, text, self._key(text)))

    def _trained(self, node: ast.Call, q: str | None) -> None:
        f = node.func
        if isinstance(f, (ast.Name, ast.Attribute)):  # `model(x)` in a function that also calls backward()
            self.called.add(self._key(ast.unparse(f)))
        if isinstance(f, ast.Attribute) and f.attr == "backward":
            self.backward_scopes.add(id(self.scope_nodes[-1]))
        if isinstance(f, ast.Attribute) and f.attr == "train" and not (node.args and isinstance(
                node.args[0], ast.Constant) and node.args[0].value is False):
            self.trained.add(self._key(ast.unparse(f.value)))
        is_optimizer = q is not None and (q.startswith("torch.optim.") or ".optim." in q)
        if is_optimizer:
            for a in node.args[:1]:
                if (isinstance(a, ast.Call) and isinstance(a.func, ast.Attribute)
                        and a.func.attr in ("parameters", "named_parameters")):
                    self.trained.add(self._key(ast.unparse(a.func.value)))

    def finish(self) -> list[tuple[int, int, str, str, str]]:
        """File-level rules, which need the whole file seen."""
        seen = set()
        for node, who, key in self.half_sites:
            trained = key in self.trained or (key in self.called and key[0] in self.backward_scopes)
            if trained and id(node) not in seen:
                seen.add(id(node))
                self.add(node, "DTL102", f"{who} is converted to float16 and then trained: "
                                         + RULES["DTL102"].why.split(": ", 1)[1])
        for node, direct in self.bce_sites:
            if direct or self.sigmoid:
                self.add(node, "DTL103")
        if self.default_f64:
            last = max(self.default_f64)
            for node in self.early_tensors:
                if node.lineno < last:
                    self.add(node, "DTL108", f"this tensor is made float32 here, but line {last} sets the default "
                                             "dtype to float64: it stays float32 while later tensors are float64")
        if self.scaler_sites and self.autocast_dtypes and all(d == "bf16" for d in self.autocast_dtypes):
            for node in self.scaler_sites:
                self.add(node, "DTL104")
        return sorted(self.found)
