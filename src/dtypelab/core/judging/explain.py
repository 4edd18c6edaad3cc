"""Why a policy is (not) faster than fp32, in one paragraph, from the two profiles: which part of the step
the policy's dtype speeds up (matmul/conv), which it does not (other ops, casts, what runs outside any op),
and how each part moved against fp32."""

from __future__ import annotations

from dtypelab.core.results import CATEGORY_LABELS, ProfileSummary

FASTER = 1.05  # below this a policy is "not faster" in the paragraph (the table's interval decides verdicts)
_WORDS = {"matmul": "matmul/conv ops", "cast": "casts between dtypes", "other": "elementwise and other ops",
          "outside": "time outside any op (Python, autograd, launches)"}


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


def bound_text(p: ProfileSummary) -> str:
    """'compute-bound: matmul/conv 72% of the step at 61% of the probe's peak', or the overhead / memory-bound
    equivalent, always with the matmul/conv share."""
    share = {k: p.share(v) for k, v in p.categories.items()}
    util = f" at {_pct(p.utilisation)} of the probe's peak" if p.utilisation is not None else ""
    mm = f"matmul/conv {_pct(share.get('matmul', 0))} of the step{util}"
    if p.bound == "compute":
        return f"compute-bound: {mm}"
    if p.bound == "overhead":
        return f"overhead-bound: {_pct(share.get('outside', 0))} of the step outside any op, {mm}"
    rest = share.get("other", 0) + share.get("cast", 0)
    return f"memory/elementwise-bound: elementwise ops and casts {_pct(rest)} of the step, {mm}"


def why(policy: str, p: ProfileSummary, base: ProfileSummary | None, speedup: float | None,
        dtype: str = "") -> str:
    """A paragraph: '<policy> is not faster here (0.92x): 41% of its step is elementwise ops and casts that
    bf16 does not speed up; matmul/conv ops are 22% of the step …'."""
    if p.error:
        return f"{policy}: no profile ({p.error})."
    dtype = dtype or "its dtype"  # the policy's compute dtype, a key of the probe's peaks
    share = {k: p.share(v) for k, v in p.categories.items()}
    if speedup is None or base is p:
        return f"{policy}: its step is {bound_text(p)}" + (f"; casts take {_pct(share['cast'])}"
                                                           if share.get("cast", 0) >= 0.05 else "") + "."
    elif speedup < FASTER:
        head = f"{policy} is not faster than fp32 here ({speedup:.2f}x)"
    else:
        head = f"{policy} is {speedup:.2f}x faster than fp32"
    parts: list[str] = []
    unmoved = share.get("other", 0) + share.get("outside", 0)
    if base is not None and base is not p and not base.error:
        b_mm, p_mm = base.categories.get("matmul", 0.0), p.categories.get("matmul", 0.0)
        b_rest = base.step_s - b_mm
        p_rest = p.step_s - p_mm
        if b_mm > 0 and p_mm > 0:
            probe = ""
            ratio = (p.peak_gflops.get(dtype, 0) / p.peak_gflops["float32"]) if p.peak_gflops.get("float32") else 0
            if ratio and dtype != "float32":
                probe = f" (the hardware probe measures {dtype} matmuls at {ratio:.2f}x float32's here)"
            parts.append(f"its matmul/conv time went from {_ms(b_mm)} to {_ms(p_mm)} per step "
                         f"({b_mm / p_mm:.2f}x){probe}, and they were {_pct(base.share(b_mm))} of fp32's step")
        if b_rest > 0:
            moved = "grew" if p_rest > b_rest * 1.05 else "shrank" if p_rest < b_rest * 0.95 else ""
            parts.append(f"everything else {moved} from {_ms(b_rest)} to {_ms(p_rest)}" if moved else
                         f"everything else stayed about the same ({_ms(b_rest)} → {_ms(p_rest)})")
    if (speedup is None or speedup < FASTER) and unmoved >= 0.3:
        parts.append(f"{_pct(unmoved)} of the step is elementwise ops and work outside any op that {dtype} "
                     f"does not speed up")
    if share.get("cast", 0) >= 0.05:
        parts.append(f"casts between dtypes take {_pct(share['cast'])} ({_ms(p.categories['cast'])})")
    if p.fp64_ops:
        t = sum(o.seconds for o in p.fp64_ops)
        where = next((f" (from {s.source})" for s in p.fp64_sources if s.source), "")
        parts.append(f"{_pct(p.share(t))} of the step ran in float64 unasked{where}")
    slow_fp32 = [o for o in p.fp32_under_autocast if p.share(o.seconds) >= 0.05]
    if slow_fp32:
        parts.append("autocast left " + ", ".join(f"{o.op.split('::')[-1]} ({_pct(p.share(o.seconds))})"
                                                  for o in slow_fp32[:3]) + " in float32")
    return head + (": " + "; ".join(parts) if parts else "") + f". Its step is {bound_text(p)}."


def breakdown_text(p: ProfileSummary) -> str:
    """'matmul/conv 22% · casts 9% · other ops 41% · outside ops 28%'."""
    return " · ".join(f"{CATEGORY_LABELS[k]} {_pct(p.share(v))}" for k, v in p.categories.items() if k in _WORDS)
