"""Precision kinds as plugins: a user's own kind in its own file, registered with one call, runs through bench (a task
in child processes, and a script), tune and the autopilot; its hooks are called where the loop says; the built-in kinds
answer what the capabilities ask of them without anyone checking which kind they are."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile

import pytest
import torch
from conftest import HERE, fake_hardware
from torch import nn

import dtypelab
from dtypelab import Cast, DtypelabError, Precision, get_policy
from dtypelab.core.loop import build_trainable, train_step
from dtypelab.core.policies import KINDS, REGISTRY, SOURCES, Plan, config_from_dict

ROOT = os.path.dirname(HERE)
EXAMPLE = os.path.join(ROOT, "examples", "custom_precision.py")
MASTER = f"{EXAMPLE}:bf16-master"
TINY = os.path.join(HERE, "tiny_task.py")
PROBE = os.path.join(HERE, "scripts", "probe_script.py")


@pytest.fixture(autouse=True, scope="module")
def _forget_the_example():
    """Other test files count the registered policies: what this file loaded goes with it."""
    yield
    from dtypelab.core.policies.registry import NAMED_ONLY

    for name in NAMED_ONLY:
        REGISTRY.pop(name, None)
    NAMED_ONLY.clear()
    for kind in [k for k, source in SOURCES.items() if source == os.path.abspath(EXAMPLE)]:
        KINDS.pop(kind, None)
        SOURCES.pop(kind, None)
    sys.modules.pop("dtypelab_user_custom_precision", None)


def test_the_example_kind_is_one_file_and_one_registration():
    plan = get_policy(MASTER)
    kind = type(plan.default)
    assert plan.name == "bf16-master" and kind.kind == "bf16-master" and KINDS["bf16-master"] is kind
    assert plan.modes == ("train",) and plan.compute_dtype == "bfloat16"
    assert SOURCES["bf16-master"] == os.path.abspath(EXAMPLE)
    assert get_policy(MASTER) is plan  # the file is imported once per process
    # its JSON says where it comes from, so that another process can read it
    assert plan.to_dict()["default"] == {"kind": "bf16-master", "source": os.path.abspath(EXAMPLE)}
    assert pickle.loads(pickle.dumps(plan)) == plan


def test_a_fresh_process_reads_a_plan_of_a_users_kind_from_its_json_and_its_pickle():
    plan = get_policy(MASTER)
    code = ("import pickle, sys, json; from dtypelab.core.policies import plan_from_dict; "
            "p = pickle.loads(sys.stdin.buffer.read()); q = plan_from_dict(json.loads(p.to_json())); "
            "print(type(p.default).__module__, p == q, p.describe())")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(plan), capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().split()[:2] == ["dtypelab_user_custom_precision", "True"]


def _steps(policy: str, lr: float, n: int) -> torch.Tensor:
    """``n`` SGD steps of a weight of 1.0 whose every update is ``lr`` (the gradient of w·1 is 1)."""
    precision = Precision(get_policy(policy))
    model = precision.convert_module(nn.Linear(1, 1, bias=False))
    with torch.no_grad():
        model.weight.fill_(1.0)
    optimizer = precision.convert_optimizer(torch.optim.SGD(model.parameters(), lr=lr), model)
    for _ in range(n):
        optimizer.zero_grad()
        precision.backward(model(torch.ones(1, 1, dtype=model.weight.dtype)).sum())
        precision.optimizer_step(optimizer)
    return model.weight.detach()


def test_the_optimizer_hook_keeps_updates_a_bfloat16_weight_would_lose():
    """bfloat16's spacing at 1.0 is 2**-7: an update of 2**-10 rounds away every time in bf16, while the master copy
    adds 64 of them up exactly (64 * 2**-10 = 2**-4, a bfloat16 number)."""
    lr = 2.0 ** -10
    assert _steps("bf16", lr, 64).item() == 1.0
    kept = _steps(MASTER, lr, 64)
    assert kept.dtype == torch.bfloat16 and kept.item() == 1.0 - 2.0 ** -4
    assert _steps("fp32", lr, 64).item() == pytest.approx(1.0 - 2.0 ** -4, abs=1e-6)


def test_each_hook_is_called_where_the_loop_says(tmp_path):
    calls = []

    class Counted(Cast):
        def session(self, device):
            calls.append("session")
            return super().session(device)

        def convert_module(self, model, names):
            calls.append(("convert_module", len(names)))
            return model, {}

        def forward_context(self, device_type):
            calls.append("forward_context")
            return super().forward_context(device_type)

        def convert_optimizer(self, optimizer, model):
            calls.append("convert_optimizer")
            return optimizer

        def optimizer_step(self, optimizer, step):
            calls.append("optimizer_step")
            return step()

    from tiny_task import make_task

    task = make_task()
    precision = Precision(Plan(Counted("float32")))
    with precision.session():
        model, optimizer = build_trainable(task, precision, torch.device("cpu"), seed=0)
        for i in range(2):
            train_step(task, model, precision, optimizer, *task.batch(i, 8))
    modules = len(list(model.named_modules()))
    assert calls == ["session", ("convert_module", modules), "convert_optimizer",
                     "forward_context", "optimizer_step", "forward_context", "optimizer_step"]


@pytest.mark.slow
def test_a_users_kind_runs_in_bench_on_a_task_in_child_processes(tmp_path):
    report = dtypelab.bench(f"{TINY}:make_task", f"fp32,bf16,{MASTER}", steps=20, rounds=0, hardware=fake_hardware(),
                            json_path=str(tmp_path / "r.json"))
    master = report.result("bf16-master")
    assert master.status == "ok", master.reason
    assert len(master.losses) == 20 and master.info.plan["default"]["kind"] == "bf16-master"
    assert master.model_bytes == report.result("bf16").model_bytes  # its weights are bfloat16
    # its byte-counting hook: the master copy is float32, twice the bfloat16 weights, and no optimizer state
    fp32 = report.result("fp32").memory
    assert master.memory["master_weights"] == 2 * master.memory["parameters"] == fp32["parameters"]
    assert master.memory["optimizer_state"] == fp32["optimizer_state"] and master.info.keeps_updates
    assert not master.updates and report.result("bf16").info.keeps_updates is False
    assert dtypelab.load_record(str(tmp_path / "r.json")) == report  # the record stands without the file


@pytest.mark.slow
def test_a_users_kind_runs_on_a_script_and_its_step_goes_through_the_hook():
    report = dtypelab.bench(PROBE, f"fp32,{MASTER}", hardware=fake_hardware(), runs=1)
    fp32, master = report.result("fp32"), report.result("bf16-master")
    assert master.status == "ok", master.reason
    assert len(master.losses) == len(fp32.losses) > 0
    assert master.losses != fp32.losses  # it trained in bfloat16


def test_a_users_kind_is_a_tune_candidate_and_an_autopilot_start():
    report = dtypelab.tune(f"{TINY}:make_recenter_task", mode="train", candidates=MASTER, tolerance="5%",
                           hardware=fake_hardware(), steps=10)
    assert report.uniform and report.uniform[0].candidate == "bf16-master"
    pilot = dtypelab.autopilot(f"{TINY}:make_task", start=MASTER, hardware=fake_hardware(), steps=20)
    assert pilot.config.start == "bf16-master" and len(pilot.losses) == 20


def test_the_users_kind_restores_globals_and_joins_no_default_sweep(tiny):
    from test_policies import global_state

    from dtypelab.core.policies import default_policies
    from dtypelab.sweep.job import Job, run_job

    get_policy(MASTER)
    assert "bf16-master" in REGISTRY and "bf16-master" not in default_policies("train", "cpu")
    before = global_state()
    with tempfile.TemporaryDirectory() as wd:
        result = run_job(Job(tiny, "bf16-master", "train", 3, 8, 1, 0, "cpu", wd, threads=1))
    assert result.ran, result.reason
    assert global_state() == before


def test_bad_plugins_are_one_line_errors(tmp_path):
    with pytest.raises(DtypelabError, match=r"precision file not found: nowhere\.py"):
        get_policy("nowhere.py:thing")
    with pytest.raises(DtypelabError, match=r"defines no policy 'bf16-mastr'.*registers bf16-master"):
        get_policy(f"{EXAMPLE}:bf16-mastr")
    with pytest.raises(DtypelabError, match="unknown config kind 'nope'"):
        config_from_dict({"kind": "nope"})
    twice = tmp_path / "twice.py"
    twice.write_text("from dataclasses import dataclass\nfrom typing import ClassVar\nfrom dtypelab import Config\n"
                     "@dataclass(frozen=True)\nclass Other(Config):\n    kind: ClassVar[str] = 'cast'\n")
    with pytest.raises(DtypelabError, match="precision kind 'cast' is defined twice"):
        get_policy(f"{twice}:Other")
    assert REGISTRY["bf16-master"].default.kind == "bf16-master"  # registered by the example, looked up above


def test_what_the_capabilities_ask_of_the_built_in_kinds():
    from dtypelab.piloting import PROMOTABLE, PROMOTION
    from dtypelab.script import HF_ARGUMENTS, LIGHTNING_PRECISION
    from dtypelab.tuning import LAYER_TYPES, RANGE_DTYPE, TUNES

    names = ("fp32", "bf16", "amp-bf16", "amp-fp16", "tf32", "int8-dyn")
    assert [LIGHTNING_PRECISION(get_policy(n).default) for n in names] \
        == ["32-true", "bf16-true", "bf16-mixed", "16-mixed", "32-true", None]
    assert HF_ARGUMENTS(get_policy("amp-fp16").default) == ({"fp16": True}, None)
    assert HF_ARGUMENTS(get_policy("bf16").default) == ({}, "bfloat16")
    assert HF_ARGUMENTS(get_policy("tf32").default) == ({"tf32": True}, None)
    assert HF_ARGUMENTS(get_policy("int8-dyn").default) is None
    assert PROMOTION(get_policy("fp16").default, bf16_fast=True) == Cast("bfloat16")
    assert PROMOTION(get_policy("amp-fp16").default, bf16_fast=True) == get_policy("amp-bf16").default
    assert PROMOTION(get_policy("amp-fp16").default, bf16_fast=False) is None
    assert [n for n in names if PROMOTABLE(get_policy(n).default)] == ["fp32", "bf16", "amp-bf16", "amp-fp16"]
    assert [n for n in ("bf16", "amp-bf16", "fp8-tensorwise", "int8-dyn", "tf32") if
            "train" in TUNES(get_policy(n).default)] == ["bf16", "amp-bf16", "fp8-tensorwise"]
    assert [RANGE_DTYPE(get_policy(n).default) for n in ("fp32", "bf16", "amp-fp16", "bf16-sr", "int8-dyn")] \
        == [None, "bfloat16", "float16", "bfloat16", None]
    assert LAYER_TYPES(get_policy("int8-dyn").default) == (torch.nn.Linear,)
    assert torch.nn.Conv2d in LAYER_TYPES(get_policy("bf16").default)


def test_a_kind_of_your_own_answers_a_capability_by_registering_and_its_subclasses_inherit_it():
    from dtypelab.core.policies.adapters import Adapter, constant

    asked = Adapter("a test's question", constant("default"))

    class Mine(Cast):  # not registered as a kind: the adapter looks at the class alone
        pass

    class Sub(Mine):
        pass

    assert asked(Mine()) == "default" and not asked.registered(Mine())
    asked.register(Mine)(lambda config, suffix="": "mine" + suffix)
    assert asked(Mine(), "!") == "mine!" and asked(Sub()) == "mine" and asked.registered(Sub())
    asked.register(Sub)(constant("sub"))
    assert (asked(Mine()), asked(Sub())) == ("mine", "sub")
    assert asked(Cast("float32")) == "default"  # its base answers by the default


def test_a_kind_that_wraps_the_step_runs_a_closure_first_and_refuses_lbfgs():
    precision = Precision(get_policy(MASTER))
    model = precision.convert_module(nn.Linear(3, 1))
    x = torch.ones(2, 3, dtype=torch.bfloat16)
    calls = []

    def closure():
        calls.append(model.weight.dtype)  # the forward sees the bfloat16 weights, not the master copy
        optimizer.zero_grad()
        loss = model(x).float().pow(2).sum()
        loss.backward()
        return loss

    optimizer = precision.convert_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    before = model.weight.detach().clone()
    loss = precision.step(optimizer, closure)
    assert calls == [torch.bfloat16] and loss.item() > 0 and not torch.equal(model.weight, before)
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(DtypelabError, match="bf16-master runs its own optimizer step, and LBFGS evaluates its closure"):
        precision.step(lbfgs, closure)


def test_the_hugging_face_trainer_refuses_a_kind_it_cannot_express():
    pytest.importorskip("transformers")
    from dtypelab.hf import training_arguments

    with pytest.raises(DtypelabError, match="policy bf16-master: it has no TrainingArguments equivalent"):
        training_arguments(get_policy(MASTER), None)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_users_kind_runs_under_lightning_through_its_hooks():
    pytest.importorskip("lightning")
    report = dtypelab.bench(os.path.join(ROOT, "examples", "train_lightning.py"), f"fp32,{MASTER}", runs=1,
                            script_args=["--epochs", "1"], hardware=fake_hardware())
    fp32, master = report.result("fp32"), report.result("bf16-master")
    assert master.status == "ok", master.reason
    assert master.model_bytes < fp32.model_bytes and len(master.losses) == len(fp32.losses) > 10
    assert not any("by hand" in n for r in report.results for n in r.notes)  # Lightning steps its optimizers


@pytest.mark.parametrize(("policy", "backward"), [(MASTER, "lab"), (MASTER, "own"), ("amp-fp16", "lab")])
def test_a_policy_acting_through_the_optimizer_is_skipped_for_hand_updated_weights(tmp_path, monkeypatch, policy,
                                                                                 backward):
    """word_language_model's default loop has no optimizer: a kind whose hooks act through it (a master copy, a
    GradScaler) would run as something it is not, so it is recorded as skipped with why."""
    from test_script import _sent, _session

    torch.manual_seed(0)
    model, x, y = nn.Linear(4, 3), torch.randn(8, 4), torch.randint(0, 3, (8,))
    lab = _session(tmp_path, monkeypatch, policy)
    wrapped = lab.setup(model)
    with pytest.raises(SystemExit):
        for _ in range(3):
            loss = nn.functional.cross_entropy(wrapped(x), y)
            lab.backward(loss) if backward == "lab" else loss.backward()
            for p in wrapped.parameters():
                p.data.add_(p.grad, alpha=-0.1)
    sent = _sent(lab)
    assert type(sent).__name__ == "ScriptSkip"
    assert ("acts through the optimizer" if policy == MASTER else "scales the loss (GradScaler)") in sent.reason
    assert Precision(get_policy("bf16")).hand_update_error() is None


SCRIPT_KIND = """
import sys
from dataclasses import dataclass
from typing import ClassVar
import dtypelab
from dtypelab import Config

@dataclass(frozen=True)
class Half(Config):
    kind: ClassVar[str] = "my-half"
    storage_dtype: ClassVar[str] = "bfloat16"
    compute_dtype: ClassVar[str] = "bfloat16"

{guard}
    report = dtypelab.bench(sys.argv[1], ["fp32", Half()], steps=6, rounds=0, force=True)  # also where bf16 is slow
    print("|".join(f"{{r.policy}}:{{r.status}}:{{r.reason}}" for r in report.results))
"""


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("guard", ['if __name__ == "__main__":', "if True:"])
def test_a_kind_defined_in_the_script_that_calls_bench(tmp_path, guard):
    """As with multiprocessing, a worker imports the running script to find the kind: it can when the script's own
    work is under the main guard, and says how to fix it when it is not."""
    script = tmp_path / "mine.py"
    script.write_text(SCRIPT_KIND.format(guard=guard))
    out = subprocess.run([sys.executable, str(script), f"{TINY}:make_task"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    results = dict(line.split(":", 1) for line in out.stdout.strip().splitlines()[-1].split("|"))
    if guard.startswith("if __name__"):
        assert results["my-half"] == "ok:"
    else:
        assert results["my-half"].startswith("failed:") and "under if __name__ == '__main__'" in results["my-half"]


def test_a_kind_dropped_into_the_kinds_package_as_one_file_is_listed_with_no_other_file_touched():
    """The example's kind, copied as it is into core/policies/kinds/: a fresh process lists its policy (the
    package imports every module in it once the registry exists); without the file it is not there."""
    import shutil

    from dtypelab.core.policies import kinds

    dropped = os.path.join(os.path.dirname(kinds.__file__), f"dropped_{os.getpid()}.py")
    listing = [sys.executable, "-m", "dtypelab", "policies"]
    env = {**os.environ, "COLUMNS": "250"}
    shutil.copyfile(EXAMPLE, dropped)
    try:
        with_it = subprocess.run(listing, capture_output=True, text=True, env=env, timeout=120)
    finally:
        os.remove(dropped)
    names = "from dtypelab.core.policies import REGISTRY; print(sorted(REGISTRY))"
    without = subprocess.run([sys.executable, "-c", names], capture_output=True, text=True, timeout=120)
    assert with_it.returncode == 0, with_it.stderr[-1500:]
    assert "bf16-master" in with_it.stdout and "float32 master copy" in with_it.stdout
    assert without.returncode == 0 and "'fp32'" in without.stdout and "bf16-master" not in without.stdout


def test_the_type_checkers_baseline_only_shrinks():
    """scripts/typecheck fails a file with more mypy errors than typecheck-baseline.json records for it, and a file
    the baseline does not name is allowed none; fewer passes. The baseline names real files of the package."""
    import importlib.machinery
    import importlib.util
    import json

    loader = importlib.machinery.SourceFileLoader("typecheck", os.path.join(ROOT, "scripts", "typecheck"))
    gate = importlib.util.module_from_spec(importlib.util.spec_from_loader("typecheck", loader))
    loader.exec_module(gate)
    baseline = {"src/dtypelab/a.py": 3, "src/dtypelab/b.py": 1}
    assert gate.grown({"src/dtypelab/a.py": 3, "src/dtypelab/b.py": 0}, baseline) == {}
    assert gate.grown({"src/dtypelab/a.py": 4}, baseline) == {"src/dtypelab/a.py": 4}
    assert gate.grown({"src/dtypelab/new.py": 1}, baseline) == {"src/dtypelab/new.py": 1}
    with open(os.path.join(ROOT, "typecheck-baseline.json")) as f:
        recorded = json.load(f)
    assert recorded and all(os.path.isfile(os.path.join(ROOT, path)) for path in recorded)


def test_a_config_is_fields_hooks_and_one_record_of_facts():
    """A kind's class holds its fields and hooks; what it *is* is one frozen ``Facts`` record, so a capability's
    question does not grow the base class (it was 36 public members, then 31 before ``Facts``)."""
    from dtypelab.core.policies import Config, Facts

    public = [n for n in dir(Config) if not n.startswith("_")]
    assert "facts" in public and len(public) <= 20, public
    assert not {f for f in Facts.__dataclass_fields__} & set(public)  # no fact is also a member
    for plan in REGISTRY.values():
        for config in plan.configs:
            assert isinstance(config.facts, Facts) and not set(type(config).__dict__) & set(Facts.__dataclass_fields__)


def test_a_kind_written_before_facts_keeps_its_class_attributes_and_properties():
    """A user's kind that states its facts the old way (class attributes, or properties from its fields) is read
    through ``facts``; so is a subclass of a built-in kind that overrides one fact, on top of its base's."""
    from dataclasses import dataclass
    from typing import ClassVar

    from dtypelab.core.policies import Config

    @dataclass(frozen=True)
    class Old(Config):
        modes: ClassVar[tuple[str, ...]] = ("train",)
        storage_dtype: ClassVar[str] = "bfloat16"
        wide: bool = False

        @property
        def compute_dtype(self) -> str:
            return "float32" if self.wide else "bfloat16"

        @property
        def probe_key(self) -> str:
            return "int8"

    facts = Old().facts
    assert (facts.modes, facts.storage_dtype, facts.compute_dtype, facts.probe_key) == \
        (("train",), "bfloat16", "bfloat16", "int8")
    assert Old(wide=True).facts.compute_dtype == "float32" and facts.autocast_dtype is None

    @dataclass(frozen=True)
    class Legacy16(Cast):
        keeps_updates: ClassVar[bool] = True

    assert (Legacy16("float16").facts.storage_dtype, Legacy16("float16").facts.keeps_updates) == ("float16", True)
    assert Cast("float16").facts.keeps_updates is False  # the base is untouched


def test_every_built_in_policys_facts_are_as_recorded():
    """``tests/data/kind_facts.json`` holds each built-in policy's configs' facts as the kinds stated them before they
    were one record (class attributes and properties): the move changed none, and a later change shows here."""
    import json
    from dataclasses import asdict

    with open(os.path.join(HERE, "data", "kind_facts.json")) as f:
        recorded = json.load(f)
    from dtypelab.core.policies.registry import NAMED_ONLY

    current = {}
    for name, plan in sorted(REGISTRY.items()):
        if plan.default.kind in SOURCES or name in NAMED_ONLY:
            continue  # a user's kind or policy another test loaded
        for i, config in enumerate(plan.configs):
            facts = asdict(config.facts)
            facts["probe_key"], facts["modes"] = config.facts.probe_key, list(facts["modes"])
            del facts["probe"]
            current[f"{name}/{i}/{config.label}"] = facts
    assert current == recorded
