"""Serving records as tables: each policy's memory (weights, KV cache, activations, peak), speed (time to first
token, prefill and decode tokens/s, per-token latency) and, measured, its quality against the baseline; forecast,
whether it fits, the largest batch and longest context, and what bounds decoding. Reads the record only."""

from __future__ import annotations

from typing import Any

from dtypelab.core.results import OBJECTIVES, GenerateFigures, GeneratePolicy, GenerateReport
from dtypelab.core.text import GIB, MIB
from dtypelab.render.html import details, record_section
from dtypelab.render.tables import html_fragment
from dtypelab.render.views import document, more, section


def _unit(report: GenerateReport) -> tuple[float, str]:
    peaks = [p.generate.peak_bytes for p in report.policies if p.generate and p.generate.peak_bytes]
    return (GIB, "GiB") if peaks and max(peaks) >= GIB else (MIB, "MiB")


def _size(n: int | None, scale: float) -> str:
    if n is None:
        return "—"
    v = n / scale
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _rate(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1e3:.3g}"


def _memory(g: GenerateFigures, scale: float) -> list[str]:
    return [_size(g.weights_bytes, scale), _size(g.kv_cache_bytes, scale), _size(g.activations_bytes, scale),
            _size(g.peak_bytes, scale)]


def _speed(g: GenerateFigures) -> list[str]:
    return [_ms(g.ttft_s), _rate(g.prefill_tok_s), _rate(g.decode_tok_s), _ms(g.token_latency_s)]


def _quality(p: GeneratePolicy) -> list[str]:
    q = p.quality
    if q is None:
        return ["—"] * 4
    change = "—" if q.perplexity_change is None else f"{q.perplexity_change:+.2%}"
    agree = "—" if q.agreement is None else f"{q.agreement:.1%}"
    first = "—" if q.first_divergence is None else f"{q.first_divergence:.1f} ({q.diverged}/{q.sequences})"
    return [f"{q.perplexity:.4g}", change, agree, first]


def _fit(g: GenerateFigures) -> list[str]:
    fits = "—" if g.fits is None else ("yes" if g.fits else "no")
    return [fits, "—" if g.largest_batch is None else f"{g.largest_batch:,}" if g.largest_batch else "none",
            "—" if g.longest_context is None else f"{g.longest_context:,}" if g.longest_context else "none",
            g.bound or "—"]


@document(GenerateReport, wrap=set())
def generate_doc(report: GenerateReport) -> tuple[str, list[str], list[list[str]], list[str]]:
    cfg = report.config
    scale, unit = _unit(report)
    measured = cfg.source == "measured"
    where = "measured here" if measured else (f"forecast for {cfg.device.label}, traced on fake tensors"
                                              if cfg.device is not None else "forecast")
    title = (f"dtypelab generate: {cfg.task_name} · batch {cfg.batch_size} · prompt {cfg.prompt_len} + "
             f"{cfg.gen_len} generated · {where}")
    headers = ["policy", f"weights {unit}", f"KV cache {unit}", f"activations {unit}", f"peak {unit}", "TTFT ms",
               "prefill tok/s", "decode tok/s", "ms/token"]
    headers += ["perplexity", "vs baseline", "next-token agree", "first divergence", "verdict"] if measured else \
        ["fits", "largest batch", "longest context", "decode bound"]
    rows = []
    for p in report.policies:
        g = p.generate
        if p.status != "ok" or g is None:
            rows.append([p.policy, *(["—"] * (len(headers) - 2)), f"{p.status}: {p.reason}"])
            continue
        tail = [*_quality(p), p.verdict or "—"] if measured else _fit(g)
        rows.append([p.policy, *_memory(g, scale), *_speed(g), *tail])
    return title, headers, rows, _notes(report)


def _notes(report: GenerateReport) -> list[str]:
    cfg = report.config
    notes = [report.answer] if report.answer else []
    if cfg.source == "measured":
        notes.append(f"chosen for {OBJECTIVES.get(cfg.objective, cfg.objective)}: the fastest whose perplexity (the "
                     f"held-out text read through its own KV cache) is within {cfg.tolerance} of {cfg.baseline}'s "
                     "(within; worse: outside it); tie: not faster beyond doubt (some timed generation no faster "
                     f"than one of {cfg.baseline}'s); speeds are medians of the timed generations in each policy's "
                     "own process")
        notes.append("peak: the most bytes allocated at once, counted tensor by tensor (weights, the KV cache for the "
                     "whole context, and everything else); first divergence: the mean position where a greedy "
                     "continuation first differs from the baseline's (and how many differ)")
    else:
        notes.append("peaks as traced (prefill and one decode step at the full context); largest batch at this "
                     "context and longest context at this batch, each traced to confirm; speed from the traced ops "
                     f"against the device's rates{': ' + report.rates if report.rates else ''}")
    notes += [n for p in report.policies for n in (f"{p.policy}: {x}" for x in p.notes)]
    return [*notes, *report.notes]


@more(GenerateReport)
def kernel_docs(report: GenerateReport, top: int = 0) -> list[Any]:
    """Forecast: what each quantized format's matmuls run, the share of bandwidth and FLOP/s decoding reaches;
    with --check, the same workload measured here."""
    out: list[Any] = []
    rows = [[p.policy, f"{p.generate.bandwidth_share:.0%}" if p.generate.bandwidth_share is not None else "—",
             f"{p.generate.flops_share:.1%}" if p.generate.flops_share is not None else "—",
             "; ".join(p.generate.kernels) or "as traced"]
            for p in report.policies if p.generate is not None and p.generate.decode_tok_s is not None]
    if rows and report.config.source == "forecast":
        out.append(("Decode: what it reaches, and the kernels", ["policy", "of bandwidth", "of FLOP/s", "kernels"],
                    rows, ["shares of the datasheet's bandwidth and of the peak of the rate the matmuls run at"]))
    checked = [p for p in report.policies if p.check is not None and p.generate is not None]
    if checked:
        scale, unit = _unit(report)

        def ratio(a: float | int | None, b: float | int | None) -> str:
            return "—" if not a or not b else f"{a / b:.3f}"

        out.append(("--check: the same workload measured here", [
            "policy", f"peak forecast {unit}", f"measured {unit}", "ratio", "decode tok/s forecast", "measured",
            "ratio", "prefill tok/s forecast", "measured", "ratio"], [
            [p.policy, _size(p.generate.peak_bytes, scale), _size(p.check.peak_bytes, scale),  # type: ignore[union-attr]
             ratio(p.generate.peak_bytes, p.check.peak_bytes),  # type: ignore[union-attr]
             _rate(p.generate.decode_tok_s), _rate(p.check.decode_tok_s),  # type: ignore[union-attr]
             ratio(p.generate.decode_tok_s, p.check.decode_tok_s),  # type: ignore[union-attr]
             _rate(p.generate.prefill_tok_s), _rate(p.check.prefill_tok_s),  # type: ignore[union-attr]
             ratio(p.generate.prefill_tok_s, p.check.prefill_tok_s)] for p in checked],  # type: ignore[union-attr]
            ["ratio: forecast over measured; measured speeds: the fastest of each policy's timed generations"]))
    return out


@section(GenerateReport)
def _generate(report: GenerateReport, key: str, layers: str | None = None) -> str:
    title, headers, rows, notes = generate_doc(report)
    body = html_fragment(headers, rows, notes, classes=True)
    for more_title, more_headers, more_rows, more_notes in kernel_docs(report):
        body += details(more_title, html_fragment(more_headers, more_rows, more_notes, classes=True), opened=True)
    return record_section(title, body, report.environment, report.created, key)
