"""Every forecast against what was published: the validation set (benchmarks/validation/*.json), run, judged, reported.

    python benchmarks/validate.py            # run every case, print each family's coverage and errors
    python benchmarks/validate.py --check    # the gate (CI): fail when a held-out case leaves its tolerance, a case
                                             # that answered stops answering, or any case moves from its recorded value
    python benchmarks/validate.py --write    # record today's values in the cases, the bands (src/dtypelab/core/
                                             # bands.json) and the report (docs/validation.md, docs/validation.png)

A case is one published figure: its source (where, which table and row), the conditions the source states, the
published value, how the forecast's value is read (``value``: a figure of one policy of one forecast run, or the
ratio of two), its role (``fitted``: a constant was set from it; ``held-out``: nothing was), a tolerance, what the
forecast cannot model of the published program (``unmodelled``) and, where a case stays outside its tolerance for a
known reason, ``known_miss``; ``outside_band`` (with a known miss) keeps a case out of its family's band where what it
measured is outside what the forecast forecasts at all (a host-bound loop: the forecast is the GPU's kernels' time).
``recorded`` is the value the last ``--write`` saw: a change that moves a figure updates it with ``--write`` and says
why in its commit.

A family's band is the largest error of its answered held-out cases (rounded up to a whole percent): what a forecast
shows beside each figure of that family. Every forecast runs for a named GPU (its datasheet's rates, nothing timed
here), so the set gives the same values on any machine, and forecasts run in parallel (``--jobs``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "benchmarks" / "validation"
PLACES = {"{configs}": str(ROOT / "benchmarks" / "configs"), "{cases}": str(ROOT / "benchmarks" / "speed_cases")}
BANDS = ROOT / "src" / "dtypelab" / "core" / "bands.json"
REPORT, PLOT = ROOT / "docs" / "validation.md", ROOT / "docs" / "validation.png"
FAMILIES = {  # family: (what it checks, the default tolerance of its cases)
    "train-speed": ("training step time: one policy's speed over another's on a GPU", 0.20),
    "train-tok-s": ("training samples (or tokens) a second on a GPU", 0.25),
    "train-peak": ("training and fine-tuning peak memory per GPU", 0.15),
    "serve-tok-s": ("single-stream decode tokens a second", 0.20),
    "serve-speed": ("decode tokens a second of a weight format over bfloat16's", 0.15),
    "serve-peak": ("serving peak memory", 0.15),
    "kv-bytes": ("KV cache bytes", 0.01),
    "kv-capacity": ("a serving engine's KV cache pool at start-up (vLLM's log)", 0.03),
    "engine-speed": ("an engine's tokens a second of a weight format over bfloat16's at 32 or more requests", 0.20),
    "energy": ("joules per generated token, and one format's over another's", 0.25),
}
UNITS = {"B": 1.0, "KiB": 2.0**-10, "MB": 1e-6, "GB": 1e-9, "GiB": 2.0**-30}
MOVED = 0.01  # a value further than this from its recorded one has moved
SAME = 0.03  # a published ratio within this of 1 is "about the same" (neither faster nor slower)


class CaseError(ValueError):
    """A case file that does not hold what the runner needs: one line saying which and why."""


@dataclass
class Outcome:
    case: dict[str, Any]
    file: str
    value: float | None = None
    why: str = ""  # why there is no value
    fits: bool | None = None  # a peak's forecast fits the named GPU (published peaks were measured: they fit)

    @property
    def family(self) -> str:
        return self.case["family"]

    @property
    def held_out(self) -> bool:
        return self.case["role"] == "held-out"

    @property
    def error(self) -> float | None:
        pub = self.case.get("published")
        return None if self.value is None or pub is None else self.value / pub - 1

    @property
    def tolerance(self) -> float:
        return float(self.case.get("tolerance", FAMILIES[self.family][1]))

    @property
    def within(self) -> bool | None:
        if self.value is None:
            return None
        if self.case.get("expect"):
            return (self.value > 1) == (self.case["expect"] == "above")
        return abs(self.error or 0.0) <= self.tolerance

    @property
    def direction(self) -> bool | None:
        """Faster or slower than the baseline as published (ratios); fits the GPU as published (peaks)."""
        if self.value is None:
            return None
        if self.case.get("expect"):
            return self.within
        if self.case["value"]["kind"] == "ratio":
            return _side(self.case["published"]) == _side(self.value)
        return self.fits


def _side(ratio: float) -> int:
    return 0 if abs(ratio - 1) <= SAME else (1 if ratio > 1 else -1)


# --- reading the set ----------------------------------------------------------------------------------------------
REQUIRED = ("id", "family", "role", "metric", "value", "source", "conditions", "unmodelled")


def _check_case(c: dict[str, Any], runs: dict[str, list[str]], where: str) -> None:
    missing = [k for k in REQUIRED if k not in c] + ([] if "published" in c else ["published"])
    if missing:
        raise CaseError(f"{where}: case {c.get('id', '?')} lacks {', '.join(missing)}")
    if c["family"] not in FAMILIES:
        raise CaseError(f"{where}: case {c['id']}: unknown family {c['family']!r} (one of {', '.join(FAMILIES)})")
    if c["role"] not in ("fitted", "held-out"):
        raise CaseError(f"{where}: case {c['id']}: role must be fitted or held-out, not {c['role']!r}")
    if c["role"] == "fitted" and not c.get("fitted"):
        raise CaseError(f"{where}: case {c['id']} is fitted: say which constant was set from it (\"fitted\")")
    if c.get("outside_band") and not c.get("known_miss"):
        raise CaseError(f"{where}: case {c['id']} is kept outside its family's band: say why (\"known_miss\")")
    if c["published"] is None and c.get("expect") not in ("above", "below"):
        raise CaseError(f"{where}: case {c['id']} has no published value: give \"expect\": above or below (1)")
    v = c["value"]
    if v.get("kind") not in ("read", "ratio"):
        raise CaseError(f"{where}: case {c['id']}: value kind must be read or ratio")
    for part in (v, v.get("over") or {}):
        if part and part.get("run") not in runs:
            raise CaseError(f"{where}: case {c['id']} reads run {part.get('run')!r}, which the file does not define")
    if v.get("unit", "B") not in UNITS:
        raise CaseError(f"{where}: case {c['id']}: unit {v['unit']!r} is not one of {', '.join(UNITS)}")


def load(paths: list[Path] | None = None) -> tuple[dict[str, dict[str, Any]], list[tuple[dict[str, Any], str]]]:
    """Every file's runs (keyed file/run) and every case with its file's name; checked, ids unique."""
    runs: dict[str, dict[str, Any]] = {}
    cases: list[tuple[dict[str, Any], str]] = []
    seen: set[str] = set()
    for path in paths or sorted(CASES.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CaseError(f"{path.name}: not a readable JSON file ({exc})") from None
        for name, args in data.get("runs", {}).items():
            runs[f"{path.name}/{name}"] = {"args": args}
        for c in data.get("cases", []):
            _check_case(c, data.get("runs", {}), path.name)
            if c["id"] in seen:
                raise CaseError(f"{path.name}: case id {c['id']} is used twice in the set")
            seen.add(c["id"])
            cases.append((c, path.name))
    return runs, cases


# --- running the forecasts ----------------------------------------------------------------------------------------
def expand(args: list[str]) -> list[str]:
    """A run's arguments with the set's folders filled in ({configs}, {cases})."""
    out = []
    for a in args:
        for key, value in PLACES.items():
            a = a.replace(key, value)
        out.append(a)
    return out


def fitted(family: str) -> list[tuple[dict[str, Any], list[str]]]:
    """Each fitted case of ``family`` with its run's arguments expanded: what a constant of the forecast is fitted
    to (``serving.py --part calibrate``, ``energy.py --part fit``)."""
    runs, cases = load()
    return [(c, expand(runs[f"{f}/{c['value']['run']}"]["args"])) for c, f in cases
            if c["family"] == family and c["role"] == "fitted"]


def flag(args: list[str], name: str) -> str:
    """The value a run's arguments give ``name`` (``--device``)."""
    return args[args.index(name) + 1]


def run_all(runs: dict[str, dict[str, Any]], jobs: int, out: Path, quiet: bool = False) -> None:
    """Each forecast as a user runs it (``dtypelab forecast ARGS --json``), ``jobs`` at a time; its record's path
    (or why there is none) and its seconds go into ``runs``. Named-GPU forecasts time nothing here: parallel is safe."""
    def one(name: str) -> None:
        path = out / (name.replace("/", "--") + ".json")
        cmd = [sys.executable, "-m", "dtypelab", "forecast", *expand(runs[name]["args"]), "--json", str(path)]
        # one tracing process each (--mode generate traces in one already)
        cmd += ["--workers", "1"] if jobs > 1 and "generate" not in runs[name]["args"] else []
        start = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                               env={**os.environ, "COLUMNS": "200"})
            ok, why = p.returncode == 0 and path.exists(), (p.stderr.strip().splitlines() or ["no output"])[-1]
        except subprocess.TimeoutExpired:
            ok, why = False, "timed out after 900 s"
        runs[name].update(record=str(path) if ok else None, why="" if ok else why,
                          seconds=time.perf_counter() - start)

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        futures = {pool.submit(one, name): name for name in sorted(runs)}
        for i, done in enumerate(as_completed(futures), 1):
            done.result()
            r = runs[futures[done]]
            if not quiet:
                print(f"  [{i}/{len(runs)}] {futures[done]}: {r['seconds']:.0f} s"
                      f"{'  FAILED: ' + r['why'] if r['why'] else ''}", file=sys.stderr, flush=True)


# --- reading a value off the records ------------------------------------------------------------------------------
def _policy(record: dict[str, Any], name: str) -> dict[str, Any]:
    for p in record.get("policies", []):
        if p["policy"] == name:
            if p.get("status") != "ok":
                raise LookupError(f"{name}: {p.get('status')}: {p.get('reason', '')}")
            return p
    raise LookupError(f"{name} is not in the record")


def _read(record: dict[str, Any], policy: str, path: str, exclude: list[str]) -> float:
    p = _policy(record, policy)
    if path == "samples_per_s":  # the whole batch over the step, less the groups the source did not time
        t = p.get("time") or {}
        if not t.get("step_s"):
            raise LookupError(f"{policy}: no step time ({t.get('reason', 'none forecast')})")
        return record["config"]["batch_size"] / (t["step_s"] - sum(t["breakdown"].get(g, 0.0) for g in exclude))
    value: Any = p
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    if not isinstance(value, (int, float)):
        raise LookupError(f"{policy}: no {path} in the record")
    return float(value)


def _fits(record: dict[str, Any], policy: str) -> bool | None:
    p = _policy(record, policy)
    if p.get("generate"):
        return p["generate"].get("fits")
    fit = p.get("train_fit")
    return fit.get("fits") if fit else None


def evaluate(case: dict[str, Any], file: str, runs: dict[str, dict[str, Any]]) -> Outcome:
    o = Outcome(case, file)
    v = case["value"]
    try:
        records = {}
        for part in (v, v.get("over")):
            if part:
                r = runs[f"{file}/{part['run']}"]
                if not r.get("record"):
                    raise LookupError(f"run {part['run']} failed: {r.get('why', 'not run')}")
                records[part["run"]] = json.loads(Path(r["record"]).read_text())
        exclude = v.get("exclude", [])
        o.value = _read(records[v["run"]], v["policy"], v["read"], exclude)
        if v["kind"] == "ratio":
            o.value /= _read(records[v["over"]["run"]], v["over"]["policy"], v["read"], exclude)
        else:
            o.value *= UNITS[v.get("unit", "B")] * v.get("per_sample", 1)
            o.fits = _fits(records[v["run"]], v["policy"]) if "peak" in case["family"] else None
    except (LookupError, KeyError, ZeroDivisionError, json.JSONDecodeError) as exc:
        o.value, o.why = None, str(exc)
    return o


# --- judging ------------------------------------------------------------------------------------------------------
def bands(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    """Each family's band: the largest error of its answered held-out cases (but those kept ``outside_band``), rounded
    up to a whole percent."""
    out = {}
    for fam in FAMILIES:
        errs = [abs(o.error) for o in outcomes if o.family == fam and o.held_out and o.error is not None
                and not o.case.get("outside_band")]
        if errs:
            out[fam] = {"band": math.ceil(round(max(errs) * 100, 6)) / 100, "held_out": len(errs),
                        "median": round(statistics.median(errs), 4), "what": FAMILIES[fam][0]}
    return out


def failures(outcomes: list[Outcome], current_bands: dict[str, Any] | None) -> list[str]:
    """What the gate fails on (nothing: it passes)."""
    out = []
    for o in outcomes:
        c, rec = o.case, o.case.get("recorded")
        if o.value is None:
            if rec is not None:
                out.append(f"{c['id']}: answered before ({rec:.4g}), no answer now: {o.why}")
            continue
        if o.held_out and o.within is False and not c.get("known_miss"):
            err = f"{o.error:+.1%}" if o.error is not None else f"{o.value:.3g}, expected {c['expect']} 1"
            out.append(f"{c['id']}: held out, outside its tolerance (±{o.tolerance:.0%}): {err}")
        if rec is None:
            out.append(f"{c['id']}: answers ({o.value:.4g}) but has no recorded value: record it with --write")
        elif abs(o.value / rec - 1) > MOVED:
            out.append(f"{c['id']}: {c['role']} case moved from {rec:.4g} to {o.value:.4g} ({o.value / rec - 1:+.1%}):"
                       " if the change is meant, record it with --write and say why in the commit")
    if current_bands is not None:
        fresh = {k: v["band"] for k, v in bands(outcomes).items()}
        kept = {k: v["band"] for k, v in current_bands.items()}
        if fresh != kept:
            out.append(f"the bands in {BANDS.relative_to(ROOT)} ({kept}) are not the evidence's ({fresh}): --write")
    return out


def summary(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    rows = []
    for fam, (what, _) in FAMILIES.items():
        mine = [o for o in outcomes if o.family == fam]
        if not mine:
            continue
        held = [abs(o.error) for o in mine if o.held_out and o.error is not None]
        dirs = [o.direction for o in mine if o.direction is not None]
        rows.append({"family": fam, "what": what, "cases": len(mine),
                     "answered": sum(o.value is not None for o in mine),
                     "held_out": sum(o.held_out for o in mine), "held_errors": len(held),
                     "median": statistics.median(held) if held else None, "largest": max(held) if held else None,
                     "within": sum(bool(o.within) for o in mine if o.held_out),
                     "direction": (sum(dirs), len(dirs))})
    return rows


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def print_summary(outcomes: list[Outcome]) -> None:
    print(f"{'family':12s} {'answered':>9s} {'held out':>9s} {'within':>7s} {'median':>7s} {'largest':>8s} "
          f"{'direction':>9s}")
    for r in summary(outcomes):
        right, n = r["direction"]
        print(f"{r['family']:12s} {r['answered']:>4d} / {r['cases']:<2d} {r['held_out']:>9d} {r['within']:>7d} "
              f"{_pct(r['median']):>7s} {_pct(r['largest']):>8s} {f'{right} / {n}' if n else '—':>9s}")
    for o in outcomes:
        if o.value is None:
            print(f"  no answer: {o.case['id']}: {o.why}")
        elif o.held_out and o.within is False:
            print(f"  outside: {o.case['id']}: {_shown(o)}" + (" (a known miss: the case says why)"
                                                             if o.case.get("known_miss") else ""))


def _shown(o: Outcome) -> str:
    if o.case.get("published") is None:
        return f"{o.value:.3g} (published: {o.case['expect']} 1)"
    return f"{o.value:.4g} against {o.case['published']:g} ({o.error:+.1%})"


# --- writing ------------------------------------------------------------------------------------------------------
def record(outcomes: list[Outcome]) -> None:
    """Today's values into the case files (``recorded``), formatting kept."""
    by_file: dict[str, dict[str, float | None]] = {}
    for o in outcomes:
        by_file.setdefault(o.file, {})[o.case["id"]] = None if o.value is None else float(f"{o.value:.6g}")
    for file, values in by_file.items():
        path = CASES / file
        data = json.loads(path.read_text())
        for c in data["cases"]:
            if c["id"] in values:
                c["recorded"] = values[c["id"]]
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def write_report(outcomes: list[Outcome], runs: dict[str, dict[str, Any]]) -> None:
    from validation_report import plot, report  # beside this file

    BANDS.write_text(json.dumps(bands(outcomes), indent=1) + "\n")
    plot(outcomes, PLOT)
    REPORT.write_text(report(outcomes, summary(outcomes), bands(outcomes), runs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="the gate: exit 1 on a failure (printed)")
    ap.add_argument("--write", action="store_true", help="record the values, the bands and the report")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="forecasts at once")
    ap.add_argument("--family", default="", help="only these families (comma-separated)")
    ap.add_argument("--cases", default=str(CASES), help="a folder of case files (tests plant one)")
    args = ap.parse_args(argv)
    try:
        files = sorted(Path(args.cases).glob("*.json"))
        if not files:
            raise CaseError(f"--cases {args.cases}: no case files (*.json) there")
        runs, cases = load(files)
    except CaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.family:
        keep = set(args.family.split(","))
        cases = [(c, f) for c, f in cases if c["family"] in keep]
    needed = {f"{f}/{part['run']}" for c, f in cases for part in (c["value"], c["value"].get("over")) if part}
    runs = {k: v for k, v in runs.items() if k in needed}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dtypelab-validate-") as tmp:
        print(f"{len(cases)} cases, {len(runs)} forecasts, {args.jobs} at a time", file=sys.stderr)
        try:
            run_all(runs, args.jobs, Path(tmp))
        except KeyboardInterrupt:  # the forecasts' records are temporary: nothing is recorded half-way
            print("interrupted: nothing was recorded or judged", file=sys.stderr)
            return 130
        outcomes = [evaluate(c, f, runs) for c, f in cases]
    print(f"{time.perf_counter() - start:.0f} s")
    print_summary(outcomes)
    if args.write:
        record(outcomes)
        write_report(outcomes, runs)
        print(f"recorded; wrote {BANDS.relative_to(ROOT)}, {REPORT.relative_to(ROOT)}, {PLOT.relative_to(ROOT)}")
    if args.check:
        whole = not args.family and Path(args.cases).resolve() == CASES  # the bands are the whole set's
        kept = json.loads(BANDS.read_text()) if BANDS.exists() and whole else None
        failed = failures(outcomes, kept)
        for line in failed:
            print(f"FAIL {line}")
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
