"""The tune record as a table: each layer's measurements and verdict, then the plan against the uniform ones."""

from __future__ import annotations

from dtypelab.core.results import TuneReport


def tune_doc(report: TuneReport) -> tuple[str, list[str], list[list[str]], list[str]]:
    cfg = report.config
    title = f"dtypelab tune: {cfg.task_name or cfg.task} · inference · worst cosine ≥ {cfg.min_cosine:g}"
    headers = ["layer", "candidate", "1 − cosine alone", "gain µs/call", "chosen", "why"]
    rows = [[layer.name, layer.candidate, f"{layer.sensitivity:.2e}", f"{layer.gain_s * 1e6:+.1f}",
             "yes" if layer.chosen else "no", layer.why] for layer in report.layers]
    n = sum(layer.chosen for layer in report.layers)
    notes = [f"chosen plan: {n} of {len(report.layers)} layers converted, {report.speedup:.2f}x fp32's speed "
             f"(measured end to end), worst cosine {report.fidelity:.5f}; {len(report.evaluations)} full "
             f"evaluations of at most {cfg.budget}"]
    notes += [f"uniform {u.why}: {u.speedup:.2f}x, worst cosine {u.fidelity:.5f}"
              + ("" if u.feasible else f" (below {cfg.min_cosine:g})") for u in report.uniform]
    notes.append(f"fp32 forward {report.base_s * 1e3:.3g} ms (batch {cfg.batch_size}); search took "
                 f"{report.wall_s:.0f} s")
    return title, headers, rows, notes
