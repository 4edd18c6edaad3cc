"""Reading a file (a plan, a record, an exported model) never runs code: a Python file that such a file names is
imported only when the user names it in the same command or call. Each case plants a file that writes a marker when
imported, and reads every kind of file that can name one."""

from __future__ import annotations

import itertools
import json
import os
import textwrap

import pytest
import torch
from conftest import fake_hardware
from typer.testing import CliRunner

import dtypelab
from dtypelab import DtypelabError
from dtypelab.cli import app
from dtypelab.core.policies import KINDS, REGISTRY, SOURCES, parse_policies, plan_from_dict
from dtypelab.core.policies.registry import NAMED_ONLY
from dtypelab.core.records import load_record

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "tiny_task.py")
_SERIAL = itertools.count()


@pytest.fixture
def planted(tmp_path):
    """A precision file and task file in one, which leaves ``marker`` behind when imported."""
    marker = tmp_path / "marker"
    path = tmp_path / f"planted_{next(_SERIAL)}.py"  # a kind and a policy name of its own: the registry is global
    path.write_text(textwrap.dedent(f"""
        import pathlib
        from dataclasses import dataclass
        from typing import ClassVar
        pathlib.Path({str(marker)!r}).write_text("imported")
        from dtypelab import Config, register
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("tiny_for_planted", {TINY!r})
        tiny = importlib.util.module_from_spec(spec); spec.loader.exec_module(tiny)

        @dataclass(frozen=True)
        class Planted(Config):
            kind: ClassVar[str] = {path.stem!r}
            modes: ClassVar[tuple[str, ...]] = ("train", "infer")

        register({path.stem!r}, Planted())

        def make_task():
            return tiny.make_task()
    """))
    yield path, marker
    # what the file registered when a test imported it, forgotten: the registry is the process's
    REGISTRY.pop(path.stem, None)
    NAMED_ONLY.discard(path.stem)
    KINDS.pop(path.stem, None)
    SOURCES.pop(path.stem, None)


def _plan(path) -> dict:
    return {"name": "shared", "default": "fp32",
            "rules": [{"pattern": "net.0", "config": {"kind": path.stem, "source": str(path)}}]}


def test_a_plan_file_naming_a_python_file_is_refused_without_importing_it(planted, tmp_path):
    path, marker = planted
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_plan(path)))
    with pytest.raises(DtypelabError) as err:
        dtypelab.load_plan(str(plan))
    assert not marker.exists()
    message = str(err.value)
    assert "\n" not in message and str(plan) in message and str(path) in message and "--policies" in message
    run = CliRunner().invoke(app, ["bench", f"{TINY}:make_task", "-p", f"fp32,{plan}", "--launcher", "inline"])
    assert run.exit_code == 2 and not marker.exists(), run.output
    assert "reading a file never runs code" in run.output and "Traceback" not in run.output


def test_the_same_plan_reads_once_the_user_names_the_file_in_any_order(planted, tmp_path):
    path, marker = planted
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_plan(path)))
    plans = parse_policies(f"{plan},{path}:{path.stem}")  # the plan first: the named file still loads first
    assert marker.exists()
    assert [p.name for p in plans] == ["shared", path.stem] and plans[0].rules[0][1].kind == path.stem


def test_a_plan_built_in_this_run_still_reaches_its_own_worker(planted):
    """The one place a source is imported from a plan's JSON: a job this run built, handed to its worker."""
    path, marker = planted
    with pytest.raises(DtypelabError):
        plan_from_dict(_plan(path))
    assert not marker.exists()
    plan = plan_from_dict(_plan(path), load_source=True)
    assert marker.exists() and plan.rules[0][1].kind == path.stem


def test_an_exported_model_naming_a_task_file_or_a_precision_file_imports_neither(planted, tmp_path):
    path, marker = planted
    out = tmp_path / "m.safetensors"
    dtypelab.export(f"{TINY}:make_task", "fp32", str(out))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out))
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        raw = dict(f.metadata())
    meta = json.loads(raw["dtypelab"])
    cases = {"task": {**meta, "task": f"{path}:make_task"},
             "plan": {**meta, "plan": _plan(path)},
             "policy": {k: v for k, v in {**meta, "policy": f"{path}:{path.stem}"}.items() if k != "plan"}}
    for what, changed in cases.items():
        bad = tmp_path / f"{what}.safetensors"
        save_file(tensors, str(bad), metadata={**raw, "dtypelab": json.dumps(changed)})
        with pytest.raises(DtypelabError) as err:
            dtypelab.load_exported(str(bad))
        assert not marker.exists(), what
        assert "\n" not in str(err.value) and "never runs code" in str(err.value), what
    # named by the caller, the task file is imported, and the model loads
    model, _ = dtypelab.load_exported(str(tmp_path / "task.safetensors"), task=f"{path}:make_task")
    assert marker.exists() and isinstance(model, torch.nn.Module)


def _with_source(obj, path):
    """Every config object in a record names the planted file, as a user's kind would."""
    if isinstance(obj, dict):
        out = {k: _with_source(v, path) for k, v in obj.items()}
        if isinstance(out.get("kind"), str) and ("storage_dtype" in out or "dtype" in out or "mode" in out):
            out["source"] = str(path)
        return out
    if isinstance(obj, list):
        return [_with_source(v, path) for v in obj]
    return obj


def test_records_naming_a_python_file_are_shown_and_reported_without_importing_it(planted, tmp_path):
    path, marker = planted
    record = tmp_path / "tune.json"
    dtypelab.tune(f"{TINY}:make_task", candidates="int8-dyn", min_cosine=0.9, json_path=str(record),
                  hardware=fake_hardware(int8=250.0))
    data = json.loads(record.read_text())
    data = _with_source(data, path)
    data["plan"]["default"] = {"kind": path.stem, "source": str(path)}
    data["task"] = f"{path}:make_task"
    record.write_text(json.dumps(data))
    golden = os.path.join(HERE, "data", "v1")
    files, planted_in = [record], []
    for name in sorted(os.listdir(golden)):
        if name.endswith(".json"):
            # as this version writes it (a v1 bench record has no plans until it is migrated)
            current = load_record(os.path.join(golden, name)).to_dict()
            changed = _with_source(current, path)
            if isinstance(changed.get("config", {}).get("policy"), str):  # an audit's or a trace's: a user's kind
                changed["config"]["policy"] = f"{path}:{path.stem}"
            if changed != current:
                planted_in.append(name)
            changed.setdefault("config", {})["task"] = f"{path}:make_task"
            (tmp_path / name).write_text(json.dumps(changed))
            files.append(tmp_path / name)
    # every golden record that holds a config or names a policy names the file; the forecasts hold neither
    assert planted_in == ["audit.json", "bench_infer.json", "bench_train.json", "trace.json", "trace_clean.json"]
    runner = CliRunner()
    for f in files:
        run = runner.invoke(app, ["show", str(f)])
        assert run.exit_code == 0, (f, run.output)
        assert not marker.exists(), f
    run = runner.invoke(app, ["report", *map(str, files), "-o", str(tmp_path / "r.html")])
    assert run.exit_code == 0, run.output
    assert not marker.exists()
