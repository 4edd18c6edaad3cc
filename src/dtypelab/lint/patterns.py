"""What the precision-hazard rules look for: the qualified names of the calls that matter (exp, log, autocast,
GradScaler, float64 conversions...) and the shapes of expressions (a literal 1, a column, a vector)."""

from __future__ import annotations

import ast

FUNCS = {
    "exp": {"torch.exp", "numpy.exp", "math.exp", "torch.special.exp"},
    "log": {"torch.log", "numpy.log", "math.log"},
    "sum": {"torch.sum", "numpy.sum", "builtins.sum", "math.fsum"},
    "softmax": {"torch.softmax", "torch.nn.functional.softmax", "torch.special.softmax"},
    "sigmoid": {"torch.sigmoid", "torch.nn.functional.sigmoid", "torch.special.expit"},
}
METHODS = {"exp", "log", "sum", "softmax", "sigmoid"}
MODULE_CALLS = {"torch.nn.Softmax": "softmax", "torch.nn.Sigmoid": "sigmoid"}
AUTOCAST = {"torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "torch.cpu.amp.autocast"}
SCALERS = {"torch.amp.GradScaler", "torch.cuda.amp.GradScaler", "torch.GradScaler", "torch.cpu.amp.GradScaler"}
BCE = {"torch.nn.BCELoss", "torch.nn.functional.binary_cross_entropy"}
FP16 = {"torch.float16", "torch.half"}
NAN = {"math.nan", "numpy.nan", "numpy.NaN", "numpy.NAN", "torch.nan"}
DEPRECATED = {"torch.cuda.amp.autocast": "torch.amp.autocast('cuda', ...)",
              "torch.cuda.amp.GradScaler": "torch.amp.GradScaler('cuda')",
              "torch.cpu.amp.autocast": "torch.amp.autocast('cpu', ...)",
              "torch.cpu.amp.GradScaler": "torch.amp.GradScaler('cpu')",
              "torch.cuda.amp.custom_fwd": "torch.amp.custom_fwd(device_type='cuda')",
              "torch.cuda.amp.custom_bwd": "torch.amp.custom_bwd(device_type='cuda')"}


def is_one(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == 1


def constant(node: ast.AST) -> bool:
    """Arithmetic on literals only (``1 + 3``): Python computes it exactly once, nothing is lost at run time."""
    return all(isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop)) for n in ast.walk(node))


# NumPy constructors whose default dtype is float64 (np.array only when it holds a float literal)
NP_FLOAT64 = {f"numpy.{n}" for n in ("zeros", "ones", "empty", "full", "linspace", "eye", "identity", "loadtxt",
                                     "genfromtxt", "random.rand", "random.randn", "random.normal", "random.uniform",
                                     "random.random", "random.standard_normal", "zeros_like", "ones_like")}
NP_ARRAY = {"numpy.array", "numpy.asarray"}
TORCH_FROM_ARRAY = {"torch.from_numpy", "torch.tensor", "torch.as_tensor", "torch.Tensor"}
CONVERTS = {"float", "half", "bfloat16", "to", "type", "long", "int", "bool", "short", "byte", "char"}
LOSSES = {f"torch.nn.functional.{n}" for n in ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss")}


def has_float_literal(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, float) for n in ast.walk(node))


def literal_floats(node: ast.AST) -> bool:
    """A Python float literal, or a (nested) list / tuple of number literals with a float among them."""
    allowed = (ast.List, ast.Tuple, ast.Constant, ast.UnaryOp, ast.USub, ast.UAdd, ast.Load)
    return all(isinstance(n, allowed) for n in ast.walk(node)) and has_float_literal(node)


def column(node: ast.AST) -> bool:
    """Visibly a (N, 1) column: x.unsqueeze(1) / (-1), x.view(-1, 1), x.reshape(-1, 1), x[:, None]."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        args = [ast.unparse(a) for a in node.args]
        if node.func.attr == "unsqueeze" and args in (["1"], ["-1"]):
            return True
        if node.func.attr in ("view", "reshape") and args == ["-1", "1"]:
            return True
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple):
        elts = [ast.unparse(e) for e in node.slice.elts]
        return elts in ([":", "None"], ["...", "None"])
    return False


def vector(node: ast.AST) -> bool:
    """Visibly one-dimensional: x.squeeze(), x.view(-1), x.reshape(-1), x.flatten(), x[:, 0]."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        args = [ast.unparse(a) for a in node.args]
        if node.func.attr in ("squeeze", "flatten", "ravel") and not node.args:
            return True
        if node.func.attr in ("view", "reshape") and args == ["-1"]:
            return True
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple):
        elts = [ast.unparse(e) for e in node.slice.elts]
        return len(elts) == 2 and elts[0] == ":" and isinstance(node.slice.elts[1], ast.Constant)
    return False
