"""The bench record's section of the report page: its table, the memory and per-layer tables, and the charts (where
the step goes, the loss, step times, speed against the metric, and per mode: fidelity and size, or memory and the
loss scale)."""

from __future__ import annotations

import math
from typing import Any

from dtypelab.core.results import CATEGORIES, CATEGORY_LABELS, PolicyResult, Report, Tolerance
from dtypelab.core.text import MIB
from dtypelab.render import plots
from dtypelab.render.bench import bench_notes, bench_title, decision, layer_rows, table_rows, training_sections
from dtypelab.render.distributed import distributed_sections
from dtypelab.render.html import details, figure, record_section, table_section
from dtypelab.render.profile import profile_sections
from dtypelab.render.tables import html_fragment
from dtypelab.render.views import section


def _band(base: float, tol: Tolerance, higher: bool) -> tuple[float, float]:
    allowed = tol.allowed(base)
    return (base - allowed, base + abs(base) * 10 + 1) if higher else (base - abs(base) * 10 - 1, base + allowed)


def _profile_parts(report: Report, key: str) -> list[str]:
    """--profile: where each policy's step goes, as a chart and tables."""
    profiled = [r for r in report.results if r.profile is not None and not r.profile.error]
    if not profiled:
        return []
    chart = figure(plots.stacked_breakdown(
        [r.policy for r in profiled], [CATEGORY_LABELS[c] for c in CATEGORIES],
        [[r.profile.categories.get(c, 0.0) * 1e3 for c in CATEGORIES] for r in profiled]),
        "Where each policy's step goes (--profile): matmul/conv is what a faster dtype speeds up; casts, other "
        "ops and the time outside any op mostly are not.", f"{key}-profile")
    return [chart, *map(table_section, profile_sections(report))]


def _time_figures(report: Report, key: str, ran: list[PolicyResult]) -> list[str]:
    """Training's loss curves and step times, or inference's latencies."""
    timed = [r for r in ran if not (r.info and r.info.numerics_only)]  # an emulated format's time is not its own
    samples = [r.step_times_s[r.warmup:] for r in timed]
    if report.config.mode != "train":
        return [figure(plots.step_times([r.policy for r in timed], samples, unit="batch"),
                       "Latency distribution per policy (box: middle half, line: median): compare medians, and "
                       "distrust boxes that overlap.", f"{key}-times")]
    return [figure(plots.loss_curves([r.policy for r in ran], [r.losses for r in ran]),
                   "Loss per step, every policy on the same batches from the same initial weights: a line that tracks "
                   "fp32's learns the same; one that lifts off or stops early diverged.", f"{key}-loss"),
            figure(plots.step_times([r.policy for r in timed], samples),
                   "Step-time distribution per policy (box: middle half of the samples, line: median, dots: "
                   "outliers): narrow boxes far apart are a real difference; wide or overlapping ones are noise.",
                   f"{key}-times")]


def _pareto_figure(report: Report, key: str, ran: list[PolicyResult], rec: Any) -> list[str]:
    """Speed against the metric, the tolerance's band and the recommendation."""
    cfg, base = report.config, report.base
    base_metric = base.metric(cfg.metric) if base and base.ran else None
    if base_metric is None or not math.isfinite(base_metric):
        return []
    # a run that diverged is no candidate, and its metric would squash the candidates into a corner
    stable = [r for r in ran if r.status == "ok" and r.first_nonfinite_step is None]
    points = [(r.policy, (rec.verdict(r.policy).speedup if rec.verdict(r.policy) else None) or math.nan,
               r.metric(cfg.metric) or math.nan) for r in stable if r.metric(cfg.metric) is not None]
    return [figure(plots.speed_vs_metric(points, cfg.metric, cfg.higher_is_better,
                                         _band(base_metric, cfg.tolerance, cfg.higher_is_better), rec.best,
                                         intervals={r.policy: (r.speedup_ci.low, r.speedup_ci.high)
                                                    for r in stable if r.speedup_ci}),
                   f"Speed against {cfg.metric}: the recommendation is the fastest point inside the green band "
                   f"(within {cfg.tolerance} of fp32); points on the dotted Pareto front are the only ones worth "
                   "considering; a bar through a point is its speedup's 95% interval from interleaved rounds. Runs "
                   "whose loss went non-finite are left out.", f"{key}-pareto")]


def _infer_figures(report: Report, key: str, ran: list[PolicyResult]) -> list[str]:
    """Inference: latency against fidelity, the converted sizes, per-layer SQNR."""
    names, mb = [r.policy for r in ran], MIB
    points = [(r.policy, (r.timing.median * 1e3) if r.timing else math.nan, r.fidelity.get("cos_min"),
               r.fidelity.get("sqnr_db")) for r in ran if r.policy != report.baseline]
    sizes = [r.size["file_bytes"] / mb if r.size else (r.model_bytes or 0) / mb or None for r in ran]
    linear = [None if (n := r.size["linear_weight_bytes"] if r.size else None) is None else n / mb for r in ran]
    series = [(r.policy, [x["layer"] for x in r.per_layer], [x["sqnr_db"] for x in r.per_layer],
               [x["own_sqnr_db"] for x in r.per_layer]) for r in ran if r.per_layer and r.policy != report.baseline]
    return [figure(plots.latency_vs_fidelity(points, report.config.min_cosine),
                   "Latency against output fidelity vs fp32: left and high is fast and faithful; below the dashed line "
                   "a policy is rejected whatever its metric.", f"{key}-fidelity"),
            figure(plots.bars(names, [("file MiB", sizes), ("linear-layer weights MiB", linear)]),
                   "Size of the converted model's file, and of its linear-layer weights alone (the part quantization "
                   "shrinks).", f"{key}-size"),
            figure(plots.layer_sqnr(series),
                   "Per-layer SQNR along the network's depth: where the accumulated line drops, error builds up; a "
                   "dashed dip marks a layer that loses precision on its own (a candidate to keep in higher "
                   "precision).", f"{key}-layers")]


def _energy_figure(key: str, ran: list[PolicyResult]) -> str:
    """Measured joules per sample (and per token where a step has tokens) of each policy, where a counter read them."""
    names = [r.policy for r in ran]
    per_sample = [r.energy.joules_per_sample if r.energy else None for r in ran]
    per_token = [r.energy.joules_per_token if r.energy else None for r in ran]
    return figure(plots.bars(names, [("joules per sample", per_sample), ("joules per token", per_token)]),
                  "Energy measured by the device's counter over each policy's rounds: the whole device's, idle "
                  "included (the table's note says which counter, and the idle power).", f"{key}-energy")


def _train_figures(key: str, ran: list[PolicyResult]) -> list[str]:
    """Training: peak memory and model size, GradScaler's loss scale."""
    names, mb = [r.policy for r in ran], MIB
    memory = [r.peak_memory_bytes / mb if r.peak_memory_bytes is not None else None for r in ran]
    size = [r.model_bytes / mb if r.model_bytes is not None else None for r in ran]
    scaled = [(r.policy, r.scaler.get("grad_scale", []), [s["step"] for s in r.scaler.get("skips", [])])
              for r in ran if r.scaler]
    return [figure(plots.bars(names, [("peak memory MiB", memory), ("model size MiB", size)]),
                   "Peak memory of each run (above what was in use before the model was built) and the size of its "
                   "weights.", f"{key}-memory"),
            figure(plots.scaler_history(scaled),
                   "GradScaler's loss scale per step (× = a skipped step): a scale that keeps falling means gradients "
                   "overflow float16 again and again.", f"{key}-scaler")]


@section(Report)
def _bench(report: Report, key: str, layers: str | None = None) -> str:
    rec = decision(report)
    ran = [r for r in report.results if r.ran]
    headers, rows = table_rows(report, rec)
    parts = [html_fragment(headers, rows, bench_notes(report, rec), classes=True)]
    parts += map(table_section, training_sections(report))  # the memory; what an emulated format did per layer
    per_layer = layer_rows(report)
    if per_layer:
        parts.append(details(f"per-layer SQNR, {len(per_layer[1])} layers",
                             html_fragment(*per_layer, [], classes=True)))
    parts += map(table_section, distributed_sections(report))  # --nproc: bytes per step, the scaling estimate
    parts += _profile_parts(report, key)
    parts += _time_figures(report, key, ran)
    parts += _pareto_figure(report, key, ran, rec)
    parts += _infer_figures(report, key, ran) if report.config.mode == "infer" else _train_figures(key, ran)
    parts.append(_energy_figure(key, ran))
    return record_section(bench_title(report), "".join(parts), report.environment, report.created, key)
