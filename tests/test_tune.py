"""dtypelab tune (inference): a real, if tiny, search; its plan file; apply_plan → export → load gives the same
outputs; a plan naming modules the model lacks is a clear error."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import TINY, avx2_hardware, fake_hardware
from torch import nn

import dtypelab
from dtypelab.core.policies import Cast, Plan, Quantize
from dtypelab.render.tables import markdown_table
from dtypelab.render.tune import tune_doc


def test_the_search_stops_at_its_time_budget_with_the_best_plan_measured_by_then():
    from dtypelab.tuning.search import Evaluation, LayerScore, search

    layers = [LayerScore(n, 0.0, 0.01) for n in "abcd"]

    def infeasible(chosen):  # nothing keeps the constraint: the count budget alone would allow many evaluations
        return Evaluation(chosen, 1.5, 0.5, len(chosen) < 1, low=1.4, high=1.6)

    free = search(layers, infeasible)
    assert len(free.evaluations) > 1 and not free.out_of_time
    late = search(layers, infeasible, stop=lambda: True)
    assert len(late.evaluations) == 1 and late.out_of_time  # the first evaluation is always made


def test_the_time_budget_covers_the_whole_command_and_keeps_room_for_what_follows_the_search():
    import time

    from dtypelab.tuning.search import Evaluation, Limit

    assert Limit(None).stop() is None  # no budget: the count alone bounds the search
    limit = Limit(100.0)
    assert not limit.stop()()  # nothing measured yet: the first evaluation is always allowed
    limit.took.append(10.0)
    assert not limit.stop(after=8)()  # 9 evaluations of 10 s fit in the 100 s left
    assert limit.stop(after=10)()  # 11 do not: the last would end past the budget
    assert not limit.stop(share=0.5, after=3)() and limit.stop(share=0.5, after=5)()  # half the time: 5 at most
    late = Limit(100.0, began=time.monotonic() - 95.0)  # time spent before the search (loading, scoring) counts
    late.took.append(10.0)
    assert late.stop()()
    timed = late.timed(lambda chosen: Evaluation(chosen, 1.0, 1.0, True))
    timed(frozenset())
    assert len(late.took) == 2 and late.took[-1] < 1.0


def test_tune_says_when_its_time_budget_cut_the_search(tmp_path):
    report = dtypelab.tune(f"{TINY}:make_task", candidates="int8-dyn", min_cosine=0.999999, budget=0.001,
                           hardware=fake_hardware(int8=250.0))
    assert len(report.evaluations) == 1
    said = "The search stopped at the time budget (0.001 s for the whole command) after 1 of at most"
    assert any(n.startswith(said) for n in report.notes)
    with pytest.raises(Exception, match="bad budget"):
        dtypelab.tune(f"{TINY}:make_task", budget="soon")


def test_tune_on_a_tiny_model_writes_a_plan_that_bench_and_export_take(tmp_path):
    plan_file, record = tmp_path / "plan.json", tmp_path / "tune.json"
    report = dtypelab.tune(f"{TINY}:make_task", candidates="int8-dyn,bf16", min_cosine=0.99,
                           output=str(plan_file), json_path=str(record), hardware=fake_hardware(int8=250.0))
    assert {layer.name for layer in report.layers} == {"net.0", "net.2"}
    assert len(report.evaluations) <= report.config.budget and len(report.uniform) == 2
    assert report.evaluations and all(e.fidelity <= 1.0 + 1e-9 for e in report.evaluations)
    assert report.fidelity >= 0.99  # what was chosen was measured, and it keeps the constraint
    plan = dtypelab.load_plan(str(plan_file))
    assert {p for p, _ in plan.rules} == {layer.name for layer in report.layers if layer.chosen}
    assert dtypelab.load_record(str(record)) == report  # JSON round trip
    bench = dtypelab.bench(f"{TINY}:make_task", "fp32", plan=str(plan_file), mode="infer", launcher="inline",
                           rounds=0, steps=5)
    assert all(r.status == "ok" for r in bench.results) and len(bench.results) == 2


def test_apply_export_load_give_identical_outputs(tmp_path):
    plan = Plan(Cast("float32"), (("net.0", Quantize("int8-dynamic")),), name="mixed")
    plan_file = tmp_path / "mixed.json"
    plan_file.write_text(plan.to_json())
    task = dtypelab.load_task(f"{TINY}:make_task")
    torch.manual_seed(3)
    weights = tmp_path / "fp32.pt"
    torch.save(task.make_model().state_dict(), weights)
    out = tmp_path / "m.safetensors"
    dtypelab.export(f"{TINY}:make_task", str(plan_file), str(out), weights=str(weights))
    loaded, meta = dtypelab.load_exported(str(out), task=f"{TINY}:make_task")  # a task file: named by the caller
    mine = task.make_model()
    mine.load_state_dict(torch.load(weights, weights_only=True))
    applied = dtypelab.apply_plan(mine.eval(), str(plan_file))
    x = task.inference_inputs(16)
    with torch.no_grad():
        assert torch.equal(applied(x), loaded(x))
    assert meta["plan"]["rules"][0]["pattern"] == "net.0"


def test_apply_plan_converts_my_model_and_names_missing_modules():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(4, 8)
    ref = model(x)
    mixed = dtypelab.apply_plan(model, {"default": "fp32", "rules": {"0": "int8-dyn"}})
    # the rule's layer holds torchao's int8 weights; the other keeps its float32 Parameter
    assert type(mixed[0].weight).__name__ == "Int8Tensor" and mixed[0].weight.dtype == torch.float32
    assert type(mixed[2].weight) is torch.nn.Parameter and mixed[2].weight.dtype == torch.float32
    got = mixed(x)
    assert got.dtype == torch.float32 and torch.nn.functional.cosine_similarity(got, ref).min() > 0.99
    with pytest.raises(dtypelab.DtypelabError, match=r"no module matches 'encoder\.layer\.0'"):
        dtypelab.apply_plan(nn.Linear(2, 2), {"default": "fp32", "rules": {"encoder.layer.0": "bf16"}})
    amp = dtypelab.apply_plan(nn.Linear(8, 2), "amp-bf16")
    assert amp(x).dtype == torch.bfloat16  # the forward runs under the plan's autocast


def test_tune_refuses_what_it_cannot_do_in_one_line():
    with pytest.raises(dtypelab.DtypelabError,
                       match=r"mode: must be one of 'infer', 'train' or 'generate', got 'fit' \(--mode\)"):
        dtypelab.tune("digits", mode="fit")
    with pytest.raises(dtypelab.DtypelabError, match="whole-model cast, autocast or float8"):
        dtypelab.tune("digits", mode="train", candidates="int8-dyn")
    with pytest.raises(dtypelab.DtypelabError, match="bad tolerance"):
        dtypelab.tune("digits", mode="train", tolerance="a lot")
    with pytest.raises(dtypelab.DtypelabError, match="at least 2"):
        dtypelab.tune("digits", mode="train", steps=1)
    with pytest.raises(dtypelab.DtypelabError, match="min-cosine"):
        dtypelab.tune("digits", min_cosine=1.5)
    with pytest.raises(dtypelab.DtypelabError, match="not a plan"):
        dtypelab.tune("digits", candidates="fp32+compile")


@pytest.mark.slow
def test_tune_cli(tmp_path, fast_bf16_env):
    from test_cli import dtypelab as cli

    plan, record = tmp_path / "p.json", tmp_path / "t.json"
    env = fast_bf16_env
    run = cli("tune", f"{TINY}:make_task", "--candidates", "int8-dyn", "--min-cosine", "0.99", "-o", str(plan),
              "--json", str(record), env=env)
    assert run.returncode == 0, run.stderr
    assert "chosen plan:" in run.stdout and "full evaluations (at most" in run.stdout and plan.exists()
    # no terminal: the progress is lines with the seconds since the start, each full evaluation said
    assert re.search(r"\[\s+\d+ s\] full evaluation 1 of at most \d+: \d+ layers? converted", run.stderr), run.stderr
    shown = cli("show", str(record), "--format", "markdown", env=env)
    assert shown.returncode == 0 and "| net.0 |" in shown.stdout
    page = tmp_path / "t.html"
    assert cli("report", str(record), "-o", str(page)).returncode == 0
    assert "dtypelab tune" in page.read_text()
    bad = cli("tune", f"{TINY}:make_task", "--mode", "train", "--candidates", "int8-dyn")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "whole-model cast, autocast or float8" in bad.stderr


def test_training_tune_finds_the_planted_layer_and_keeps_it_an_fp32_island(tmp_path):
    """tiny-recenter's layer 2 computes (x + 1000) - 1000: converted to bf16 alone it wipes out its input; the
    other layers are harmless. Whatever this CPU's bf16 speed, the probe must rank it most sensitive, every plan
    that converts it must fail the metric, and a chosen plan (where bf16 pays) must keep it in fp32."""
    plan_file, record = tmp_path / "plan.json", tmp_path / "tune.json"
    report = dtypelab.tune(f"{TINY}:make_recenter_task", mode="train", candidates="bf16", tolerance="5%",
                           output=str(plan_file), json_path=str(record), hardware=fake_hardware())
    sens = {layer.name: layer.sensitivity for layer in report.layers}
    assert set(sens) == {"0", "2", "3"} and sens["2"] > 20 * max(sens["0"], sens["3"])
    assert 0 < len(report.evaluations) <= report.config.budget == 3 + 3
    assert all(not e.feasible for e in report.evaluations if "2" in e.layers)
    assert any(e.feasible for e in report.evaluations)  # the search measured plans that keep the metric
    assert [u.feasible for u in report.uniform] == [False]  # bf16 everywhere breaks it
    assert dtypelab.load_record(str(record)) == report
    text = markdown_table(*tune_doc(report))
    assert "training (30 steps)" in text


@pytest.mark.parametrize("measured", [1.5, 0.8])
def test_a_training_plan_is_written_only_where_it_was_measured_faster(measured, tmp_path, monkeypatch):
    """The speed this CPU happens to have decides nothing here: every plan is timed as ``measured`` x fp32's speed.
    Faster, the plan keeps the sensitive layer '2' in fp32 and the metric; slower, fp32 is kept and said why."""
    from dtypelab.core.stats import Interval
    from dtypelab.tuning import train as tuning_train
    from dtypelab.tuning.timing import Paired

    def timed(base, other, *args, **kwargs):
        ratio = 1.0 if other is base else measured
        return Paired(0.01, 0.01 / ratio, Interval(ratio, ratio * 0.95, ratio * 1.05, 10))

    monkeypatch.setattr(tuning_train, "paired", timed)
    plan_file = tmp_path / "plan.json"
    report = dtypelab.tune(f"{TINY}:make_recenter_task", mode="train", candidates="bf16", tolerance="5%",
                           output=str(plan_file), hardware=fake_hardware())
    plan = dtypelab.load_plan(str(plan_file))
    if measured > 1:
        assert report.speedup == pytest.approx(1.5)
        assert plan.default == Cast("bfloat16") and ("2", Cast("float32")) in plan.rules
        assert report.fidelity >= report.config.base_metric * 0.95
        assert "fp32 islands" in markdown_table(*tune_doc(report))
    else:
        assert plan.default == Cast("float32") and not plan.rules
        assert report.explanation.startswith("No plan measured")


def test_an_fp32_island_keeps_its_parameters_and_rescues_the_metric():
    island = Plan(Cast("bfloat16"), (("2", Cast("float32")),), name="bf16-island")
    task = dtypelab.load_task(f"{TINY}:make_recenter_task")
    model = dtypelab.Precision(island).convert_module(task.make_model())
    assert model[0].weight.dtype == torch.bfloat16 and model[2].shift.dtype == torch.float32
    assert model(torch.randn(4, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16  # cast back for the next layer
    report = dtypelab.bench(f"{TINY}:make_recenter_task", ["fp32", "bf16", island], isolate=False, rounds=0,
                            hardware=fake_hardware())
    acc = {r.policy: r.metric("accuracy") for r in report.results}
    assert acc["bf16"] < acc["fp32"] - 0.2 and acc["bf16-island"] >= acc["fp32"] - 0.05


def test_the_cosine_constraint_has_a_meaning_for_one_output_value_per_sample():
    from dtypelab.inference.fidelity import compare
    from dtypelab.tuning.infer import output_cosine

    g = torch.Generator().manual_seed(0)
    scalar = torch.randn(64, generator=g)  # a regression's predictions: no per-sample cosine exists
    assert output_cosine(scalar, scalar + 1e-3 * torch.randn(64, generator=g)) > 0.9999
    assert output_cosine(scalar, scalar + torch.randn(64, generator=g)) < 0.9
    assert output_cosine(scalar, -scalar) < -0.99
    vectors = torch.randn(8, 4, generator=g)  # per-sample vectors: the worst sample's cosine, as bench reports
    noisy = vectors + 0.1 * torch.randn(8, 4, generator=g)
    assert output_cosine(vectors, noisy) == pytest.approx(compare(vectors, noisy)["cos_min"])
    assert output_cosine(vectors, torch.zeros(3)) == 0.0  # outputs of another shape keep nothing


def test_where_every_candidate_is_slow_tune_keeps_fp32_in_a_record_and_force_searches(tmp_path):
    """On the AVX2-only CPU bf16 and amp-bf16 are ~118x slower: that is the answer (keep fp32), not an error."""
    record = tmp_path / "t.json"
    report = dtypelab.tune(f"{TINY}:make_recenter_task", mode="train", hardware=avx2_hardware(),
                           json_path=str(record))
    assert report.plan["rules"] == [] and report.plan["default"]["dtype"] == "float32" and not report.evaluations
    assert report.explanation.startswith("Keep fp32: every candidate is measured pathologically slow here")
    assert "bf16: left out, this CPU has no native bfloat16 arithmetic" in " ".join(report.notes)
    assert dtypelab.load_record(str(record)).to_json() == report.to_json()  # its metric is NaN: nothing trained
    text = markdown_table(*tune_doc(report))
    assert "nothing was searched" in text and "--force searches" in text
    forced = dtypelab.tune(f"{TINY}:make_recenter_task", mode="train", candidates="bf16", steps=10,
                           hardware=avx2_hardware(), force=True)
    assert forced.evaluations and not any("left out" in n for n in forced.notes)


def test_a_candidate_equal_to_the_default_is_no_conversion(tmp_path):
    plan_file = tmp_path / "p.json"
    report = dtypelab.tune(f"{TINY}:make_task", candidates="fp32,int8-dyn", min_cosine=0.9, output=str(plan_file),
                           hardware=fake_hardware(int8=250.0))
    assert report.config.candidates == ("int8-dyn",) and any("fp32: left out" in n for n in report.notes)
    assert all(rule["config"]["kind"] != "cast" for rule in report.plan["rules"])  # never a rule restating fp32
    assert all(c != "fp32" for layer in report.layers for c, _, _ in layer.tried)
    with pytest.raises(dtypelab.DtypelabError, match="no candidate to convert to"):
        dtypelab.tune(f"{TINY}:make_task", candidates="fp32", hardware=fake_hardware())


def test_a_plan_is_chosen_only_when_its_interval_says_faster():
    from dtypelab.tuning.search import Evaluation, LayerScore, search

    layers = [LayerScore("a", 0.0, 0.01), LayerScore("b", 0.0, 0.01)]

    def noisy(chosen):  # 1.05x measured, but the interval reaches below the 1.02 band: not measurably faster
        return Evaluation(chosen, 1.05, 1.0, True, low=0.97, high=1.13)

    assert search(layers, noisy).best is None

    def clear(chosen):
        return Evaluation(chosen, 1.05, 1.0, True, low=1.03, high=1.07)

    assert search(layers, clear).best is not None


def test_tune_measures_again_under_disturbance_and_names_it(monkeypatch):
    from dtypelab.core.disturbance import Disturbance
    from dtypelab.tuning import timing

    class Busy:
        def start(self):
            pass

        def stop(self):
            return Disturbance(wall_s=1.0, other_cpu_s=0.9, steal_s=0.0, pressure_s=0.5, involuntary_switches=3)

    attempts = []
    real = timing.StepTimer

    def counting(*a, **k):
        attempts.append(1)
        return real(*a, **k)

    monkeypatch.setattr(timing, "CpuMeter", Busy)
    monkeypatch.setattr(timing, "StepTimer", counting)
    report = dtypelab.tune(f"{TINY}:make_task", candidates="int8-dyn", min_cosine=0.9,
                           hardware=fake_hardware(int8=250.0))
    assert report.evaluations and all(e.disturbed.startswith("other processes used 0.90 of a core")
                                      for e in report.evaluations)
    assert any(n.startswith("Disturbance: other processes used the CPU during") for n in report.notes)
    measurements = len(attempts) // 2  # two timers per measurement
    assert measurements >= (1 + timing.RETRIES) * len(report.evaluations)
    assert measurements % (1 + timing.RETRIES) == 0  # every measurement was taken again, RETRIES times


def test_where_no_plan_keeps_the_constraint_the_record_says_why_in_the_constraints_terms():
    """An unreachable cosine (int8 never gives exactly fp32's outputs): fp32 is kept, and the explanation gives
    each uniform candidate's worst cosine (not a bare number) and the probe figure for that candidate's own
    kernel (fbgemm's linear for the legacy policy, not torchao's int8 matmul)."""
    report = dtypelab.tune(f"{TINY}:make_task", candidates="int8-dyn-legacy", min_cosine=1.0,
                           hardware=fake_hardware(int8=250.0, int8_fbgemm=150.0))
    assert report.speedup == 1.0 and not any(layer.chosen for layer in report.layers)
    why = report.explanation
    assert why.startswith("No plan measured") and "a worst output cosine of 1" in why
    assert "int8-dyn-legacy on every layer it applies to:" in why and ", worst cosine 0.9" in why
    assert "fbgemm" in why and "_int_mm" not in why
    front = [n for n in tune_doc(report)[3] if n.startswith("Pareto front seen")]
    assert all(re.fullmatch(r"\d+\.\d\dx/[01]\.\d{5}", e) for n in front for e in n.split(": ")[1].split(", "))
