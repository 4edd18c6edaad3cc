"""Serving records as tables: each policy's memory (weights, KV cache, activations, peak), speed (time to first
token, prefill and decode tokens/s, per-token latency) and, measured, its quality against the baseline; forecast,
whether it fits, the largest batch and longest context, and what bounds decoding. Reads the record only."""

from __future__ import annotations

from typing import Any

from dtypelab.core.machine.speed import (
    BOUNDS,  # what bounds a timed step; a record's other "bound" is why it was not timed
)
from dtypelab.core.objectives import objective
from dtypelab.core.results import (
    Decision,
    Estimate,
    GenerateFigures,
    GeneratePlanReport,
    GeneratePolicy,
    GenerateReport,
    Verdict,
)
from dtypelab.core.stats import MIN_GAIN
from dtypelab.core.text import GIB, MIB
from dtypelab.core.tolerance import Tolerance
from dtypelab.render import plots
from dtypelab.render.html import details, figure, record_section
from dtypelab.render.tables import html_fragment, plus_minus
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
    return "—" if v is None else f"{v * 1e3:,.0f}" if v >= 1 else f"{v * 1e3:.3g}"


def _memory(g: GenerateFigures, scale: float) -> list[str]:
    return [_size(g.weights_bytes, scale), _size(g.kv_cache_bytes, scale), _size(g.activations_bytes, scale),
            _size(g.peak_bytes, scale)]


def _speed(g: GenerateFigures) -> list[str]:
    return [_ms(g.ttft_s), _rate(g.prefill_tok_s), _rate(g.decode_tok_s), _ms(g.token_latency_s)]


def _interval(e: Estimate | None, fmt: str) -> str:
    return "" if e is None else f" [{e.low:{fmt}}, {e.high:{fmt}}]"


def _quality(p: GeneratePolicy) -> list[str]:
    q = p.quality
    if q is None:
        return ["—"] * 5
    change = "—" if q.perplexity_change is None else f"{q.perplexity_change:+.2%}{_interval(q.change, '+.2%')}"
    kl = "—" if q.kl is None else f"{q.kl.value:.3g}{_interval(q.kl, '.3g')}"
    top1 = q.top1.value if q.top1 is not None else q.agreement
    agree = "—" if top1 is None else f"{top1:.1%}{_interval(q.top1, '.1%')}"
    first = "—" if q.first_divergence is None else f"{q.first_divergence:.1f} ({q.diverged}/{q.sequences})"
    return [f"{q.perplexity:.4g}", change, kl, agree, first]


def bucket_notes(report: GenerateReport) -> list[str]:
    """Each judged policy's quality by context length: KL and the perplexity change, each with its interval."""
    out = []
    for p in report.policies:
        q = p.quality
        if q is None or not q.buckets:
            continue
        parts = [f"{b.start}–{b.end}: KL {b.kl.value:.3g}{_interval(b.kl, '.3g')}, perplexity "
                 f"{b.perplexity_change.value:+.2%}{_interval(b.perplexity_change, '+.2%')}"
                 for b in q.buckets if b.kl is not None and b.perplexity_change is not None]
        out.append(f"{p.policy} by context length (tokens): " + "; ".join(parts))
    return out


def detectable_note(report: GenerateReport) -> str:
    """The smallest perplexity change the held-out text resolves: the narrowest interval's half-width."""
    widths = [(q.change.high - q.change.low) / 2 for p in report.policies if (q := p.quality) and q.change]
    if not widths:
        return ""
    return (f"[95%]: bootstrap intervals over the held-out documents; a perplexity change under ±{min(widths):.2%} "
            "(the narrowest interval's half-width) cannot be told from noise on this text, and a policy is within "
            "tolerance only when its whole interval is; KL: the mean KL divergence (nats) of its next-token "
            "distribution from the baseline's; top-1: the share of positions whose likeliest next token is the "
            "baseline's")


def _joules(g: GenerateFigures) -> str:
    """Joules per generated token (the whole generation's, prefill included)."""
    e = g.energy
    return "—" if e is None or e.joules_per_token is None else f"{e.joules_per_token:.3g}"


def _fit(g: GenerateFigures) -> list[str]:
    fits = "—" if g.fits is None else ("yes" if g.fits else "no")
    bound = g.bound if not g.bound or g.bound in BOUNDS else "not timed"  # why: in the notes (a cell would wrap)
    return [fits, "—" if g.largest_batch is None else f"{g.largest_batch:,}" if g.largest_batch else "none",
            "—" if g.longest_context is None else f"{g.longest_context:,}" if g.longest_context else "none",
            bound or "—"]


def _paged(g: GenerateFigures) -> list[str]:
    """A paged engine's columns: whether it starts, its KV cache's tokens and the requests of --max-model-len they
    hold, and the concurrency from which it stops beating bfloat16's tokens a second."""
    fits = "—" if g.fits is None else ("yes" if g.fits else "no")
    paying = g.stops_paying.get("tok/s", 0) if g.stops_paying else 0
    stops = "—" if not g.stops_paying else "never" if paying is None else "from 1" if paying == 1 else f"{paying:,}"
    bound = g.bound if not g.bound or g.bound in BOUNDS else "not timed"
    return [fits, f"{g.kv_capacity_tokens:,}" if g.kv_capacity_tokens is not None else "—",
            f"{g.max_concurrency:.1f}x" if g.max_concurrency is not None else "—", stops, bound or "—"]


def row_reasons(report: GenerateReport) -> list[str]:
    """Why a policy has no row of figures, or no time, one note each (a reason in a cell wraps a word a line)."""
    out = []
    for p in report.policies:
        g = p.generate
        if p.status != "ok" or g is None:
            out.append(f"{p.policy}: {p.status}: {p.reason}")
        elif g.bound and g.bound not in BOUNDS:
            out.append(f"{p.policy}: not timed: {g.bound}")
    return out


# the columns a narrow terminal leaves out, first to last; the objective's own go last of all
NARROW = ("first divergence", "top-1", "activations", "weights", "prefill", "TTFT", "ms/token", "J/token",
          "decode bound", "largest batch", "longest context", "stops paying at", "vs baseline", "KV cache",
          "max concurrency", "fits", "perplexity", "KV tokens", "peak", "KL", "decode tok/s")
OBJECTIVE_COLUMNS = {"decode": ("decode tok/s",), "prefill": ("prefill", "TTFT"), "latency": ("TTFT", "ms/token"),
                     "energy": ("J/token",)}


def narrow_order(report: GenerateReport) -> tuple[str, ...]:
    """Which columns an 80-column terminal leaves out first: the objective's are kept longest."""
    own = OBJECTIVE_COLUMNS.get(report.config.objective, ())
    # a paged engine's peak is its budget, the same for every policy, and its pool is in KV tokens: those go first
    first = ("peak", "KV cache") if report.config.engine == "vllm" else ()
    return first + tuple(c for c in NARROW if c not in own and c not in first) + own


VERDICT_WORDS = {Verdict.RECOMMENDED: "chosen", Verdict.BASELINE: "baseline", Verdict.WITHIN: "within",
                 Verdict.NO_GAIN: "within, no gain", Verdict.OUTSIDE: "worse", Verdict.UNTIMED: "within, not timed"}


def verdict_text(p: GeneratePolicy, decision: Decision | None, tolerance: str = "") -> str:
    """A measured policy's verdict in words, with its paired gain; a gain resting on a disturbed round says so, and a
    policy outside only by its interval's upper end says how far that reaches."""
    if p.verdict is None:
        return "—"
    words = VERDICT_WORDS.get(p.verdict, p.verdict.value)
    q = p.quality
    if p.verdict == Verdict.OUTSIDE and q is not None and q.change is not None and q.perplexity_change is not None \
            and tolerance:
        tol = Tolerance.parse(tolerance)
        base = q.perplexity / (1 + q.perplexity_change)
        if q.perplexity - base <= tol.allowed(base):
            words += f": its interval reaches {q.change.high:+.2%}"
    if p.verdict == Verdict.BASELINE and decision == Decision.KEEP_BASELINE:
        words += ", kept"
    ci = p.gain
    if ci is None:
        return words
    return f"{words} {ci.point:.2f}x [{ci.low:.2f}–{ci.high:.2f}]" + (
        ", disturbed" if ci.disturbed > ci.dropped else "")


@document(GenerateReport, wrap=set(), drop=narrow_order)
def generate_doc(report: GenerateReport) -> tuple[str, list[str], list[list[str]], list[str]]:
    cfg = report.config
    scale, unit = _unit(report)
    measured = cfg.source == "measured"
    where = "measured here" if measured else (f"forecast for {cfg.device.label}, traced on fake tensors"
                                              if cfg.device is not None else "forecast")
    paged = cfg.engine == "vllm"
    batch = f"{cfg.batch_size} concurrent requests (vLLM)" if paged else f"batch {cfg.batch_size}"
    title = (f"dtypelab generate: {cfg.task_name} · {batch} · prompt {cfg.prompt_len} + "
             f"{cfg.gen_len} generated · {where}")
    mem = plus_minus(report.memory_error)
    headers = ["policy", f"weights {unit}", f"KV cache {unit}{mem}", f"activations {unit}", f"peak {unit}{mem}",
               "TTFT ms", "prefill tok/s", f"decode tok/s{plus_minus(report.speed_error)}", "ms/token"]
    energy = any(p.generate and p.generate.energy for p in report.policies)
    headers += [f"J/token{plus_minus(report.energy_error)}"] if energy else []
    headers += ["perplexity", "vs baseline [95%]", "KL [95%]", "top-1 [95%]", "first divergence", "verdict"] \
        if measured else \
        ["fits", "KV tokens", "max concurrency", "stops paying at", "decode bound"] if paged else \
        ["fits", "largest batch", "longest context", "decode bound"]
    rows = []
    for p in report.policies:
        g = p.generate
        if p.status != "ok" or g is None:
            rows.append([p.policy, *(["—"] * (len(headers) - 2)), f"{p.status} (below)"])
            continue
        tail = [*_quality(p), verdict_text(p, report.decision, cfg.tolerance)] if measured else _paged(g) if paged \
            else _fit(g)
        joules = [_joules(g)] if energy else []
        rows.append([p.policy, *_memory(g, scale), *_speed(g), *joules, *tail])
    return title, headers, rows, _notes(report)


def _notes(report: GenerateReport) -> list[str]:
    cfg = report.config
    notes = [report.answer] if report.answer else []
    notes += row_reasons(report)
    if cfg.source == "measured":
        judged_by = objective(cfg.objective, "decode")
        best = "the least energy per token" if judged_by.counts_joules else "the fastest"
        what = "joules" if judged_by.counts_joules else "seconds"
        rounds = max((len(p.generate.blocks) for p in report.policies if p.generate), default=0)
        chosen_for = "the least energy per generated token" if judged_by.counts_joules else judged_by.what
        notes.append(f"chosen for {chosen_for}: {best} whose perplexity (the "
                     f"held-out text read through its own KV cache) is within {cfg.tolerance} of {cfg.baseline}'s "
                     f"(within; worse: outside it) and whose gain ({cfg.baseline}'s {what} over its own, paired round "
                     f"by round: geometric mean [95% interval]) lies wholly above {1 + MIN_GAIN:.2f}x (no gain: it "
                     f"does not); speeds are medians of {rounds} interleaved rounds of generations, every policy in "
                     "one process")
        notes += [generate_energy_note(report)] if report.energy_source else []
        notes.append("peak: the most bytes allocated at once, counted tensor by tensor (weights, the KV cache for the "
                     "whole context, and everything else); first divergence: the mean position where a greedy "
                     "continuation first differs from the baseline's (and how many differ)")
        notes += [n for n in (detectable_note(report), *bucket_notes(report)) if n]
        notes += [f"calibration (GPTQ, AWQ, et-int8, kv-fp8-cal): {cfg.calibration}"] if cfg.calibration else []
    elif cfg.engine == "vllm":
        notes += _engine_notes(report)
    else:
        notes.append("peaks as traced (prefill and one decode step at the full context); largest batch at this "
                     "context and longest context at this batch, each traced to confirm; speed from the traced ops "
                     f"against the device's rates{': ' + report.rates if report.rates else ''}")
        if report.speed_error or report.memory_error:
            notes.append(f"±: the largest error of the validation set's held-out cases of that figure (docs/"
                         f"validation.md); one format's speed against another's: ±{report.ratio_error:.0%}, a tie "
                         "within it")
        if report.energy_note:
            notes.append(f"J/token: a whole generation's (prefill and decode) at the {report.energy_note}"
                         if any(p.generate and p.generate.energy for p in report.policies) else report.energy_note)
    notes += [n for p in report.policies for n in (f"{p.policy}: {x}" for x in p.notes)]
    return [*notes, *report.notes]


def _paying(at: int | None) -> str:
    if at is None:
        return "beats bf16 at every concurrency read"
    return "never beats bf16" if at == 1 else f"stops beating bf16 from {at:,} requests"


def _engine_notes(report: GenerateReport) -> list[str]:
    """What a paged engine's columns mean, its settings, and where each format stops paying."""
    cfg = report.config
    flags = " ".join(f"--{k} {v}" for k, v in cfg.engine_settings.items())
    out = [f"vLLM, one card's memory as it accounts it: peak = --gpu-memory-utilization of the card; weights, the "
           f"profile run's activations and the KV cache's pool within it; KV tokens: \"GPU KV cache size\"; max "
           f"concurrency: requests of --max-model-len it holds at once; settings: {flags}",
           f"speed in steady state at {cfg.batch_size} concurrent requests (decode tok/s over all of them, ms/token "
           f"between two tokens of one, TTFT under that load); stops paying at: the concurrency from which a format "
           f"no longer beats bfloat16's tokens a second beyond the forecast's error (±{report.ratio_error:.0%}: a tie "
           f"does not pay; read at 1, 2, 4, ... requests)"
           + (f": {report.rates}" if report.rates else "")]
    for p in report.policies:
        g = p.generate
        if g is None or not g.stops_paying:
            continue
        out.append(f"{p.policy}: {'; '.join(f'{k} {_paying(v)}' for k, v in g.stops_paying.items())}")
    if report.speed_error or report.memory_error:
        out.append(f"±: the largest error of the validation set's held-out cases of that figure (docs/validation.md); "
                   f"one format's speed against another's: ±{report.ratio_error:.0%}, a tie within it")
    if report.energy_note:
        out.append(f"J/token: a steady step's (its decode and its prefill chunks) at the {report.energy_note}")
    return out


def generate_energy_note(report: GenerateReport) -> str:
    source = report.energy_source
    assert source is not None
    if not source.counter or source.why:
        return f"No energy: {source.why}"
    idle = f"; idle {source.idle_watts:.1f} W, measured apart" if source.idle_watts else ""
    least = f" (at least {source.min_window_s:g} s each)" if source.min_window_s else ""
    return (f"J/token: the {source.counter} counter read at synchronized edges of windows of whole generations{least}, "
            f"all their joules over all the tokens they generated, the prefill included; the whole device's energy, "
            f"idle included{idle}")


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
            ["ratio: forecast over measured; measured speeds: each policy's fastest round (the median generation of "
             "its block, interleaved with the others')"]))
    return out


@section(GenerateReport)
def _generate(report: GenerateReport, key: str, layers: str | None = None) -> str:
    title, headers, rows, notes = generate_doc(report)
    body = html_fragment(headers, rows, notes, classes=True)
    for more_title, more_headers, more_rows, more_notes in kernel_docs(report):
        body += details(more_title, html_fragment(more_headers, more_rows, more_notes, classes=True), opened=True)
    body += _energy_figure(report, key)
    return record_section(title, body, report.environment, report.created, key)


def _energy_figure(report: GenerateReport, key: str) -> str:
    """Joules per generated token beside decode tokens per second, per policy (measured or forecast)."""
    shown = [p for p in report.policies if p.generate is not None and p.generate.energy is not None]
    names = [p.policy for p in shown]
    jpt = [p.generate.energy.joules_per_token for p in shown]  # type: ignore[union-attr]
    tok = [p.generate.decode_tok_s for p in shown]  # type: ignore[union-attr]
    how = "measured by the device's counter" if report.config.source == "measured" else "forecast by the power model"
    return figure(plots.bars(names, [("joules per generated token", jpt), ("decode tokens/s", tok)]),
                  f"Energy per generated token ({how}; the prefill included) beside decode speed: a faster format "
                  "is not always the one that spends less.", f"{key}-energy")


FRONTIER_SHOWN = 8


def plan_narrow_order(report: GeneratePlanReport) -> tuple[str, ...]:
    """A narrow terminal leaves out the forecast seconds first (the notes give the plan's speed), the KL last."""
    choices = list(dict.fromkeys(c.choice for u in report.units for c in u.choices))
    return (*(f"{c} µs/token" for c in choices), *(f"{c} KL" for c in reversed(choices[1:])))


@document(GeneratePlanReport, wrap=set(), drop=plan_narrow_order)
def generate_plan_doc(report: GeneratePlanReport) -> tuple[str, list[str], list[list[str]], list[str]]:
    """tune --mode generate: each unit's choice and what each choice costs (KL measured, seconds and bytes
    forecast), then the trade-off frontier in the notes."""
    title = (f"dtypelab tune --mode generate: {report.task_name} served on {report.device} · KL budget "
             f"{report.budget:g} nats · most {'decode speed' if report.objective == 'speed' else 'memory saved'}")
    choices = list(dict.fromkeys(c.choice for u in report.units for c in u.choices))
    headers = ["unit", "chosen", "bf16 µs/token"]
    for c in choices[1:]:
        headers += [f"{c} KL", f"{c} µs/token"]
    rows = []
    for u in report.units:
        by = {c.choice: c for c in u.choices}
        row = [u.name.removeprefix("model."), u.chosen, f"{by['bf16'].seconds * 1e6:.3g}" if "bf16" in by else "—"]
        for c in choices[1:]:
            row += [f"{by[c].kl:.3g}", f"{by[c].seconds * 1e6:.3g}"] if c in by else ["—", "—"]
        rows.append(row)
    notes = []
    if report.measured_kl is not None:
        notes.append(f"chosen plan: KL {report.measured_kl:.3g} nats measured with every chosen unit converted "
                     f"(budget {report.budget:g})")
    else:
        notes.append(f"no plan within the budget held it when measured whole: bfloat16 everywhere ({report.budget:g})")
    notes += [f"measured whole: {formats or 'bf16'}, KL {kl:.3g}" for formats, kl in report.tried]
    points = report.frontier
    step = max(1, len(points) // FRONTIER_SHOWN)
    shown = [p for i, p in enumerate(points) if i % step == 0 or p.chosen or i == len(points) - 1]
    front = " · ".join(f"KL {p.kl:.3g}: {p.speedup:.2f}x speed, {p.memory:.0%} memory{' (chosen)' if p.chosen else ''}"
                       for p in shown) + (f" ({len(shown)} of its {len(points)} plans; the record holds all)"
                                          if len(shown) < len(points) else "")
    notes.append(f"trade-off (the frontier: no plan beats one on both KL and {report.objective}; KL the sum of its "
                 f"units', the weights' decode speed and bytes against all-bfloat16's): {front}")
    notes.append("a unit: layers vLLM fuses (q/k/v, gate/up) or one linear layer; its KL measured here with it alone "
                 "converted; µs/token: reading its weights per decode token at batch 1, forecast (stored bytes over "
                 "the card's bandwidth times the kernel's share); the output head stays bfloat16")
    notes += [f"calibration: {report.calibration}"] if report.calibration else []
    return title, headers, rows, notes


@section(GeneratePlanReport)
def _generate_plan(report: GeneratePlanReport, key: str, layers: str | None = None) -> str:
    title, headers, rows, notes = generate_plan_doc(report)
    return record_section(title, html_fragment(headers, rows, notes, classes=True), {}, report.created, key)
