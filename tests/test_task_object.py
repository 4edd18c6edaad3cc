"""bench() with a Task object, not its spec: the object itself is measured (its name is no built-in), in this
process, since its closures cannot travel to a child; a launcher that needs them to is refused in one line."""

from __future__ import annotations

import pytest
from conftest import TINY, fake_hardware

from dtypelab import bench
from dtypelab.core.errors import DtypelabError
from dtypelab.core.task import load_task


def _object():
    task = load_task(f"{TINY}:make_task")
    from dataclasses import replace

    return replace(task, name="not-a-built-in")  # loading it by name would fail: the object must be used


def test_a_task_object_is_trained_and_timed_in_rounds():
    report = bench(_object(), "fp32,bf16", steps=6, warmup=2, rounds=2, hardware=fake_hardware())
    assert [r.status for r in report.results] == ["ok", "ok"], [r.reason for r in report.results]
    assert len(report.result("bf16").rounds) >= 2  # the interleaved rounds ran on the object too


def test_a_task_object_is_inferred_against_its_trained_reference():
    report = bench(_object(), "bf16", mode="infer", steps=3, rounds=0, hardware=fake_hardware())
    r = report.result("bf16")
    assert r.status == "ok", r.reason
    assert r.fidelity["sqnr_db"] > 20


@pytest.mark.parametrize("settings, named", [({"isolate": True}, "launcher 'process'"),
                                             ({"launcher": "local-gpus"}, "launcher 'local-gpus'"),
                                             ({"nproc": 2}, "torchrun")])
def test_a_task_object_is_refused_where_it_would_travel(settings, named):
    with pytest.raises(DtypelabError, match=f"Task object runs in this process only.*{named}.*make_task"):
        bench(_object(), "fp32", steps=2, hardware=fake_hardware(), **settings)
