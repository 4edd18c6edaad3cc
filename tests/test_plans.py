"""Policies as configs and per-module plans, self-describing records (old files included), the memory
window, and result-file names."""

from __future__ import annotations

import glob
import json
import math
import os
import pickle
import tempfile

import pytest
import torch
from conftest import HERE, TINY, fake_hardware
from test_policies import global_state

import dtypelab
from dtypelab import TF32, Autocast, Cast, DtypelabError, Plan, Precision, Quantize, get_policy
from dtypelab.core.policies import REGISTRY, register
from dtypelab.core.records import load_record
from dtypelab.core.results import Report, default_result_path
from dtypelab.core.results.bench import BENCH_VERSION
from dtypelab.render.bench import render_html, render_markdown
from dtypelab.sweep.job import Job, run_job

V1 = os.path.join(HERE, "data", "v1")


# --- records ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bench_train", "bench_infer", "audit", "trace", "trace_clean", "forecast",
                                  "forecast_check", "forecast_gpus"])
def test_files_written_by_version_1_render_as_before(name):
    """Rendered by the code before configs and plans. What reads differently now: 2.63x slower than fp32 (0.38x
    its speed), not 0.38x slower; a metric that moved the good way is 'better than fp32' / 'equal to fp32', not
    'within 1%', and a sentence says the tolerance is one-sided; the verdict column is short ('within 1%', 'cosine
    0.9771 < 0.99': the metric is the column beside it) and the HTML's tables scroll inside the page."""
    from dtypelab.core.results import ForecastReport
    from dtypelab.render.forecast import check_docs, forecast_doc
    from dtypelab.render.numeric import audit_doc, emit
    from dtypelab.render.trace import trace_doc

    record = load_record(os.path.join(V1, f"{name}.json"))
    for fmt in ("markdown", "html"):
        with open(os.path.join(V1, f"{name}.{fmt}")) as f:
            expected = f.read()
        if isinstance(record, ForecastReport):  # its table, then --check's beside the measured steps
            got = "".join(emit(part, fmt, None) for part in [forecast_doc(record), *check_docs(record)])
        elif isinstance(record, Report):
            got = render_markdown(record) if fmt == "markdown" else render_html(record)
        elif name == "audit":
            doc, styles, wrap = audit_doc(record, 0)
            got = emit(doc, fmt, None, styles, wrap)
        else:
            got = emit(trace_doc(record), fmt, None, wrap={1})
        assert got == expected


def test_show_prints_every_table_a_record_kind_registers(capsys):
    """A forecast registers two tables under its own (--check's beside the measured steps, and the times): `show`
    prints both (the second registration once replaced the first, and --check's table was in the JSON alone)."""
    from dtypelab.cli._common import emit
    from dtypelab.render.drawing import more_of
    from dtypelab.render.forecast import check_docs

    record = load_record(os.path.join(V1, "forecast_check.json"))
    titles = [doc[0] for doc in more_of(record)]
    assert check_docs(record)[0][0] in titles
    emit(record, "markdown")
    assert "dtypelab forecast --check: the forecast beside the same steps run here" in capsys.readouterr().out


def test_a_version_5_records_adapters_inputs_become_a_labelled_part_and_render_as_before(tmp_path):
    """Version 5 held LoRA's adapters' inputs as a field of the memory breakdown; version 6 holds every kind's parts
    as labelled data. A version-5 record reads as a part and its table keeps the column and its note."""
    import json

    from dtypelab.render.bench import render

    d = load_record(os.path.join(V1, "bench_train.json")).to_dict()
    memory = {"frozen_weights": 4096, "parameters": 512, "gradients": 512, "optimizer_state": 1024,
              "master_weights": 0, "activations": 2048, "adapter_inputs": 768, "total": 8192}
    for r in d["results"]:
        r["memory"] = {**memory, "frozen_weights": 0, "adapter_inputs": 0} if r["policy"] == "fp32" else memory
    d["schema_version"] = 5
    path = tmp_path / "v5.json"
    path.write_text(json.dumps(d))
    report = load_record(str(path))
    part = report.result("bf16").memory["parts"]
    assert part == [{"label": "adapters' inputs", "bytes": 768, "note": part[0]["note"]}]
    assert "adapter_inputs" not in report.result("bf16").memory and "LoRA's adapters keep" in part[0]["note"]
    text = render(report, "markdown")
    assert "adapters' inputs: of the activations, what LoRA's adapters keep for their backward" in text
    header = next(line for line in text.splitlines() if line.startswith("|") and "adapters' inputs" in line)
    assert "frozen base" in header and "train KiB" in header  # beside the fixed columns, before the total


def test_version_1_bench_is_migrated_to_self_describing_fields():
    report = load_record(os.path.join(V1, "bench_train.json"))
    assert report.schema_version == BENCH_VERSION and report.recommendation.chosen == "fp32"
    amp = report.result("amp-fp16")
    assert amp.info.plan["default"] == {"kind": "autocast", "dtype": "float16", "scaler": True}
    # filled once by the migration from the plan's JSON, so that no reader knows a kind by its name
    assert amp.info.fp32_weights is True and amp.info.keeps_updates is True
    assert report.result("bf16").info.fp32_weights is False and report.result("bf16").info.keeps_updates is False
    assert amp.scaler["grad_scale"][0] == 65536.0
    assert report.result("tf32").skip == "unsupported"
    infer = load_record(os.path.join(V1, "bench_infer.json"))
    fp8 = infer.result("fp8-wo")
    assert fp8.info.emulated and fp8.size["format"] == "safetensors" and fp8.per_layer[1]["own_sqnr_db"] == math.inf


def test_a_string_that_says_nan_stays_a_string(tmp_path):
    report = load_record(os.path.join(V1, "bench_train.json"))
    odd = dtypelab.PolicyResult("odd", "failed", "NaN", losses=(math.nan, math.inf), metrics={"acc": -math.inf})
    path = str(tmp_path / "r.json")
    report.with_result(odd).save(path)
    back = load_record(path).result("odd")
    assert back.reason == "NaN" and math.isnan(back.losses[0]) and back.losses[1] == math.inf
    assert back.metrics["acc"] == -math.inf


def test_default_result_files_never_collide(tmp_path):
    paths = {default_result_path("digits", "train", str(tmp_path)) for _ in range(3)}
    assert len(paths) == 3 and all(os.path.exists(p) for p in paths)


# --- plans --------------------------------------------------------------------------------------------
def test_plan_patterns_exact_first_then_in_order_and_children_inherit():
    bf16, fp16, fp32 = Cast("bfloat16"), Cast("float16"), Cast("float32")
    plan = Plan(Autocast("bfloat16"), {"re:.*\\.dense": bf16, "*.out*": fp16, "enc.out.dense": fp32})
    assert plan.config_for("enc.out.dense") == fp32  # exact beats both patterns
    assert plan.config_for("enc.in.dense") == bf16
    assert plan.config_for("enc.output") == fp16
    assert plan.config_for("enc.output.act", parent=fp16) == fp16  # inherits from its parent
    assert plan.config_for("head") == Autocast("bfloat16")


def test_plan_json_and_pickle_round_trip(tmp_path):
    plan = Plan(Autocast("bfloat16"), {"head": Cast("float32")}, name="amp-head32")
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert pickle.loads(pickle.dumps(plan)).config_for("head") == Cast("float32")
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"default": "amp-bf16", "rules": {"head": "fp32"}}))  # names of registered policies
    loaded = get_policy(str(path))
    assert loaded.name == "p" and loaded.default == Autocast("bfloat16")
    assert loaded.rules == (("head", Cast("float32")),)


@pytest.mark.parametrize(("plan", "message"), [
    (lambda: Plan(Cast("float32"), {"x": TF32()}), "process-wide"),
    (lambda: Plan(Cast("bfloat16"), {"x": Quantize("int8-dynamic", library="torch.ao", granularity="per-tensor")}),
     "needs float32"),
    (lambda: Plan(Cast("float32"), {"re:([": Cast("bfloat16")}), "not a valid regular expression"),
    (lambda: Cast("float8"), "unknown dtype"),
    (lambda: Autocast("float64"), "bfloat16 or float16"),
    (lambda: Plan.from_dict({"default": {"kind": "cast", "dtype": "float32", "bits": 3}}), "unknown field"),
])
def test_bad_plans_are_one_line_errors(plan, message):
    with pytest.raises(DtypelabError, match=message):
        plan()


def test_a_pattern_that_matches_nothing_is_an_error(tiny):
    plan = Plan(Autocast("bfloat16"), {"nett.2": Cast("float32")})
    with pytest.raises(DtypelabError, match=r"no module matches 'nett\.2'"):
        Precision(plan).convert_module(dtypelab.load_task(tiny).make_model())


def test_a_parameterised_variant_is_one_registry_line():
    try:
        register("amp-fp16-noscaler", Autocast("float16", scaler=False))
        plan = get_policy("amp-fp16-noscaler")
        assert not plan.uses_scaler and "autocast(float16)" in plan.describe()
        with pytest.raises(DtypelabError, match="registered already"):
            register("amp-fp16-noscaler", Autocast("float16"))
    finally:
        REGISTRY.pop("amp-fp16-noscaler", None)


def test_one_module_kept_fp32_under_amp_bf16_on_digits():
    plan = Plan(Autocast("bfloat16"), {"head.3": Cast("float32")}, name="amp-bf16-head32")
    task = dtypelab.load_task("digits")
    precision = Precision(plan)
    model = precision.convert_module(task.make_model())
    seen = {}
    for name in ("head.1", "head.3"):
        model.get_submodule(name).register_forward_hook(lambda m, i, o, n=name: seen.__setitem__(n, o.dtype))
    x, y = task.train_batch(0, 8)
    with precision.forward_context():
        loss = task.loss_fn(model(x), y)
    assert seen == {"head.1": torch.bfloat16, "head.3": torch.float32}
    assert not torch.is_autocast_enabled("cpu")  # the region's own autocast state was restored
    report = dtypelab.bench("digits", ["amp-bf16", plan], steps=12, rounds=0, isolate=False,
                            hardware=fake_hardware())
    r = report.result("amp-bf16-head32")
    assert r.status == "ok" and r.info.plan["rules"] == [{"pattern": "head.3", "config": {"kind": "cast",
                                                                                        "dtype": "float32"}}]
    assert math.isfinite(r.metric("accuracy")) and loss.dtype == torch.float32


def test_two_int8_configs_on_two_linears(tiny):
    plan = Plan(Cast("float32"), {"net.0": Quantize("int8-dynamic"), "net.2": Quantize("int8-weight-only")},
                name="mixed-int8")
    model = Precision(plan).convert_module(dtypelab.load_task(tiny).make_model())
    first, second = model.net[0].weight, model.net[2].weight
    assert type(first).__name__ == type(second).__name__ == "Int8Tensor"
    assert first.act_quant_kwargs is not None and second.act_quant_kwargs is None  # dynamic vs weight-only
    legacy = Plan(Cast("float32"), {"net.2": Quantize("int8-dynamic", library="torch.ao", granularity="per-tensor")})
    model = Precision(legacy).convert_module(dtypelab.load_task(tiny).make_model())
    assert type(model.net[0]) is torch.nn.Linear and "quantized" in type(model.net[2]).__module__
    report = dtypelab.bench(tiny, [plan], mode="infer", steps=3, warmup=1, rounds=0, isolate=False,
                            hardware=fake_hardware())
    r = report.result("mixed-int8")
    assert r.status == "ok" and r.fidelity["sqnr_db"] > 25 and r.size["linear_weight_bytes"] < \
        report.result("fp32").size["linear_weight_bytes"]


@pytest.mark.parametrize("plan", [
    Plan(Cast("float32"), {"net.2": Autocast("bfloat16")}, name="fp32+amp-head"),
    Plan(Autocast("float16", scaler=True), {"net.0": Cast("float32")}, name="amp16+fp32-first"),
    Plan(Cast("bfloat16"), {"net.2": Cast("float32")}, name="bf16+fp32-head"),
], ids=lambda p: p.name)
def test_plans_train_and_restore_every_global(plan, tiny):
    before = global_state()
    with tempfile.TemporaryDirectory() as wd:
        result = run_job(Job(tiny, plan, "train", 4, 8, 1, 0, "cpu", wd, threads=1))
    assert result.status == "ok", result.reason
    assert global_state() == before


@pytest.mark.slow
def test_peak_memory_excludes_loading_and_converting(monkeypatch):
    """An inference policy that halves or quarters the weights must show it: its peak below fp32's by at least
    30% of the weight bytes saved (loading fp32 weights and converting them happen before the window).
    int8-wo dequantizes each layer's weight (4 MB) per call, and glibc's dynamic mmap threshold keeps some of those
    freed blocks resident: 15 to 40 MB from run to run against fp32's 35.4 (the bound is 28). A fixed threshold,
    read by fresh interpreters at start, returns them at once: 14.9 MB every run (docs/guide/measuring.md)."""
    monkeypatch.setenv("DTYPELAB_FORK", "0")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    task = TINY + ":make_big_task"
    report = dtypelab.bench(task, "bf16,int8-wo", mode="infer", steps=2, warmup=1, rounds=0, force=True,
                            hardware=fake_hardware())
    fp32 = report.result("fp32")
    weights = 8 * 1024 * 1024 * 4
    for name, kept in (("bf16", 0.5), ("int8-wo", 0.25)):
        r = report.result(name)
        assert r.status == "ok", r.reason
        saved = weights * (1 - kept)
        assert r.peak_memory_bytes < fp32.peak_memory_bytes - 0.3 * saved, (name, r.peak_memory_bytes,
                                                                             fp32.peak_memory_bytes)
        assert r.load_peak_memory_bytes >= r.peak_memory_bytes * 0.9  # the fp32 copy was there while loading


def test_bench_refuses_a_plan_pattern_that_names_no_module_before_running(tiny):
    typo = Plan(Cast("float32"), {"nett.0": Cast("bfloat16")}, name="typo")
    with pytest.raises(DtypelabError, match=r"plan typo: no module matches 'nett\.0'"):
        dtypelab.bench(tiny, [typo], steps=2, isolate=False, hardware=fake_hardware(),
                       on_event=lambda e: pytest.fail(f"started {e.kind} before checking the plan"))


RENDER_WITHOUT_REGISTRY = r"""
import importlib.abc, sys
BLOCKED = ("dtypelab.core.policies", "dtypelab.core.loop", "dtypelab.run", "dtypelab.sweep", "dtypelab.tuning",
           "dtypelab.tracing", "dtypelab.profiling", "dtypelab.numerics", "dtypelab.inference", "dtypelab.lint",
           "dtypelab.distributed", "dtypelab.script", "dtypelab.forecasting", "dtypelab.lightning", "dtypelab.hf")

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith(BLOCKED):
            raise ImportError(f"{name} must not be needed to render a record")

sys.meta_path.insert(0, Block())
from dtypelab.core.records import load_record
from dtypelab.core.results import Report
from dtypelab.render import report
from dtypelab.render.bench import render_html, render_markdown
from dtypelab.render.drawing import document_of, more_of
from dtypelab.render.numeric import emit

records = [load_record(p) for p in sys.argv[1:]]
for r in records:
    if isinstance(r, Report):  # bench draws its own table
        render_markdown(r), render_html(r)
        continue
    doc, styles, wrap = document_of(r)(r, 0)  # whichever kind: its renderer, found as `show` finds it
    emit(doc, "markdown", None, styles, wrap)
    for part in more_of(r, 0):
        emit(part, "markdown", None)
page = report(records).html
print(len(records), "records", len(page), "bytes")
"""


def test_every_golden_record_renders_with_the_registry_and_every_capability_unimportable(tmp_path):
    """Renderers read records only: the decision, the verdicts and the notes are in the record (old files get theirs
    when loaded), so rendering needs neither the policy registry nor any capability."""
    import subprocess
    import sys

    tune = tmp_path / "tune.json"
    from conftest import TINY, fake_hardware

    dtypelab.tune(f"{TINY}:make_task", candidates="int8-dyn", min_cosine=0.9, json_path=str(tune),
                  hardware=fake_hardware(int8=250.0))
    files = [os.path.join(V1, f"{n}.json") for n in ("bench_train", "bench_infer", "audit", "trace", "trace_clean",
                                                     "forecast", "forecast_check", "forecast_gpus")]
    # and every record published from a GPU (scripts/gpu/collect files them under benchmarks/results/<gpu>/)
    results = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")
    files += [f for f in sorted(glob.glob(os.path.join(results, "*", "*.json"))) if not f.endswith("hardware.json")]
    run = subprocess.run([sys.executable, "-c", RENDER_WITHOUT_REGISTRY, *files, str(tune)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith(f"{len(files) + 1} records")


def test_a_bench_record_carries_its_decision_as_data(tmp_path):
    """What `jq .recommendation` reads: the decision as a code, the policy chosen, the reason, every verdict."""
    import json

    path = tmp_path / "r.json"
    report = dtypelab.bench(f"{TINY}:make_task", "fp32,fp64", steps=6, rounds=0, launcher="inline",
                            json_path=str(path), hardware=fake_hardware())
    rec = json.loads(path.read_text())["recommendation"]
    decided = report.recommendation  # what the judge decided in memory is what the file says, as codes
    assert rec["decision"] == decided.decision.value and rec["chosen"] == decided.best
    assert rec["reason"] == decided.reason and rec["reason"].startswith(("Use", "Keep"))
    verdicts = {v["policy"]: v for v in rec["policies"]}
    assert verdicts["fp32"]["verdict"] == "baseline"
    assert {n: v["verdict"] for n, v in verdicts.items()} == {v.policy: v.verdict.value for v in decided.policies}
    assert verdicts["fp64"]["speedup"] == pytest.approx(report.result("fp32").timing.median
                                                        / report.result("fp64").timing.median)
    assert json.loads(path.read_text())["config"]["tolerance"] == {"value": 0.01, "relative": True}
    with open(os.path.join(V1, "bench_train.json")) as f:
        old = json.load(f)
    assert "recommendation" not in old and load_record(os.path.join(V1, "bench_train.json")).recommendation
