"""The footnotes under a bench table, carried in its ``Recommendation``: how each policy computes, compiled policies
against their fair baselines, what a float8 / int4 policy converted, emulated formats, what the columns mean, and
the policies the interleaved rounds left out."""

from __future__ import annotations

from dtypelab.core.judging.prefer import keeps_updates
from dtypelab.core.machine.hardware import HardwareInfo, kernel_path_text
from dtypelab.core.objectives import objective
from dtypelab.core.results import COMPILED_BASELINE, PolicyResult, PolicyVerdict, Report, Verdict
from dtypelab.core.results.parts import Conversion
from dtypelab.core.stats import CLEARLY_SLOWER, MIN_GAIN

KEPT = (Verdict.BETTER, Verdict.EQUAL, Verdict.WITHIN, Verdict.NO_GAIN, Verdict.RECOMMENDED, Verdict.OVER_MEMORY)
REJECTED = (Verdict.OUTSIDE, Verdict.NONFINITE, Verdict.DIVERGED)


def _compiled_text(r: PolicyResult, report: Report) -> str:
    """A compiled policy against compiled fp32, its fair baseline (compilation alone speeds fp32 up too)."""
    base = report.result(COMPILED_BASELINE)
    if r.policy == COMPILED_BASELINE or not (r.info and r.info.compiles) or not r.ran or not base or not base.ran:
        return ""
    ci = r.compiled_ci
    if ci:
        how = f"{ci.point:.2f}x ({ci.low:.2f}–{ci.high:.2f}, paired rounds)"
    elif r.timing and base.timing:
        how = f"{base.timing.median / r.timing.median:.2f}x (medians)"
    else:
        return ""
    return (f"{r.policy} vs {COMPILED_BASELINE}, its fair baseline (compiling speeds fp32 up too): {how}; "
            "the speedup column is vs eager fp32.")


COLD_CACHE_NOTE_S = 10.0  # compilation a warm cache saves, below which a re-run is not worth a note


def _compile_s(r: PolicyResult) -> tuple[float | None, float | None]:
    """A compiled policy's first forward call in its own run and in the rounds: (cold, warm). Inference only: a
    training run compiles while it primes, so no step of its own shows the cost."""
    if not (r.info and r.info.compiles) or r.first_call_s is None:
        return None, None
    return r.first_call_s, r.rounds_first_call_s


def _linear_bytes(r: PolicyResult) -> float | None:
    return r.size["linear_weight_bytes"] if r.size else None


FLOAT8_BASELINE = "amp-bf16+compile"  # float8 training's fair baseline: compiled, bfloat16 autocast elsewhere


def _conversion_text(r: PolicyResult, report: Report | None = None) -> str:
    """How much of the model a float8 / int4 policy converted, what it left out (shapes), and for float8 training its
    speed against ``FLOAT8_BASELINE`` when that ran too (each run's own median step)."""
    c = r.conversion
    if not c:
        return ""
    if "fallback" in c:
        return program_text(r.policy, c)
    done, out = c.get("converted", []), c.get("left_out", [])
    text = f"{r.policy}: {c.get('format', 'converted')} in {len(done)} of {len(done) + len(out)} Linear layers"
    if not done:
        text += " (none, so its speed is that of its float part alone)"
    if out:
        shown = "; ".join(f"{e['layer']} {e['why']}" for e in out[:4])
        text += f"; left out: {shown}" + (f"; and {len(out) - 4} more" if len(out) > 4 else "")
    # only a training sweep has it (the fp8 and int4 inference formats are judged against fp32 alone)
    base = report.result(FLOAT8_BASELINE) if report is not None and report.config.mode == "train" else None
    if base is not None and base.ran and base.timing and r.timing and r.timing.median > 0:
        ratio = base.timing.median / r.timing.median
        text += (f"; {ratio:.2f}x the speed of {FLOAT8_BASELINE}, its fair baseline (compiled, bfloat16 elsewhere; "
                 "each run's own median step)")
    return text + "."


FALLBACK_SHOWN = 6  # operators named outside a delegate


def program_text(policy: str, c: Conversion) -> str:
    """A whole-model program (an ExecuTorch .pte): its delegated subgraphs, and the operators left outside the
    delegate, most called first."""
    text = f"{policy}: the whole model as one {c.get('format', 'program')} program, {c.get('delegated', 0)} " \
        f"subgraph(s) delegated to {c.get('delegate', 'its backend')}"
    if c.get("planned_bytes"):
        text += f", {int(c['planned_bytes']) / 2**20:.1f} MiB of activations planned ahead of time"
    ops = sorted(dict(c.get("fallback", {})).items(), key=lambda kv: (-int(kv[1]), kv[0]))
    if not ops:
        return text + "; every operator inside the delegate."
    shown = ", ".join(f"{_op_name(op)} ×{n}" for op, n in ops[:FALLBACK_SHOWN])
    more = f" and {len(ops) - FALLBACK_SHOWN} more" if len(ops) > FALLBACK_SHOWN else ""
    return text + f"; outside it ({sum(int(n) for _, n in ops)} calls on the runtime's portable kernels): " \
        f"{shown}{more}."


def _op_name(op: str) -> str:
    """ExecuTorch's operator key as aten's name: aten_native_layer_norm_default -> native_layer_norm."""
    for prefix in ("aten_", "dim_order_ops_"):
        if op.startswith(prefix):  # an overload's name follows: drop it (scalar_tensor, no prefix, is an op's name)
            op = op.removeprefix(prefix)
            for suffix in ("_default", "_tensor", "_scalar", "_self", "_int_list", "_start_step", "_dim"):
                if op.endswith(suffix) and len(op) > len(suffix):
                    return op.removesuffix(suffix)
    return op


LOST_SHOWN = 3  # parameters named in a lost-updates note
LOST_FLOOR = 0.10  # a parameter that lost less than this share of its updates is not named


def _lost_text(r: PolicyResult, report: Report, verdicts: dict[str, PolicyVerdict]) -> str:
    """Why a pure low-precision policy fell outside the tolerance, when its weights lost their updates: the
    parameters that lost most, and the policies of this sweep that keep them (within the tolerance), or the ones
    that would."""
    worst = [u for u in r.updates if max(u["lost"].values(), default=0.0) >= LOST_FLOOR][:LOST_SHOWN]
    if not worst:
        return ""
    steps = max(u["steps"] for u in r.updates)
    shown = ", ".join(f"{u['parameter']} {max(u['lost'].values()):.0%}" for u in worst)
    more = len([u for u in r.updates if max(u["lost"].values(), default=0.0) >= LOST_FLOOR]) - len(worst)
    dtype = worst[0]["dtype"]
    keepers = [q.policy for q in report.results if q.ran and q.policy != report.baseline and keeps_updates(q)
               and verdicts.get(q.policy) and verdicts[q.policy].verdict in KEPT]
    named = ", ".join(keepers[:LOST_SHOWN + 1]) + (", …" if len(keepers) > LOST_SHOWN + 1 else "")
    keep = (f"policies here that keep them, within the tolerance: {named}" if keepers else
            "bf16-sr or bf16-kahan keep them in bfloat16 weights, amp-bf16 in float32 weights (--policies "
            "bf16-sr,bf16-kahan,amp-bf16)")
    return (f"{r.policy}: its {dtype} weights rounded their small updates away (the share of elements whose weight "
            f"stayed the same though its gradient was not zero, over {steps} steps after training): {shown}"
            f"{f' and {more} more' if more > 0 else ''}; {keep}; `dtypelab audit TASK --updates` counts them per "
            "format.")


def _int8_text(r: PolicyResult, hw: HardwareInfo | None) -> str:
    """Whether an int8 policy's matmuls are native here, and which oneDNN primitive ran them (the probe's record)."""
    info = r.info
    if not (info and info.compute_dtype == "int8" and hw):
        return ""
    if hw.native("int8") is False:
        return (f"{r.policy}: this {hw.device_name or 'device'} has no int8 dot-product instructions (VNNI/AMX), so "
                "its int8 matmuls are not native here.")
    path = kernel_path_text(hw, "int8-fbgemm" if info.backend.startswith("torch.ao") else "int8")
    return f"{r.policy}: int8 matmuls {path}." if path else ""


def _arithmetic_text(r: PolicyResult) -> str:
    """What the policy's arithmetic is, as its kind says, unless its conversion took no layer of this model (then
    there is nothing quantized to compute with: say that instead)."""
    if not (r.info and r.info.arithmetic):
        return ""
    c = r.conversion
    if c and not c.get("converted") and c.get("left_out"):
        return (f"{r.policy} ({r.info.backend}): no layer of this model was converted (none takes its format's "
                "shape), so its weights stay as they are and no matmul runs its format.")
    return f"{r.policy} ({r.info.backend}): {r.info.arithmetic}."


def _policy_notes(r: PolicyResult, report: Report, verdicts: dict[str, PolicyVerdict] | None,
                  hw: HardwareInfo | None) -> list[str]:
    """One policy's own notes: lost updates, its arithmetic, int8's path, its conversion, compiling."""
    v = verdicts.get(r.policy) if verdicts else None
    lost = _lost_text(r, report, verdicts) if r.updates and v and v.verdict in REJECTED else ""
    arithmetic = _arithmetic_text(r)
    cold, warm = _compile_s(r)
    again = f"; {warm:.1f} s when the rounds compiled it again from that cache" if warm else ""
    compiled = (f"{r.policy}: the first call took {cold:.1f} s (compilation, which inductor caches on disk for later "
                f"runs{again}), outside the latency.") if cold else ""
    texts = (lost, arithmetic, _int8_text(r, hw), _conversion_text(r, report), _compiled_text(r, report), compiled)
    return [t for t in texts if t]


def _format_notes(ran: list[PolicyResult]) -> list[str]:
    """The sweep's compile time saved by the cache, emulated formats, the size columns."""
    notes = []
    times = [_compile_s(r) for r in ran]
    cold_all, warm_all = sum(c for c, w in times if c and w), sum(w for c, w in times if c and w)
    if cold_all - warm_all >= COLD_CACHE_NOTE_S:
        notes.append(f"Compiling took {cold_all:.0f} s of this sweep; from inductor's on-disk cache, now warm, the "
                     f"same graphs took {warm_all:.0f} s, so a re-run is about {cold_all - warm_all:.0f} s shorter.")
    numerics = [r.policy for r in ran if r.info and r.info.numerics_only]
    if numerics:
        notes.append(f"{', '.join(numerics)}: emulated, numerics only: the format's rounding on this hardware, its "
                     "matmuls in float32; its step time says nothing of the format's speed, so it has no speedup and "
                     "is never chosen for speed.")
    if any(r.info and r.info.emulated and not r.info.numerics_only for r in ran):
        notes.append("† emulated format: stored in it but computed in a wider type; its speed is not the "
                     "format's native speed.")
    if any(_linear_bytes(r) for r in ran):
        pte = any(r.size and r.size["format"] == "executorch .pte" for r in ran)
        notes.append("size MiB: the converted model's file (safetensors, or torch.save for torch.ao's packed "
                     f"modules{'; an ExecuTorch policy: its .pte program' if pte else ''}); linear W: bytes of "
                     "linear-layer weights incl. scales, vs fp32.")
    return notes


def _speedup_method_text(report: Report) -> str:
    """How the speedups and their intervals were measured: rounds in one process, or whole runs of a script."""
    cfg = report.config
    if not any(r.speedup_ci for r in report.results):
        return ""
    runs = {r.policy: len(r.rounds) for r in report.results if r.speedup_ci or r.policy == report.baseline}
    if cfg.runs > 1:  # a script's policies: whole runs, each in its own process, are the replicates
        counts = ", ".join(f"{name} {n}" for name, n in runs.items())
        return (f"speedup: geometric mean of {report.baseline}'s median step over the policy's, run by run (each run "
                f"its own process, in ABBA order), with a 95% Student-t interval over the runs (runs: {counts}); "
                "step ms is from each policy's first run.")
    most = max((len(r.rounds) for r in report.results), default=0)
    more = (f" (up to {most} for a policy whose interval still reached below the {1 + MIN_GAIN:.2f}x band "
            "while its point lay above it)") if most > cfg.rounds else ""
    steps = f"{cfg.rounds_block} step{'s' if cfg.rounds_block != 1 else ''}"
    return (f"speedup: geometric mean of {report.baseline}'s block median over the policy's, over {cfg.rounds} "
            f"interleaved rounds{more} of {steps} in one process (paired: the same round, the same batches), with a "
            "95% Student-t interval; step ms is from each policy's own run.")


def _rounds_notes(report: Report, ran: list[PolicyResult], verdicts: dict[str, PolicyVerdict] | None) -> list[str]:
    """Policies left out of the rounds and why, where each run went, noisy timings."""
    notes = []
    settled = [r.policy for r in ran if r.timing and not r.speedup_ci and verdicts and r.policy in verdicts
               and verdicts[r.policy].verdict.settled and not (r.info and r.info.numerics_only)]
    if settled and any(r.speedup_ci for r in report.results):
        notes.append(f"{', '.join(settled)}: not timed in the rounds (a policy outside the constraints is rejected "
                     "whatever its speed); its speedup is the ratio of each run's own median, without an interval.")
    placed = [r for r in report.results if r.ran_on]
    if placed or report.rounds_on:
        runs = "; ".join(f"{r.policy} on {r.ran_on}" for r in placed)
        rounds = f"; the speed rounds, every policy on one device: {report.rounds_on}" if report.rounds_on else ""
        notes.append(f"Where each learning run went: {runs or 'this machine'}{rounds}.")
    slower = [r.policy for r in ran if r.rounds_skip == "slower" and not r.speedup_ci]
    if slower:
        notes.append(f"{', '.join(slower)}: not timed in the rounds (its own run and {report.baseline}'s, both "
                     f"undisturbed, put it at or below {CLEARLY_SLOWER:.2f}x {report.baseline}'s speed: more rounds "
                     "could not make it the answer); its speedup is the ratio of each run's own median, without an "
                     "interval.")
    if any(r.timing and r.timing.noisy for r in report.results):
        notes.append("* noisy timing: IQR above 10% of the median; compare such policies with care.")
    return notes


def table_notes(report: Report, verdicts: dict[str, PolicyVerdict] | None = None) -> list[str]:
    """The footnotes under the table: how each policy computes, compiled baselines, emulated formats, what the
    columns mean, policies left out of the rounds (by their ``verdicts``), noisy timings."""
    ran = [r for r in report.results if r.ran]
    try:
        hw = HardwareInfo.from_dict(report.environment["hardware"])
    except (KeyError, TypeError):  # a record without (a whole) hardware description
        hw = None
    notes = [text for r in ran for text in _policy_notes(r, report, verdicts, hw)]
    method = _speedup_method_text(report)
    energy = energy_note(report)
    return [*notes, *_format_notes(ran), *([method] if method else []), *_rounds_notes(report, ran, verdicts),
            *([energy] if energy else [])]


def energy_note(report: Report) -> str:
    """How the energy column was measured, or why there is none, in one line ("" when the rounds did not run)."""
    source = report.energy_source
    if source is None:
        return ""
    if not source.counter or source.why:  # said once: --objective energy's decision already says why
        return "" if objective(report.config.objective).counts_joules else f"No energy: {source.why}."
    idle = f"; idle {source.idle_watts:.1f} W, measured apart before the rounds" if source.idle_watts else ""
    least = f" (windows of at least {source.min_window_s:g} s)" if source.min_window_s else ""
    return (f"J/sample: the {source.counter} counter read at synchronized edges of each policy's block of every round"
            f"{least}, all its joules over all its samples, ± the 95% Student-t half-interval over the windows; the "
            f"whole device's energy, idle included{idle}.")
