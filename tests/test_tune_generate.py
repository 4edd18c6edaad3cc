"""tune --mode generate: the frontier search checked by brute force (random tables and one measured on tinylm), the
units vLLM fuses, and the command end to end."""

from __future__ import annotations

import random

import pytest

from dtypelab.tuning.generate import Unit, best_within, brute_force, frontier, tune_generate, units


def _random_table(rng: random.Random, n: int) -> list[Unit]:
    out = []
    for i in range(n):
        b = rng.randint(1000, 5000)
        out.append(Unit(f"u{i}", (f"u{i}",), {
            "bf16": (0.0, b / 1e9, b),
            "w8": (rng.uniform(0, 1e-3), b / 2 / 0.86e9, b // 2),
            "w4": (rng.uniform(0, 5e-3), b / 4 / 0.8e9, b // 4)}))
    return out


@pytest.mark.parametrize("objective", ["speed", "memory"])
def test_the_frontier_search_equals_brute_force(objective):
    rng = random.Random(0)
    for trial in range(60):
        table = _random_table(rng, rng.randint(1, 6))
        budget = rng.uniform(0, 0.02)
        got = best_within(frontier(table, objective), budget, objective)
        want = brute_force(table, budget, objective)
        key = (lambda p: (p[1], p[2])) if objective == "speed" else (lambda p: (p[2], p[1]))
        assert (got is None) == (want is None), trial
        if got is not None:
            assert key(got) == pytest.approx(key(want)), trial


def test_units_are_what_vllm_fuses():
    from dtypelab.serving import load_served

    got = units(load_served("tinylm").make_model())
    assert len(got) == 16 and got[0] == ("model.layers.0.self_attn.q_proj+k_proj+v_proj", (
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"))
    assert ("model.layers.0.mlp.down_proj", ("model.layers.0.mlp.down_proj",)) in got
    assert not any("lm_head" in n for n, _ in got)


@pytest.mark.slow
def test_tune_generate_on_tinylm_is_brute_forces_plan_and_holds_its_budget():
    budget = 0.001
    report = tune_generate("tinylm", "w4a16-rtn,w8a16-rtn", "h100", budget, "speed", 0, lambda s: None)
    table = [Unit(u.name, u.layers, {c.choice: (c.kl, c.seconds, c.bytes) for c in u.choices})
             for u in report.units]
    # the measured table's first two layers (3^8 plans): the search is brute force's
    head = table[:8]
    for b in (0.0002, 0.0005, 0.001):
        got, want = best_within(frontier(head), b), brute_force(head, b)
        assert got is not None and want is not None and got[1] == pytest.approx(want[1])
    # the plan chosen is the whole frontier's best within the budget, and measured whole it holds the budget
    assert report.measured_kl is not None and report.measured_kl <= budget
    if len(report.tried) == 1:
        assert tuple(u.chosen for u in report.units) == best_within(frontier(table), budget)[3]
    assert any(u.chosen != "bf16" for u in report.units) and any(u.chosen == "bf16" for u in report.units)


def test_the_plan_record_saves_loads_and_draws(tmp_path):
    from dtypelab.core.records import load_record
    from dtypelab.core.results import FrontierPoint, GeneratePlanReport, PlanChoice, PlanUnit
    from dtypelab.render.drawing import document_of, section_of

    unit = PlanUnit("model.layers.0.mlp.down_proj", ("model.layers.0.mlp.down_proj",),
                    (PlanChoice("bf16", 0.0, 2e-8, 1000), PlanChoice("w4a16-gptq", 1e-4, 6e-9, 280)), "w4a16-gptq")
    report = GeneratePlanReport("tinylm", "tinylm", "NVIDIA H100 80GB", "speed", 0.001, (unit,),
                                (FrontierPoint(0.0, 1.0, 1.0, False), FrontierPoint(1e-4, 3.3, 0.28, True)),
                                {"default": {"kind": "cast", "dtype": "bfloat16"}}, 1.2e-4, (("w4a16-gptq", 1.2e-4),))
    path = str(tmp_path / "plan-record.json")
    report.save(path)
    loaded = load_record(path)
    assert loaded == report
    doc, _, _ = document_of(loaded)(loaded, 0)
    assert "layers.0.mlp.down_proj" in str(doc) and "KL 0.00012 nats measured" in str(doc)
    assert "tinylm" in section_of(loaded)(loaded, "k", None)
