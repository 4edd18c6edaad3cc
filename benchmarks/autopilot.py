"""The autopilot against static precision, in one run (ratios only: absolute times vary from day to day).

    python benchmarks/autopilot.py [--calm digits,charlm] [--start amp-bf16] [--rounds 3] [--skip-drift]
                                   [--script-start amp-fp16] [--script-steps 400] [--only-script]

1. Overhead where nothing comes near a limit (the autopilot must move nothing and cost <= 5%): on each --calm task,
   the training loop under the static --start policy (dtypelab's own loop, one loss read per step as in bench) and
   the autopilot's loop from the same start (readings every 10 steps, checkpoints, the guard's per-step check),
   alternated --rounds times in this process; the ratio of the medians.
2. The drift case (examples/autopilot_tasks.py:make_drift_task, fp16's range): one table of fp32, static amp-fp16, the
   best static plan `tune --mode train` finds, and the autopilot's own final plan, speed from bench's paired rounds,
   metric, steps lost; and the autopilot's loop against the best static plan's loop, alternated as in 1.
3. A script's own loop: the calm model through a session run on its own, static --script-start against the same
   with the autopilot on it (readings at the automatic interval, checkpoints, the per-step input capture), alternated.

Say the CPU (`dtypelab hardware`) with every figure. Run it alone: nothing else may use the CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import dtypelab
from dtypelab.core.loop import build_trainable, fit
from dtypelab.core.machine.hardware import hardware_for
from dtypelab.core.policies import Precision, get_policy
from dtypelab.core.task import load_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIFT = os.path.join(ROOT, "examples", "autopilot_tasks.py") + ":make_drift_task"


def static_loop(task_spec: str, policy, steps: int | None = None) -> float:
    """Seconds of the training loop alone under a static policy (or plan)."""
    task, cpu = load_task(task_spec), torch.device("cpu")
    precision = Precision(get_policy(policy), cpu)
    model, optimizer = build_trainable(task, precision, cpu, 0)
    start = time.perf_counter()
    fit(task, model, precision, optimizer, cpu, steps or task.steps, task.batch_size, 0)
    return time.perf_counter() - start


def pilot_loop(task_spec: str, start: str, **kw) -> tuple[float, dtypelab.AutopilotReport]:
    report = dtypelab.autopilot(task_spec, start=start, force=True, **kw)
    return report.train_s, report


def alternate(rounds: int, a, b) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in range(rounds):
        for first in ((a, xs), (b, ys)) if r % 2 == 0 else ((b, ys), (a, xs)):
            first[1].append(first[0]())
    return xs, ys


def overhead(tasks: list[str], start: str, rounds: int) -> None:
    print(f"## 1. Overhead where nothing nears a limit (start {start}, readings every 10 steps)\n")
    print("| task | static loop s (median) | autopilot loop s (median) | ratio | moves | rollbacks |")
    print("|---|---|---|---|---|---|")
    for t in tasks:
        reports = []

        def pilot(t: str = t, reports: list = reports) -> float:
            s, rep = pilot_loop(t, start, sample_every=10)
            reports.append(rep)
            return s

        static, auto = alternate(rounds, lambda t=t: static_loop(t, start), pilot)
        s, a = statistics.median(static), statistics.median(auto)
        moves = max(len(r.moves) for r in reports)
        backs = max(len(r.rollbacks) for r in reports)
        print(f"| {t} | {s:.3f} | {a:.3f} | {a / s:.3f}x | {moves} | {backs} |", flush=True)


def drift(rounds: int) -> None:
    print("\n## 2. The drift case (fp16's range)\n")
    tuned = dtypelab.tune(DRIFT, mode="train", candidates="amp-fp16", force=True)
    best = dtypelab.Plan.from_dict(tuned.plan) if tuned.plan.get("rules") or tuned.plan_default != "fp32" else None
    _, pilot = pilot_loop(DRIFT, "amp-fp16", sample_every=5)
    auto_plan = dtypelab.Plan.from_dict(pilot.final_plan)
    plans = ["fp32", "amp-fp16", auto_plan] + ([best] if best is not None else [])
    report = dtypelab.bench(DRIFT, plans, force=True)
    print("| configuration | speed vs fp32 (paired rounds) | accuracy | steps lost |")
    print("|---|---|---|---|")
    for r in report.results:
        ci = r.speedup_ci
        speed = f"{ci.point:.2f}x ({ci.low:.2f}-{ci.high:.2f})" if ci else "1.00x" if r.policy == "fp32" else "-"
        label = r.policy + (" (tune's best static plan)" if best is not None and r.policy == best.name else "") + (
            " (the autopilot's final plan, static)" if r.policy == auto_plan.name else "")
        print(f"| {label} | {speed} | {r.metrics.get('accuracy', float('nan')):.4f} | {r.status} |")
    print(f"| autopilot from amp-fp16 | see below | {pilot.metrics.get('accuracy', float('nan')):.4f} | "
          f"{pilot.steps_rolled_back} rolled back, {pilot.steps_skipped} skipped |")
    target = best or auto_plan
    static, auto = alternate(rounds, lambda: static_loop(DRIFT, target), lambda: pilot_loop(DRIFT, "amp-fp16",
                                                                                            sample_every=5)[0])
    s, a = statistics.median(static), statistics.median(auto)
    print(f"\nautopilot loop {a:.3f} s vs static {target.name} {s:.3f} s (medians of {rounds}): it keeps "
          f"{s / a:.0%} of that plan's speed; moves: " + "; ".join(f"{m.layer} at step {m.step} ({m.cause})"
                                                                   for m in pilot.moves))


def script_loop(start: str, steps: int, pilot: bool) -> float:
    """Seconds of a plain script loop (the calm model of examples/autopilot_tasks.py) through a session run on its
    own: the static start policy, or the same with the autopilot on it (``session(autopilot=...)``'s diagnosis)."""
    import sys

    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from autopilot_tasks import Drifting, X, Y

    from dtypelab.piloting import PilotDiagnosis
    from dtypelab.script import Session

    torch.manual_seed(0)
    plan = get_policy(start)
    lab = Session(plan=plan, diagnosis=PilotDiagnosis({"start": plan.name}) if pilot else None)
    model = Drifting()
    model, optimizer = lab.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    begin = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(0, len(X), (32,), generator=torch.Generator().manual_seed(step))
        lab.backward(F.cross_entropy(model(X[idx]), Y[idx]))
        optimizer.step()
        optimizer.zero_grad()
    took = time.perf_counter() - begin
    moves = len(lab.diag.moves) if pilot else 0
    lab.close()  # ends the session without a metric (the autopilot prints its summary)
    assert moves == 0, "the calm loop moved a layer"
    return took


def script(start: str, steps: int, rounds: int) -> None:
    """A/B in alternation, and the time spent inside the autopilot's own hooks counted in the autopilot's runs (on a
    ~1 ms step the A/B pairs scatter by +-20% on a shared 2-core VM; the count does not)."""
    import functools

    from dtypelab.piloting import PilotDiagnosis

    print(f"\n## 3. A script's own loop (session(autopilot=...)), start {start}, {steps} steps, automatic readings\n")
    spent = [0.0]
    def count(f):
        @functools.wraps(f)
        def counted(self, *a, **k):
            t = time.perf_counter()
            try:
                return f(self, *a, **k)
            finally:
                spent[0] += time.perf_counter() - t
        return counted

    for name in ("begin", "backward", "end", "_keep_inputs"):
        setattr(PilotDiagnosis, name, count(getattr(PilotDiagnosis, name)))
    shares: list[float] = []

    def pilot() -> float:
        spent[0] = 0.0
        took = script_loop(start, steps, True)
        shares.append(spent[0] / took)
        return took

    static, auto = alternate(rounds, lambda: script_loop(start, steps, False), pilot)
    pairs = sorted(a / s for s, a in zip(static, auto, strict=True))
    print(f"static {statistics.median(static):.3f} s, autopilot {statistics.median(auto):.3f} s (medians of {rounds}); "
          f"pair ratios {pairs[0]:.2f}-{pairs[-1]:.2f}, median {statistics.median(pairs):.3f}x; no layer moved")
    print(f"time inside the autopilot's hooks (checkpoints, reading set-up and decisions, input capture, RNG): "
          f"{statistics.median(shares):.1%} of the loop (median); the readings' forward hooks come on top, inside "
          "their ~2% budget")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calm", default="digits,charlm")
    ap.add_argument("--start", default="amp-bf16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-drift", action="store_true")
    ap.add_argument("--script-start", default="amp-fp16", help="start of section 3 (a script's loop)")
    ap.add_argument("--script-steps", type=int, default=400)
    ap.add_argument("--only-script", action="store_true", help="section 3 alone")
    args = ap.parse_args()
    hw = hardware_for("cpu")
    print(f"hardware: {hw.cpu_name}, {hw.cpu_capability}, {hw.threads} threads\n")
    if not args.only_script:
        overhead(args.calm.split(","), args.start, args.rounds)
        if not args.skip_drift:
            drift(args.rounds)
    script(args.script_start, args.script_steps, args.rounds)


if __name__ == "__main__":
    main()
