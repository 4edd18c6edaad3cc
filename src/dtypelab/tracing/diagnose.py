"""Why an op produced NaN or Inf: a one-line diagnosis from the op's name, inputs and dtype."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from dtypelab.core.results import OpEvent, TensorSummary

EXP = {"exp": math.e, "exp2": 2.0, "expm1": math.e}
LOG = {"log", "log2", "log10", "log1p"}
DIV = {"div", "true_divide", "reciprocal", "remainder", "fmod", "floor_divide", "addcdiv"}
SOFTMAX = {"_softmax", "softmax", "_log_softmax", "log_softmax", "_safe_softmax"}
ADDITIVE = {"add", "sub", "rsub", "sum", "mean", "cumsum", "addcmul", "lerp", "nansum", "var", "std"}
PRODUCT = {"mul", "mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "linear", "convolution", "einsum", "dot",
           "mv", "prod", "_scaled_dot_product_flash_attention_for_cpu"}
CAST = {"_to_copy", "copy", "to"}
DOMAIN = {"asin": (-1, 1), "acos": (-1, 1), "atanh": (-1, 1), "acosh": (1, math.inf)}


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def summarize_tensor(t: torch.Tensor) -> TensorSummary:
    x = t.detach()
    finite = x[torch.isfinite(x)]
    return TensorSummary(
        dtype=_dname(t.dtype), shape=tuple(t.shape),
        min=float(finite.min()) if finite.numel() else None, max=float(finite.max()) if finite.numel() else None,
        nan=int(torch.isnan(x).sum()), posinf=int(torch.isposinf(x).sum()), neginf=int(torch.isneginf(x).sum()),
        zeros=int((x == 0).sum()))


def _finite_max(t: torch.Tensor, absolute: bool = False) -> float:
    x = t.detach().double()
    x = x[torch.isfinite(x)]
    if absolute:
        x = x.abs()
    return float(x.max()) if x.numel() else math.nan


def _recompute64(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The op's outputs computed again in float64 (exact enough to show how large the result really is)."""
    def up(v: Any) -> Any:
        return v.detach().double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    try:
        a64, k64 = tree_map(up, (args, kwargs))
        if "dtype" in k64:  # a cast's target dtype would reproduce the overflow
            k64["dtype"] = torch.float64
        with torch.no_grad():
            out = func(*a64, **k64)
    except Exception:  # not every op has a float64 kernel; the diagnosis then says less
        return []
    leaves, _ = tree_flatten(out if out is not None else a64[0])
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _divisor(base: str, args: tuple) -> tuple[Any, Any]:
    """(numerator, divisor) of a division-like op."""
    if base == "reciprocal":
        return 1.0, args[0]
    if base == "addcdiv":
        return args[1], args[2]
    return args[0], args[1] if len(args) > 1 else None


def _division(base: str, args: tuple, made_nan: bool) -> str | None:
    num, den = _divisor(base, args)
    if isinstance(den, torch.Tensor):
        zeros = den == 0
    elif den is not None:
        zeros = torch.tensor(float(den) == 0.0)
    else:
        return None
    n = int(zeros.sum())
    if n == 0:
        return None
    text = f"division by zero: {n} zero{'s' if n > 1 else ''} in the divisor"
    if made_nan and isinstance(num, torch.Tensor):
        both = int(((num == 0) & zeros).sum())
        if both:
            text += f", {both} of them 0/0 → NaN"
    return text


def _nan_from_inf(base: str, args: tuple, masks: list[OpEvent]) -> str:
    if base in SOFTMAX and isinstance(args[0], torch.Tensor):
        x, dim = args[0], args[1] if len(args) > 1 and isinstance(args[1], int) else -1
        rows = int(torch.isneginf(x).all(dim).sum())
        text = (f"softmax over {rows} row{'s' if rows > 1 else ''} that are entirely −inf (every position masked)"
                if rows else "softmax over a row containing +inf")
    elif base in ADDITIVE:
        text = "inf − inf"
    elif base in PRODUCT:
        text = "0 × inf (or inf − inf) inside a product"
    elif base in DIV:
        text = "inf / inf"
    else:
        text = f"{base} turned an infinite input into NaN"
    if masks and all(m.kind == "mask" for m in masks):
        m = masks[0]
        where = f" at {m.source}" if m.source else ""
        text += f"; the infinities are a mask ({m.op or 'a constant'}{where})"
    return text


def _of_its_input(base: str, x: torch.Tensor, made_nan: bool, dtype: str, fmax: float) -> str:
    """What an op outside its input's range did (exp past its overflow, log of a negative, …), or ""."""
    if base in EXP:
        limit = math.log(fmax) / math.log(EXP[base])
        sym = "log2" if base == "exp2" else "ln"
        return f"{base} input {_finite_max(x):.4g} > {sym}({fmax:g}) = {limit:.4g} in {dtype}"
    if base in LOG:
        low = -1.0 if base == "log1p" else 0.0
        neg, zero = int((x < low).sum()), int((x == low).sum())
        if made_nan and neg:
            return f"{base} of a value below {low:g}: {neg} of them (min {float(x.min()):.4g}) → NaN"
        if zero:
            return f"{base} of {'−1' if low else 'zero'} → −inf ({zero} value{'s' if zero > 1 else ''})"
    if base in ("sqrt", "rsqrt"):
        neg, zero = int((x < 0).sum()), int((x == 0).sum())
        if made_nan and neg:
            return f"{base} of a negative: {neg} value{'s' if neg > 1 else ''} < 0 (min {float(x.min()):.4g})"
        if base == "rsqrt" and zero:
            return f"rsqrt of zero → inf ({zero} values)"
    if base in DOMAIN:
        lo, hi = DOMAIN[base]
        bad = int(((x < lo) | (x > hi)).sum())
        if bad:
            return f"{base} outside its domain [{lo:g}, {hi:g}]: {bad} values (min {float(x.min()):.4g}, " \
                   f"max {float(x.max()):.4g})"
    return ""


def _of_its_result(func: Any, args: tuple, kwargs: dict, made_nan: bool, dtype: str, fmax: float) -> str:
    """The op recomputed in float64: an overflow of the result, or of an intermediate only."""
    exact = _recompute64(func, args, kwargs)
    if exact and all(bool(torch.isfinite(t).all()) for t in exact):
        m = max(_finite_max(t, absolute=True) for t in exact)
        if m > fmax:
            low = dtype in ("float16", "bfloat16") and m < torch.finfo(torch.float32).max
            return f"overflow: the exact result reaches {m:.4g}, past the {dtype} max {fmax:g}" + (
                " (fits in float32)" if low else "")
        return (f"non-finite only in {dtype}: an intermediate overflowed; in float64 the result is finite "
                f"(max |x| {m:.4g})")
    return f"{'NaN' if made_nan else 'inf'} from finite inputs"


def explain(name: str, func: Any, args: tuple, kwargs: dict, inputs: list[torch.Tensor],
            flags: list[tuple[bool, bool]], outputs: list[torch.Tensor], out_flags: list[tuple[bool, bool]],
            masks: list[OpEvent]) -> str:
    """One line: what this op did to create a non-finite value (the op's inputs themselves were finite,
    or infinite only where NaN was made)."""
    base = name.removeprefix("_foreach_").rstrip("_") if name != "_softmax" else name
    made_nan = any(n for n, _ in out_flags)
    out = next((t for t, (n, i) in zip(outputs, out_flags, strict=True) if n or i), outputs[0])
    dtype, fmax = _dname(out.dtype), torch.finfo(out.dtype).max
    if made_nan and any(i for _, i in flags):
        return _nan_from_inf(base, args, masks)
    x = args[0] if args and isinstance(args[0], torch.Tensor) else (inputs[0] if inputs else None)
    text = _of_its_input(base, x, made_nan, dtype, fmax) if x is not None else ""
    if text:
        return text
    text = _division(base, args, made_nan) if base in DIV else ""
    if text:
        return f"{text} ({dtype})"
    if base == "pow" and x is not None and made_nan and bool((x < 0).any()):
        return "a negative base raised to a fractional power → NaN"
    if base in CAST and x is not None and _finite_max(x, absolute=True) > fmax:
        return f"cast to {dtype} overflows: input max |x| {_finite_max(x, absolute=True):.4g} > {fmax:g}"
    return _of_its_result(func, args, kwargs, made_nan, dtype, fmax)


# Root causes the lint rules also know, recognised from how an op's input was made (``made``: objects with the
# producing op's name ``op``, whether it took a scalar 1 ``one``, and the ops that made its inputs ``inputs``).
ROOT_HINTS = {
    "log_softmax": "; root cause: log(softmax(z)): softmax underflows to 0 (or to values so small that the "
                   "log's gradient 1/p overflows): use torch.log_softmax(z, dim), which never forms the probabilities",
    "logsigmoid": "; root cause: log(sigmoid(x)) underflows for large negative x: use F.logsigmoid(x)",
    "log1p": "; root cause: log(1 + x) written out (1 + x reached 0 here, and for small x it loses x entirely): "
             "use torch.log1p(x)",
    "expm1": "; root cause: exp(x) − 1 written out cancels to 0 for |x| below eps: use torch.expm1(x)",
    "softmax": "; root cause: a softmax written by hand (exp(x) / exp(x).sum()) overflows exp: use "
               "torch.softmax(x, dim), which subtracts the maximum first",
    "logsumexp": "; root cause: log(sum(exp(x))) or log(1 + exp(x)) written by hand overflows exp: use "
                 "torch.logsumexp(x, dim) or F.softplus(x)",
}


def root_hint(name: str, made: list[Any]) -> str:
    """The root-cause hint for a log-like op from the ops that made its inputs, or ""."""
    if name not in LOG - {"log1p"}:
        return ""
    for m in made:
        if m.op in ("_softmax", "softmax"):
            return ROOT_HINTS["log_softmax"]
        if m.op == "sigmoid":
            return ROOT_HINTS["logsigmoid"]
        if m.op in ("sub", "rsub") and m.one and "exp" in m.inputs:
            return ROOT_HINTS["expm1"]
        if m.op == "add" and m.one:
            return ROOT_HINTS["logsumexp"] if "exp" in m.inputs else ROOT_HINTS["log1p"]
    return ""


def path_hint(op: str, path: tuple[str, ...] | list[str]) -> str:
    """For an exp that overflowed, the hand-written idiom its infinity went on into, or ""."""
    if op != "aten.exp":
        return ""
    ops = [p.split(" ", 1)[0] for p in path]
    if "aten.div" in ops:
        return ROOT_HINTS["softmax"]
    if any(o in ("aten.log", "aten.log1p") for o in ops):
        return ROOT_HINTS["logsumexp"]
    return ""
