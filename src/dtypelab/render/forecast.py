"""The forecast record as tables: each policy's peak memory by category and against the device's memory; with
``--check``, the forecast beside what the same steps measured here. Reads the record only."""

from __future__ import annotations

from typing import Any

from dtypelab.core.machine import devices
from dtypelab.core.results import MEMORY_LABELS, METHODS, PEAK_CATEGORIES, ForecastReport, PolicyForecast
from dtypelab.core.text import GIB, MIB, size_text
from dtypelab.render import plots
from dtypelab.render.html import details, figure, record_section
from dtypelab.render.tables import html_fragment, plus_minus
from dtypelab.render.views import document, more, section

SHORT = MEMORY_LABELS
# the rate keys the device table shows, with their headings (its rows: core.machine.devices.DEVICES as they are)
RATE_COLUMNS = (("float32", "fp32 TFLOP/s"), ("tf32", "tf32"), ("bfloat16", "bf16"), ("fp8", "fp8"),
                ("int8", "int8 TOPS"))
DEVICE_NOTES = (
    "usable: what torch.cuda.get_device_properties().total_memory reports (the total capacity CUDA's out-of-memory "
    "message quotes), where such a report was found; else NVML's total less the {keeps} GiB the driver keeps on the "
    "cards that have both; sources in dtypelab/core/machine/devices.py",
    "a forecast keeps 0.5 GiB of it aside for the CUDA context and libraries (--reserve changes that); --memory SIZE "
    "forecasts for any other size",
    "peaks: dense (no structured sparsity), from NVIDIA's datasheets (the GeForce cards: the architecture whitepapers, "
    "with FP32 accumulation); memory GB/s: the datasheet's bandwidth; what a forecast of speed is made from; —: no "
    "such tensor cores",
    "limit W: the datasheet's maximum board power; idle W: published nvidia-smi readings at 0% utilization (P0; P8: "
    "only the sleep state's was found); —: none found, the energy forecast takes a tenth of the limit; what a "
    "forecast of energy is made from (dtypelab/core/machine/power.py)")


def devices_table() -> tuple[str, list[str], list[list[str]], list[str]]:
    """``forecast --devices``: every row of the device table, each column drawn from a field of its row."""
    rows = [[d.name, d.label, d.datasheet, f"{d.memory_bytes / GIB:.2f}", ".".join(map(str, d.capability)),
             ", ".join(f for f, cc in (("bf16", (8, 0)), ("fp8", (8, 9))) if d.capability >= cc) or "—",
             "torch's report" if d.torch_gib is not None else f"NVML less {devices.DRIVER_KEEPS_GIB} GiB",
             *(f"{d.rates[k]:g}" if k in d.rates else "—" for k, _ in RATE_COLUMNS),
             f"{d.bandwidth_gbs:g}" if d.bandwidth_gbs else "—",
             f"{d.idle_watts:g}" + ("" if d.idle_from.startswith("P0") else " (P8)") if d.idle_watts else "—",
             f"{d.limit_watts:g}" if d.limit_watts else "—"] for d in devices.DEVICES]
    headers = ["--device", "GPU", "datasheet", "usable GiB", "compute capability", "native", "from",
               *(h for _, h in RATE_COLUMNS), "memory GB/s", "idle W", "limit W"]
    notes = [n.format(keeps=devices.DRIVER_KEEPS_GIB) for n in DEVICE_NOTES]
    return "GPUs a forecast can be made for", headers, rows, notes


def unit_of(report: ForecastReport) -> tuple[float, str]:
    """GiB for the table when any peak reaches one, MiB below (binary: as torch and nvidia-smi report memory)."""
    peaks = [p.peak.peak_bytes for p in report.policies if p.peak is not None]
    return (GIB, "GiB") if peaks and max(peaks) >= GIB else (MIB, "MiB")


def _size(n: int | None, scale: float, sign: str = "") -> str:
    if n is None:
        return "—"
    if abs(n) >= 1000 * scale:  # thousands of the table's unit: whole numbers, grouped
        return f"{n / scale:{sign},.0f}"
    return f"{n / scale:{sign}.3g}" if abs(n) >= scale / 100 else ("0" if n == 0 else f"{n / scale:{sign}.2g}")



def _where(p: PolicyForecast) -> str:
    peak = p.train or p.infer
    if peak is None:
        return ""
    return peak.phase + (f" ({peak.module})" if peak.module else "")


def _fit(p: PolicyForecast, scale: float) -> list[str]:
    fit = p.train_fit or p.infer_fit
    if p.runs_there:
        return ["cannot run", "—", "—"]
    if p.untraced:
        return ["not traced", "—", "—"]
    if fit is None:
        return ["—", "—", "—"]
    largest = "—" if not (p.train_fit or p.infer_fit) else (
        "none" if fit.largest_batch is None and fit.traces else
        "—" if fit.largest_batch is None else f"{fit.largest_batch}{'+' if fit.capped else ''}")
    return ["yes" if fit.fits else "no", _size(fit.headroom_bytes, scale, "+"), largest]


@document(ForecastReport, wrap=set())
def forecast_doc(report: ForecastReport) -> tuple[str, list[str], list[list[str]], list[str]]:
    cfg = report.config
    scale, unit = unit_of(report)
    dev = cfg.device
    ranks = f" over {cfg.nproc} ranks ({cfg.batch_size // cfg.nproc} each)" if cfg.nproc > 1 else ""
    where = dev.label if dev.name else "no device named (peaks only)"
    title = (f"dtypelab forecast: {cfg.task_name} · {cfg.parameters:,} parameters · batch {cfg.batch_size}{ranks} · "
             f"{where} · traced on fake tensors, nothing run")
    train = cfg.mode == "train"
    # an inference pass holds weights and temporaries only (no gradient, no state, nothing kept for a backward)
    cats = [c for c in PEAK_CATEGORIES if c != "buffers" and (train or c in ("parameters", "temporaries"))]
    if not any(p.train and p.train.breakdown.get("frozen_weights") for p in report.policies):
        cats.remove("frozen_weights")  # a column for fine-tuning's frozen base only where there is one
    if not any(p.train and p.train.breakdown.get("loss") for p in report.policies) and "loss" in cats:
        cats.remove("loss")  # a column for a language model's loss only where one was counted
    headers = ["policy", *(f"{SHORT[c]} {unit}" for c in cats),
               f"{'train' if train else 'inference'} peak {unit}{plus_minus(report.memory_error)}", "peak in"]
    if train:
        headers.append(f"inference peak {unit}")
    headers += ["fits", f"headroom {unit}", "largest batch"] if dev.memory_bytes is not None else ["smallest GPU"]
    rows = []
    for p in report.policies:
        if p.status != "ok":
            rows.append([p.policy, *(["—"] * (len(headers) - 2)), f"{p.status}: {p.reason}"])
            continue
        peak = p.train if train and p.train is not None else p.infer
        cells = [p.policy]
        if peak is not None and (p.train is not None or not train):
            b = peak.breakdown
            cells += [_size(b.get(c, 0) + (b.get("buffers", 0) if c == "parameters" else 0), scale) for c in cats]
            cells += ["≥ " + _size(peak.peak_bytes, scale) if p.untraced else _size(peak.peak_bytes, scale),
                      "not traced" if p.untraced else _where(p)]
        else:  # an inference format in a training task: its pass has no training columns
            cells += ["—"] * len(cats) + ["—", "inference only"]
        if train:
            cells.append(_size(p.infer.peak_bytes if p.infer else None, scale))
        if dev.memory_bytes is not None:
            cells += _fit(p, scale)
        else:
            cells.append("not traced" if p.untraced else "cannot run anywhere in the table"
                         if p.smallest_device == "" and p.peak else (p.smallest_device or "none in the table"))
        rows.append(cells)
    return title, headers, rows, _notes(report, scale, unit)


def _notes(report: ForecastReport, scale: float, unit: str) -> list[str]:
    cfg = report.config
    notes = [report.answer] if report.answer else []
    methods = sorted({p.method for p in report.policies if p.status == "ok" and p.method})
    for m in methods:
        who = [p.policy for p in report.policies if p.method == m]
        notes.append(f"{METHODS.get(m, m)}: {', '.join(who)}")
    if any(p.train and p.train.breakdown.get("frozen_weights") for p in report.policies):
        notes.append("frozen: the weights that do not train (a fine-tuned model's base, a quantized one by its inner "
                     "tensors: NF4's codes, block scales and their double-quantized scales); weights: those that do")
    notes.append("weights, gradients, optimizer (state), master (a float32 copy, Kahan's compensation), activations "
                 "(what the forward keeps for the backward) and temporaries (the batch, outputs, the backward's and "
                 f"the optimizer's intermediates) at the moment of the peak, in {unit}; weights include buffers; the "
                 "peak is every step's after the first (the optimizer's state exists by then)")
    if any(p.train and p.train.breakdown.get("loss") for p in report.policies):
        notes.append("loss: the language model's logits and every tensor as wide (their float32 copy, the "
                     "log-probabilities the cross-entropy keeps for the backward, their gradients), apart from the "
                     "activations and temporaries; POLICY+chunked-ce computes them a chunk of the positions at a time")
    dev = cfg.device
    if dev.memory_bytes is not None:
        notes.append(f"fits: the peak within the {size_text(dev.memory_bytes - dev.reserve_bytes)} usable "
                     f"on {dev.label}; headroom: what is left (negative: short by); largest batch: the largest "
                     "traced to fit, all ranks together (traced, not extrapolated: the next size was traced not to "
                     "fit)")
    else:
        notes.append("smallest GPU: the one with the least memory in the table (dtypelab forecast --devices) that "
                     "holds the peak and runs the policy")
    for p in report.policies:
        if p.runs_there:
            notes.append(f"{p.policy} cannot run on {dev.label}: {p.runs_there}")
        for n in p.notes:
            notes.append(f"{p.policy}: {n}")
    notes += list(report.notes)
    notes.append(f"forecast in {report.seconds:.1f} s")
    return notes


@more(ForecastReport)
def check_docs(report: ForecastReport, top: int = 0) -> list[Any]:
    """``--check``: each forecast beside the same steps run here on real tensors."""
    checked = [(p, p.check) for p in report.policies if p.check is not None]
    if not checked:
        return []
    scale, unit = unit_of(report)

    def ratio(forecast: int | None, measured: int | None) -> str:
        return f"{forecast / measured:.3f}" if forecast and measured else "—"

    # Each column names its mode: a table narrowed to the terminal drops columns, and the rest must still read.
    headers = ["policy", f"train forecast {unit}", f"train measured {unit}", "train forecast/measured",
               f"inference forecast {unit}", f"inference measured {unit}", "inference forecast/measured",
               f"process peak {unit}", "forecast/process"]
    rows = []
    for p, c in checked:
        ft, fi = (p.train.peak_bytes if p.train else None), (p.infer.peak_bytes if p.infer else None)
        rows.append([p.policy, _size(ft, scale), _size(c.train_peak_bytes, scale), ratio(ft, c.train_peak_bytes),
                     _size(fi, scale), _size(c.infer_peak_bytes, scale), ratio(fi, c.infer_peak_bytes),
                     _size(c.process_peak_bytes, scale), ratio(ft or fi, c.process_peak_bytes)])
    method = next((c.process_method for _, c in checked if c.process_method), "")
    steps = checked[0][1].steps
    what = f"{steps} training steps" if report.config.mode == "train" else "one inference pass"
    notes = [f"measured: the same steps on real tensors here ({what}), every storage counted from its creation to "
             "its release by the same ledger",
             f"process peak: as bench measures it ({method}): it adds what is outside the tensors (the allocator's "
             "slack, the runtime's workspaces, pages the kernels touch)"]
    return [("dtypelab forecast --check: the forecast beside the same steps run here", headers, rows, notes)]


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 1000 else f"{ms:.3g}"


def _band(speedup: float | None, error: float, baseline: bool) -> str:
    if not speedup:
        return "—"
    if not error or baseline:
        return f"{speedup:.2f}x"
    return f"{speedup:.2f}x ({speedup * (1 - error):.2f}–{speedup * (1 + error):.2f})"


def _energy_cells(p: PolicyForecast, n: int) -> list[str]:
    """The step's forecast joules and watts (and joules per token where the step has tokens), ``n`` cells."""
    e = p.energy
    if e is None:
        return ["—"] * n
    cells = [f"{e.joules_per_step:.3g}", f"{e.watts:.0f}" if e.watts else "—"]
    return [*cells, f"{e.joules_per_token:.3g}" if e.joules_per_token else "—"][:n]


@more(ForecastReport)
def time_docs(report: ForecastReport, top: int = 0) -> list[Any]:
    """Each policy's predicted step time on the target, its speedup against the baseline, what bounds it and where it
    goes; with --check, beside the step timed here."""
    timed = [(p, p.time) for p in report.policies if p.time is not None]
    if not timed:
        return [(report.speed_answer, [], [], [])] if report.speed_answer else []
    checked = any(t.measured_s for _, t in timed)
    base = report.baseline or "the baseline"
    energy = any(p.energy for p, _ in timed)
    joules = ([f"J/step{plus_minus(report.energy_error)}", "W"]
              + (["J/token"] if any(p.energy and p.energy.joules_per_token for p, _ in timed) else []) if energy
              else [])
    # the energy columns before the text ones: a narrow terminal leaves out J/token, then W, before J/step
    headers = ["policy", f"step ms{plus_minus(report.step_error)}", f"speedup vs {base}", "bound", *joules,
               "where the time goes", "kernels"]
    if checked:
        headers += ["measured ms", "measured speedup", "predicted/measured speedup"]
    rows = []
    for p, t in timed:
        if t.step_s is None:
            rows.append([p.policy, "—", "—", "—", *(["—"] * len(joules)), t.reason, "—",
                         *(["—"] * 3 if checked else [])])
            continue
        step_s = t.step_s
        shares = sorted(((v / step_s, k) for k, v in t.breakdown.items() if v), reverse=True)[:3]
        cells = [p.policy, _ms(t.step_s), _band(t.speedup, report.speed_error, p.policy == report.baseline), t.bound,
                 *_energy_cells(p, len(joules)), ", ".join(f"{k} {s:.0%}" for s, k in shares), str(t.kernels)]
        if checked:
            m, ms = t.measured_s, t.measured_speedup
            cells += [_ms(m) if m else "—", f"{ms:.2f}x" if ms else "—",
                      f"{t.speedup / ms:.2f}" if ms and t.speedup else "—"]
        rows.append(cells)
    notes = [f"predicted from the traced ops (FLOPs, bytes read and written, the dtype each computes in), each op "
             f"max(FLOPs at its dtype's rate × a GEMM's size efficiency, bytes at the bandwidth, a per-kernel floor), "
             f"summed; a compiled policy's elementwise runs fused: {report.rates}",
             "bound: what most of the step's time is bound by (compute, memory, or the per-kernel floor: overhead); "
             "the step is the GPU's kernels: what the host adds (a batch made on the CPU each step, the launches of an "
             "eager step of small kernels) is not forecast, and a host-bound loop runs slower than forecast "
             "(docs/validation.md: this project's own GPU checks)"]
    if report.speed_error:
        notes.append(f"speedup: predicted, ± {report.speed_error:.0%}, the largest error of the validation set's "
                     "held-out training-speed cases (docs/validation.md); two predictions within each other's band are "
                     "a tie")
    if checked:
        notes.append("measured: the same step on real tensors here, the fastest of 10 or more (0.5 s of fast ones) "
                     "after 3 warm-up steps (a busy machine slows steps, never speeds one; on this CPU every "
                     "policy's steps in rounds, in turn); bench's paired rounds decide speed")
    if report.energy_note:
        notes.append(f"J/step and W: the predicted step at the {report.energy_note}; ± the model's error against "
                     "the validation set's held-out energy cases (docs/validation.md)"
                     if energy else report.energy_note)
    busy = next((t.disturbed for _, t in timed if t.disturbed), "")
    if busy:
        notes.append(f"not reliable: {busy}")
    notes += [f"{p.policy}: {t.reason}" for p, t in timed if t.step_s is not None and t.reason]
    title = report.speed_answer or "dtypelab forecast: predicted step times"
    return [(title, headers, rows, notes)]


@section(ForecastReport)
def _forecast(report: ForecastReport, key: str, layers: str | None = None) -> str:
    title, headers, rows, notes = forecast_doc(report)
    body = html_fragment(headers, rows, notes, classes=True)
    scale, unit = unit_of(report)
    drawn = [(p.policy, p.peak) for p in report.policies if p.peak is not None]
    parts = [c for c in PEAK_CATEGORIES if any(peak.breakdown.get(c) for _, peak in drawn)]
    usable = report.config.device.usable_bytes
    highest = max((peak.peak_bytes for _, peak in drawn), default=0)
    near = usable is not None and usable <= 3 * highest  # a line far past the bars would squash them
    chart = plots.stacked_breakdown([name for name, _ in drawn], [SHORT[c] for c in parts],
                                    [[peak.breakdown.get(c, 0) / scale for c in parts] for _, peak in drawn],
                                    xlabel=f"{unit} at the peak (training; inference for the inference formats)",
                                    limit=(usable / scale, f"{report.config.device.label}: usable")
                                    if near and usable is not None else None)
    where = "" if usable is None else (
        f", against the {usable / scale:,.4g} {unit} usable on {report.config.device.label}" if near else
        f" ({report.config.device.label} has {usable / scale:,.4g} {unit} usable)")
    body += figure(chart, f"What each policy's peak holds, category by category{where}.", f"{key}-forecast")
    for more_title, more_headers, more_rows, more_notes in check_docs(report):
        body += details(more_title, html_fragment(more_headers, more_rows, more_notes, classes=True), opened=True)
    return record_section(title, body, report.environment, report.created, key)
