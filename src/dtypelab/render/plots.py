"""Charts for the HTML report: matplotlib figures written as inline SVG, reading records only.

Why matplotlib's SVG: one chart is 15-40 KB of text (searchable, since ``svg.fonttype='none'`` keeps labels as
text), prints sharp, and needs no script at all; Bokeh's inline resources weigh 1.3 MB and plotly's 4.8 MB
for interactivity a static comparison table of a handful of policies does not need.

Every function returns an SVG string, or None when its record holds nothing to draw.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

# Okabe-Ito: distinguishable with every common colour-vision deficiency, and in greyscale print by marker.
PALETTE = ("#000000", "#E69F00", "#56B4E9", "#009E73", "#0072B2", "#D55E00", "#CC79A7", "#F0E442")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
SEVERITY_COLOURS = ("#f2f2f2", "#F0E442", "#E69F00", "#D55E00")  # safe, subnormal, underflow, overflow
SEVERITY_LABELS = ("safe", "precision loss, little headroom", "underflow: values lost to 0", "overflow / non-finite")


def _rc(**extra: Any) -> Any:
    """matplotlib's rc settings for one chart, restored afterwards. Figures are plain ``Figure`` objects drawn
    by the SVG canvas, never pyplot's: a report made inside a notebook or a GUI program does not switch its
    backend, register figures or leak rcParams."""
    import matplotlib

    return matplotlib.rc_context({**_style(), **extra})


def _style() -> dict[str, Any]:
    return {"svg.fonttype": "none", "font.size": 9, "font.family": "sans-serif", "axes.spines.top": False,
            "axes.spines.right": False, "axes.grid": True, "grid.color": "#dddddd", "grid.linewidth": 0.6,
            "axes.edgecolor": "#444444", "text.color": "#111111", "axes.labelcolor": "#111111",
            "svg.hashsalt": "dtypelab"}  # the same record draws the same bytes


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]  # the XML prolog and DOCTYPE do not belong inside HTML


def _figure(width: float = 7.0, height: float = 3.2, ncols: int = 1) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    with _rc():
        fig = Figure(figsize=(width, height))
        axes = fig.subplots(1, ncols, squeeze=False)
    return fig, axes[0]


def colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


# --- bench, training -------------------------------------------------------------------------------
def loss_curves(names: Sequence[str], losses: Sequence[Sequence[float]]) -> str | None:
    series = [(n, [v if math.isfinite(v) else math.nan for v in ls]) for n, ls in zip(names, losses, strict=True) if ls]
    if not series:
        return None
    with _rc():
        fig, (ax,) = _figure()
        finite = [v for _, ls in series for v in ls if math.isfinite(v)]
        for i, (name, ls) in enumerate(series):
            ax.plot(range(len(ls)), ls, color=colour(i), lw=1.2 if i else 1.8, label=name,
                    marker=MARKERS[i % len(MARKERS)], markevery=max(1, len(ls) // 8), ms=4)
        if finite and min(finite) > 0 and max(finite) / min(finite) > 20:
            ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_ylabel("loss" + (" (log scale)" if ax.get_yscale() == "log" else ""))
        ax.legend(frameon=False, ncols=min(4, len(series)), fontsize=8)
        return _svg(fig)


def step_times(names: Sequence[str], samples: Sequence[Sequence[float]], unit: str = "step") -> str | None:
    data = [(n, [s * 1e3 for s in xs]) for n, xs in zip(names, samples, strict=True) if xs]
    if not data:
        return None
    with _rc():
        fig, (ax,) = _figure(height=0.45 * len(data) + 1.2)
        parts = ax.boxplot([xs for _, xs in data], orientation="horizontal", widths=0.6, patch_artist=True,
                           showfliers=True, flierprops={"markersize": 3, "markeredgecolor": "#777777"},
                           medianprops={"color": "#000000", "lw": 1.5})
        for i, box in enumerate(parts["boxes"]):
            box.set_facecolor(colour(i))
            box.set_alpha(0.55)
        ax.set_yticks(range(1, len(data) + 1), [n for n, _ in data])
        ax.invert_yaxis()
        values = [v for _, xs in data for v in xs]
        if values and min(values) > 0 and max(values) / min(values) > 20:
            ax.set_xscale("log")
        ax.set_xlabel(f"ms per {unit} (every timed sample after warm-up)")
        return _svg(fig)


def speed_vs_metric(points: Sequence[tuple[str, float, float]], metric: str, higher: bool, band: tuple[float, float],
                    recommended: str | None, baseline: str = "fp32",
                    intervals: dict[str, tuple[float, float]] | None = None) -> str | None:
    """``points``: (policy, speedup vs the baseline, metric); ``band``: the metric values within tolerance;
    ``intervals``: a speedup's 95% interval by policy, drawn as a horizontal bar."""
    points = [p for p in points if math.isfinite(p[1]) and math.isfinite(p[2])]
    if len(points) < 2:
        return None
    with _rc():
        fig, (ax,) = _figure(height=3.6)
        ys = [p[2] for p in points]
        pad = (max(ys) - min(ys)) * 0.08 or abs(ys[0]) * 0.05 or 1.0
        low, high = min(ys) - pad, max(ys) + pad
        ax.set_ylim(low, high)
        ax.axhspan(max(band[0], low), min(band[1], high), color="#009E73", alpha=0.15, lw=0,
                   label="within tolerance of " + baseline)
        ax.axvline(1.0, color="#777777", lw=0.8, ls="--")
        front = pareto(points, higher)
        if len(front) > 1:
            ax.plot([p[1] for p in front], [p[2] for p in front], color="#0072B2", lw=1, ls=":",
                    label="Pareto front (nothing both faster and better)")
        for i, (name, x, y) in enumerate(points):
            if intervals and name in intervals:
                lo, hi = intervals[name]
                ax.plot([lo, hi], [y, y], color=colour(i), lw=2.5, alpha=0.6, solid_capstyle="butt", zorder=2)
            star = name == recommended
            ax.scatter([x], [y], s=140 if star else 36, marker="*" if star else MARKERS[i % len(MARKERS)],
                       color=colour(i), edgecolors="#000000", linewidths=0.6, zorder=3)
            ax.annotate(name + (" (recommended)" if star else ""), (x, y), textcoords="offset points", xytext=(6, 4),
                        fontsize=8, fontweight="bold" if star else "normal")
        ax.set_xscale("log")
        ax.set_xlabel(f"speedup vs {baseline} (log scale; right is faster)")
        ax.set_ylabel(f"{metric} ({'higher' if higher else 'lower'} is better)")
        ax.legend(frameon=False, fontsize=8, loc="best")
        return _svg(fig)


def pareto(points: Sequence[tuple[str, float, float]], higher: bool) -> list[tuple[str, float, float]]:
    """The points no other point beats on both speed and metric, in order of speed."""
    def better(a: float, b: float) -> bool:
        return a >= b if higher else a <= b

    front = [p for p in points if not any(q is not p and q[1] >= p[1] and better(q[2], p[2]) and
                                          (q[1] > p[1] or q[2] != p[2]) for q in points)]
    return sorted(front, key=lambda p: p[1])


def bars(names: Sequence[str], panels: Sequence[tuple[str, Sequence[float | None]]]) -> str | None:
    """One horizontal bar panel per (title, values); None values are drawn as 'n/a'."""
    panels = [(t, vs) for t, vs in panels if any(v is not None for v in vs)]
    if not panels or not names:
        return None
    with _rc():
        fig, axes = _figure(width=3.6 * len(panels), height=0.38 * len(names) + 1.1, ncols=len(panels))
        for ax, (title, values) in zip(axes, panels, strict=True):
            ys = range(len(names))
            ax.barh(ys, [v or 0 for v in values], color=[colour(i) for i in range(len(names))], alpha=0.8)
            top = max((v for v in values if v is not None), default=0)
            ax.set_xlim(0, top * 1.22 or 1)  # room for the value labels
            for y, v in zip(ys, values, strict=True):
                ax.text((v or 0) + top * 0.01, y, "n/a" if v is None else f"{v:.3g}", va="center", fontsize=8)
            ax.set_yticks(list(ys), list(names))
            ax.invert_yaxis()
            ax.set_title(title, fontsize=9, loc="left")
            ax.grid(axis="y", visible=False)
        return _svg(fig)


def scaler_history(series: Sequence[tuple[str, Sequence[float], Sequence[int]]]) -> str | None:
    """(policy, loss scale per step, steps GradScaler skipped)."""
    series = [s for s in series if s[1]]
    if not series:
        return None
    with _rc():
        fig, (ax,) = _figure(height=2.8)
        for i, (name, scales, skipped) in enumerate(series):
            ax.step(range(len(scales)), scales, where="post", color=colour(i + 1), label=name)
            if skipped:
                ax.scatter(skipped, [scales[min(s, len(scales) - 1)] for s in skipped], marker="x", color="#D55E00",
                           zorder=3, label=f"{name}: skipped steps ({len(skipped)})")
        ax.set_yscale("log", base=2)
        ax.set_xlabel("training step")
        ax.set_ylabel("loss scale (log2)")
        ax.legend(frameon=False, fontsize=8)
        return _svg(fig)


# --- bench, inference ------------------------------------------------------------------------------
def latency_vs_fidelity(points: Sequence[tuple[str, float, float | None, float | None]], min_cosine: float
                        ) -> str | None:
    """(policy, latency ms, worst cosine, SQNR dB)."""
    points = [p for p in points if math.isfinite(p[1])]
    if len(points) < 2:
        return None
    with _rc():
        fig, (a, b) = _figure(width=8.0, height=3.4, ncols=2)
        for i, (name, ms, cos, sqnr) in enumerate(points):
            m = MARKERS[i % len(MARKERS)]
            if cos is not None and math.isfinite(cos):
                a.scatter([ms], [cos], marker=m, color=colour(i), edgecolors="#000000", linewidths=0.5, zorder=3)
                a.annotate(name, (ms, cos), textcoords="offset points", xytext=(5, 3), fontsize=7)
            if sqnr is not None and math.isfinite(sqnr):
                b.scatter([ms], [sqnr], marker=m, color=colour(i), edgecolors="#000000", linewidths=0.5, zorder=3)
                b.annotate(name, (ms, sqnr), textcoords="offset points", xytext=(5, 3), fontsize=7)
        a.axhline(min_cosine, color="#D55E00", lw=0.8, ls="--")
        a.text(a.get_xlim()[0], min_cosine, f" --min-cosine {min_cosine:g}", va="bottom", fontsize=7, color="#D55E00")
        a.set_xlabel("latency ms per batch (left is faster)")
        a.set_ylabel("worst per-sample cosine vs fp32")
        b.set_xlabel("latency ms per batch")
        b.set_ylabel("SQNR dB vs fp32 (higher is closer)")
        return _svg(fig)


def layer_sqnr(series: Sequence[tuple[str, Sequence[str], Sequence[float | None], Sequence[float | None]]]
               ) -> str | None:
    """(policy, layer names in order, accumulated SQNR, alone SQNR) along the network's depth."""
    series = [s for s in series if s[1]]
    if not series:
        return None
    with _rc():
        fig, (ax,) = _figure(width=8.0, height=3.4)
        for i, (name, _layers, acc, own) in enumerate(series):
            xs = range(len(acc))
            clip = [v if v is not None and math.isfinite(v) else math.nan for v in acc]
            ax.plot(xs, clip, color=colour(i + 1), lw=1.4, label=f"{name}: accumulated")
            clip = [v if v is not None and math.isfinite(v) else math.nan for v in own]
            ax.plot(xs, clip, color=colour(i + 1), lw=0.9, ls="--", label=f"{name}: layer alone")
        layers = series[0][1]
        step = max(1, len(layers) // 12)
        ax.set_xticks(range(0, len(layers), step), [layers[j] for j in range(0, len(layers), step)], rotation=60,
                      ha="right", fontsize=6)
        ax.set_ylabel("SQNR dB vs fp32 (inf not drawn)")
        ax.legend(frameon=False, fontsize=7, ncols=2)
        return _svg(fig)


# --- audit -----------------------------------------------------------------------------------------
def audit_heatmap(layers: Sequence[str], formats: Sequence[str], severity: Sequence[Sequence[int]]) -> str | None:
    if not layers or not formats:
        return None
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    with _rc(**{"axes.grid": False}):
        fig, (ax,) = _figure(width=min(9.0, 2.4 + 1.1 * len(formats)), height=0.22 * len(layers) + 1.4)
        cmap = ListedColormap(SEVERITY_COLOURS)
        ax.imshow(severity, aspect="auto", cmap=cmap, norm=BoundaryNorm([-0.5, 0.5, 1.5, 2.5, 3.5], cmap.N),
                  interpolation="nearest")
        ax.set_xticks(range(len(formats)), list(formats), rotation=30, ha="right")
        ax.set_yticks(range(len(layers)), list(layers), fontsize=7)
        ax.set_xticks([x - 0.5 for x in range(1, len(formats))], minor=True)
        ax.set_yticks([y - 0.5 for y in range(1, len(layers))], minor=True)
        ax.grid(which="minor", color="#ffffff", lw=1.2)
        ax.tick_params(which="minor", length=0)
        handles = [Patch(facecolor=c, edgecolor="#999999", label=label)
                   for c, label in zip(SEVERITY_COLOURS, SEVERITY_LABELS, strict=True)]
        ax.legend(handles=handles, frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        return _svg(fig)


def binade_histogram(name: str, binades: dict[str, int], bands: Sequence[tuple[str, float, float, float]]
                     ) -> str | None:
    """A tensor's values per power of two (log2 |x|), against each format's ``bands``: (format, log2 smallest
    subnormal, log2 smallest normal, log2 max)."""
    counts = sorted((int(k), v) for k, v in binades.items() if v)
    if not counts:
        return None
    with _rc():
        fig, (ax,) = _figure(width=8.0, height=1.6 + 0.3 * len(bands))
        xs = [k for k, _ in counts]
        ax.bar(xs, [v for _, v in counts], width=0.9, color="#56B4E9", edgecolor="#0072B2", lw=0.4)
        top = max(v for _, v in counts)
        for j, (fmt, sub, normal, big) in enumerate(bands):
            y = top * (1.08 + 0.09 * j)
            ax.plot([sub, normal], [y, y], color="#E69F00", lw=3, solid_capstyle="butt")
            ax.plot([normal, big], [y, y], color="#009E73", lw=3, solid_capstyle="butt")
            ax.text(big + 0.5, y, fmt, va="center", fontsize=7)
        ax.set_xlabel("log2 |x| (binade); bars above: each format's subnormal (orange) and normal (green) range")
        ax.set_ylabel("values")
        ax.set_title(name, fontsize=9, loc="left")
        ax.set_xlim(min(min(xs), *(b[1] for b in bands)) - 2, max(max(xs), *(b[3] for b in bands)) + 8)
        return _svg(fig)


def stacked_breakdown(names: Sequence[str], parts: Sequence[str], ms: Sequence[Sequence[float]],
                      xlabel: str = "ms per profiled step", limit: tuple[float, str] | None = None) -> str | None:
    """One horizontal bar per policy, its step (ms, or what ``xlabel`` says) split into ``parts``: where each
    policy's time (or memory) goes; ``limit``: a vertical line at (value, its label)."""
    if not names:
        return None
    with _rc():
        fig, (ax,) = _figure(height=0.42 * len(names) + 1.3)
        ys = list(range(len(names)))
        left = [0.0] * len(names)
        for j, part in enumerate(parts):
            widths = [row[j] for row in ms]
            ax.barh(ys, widths, left=left, color=colour(j), label=part, alpha=0.85)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        ax.set_yticks(ys, list(names))
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        if limit is not None:
            ax.axvline(limit[0], color="#D55E00", linestyle="--", linewidth=1.2)
            ax.annotate(limit[1], (limit[0], 1.0), xycoords=("data", "axes fraction"), ha="right", va="bottom",
                        fontsize=8, color="#D55E00")
        ax.legend(fontsize=8, ncols=len(parts), loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
        ax.grid(axis="y", visible=False)
        return _svg(fig)
