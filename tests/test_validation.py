"""The validation set (benchmarks/validation), its runner and gate (benchmarks/validate.py) and the bands it gives
the forecasts (core.bands)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import validate  # noqa: E402

from dtypelab.core import bands as core_bands  # noqa: E402


def test_the_set_is_large_mostly_held_out_and_covers_every_family():
    runs, cases = validate.load()
    held = [c for c, _ in cases if c["role"] == "held-out"]
    assert len(cases) >= 40 and len(held) >= 0.6 * len(cases)
    for family in validate.FAMILIES:
        assert any(c["family"] == family for c in held), family
    for c, _ in cases:
        assert c["source"] and c["conditions"], c["id"]
        assert c.get("recorded") is not None or c.get("known_miss"), f"{c['id']}: run --write"
    # every run a case reads is defined, and every defined run is read by some case
    read = {f"{f}/{p['run']}" for c, f in cases for p in (c["value"], c["value"].get("over")) if p}
    assert read == set(runs)


def _outcome(value, published=1.2, role="held-out", recorded=None, **extra):
    case = {"id": "x", "family": "train-speed", "role": role, "published": published, "recorded": recorded,
            "value": {"kind": "ratio"}, **extra}
    return validate.Outcome(case, "f.json", value=value, why="" if value is not None else "it failed")


def test_the_gate_fails_on_each_thing_it_guards():
    assert validate.failures([_outcome(1.25, recorded=1.25)], None) == []
    out_of_tolerance = validate.failures([_outcome(2.0, recorded=2.0)], None)
    assert len(out_of_tolerance) == 1 and "outside its tolerance" in out_of_tolerance[0]
    assert validate.failures([_outcome(2.0, recorded=2.0, known_miss="why")], None) == []
    stopped = validate.failures([_outcome(None, recorded=1.25)], None)
    assert len(stopped) == 1 and "no answer now" in stopped[0]
    moved = validate.failures([_outcome(1.3, role="fitted", recorded=1.25)], None)
    assert len(moved) == 1 and "moved" in moved[0]
    assert "no recorded value" in validate.failures([_outcome(1.25)], None)[0]
    stale = validate.failures([_outcome(1.25, recorded=1.25)], {"train-speed": {"band": 0.5}})
    assert len(stale) == 1 and "bands" in stale[0]


def test_direction_cases_and_bands():
    above = _outcome(1.1, published=None, expect="above", recorded=1.1)
    assert above.within and above.direction and validate.failures([above], None) == []
    wrong = _outcome(0.9, published=None, expect="above", recorded=0.9)
    assert wrong.within is False and "outside" in validate.failures([wrong], None)[0]
    # the band: the largest held-out error, rounded up to a whole percent; fitted cases and no-answers left out
    got = validate.bands([_outcome(1.26), _outcome(1.32, published=1.25), _outcome(2.0, role="fitted"),
                          _outcome(None)])
    assert got["train-speed"]["band"] == 0.06 and got["train-speed"]["held_out"] == 2
    # a ratio within 3% of 1 is neither faster nor slower: a forecast of 1.16 against a published 0.997 is wrong
    assert _outcome(1.16, published=0.997).direction is False
    assert _outcome(1.02, published=0.997).direction is True


def test_a_bad_case_file_is_refused_in_one_line(tmp_path):
    data = json.loads((validate.CASES / "kv-cache.json").read_text())
    bad = copy.deepcopy(data)
    bad["cases"][0]["family"] = "vibes"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(validate.CaseError, match="unknown family 'vibes'"):
        validate.load([tmp_path / "bad.json"])
    bad = copy.deepcopy(data)
    bad["cases"][0]["role"] = "fitted"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(validate.CaseError, match="say which constant"):
        validate.load([tmp_path / "bad.json"])
    assert validate.main(["--cases", str(tmp_path)]) == 2
    assert validate.main(["--cases", str(tmp_path / "none")]) == 2  # no case files there: refused, not the set


def test_the_forecasts_carry_the_bands_the_evidence_gives():
    from dtypelab.core.results import TargetDevice
    from dtypelab.forecasting.timing import memory_error, speedup_error

    table = json.loads(validate.BANDS.read_text())
    assert set(table) == set(validate.FAMILIES)
    gpu, cpu = TargetDevice("H100", "H100", "cuda"), TargetDevice("cpu", "cpu", "cpu")
    assert speedup_error(gpu) == table["train-speed"]["band"] == core_bands.band("train-speed")
    assert memory_error(gpu) == table["train-peak"]["band"] and memory_error(cpu) == 0.0
    assert speedup_error(cpu) == 0.20  # the CPU's own self-check bound, not the GPUs' evidence


def test_a_serving_tie_goes_to_the_wider_weights():
    from dtypelab.core.results import GenerateFigures, GeneratePolicy
    from dtypelab.serving.forecast import _tied
    from dtypelab.serving.workload import Shape

    def pol(name, tok_s, weights):
        return GeneratePolicy(name, name, "ok", generate=GenerateFigures(decode_tok_s=tok_s, weights_bytes=weights))

    shape = Shape(5, 200, 1)
    best, tied = _tied([pol("bf16", 100, 16), pol("int8-wo", 110, 8), pol("int4-wo", 200, 4)], "decode", shape, 0.1)
    assert best.policy == "int4-wo" and tied == []  # 200 is beyond 110's band
    best, tied = _tied([pol("bf16", 100, 16), pol("int8-wo", 110, 8)], "decode", shape, 0.1)
    assert best.policy == "bf16" and [t.policy for t in tied] == ["int8-wo"]


@pytest.mark.e2e
@pytest.mark.validation
def test_the_gate_passes_on_the_set_and_fails_on_a_planted_regression(tmp_path):
    """The whole set as CI runs it; then one case file planted with a value the forecast no longer gives."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "validate.py"), "--check"], capture_output=True,
                          text=True, cwd=ROOT, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    data = json.loads((validate.CASES / "kv-cache.json").read_text())
    data["cases"] = [c for c in data["cases"] if c["id"] == "vllm-paper-opt-13b-kv-per-token"]
    data["runs"] = {"opt-13b": data["runs"]["opt-13b"]}
    data["cases"][0]["recorded"] *= 1.25  # as if a change had moved the forecast by a fifth
    (tmp_path / "planted.json").write_text(json.dumps(data))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "validate.py"), "--check", "--cases",
                           str(tmp_path), "--family", "kv-bytes"], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert done.returncode == 1 and "FAIL vllm-paper-opt-13b-kv-per-token" in done.stdout, done.stdout
