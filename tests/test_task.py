from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TINY, fake_hardware

import dtypelab
from dtypelab import Task, TaskError, load_task
from dtypelab.core.task import BUILTIN, FULL_SIZE, call_model, map_tensors

# minilm: inference-only, optional extra (test_minilm.py); minilm-ft: the same extra, a Hugging Face model's batches
# and outputs (test_finetune.py); the full-size shapes: test_full_size_shapes_on_meta
TRAINABLE = [n for n in BUILTIN if n not in ("minilm", "minilm-ft", "tinylm") and n not in FULL_SIZE]


def test_tinylm_is_pretrained_on_text_it_then_predicts():
    """The shipped model loads offline, predicts its held-out text far better than chance (bytes: perplexity 256),
    and its held-out windows are the same at every call."""
    task = load_task("tinylm")
    assert task.inference_only and task.context == 1024
    assert torch.equal(task.text(4, 64), task.text(4, 64)) and task.text(4, 64).shape == (4, 64)
    model = task.make_model().eval()
    assert sum(p.numel() for p in model.parameters()) == 853_120
    with torch.no_grad():
        metrics = task.evaluate(lambda inputs: model(**inputs).logits.float())
    assert metrics["perplexity"] < 10


@pytest.mark.parametrize("name", TRAINABLE)
def test_builtin_tasks_load_and_are_deterministic(name):
    task = load_task(name)
    assert task.name == name and task.metric
    x1, y1 = task.train_batch(7, 4)
    x2, y2 = task.train_batch(7, 4)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(task.train_batch(8, 4)[0], x1)


@pytest.mark.parametrize("name", TRAINABLE)
def test_builtin_tasks_learn_in_a_few_steps(name):
    """Twenty fp32 steps lower the loss, and evaluate() reports the primary metric."""
    task = load_task(name)
    torch.manual_seed(0)
    model = task.make_model()
    opt = task.make_optimizer(model.parameters())
    losses = []
    for step in range(20):
        x, y = task.train_batch(step, task.batch_size)
        opt.zero_grad()
        loss = task.loss_fn(call_model(model, x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) < sum(losses[:5])
    model.eval()
    with torch.no_grad():
        metrics = task.evaluate(lambda inputs: call_model(model, inputs).float())
    assert task.metric in metrics


@pytest.mark.parametrize("name,parameters", [("gpt2-full", 124_475_904), ("llama2-7b", 6_738_415_616)])
def test_full_size_shapes_on_meta(name, parameters):
    """GPT-2 small (its 50,304-token vocabulary padded as nanoGPT pads it, embeddings tied) and Llama-2-7B, built
    on the meta device as a forecast builds them: their parameter counts, and batches deterministic at any size."""
    task = load_task(name)
    with torch.device("meta"):
        model = task.make_model()
    assert sum(p.numel() for p in model.parameters()) == parameters  # each parameter once: tied ones too
    x1, y1 = task.train_batch(3, 2)
    assert torch.equal(x1, task.train_batch(3, 2)[0]) and x1.shape[0] == 2 and y1.shape == x1.shape


def test_load_from_file_and_module(monkeypatch):
    assert load_task(f"{TINY}:make_task").name == "tiny"
    assert load_task(TINY).name == "tiny"  # ':make_task' is the default attribute
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(TINY).parent))
    assert load_task("tiny_task:make_task").name == "tiny"


@pytest.mark.parametrize(("spec", "message"), [
    ("nope.py:make_task", "task file not found: nope.py"),
    (f"{TINY}:make_tsk", "has no attribute 'make_tsk' (did you mean 'make_task'?)"),
    (f"{TINY}:not_a_task", "returned int, expected dtypelab.Task"),
    (f"{TINY}:X", "neither a Task nor a function"),
    ("no_such_pkg.mod:make_task", "no module named 'no_such_pkg.mod'"),
    ("digit", "unknown task 'digit' (did you mean 'digits'?)"),
])
def test_bad_specs_give_one_line_errors(spec, message):
    with pytest.raises(TaskError) as info:
        load_task(spec)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_raising_factory_names_the_users_line():
    expected = r"RuntimeError: the user's own bug \(at tiny_task.py:\d+ in helper_that_fails\)"
    with pytest.raises(TaskError, match=expected):
        load_task(f"{TINY}:make_broken_task")


def test_task_validation():
    with pytest.raises(TaskError, match="steps and batch_size must be positive"):
        Task("t", lambda: None, lambda s, b: None, lambda o, t: None, lambda p: {}, "m", True, steps=0)
    with pytest.raises(TaskError, match="loss_fn must be callable"):
        Task("t", lambda: None, lambda s, b: None, None, lambda p: {}, "m", True)


def test_map_tensors_and_call_model_handle_nested_batches():
    batch = {"a": torch.ones(2), "b": (torch.zeros(1), 3)}
    doubled = map_tensors(lambda t: t * 2, batch)
    assert doubled["a"].tolist() == [2.0, 2.0] and doubled["b"][1] == 3
    assert call_model(lambda a, b: a + b[0].sum(), (torch.ones(1), [torch.ones(2)])).item() == 3.0


def test_compute_loss_task_trains_and_evaluate_gets_the_model_output_intact():
    pytest.importorskip("transformers")
    # hf_tasks.evaluate asserts it got a SequenceClassifierOutput with float32 logits: else the run fails
    report = dtypelab.bench("tests/hf_tasks.py:own_loss_task", "fp32,amp-bf16", launcher="inline", rounds=0,
                            hardware=fake_hardware())
    for r in report.results:
        assert r.status == "ok", (r.policy, r.reason)
        assert len(r.losses) == 6 and "accuracy" in r.metrics


def test_inference_task_needs_no_training_fields():
    pytest.importorskip("transformers")
    report = dtypelab.bench("tests/hf_tasks.py:inference_task", "fp32,bf16", mode="infer", launcher="inline",
                            rounds=0, hardware=fake_hardware())
    assert [r.status for r in report.results] == ["ok", "ok"] and report.result("bf16").fidelity["sqnr_db"] > 10
    with pytest.raises(dtypelab.DtypelabError, match="inference-only"):
        dtypelab.bench("tests/hf_tasks.py:inference_task", "fp32", launcher="inline")


def test_task_loss_fields_are_checked():
    def make(**kw):
        return dtypelab.Task(name="t", make_model=lambda: torch.nn.Linear(2, 2), train_batch=lambda s, b: (1, 2),
                             evaluate=lambda p: {"a": 1.0}, metric="a", **kw)

    with pytest.raises(dtypelab.TaskError, match=r"loss_fn must be callable .or give compute_loss"):
        make()
    with pytest.raises(dtypelab.TaskError, match="not both"):
        make(loss_fn=lambda o, t: o, compute_loss=lambda m, b: m)
    odd = dataclasses.replace(make(loss_fn=lambda o, t: o), train_batch=lambda s, b: {"x": 1})
    with pytest.raises(dtypelab.TaskError, match=r"must return .inputs, target."):
        odd.batch(0, 2)
    with pytest.raises(dtypelab.TaskError, match="needs infer_batch"):
        dtypelab.Task(name="i", make_model=lambda: torch.nn.Linear(2, 2), evaluate=lambda p: {"a": 1.0},
                      metric="a", inference_only=True)


def test_map_tensors_keeps_dataclasses_namedtuples_and_mappings():
    import collections

    from dtypelab.core.task import map_tensors

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        extra: tuple

    Pair = collections.namedtuple("Pair", "a b")
    got = map_tensors(lambda t: t * 2, Out(torch.ones(2), (Pair(torch.ones(1), 3),)))
    assert isinstance(got, Out) and got.logits.tolist() == [2.0, 2.0]
    assert isinstance(got.extra[0], Pair) and got.extra[0].a.tolist() == [2.0] and got.extra[0].b == 3
    ordered = map_tensors(lambda t: t + 1, collections.OrderedDict(x=torch.zeros(1)))
    assert isinstance(ordered, collections.OrderedDict) and ordered["x"].item() == 1.0
