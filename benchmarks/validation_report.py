"""The validation report (docs/validation.md) and its plot: written by ``python benchmarks/validate.py --write``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLOURS = {"train-speed": "#0072B2", "train-tok-s": "#F0E442", "train-peak": "#E69F00", "serve-tok-s": "#56B4E9",
           "serve-speed": "#009E73", "serve-peak": "#D55E00", "kv-bytes": "#CC79A7", "energy": "#000000"}


def plot(outcomes: list[Any], path: Path) -> None:
    """Predicted against published, log-log, a colour per family; the diagonal and ±15% around it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 6.0), dpi=110)
    lo, hi = 1e9, 0.0
    for fam, colour in COLOURS.items():
        pts = [(o.case["published"], o.value, o.held_out) for o in outcomes
               if o.family == fam and o.value is not None and o.case.get("published")]
        if fam == "kv-bytes":  # bytes per token and whole caches: KiB and GiB keep them on the same axes
            pts = [(p * (2**-10 if p > 1e4 else 1), v * (2**-10 if p > 1e4 else 1), h) for p, v, h in pts]
        for held in (True, False):
            mine = [(p, v) for p, v, h in pts if h is held]
            if mine:
                ax.scatter(*zip(*mine, strict=True), s=28, color=colour, marker="o" if held else "x",
                           label=f"{fam}{'' if held else ' (fitted)'}")
                lo, hi = min(lo, *(min(p, v) for p, v in mine)), max(hi, *(max(p, v) for p, v in mine))
    lo, hi = lo / 1.5, hi * 1.5
    ax.plot([lo, hi], [lo, hi], color="grey", lw=1)
    for k in (0.85, 1.15):
        ax.plot([lo, hi], [lo * k, hi * k], color="grey", lw=0.6, ls=":")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="published",
           ylabel="forecast (dtypelab)", title="Every forecast against what was published")
    ax.legend(fontsize=7, loc="upper left")
    ax.text(0.98, 0.02, "each in its own unit (ratio, GB, tok/s, KiB, J);\ndotted: ±15%", transform=ax.transAxes,
            ha="right", va="bottom", fontsize=7, color="grey")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _families(rows: list[dict[str, Any]], bands: dict[str, Any]) -> list[str]:
    out = ["| family | what it checks | answered | held out | within tolerance | median error | largest error | "
           "band | direction right |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        right, n = r["direction"]
        band = bands.get(r["family"], {}).get("band")
        out.append(f"| {r['family']} | {r['what']} | {r['answered']} / {r['cases']} | {r['held_out']} | "
                   f"{r['within']} / {r['held_out']} | {_pct(r['median'])} | {_pct(r['largest'])} | "
                   f"{'±' + format(band, '.0%') if band is not None else '—'} | {f'{right} / {n}' if n else '—'} |")
    return out


def _value(o: Any) -> str:
    return "—" if o.value is None else f"{o.value:.4g}"


def _cases(outcomes: list[Any], family: str) -> list[str]:
    out = ["| case | published | forecast | error | role | tolerance | within | what the forecast does not model |",
           "|---|---|---|---|---|---|---|---|"]
    for o in (o for o in outcomes if o.family == family):
        c = o.case
        pub = f"{c['published']:g}" if c.get("published") is not None else f"{c['expect']} 1"
        within = {True: "yes", False: "**no**", None: "no answer"}[o.within]
        notes = "; ".join(c["unmodelled"]) or "—"
        if c.get("known_miss"):
            notes += f". **Known miss**: {c['known_miss']}"
        if c.get("outside_band"):
            notes += ". Kept out of the family's band: what it measured is outside what the forecast forecasts"
        if o.value is None:
            notes += f". No answer: {o.why}"
        unit = c["value"].get("unit", "") if c["value"]["kind"] == "read" else "x"
        out.append(f"| `{c['id']}`<br><small>{_cell(c['source'])}</small> | {pub} {unit} | {_value(o)} | "
                   f"{'—' if o.error is None else format(o.error, '+.1%')} | {c['role']} | ±{o.tolerance:.0%} | "
                   f"{within} | {_cell(notes)} |")
    return out


def report(outcomes: list[Any], rows: list[dict[str, Any]], bands: dict[str, Any], runs: dict[str, Any]) -> str:
    held = sum(o.held_out for o in outcomes)
    seconds = sum(r.get("seconds", 0.0) for r in runs.values())
    lines = [
        "# Validation: every forecast against what was published", "",
        f"{len(outcomes)} published figures ({held} held out: no constant of the forecast was set from them) from "
        f"{len({o.file for o in outcomes})} case files (a source or a few each), each forecast as a user runs it "
        "(`dtypelab forecast …`, "
        f"{len(runs)} forecasts, {seconds:.0f} s of them summed). Made by `python benchmarks/validate.py --write`; "
        "`python benchmarks/validate.py --check` is the gate CI runs (the end-to-end step): it fails when a held-out "
        "case leaves its tolerance, a case that answered stops answering, or any case moves from the value recorded "
        "here. The cases, with every condition their sources state, are in `benchmarks/validation/*.json`.", "",
        "Error is forecast / published − 1 (of the ratio, for ratios). A family's **band** is the largest error of its "
        "held-out cases (but for a case kept out of it, which says why: a host-bound loop, where the forecast times "
        "the GPU's kernels only): the forecast shows it beside each figure of that family (`±`), and two predictions "
        "whose bands overlap are a tie. Direction: faster or slower than the baseline as published (a ratio within 3% "
        "of 1 is neither), or fits the GPU as the published run did.", "",
        *_families(rows, bands), "", "![Forecast against published](validation.png)", "",
    ]
    for r in rows:
        lines += [f"## {r['family']}: {r['what']}", "", *_cases(outcomes, r["family"]), ""]
    return "\n".join(lines)
