"""The loss as a choice (``POLICY+chunked-ce``): torchtune's chunked output projection and cross-entropy beside the
task's own loss, the loss's share of the memory apart from the activations (forecast and bench), and the pure
bfloat16 LoRA recipes (``-pure``)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import HERE
from torch import nn
from torch.nn import functional as F

import dtypelab
from dtypelab.core.errors import DtypelabError, Unsupported
from dtypelab.core.footprint import loss_part, saved_activations
from dtypelab.core.policies import Precision, get_policy
from dtypelab.core.policies.loss import IGNORE_INDEX, HeadInputs, chunked_cross_entropy, logit_width
from dtypelab.core.policies.plan import Plan

WIDE = os.path.join(HERE, "data", "llama-wide")  # a 4,096-token vocabulary on 32 features: the loss dominates
PHI3 = os.path.join(HERE, "data", "phi3-tiny")
TINY_LLAMA = os.path.join(os.path.dirname(HERE), "benchmarks", "configs", "tiny-llama")


# --- the name ---------------------------------------------------------------------------------------------------
def test_chunked_ce_is_a_modifier_named_in_the_policy_and_kept_in_its_record():
    plan = get_policy("lora-bf16+ckpt+chunked-ce16+adam8bit")
    assert plan.loss == "chunked-ce16" and plan.checkpoint and plan.state is not None
    assert plan.name == "lora-bf16+ckpt+chunked-ce16+adam8bit"
    assert "16 chunks" in plan.describe()
    again = Plan.from_dict(plan.to_dict(), lookup=lambda n: get_policy(n).default)
    assert again.loss == "chunked-ce16" and again.name == plan.name
    assert get_policy("fp32+chunked-ce").loss == "chunked-ce"  # 8 chunks, torchtune's default
    assert "loss" not in get_policy("fp32").to_dict()  # a plan without one reads as before


@pytest.mark.parametrize("name, message", [
    ("fp32+chunked-ce+chunked-ce", "a loss is named twice"),
    ("fp32+chunked-ce0", "the number of chunks is 1 to 1024"),
    ("int8-dyn+chunked-ce", "inference-only"),
])
def test_a_loss_choice_that_means_nothing_is_one_line(name, message):
    with pytest.raises(DtypelabError, match=message):
        get_policy(name)


# --- the arithmetic ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_the_chunked_loss_and_its_gradients_equal_the_whole_cross_entropy(chunks):
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=False)
    hidden = torch.randn(2, 11, 16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 11))
    targets[0, 3] = targets[1, -1] = IGNORE_INDEX  # positions that predict nothing count neither way
    whole = F.cross_entropy(head(hidden).reshape(-1, 50).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    whole.backward()
    expected = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = head.weight.grad = None
    chunked = chunked_cross_entropy(HeadInputs(hidden, head, targets), chunks)
    chunked.backward()
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close((hidden.grad, head.weight.grad), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("base", ["fp32", "amp-bf16", "lora-bf16+ckpt"])
def test_an_hf_models_chunked_loss_trains_as_its_own_loss(base):
    """Hugging Face's loss (labels=input_ids, shifted inside) and the chunked one from the decoder's hidden states:
    the same loss and gradients, to float32's rounding and to bfloat16's where the policy computes in it."""
    from dtypelab.core.loop import build_trainable, forward_loss, to_device
    from dtypelab.core.task import load_task

    task = load_task(f"hf:{PHI3}#seq=32")
    got = {}
    for name in (base, f"{base}+chunked-ce"):
        precision = Precision(get_policy(name), "cpu")
        model, _ = build_trainable(task, precision, torch.device("cpu"), 0)
        inputs, target = to_device(task.batch(0, 2), torch.device("cpu"))
        loss = forward_loss(task, model, precision, inputs, target)
        precision.backward(loss)
        got[name] = float(loss.detach()), [p.grad.float() for p in model.parameters() if p.grad is not None]
    (own, own_grads), (chunked, chunked_grads) = got.values()
    rtol, atol = (1e-5, 1e-6) if base == "fp32" else (2e-2, 2e-4)  # float32's rounding; bfloat16's 8 bits
    assert chunked == pytest.approx(own, rel=rtol) and len(own_grads) == len(chunked_grads) > 0
    for a, b in zip(own_grads, chunked_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def test_a_task_without_an_output_projection_refuses_a_loss_choice_in_one_line(tiny):
    from dtypelab.core.loop import build_trainable, forward_loss, to_device
    from dtypelab.core.task import load_task

    task = load_task(tiny)
    precision = Precision(get_policy("fp32+chunked-ce"), "cpu")
    model, _ = build_trainable(task, precision, torch.device("cpu"), 0)
    inputs, target = to_device(task.batch(0, 2), torch.device("cpu"))
    with pytest.raises(Unsupported, match=r"\+chunked-ce: task .* gives no output projection"):
        forward_loss(task, model, precision, inputs, target)


# --- the loss's share --------------------------------------------------------------------------------------------
def test_the_forecast_counts_the_loss_apart_and_chunks_shrink_it_as_the_steps_run_here_do():
    report = dtypelab.forecast(f"hf:{WIDE}", seq_len=64, policies="fp32,fp32+chunked-ce", device="cpu",
                               check=True, batch_search=False, batch_size=2, launcher="inline", speed=False)
    full, chunked = report.result("fp32"), report.result("fp32+chunked-ce")
    for p in (full, chunked):
        assert p.status == "ok", p.reason
        assert p.train.peak_bytes == p.check.train_peak_bytes  # the same ledger on real tensors
    # 2 sequences x 64 positions x 4,096 logits x 4 bytes: the float32 log-probabilities Hugging Face's loss keeps
    # for the backward, and its gradient beside them at the peak
    kept = 2 * 64 * 4096 * 4
    assert full.train.breakdown["loss"] >= 2 * kept
    # the whole loss holds its logits, their float32 copy and the log-probabilities at once; the chunks a chunk's
    assert chunked.train.breakdown["loss"] < full.train.breakdown["loss"]
    assert chunked.train.peak_bytes < full.train.peak_bytes
    assert "The loss holds" in report.answer and "fp32+chunked-ce computes it in chunks" in report.answer


def test_bench_counts_the_log_probabilities_the_loss_keeps_apart():
    from dtypelab.core.loop import build_trainable, forward_loss, to_device
    from dtypelab.core.task import load_task

    task = load_task(f"hf:{WIDE}#seq=16")
    precision = Precision(get_policy("fp32"), "cpu")
    model, _ = build_trainable(task, precision, torch.device("cpu"), 0)
    assert logit_width(model) == 4096
    parts = loss_part(logit_width(model))
    inputs, target = to_device(task.batch(0, 2), torch.device("cpu"))
    with saved_activations(model, parts) as saved:
        forward_loss(task, model, precision, inputs, target)
    # Hugging Face's loss keeps the float32 log-probabilities of all 2 x 16 positions for its backward
    assert 2 * 16 * 4096 * 4 <= saved["loss"] < saved["bytes"]
    assert loss_part(0) == []


# --- pure bfloat16 LoRA -------------------------------------------------------------------------------------------
def test_pure_bf16_lora_keeps_its_adapters_and_their_adam_state_in_bfloat16():
    from dtypelab.core.loop import build_trainable, to_device, train_step
    from dtypelab.core.task import load_task

    task = load_task(f"hf:{PHI3}#seq=16")
    held = {}
    for name in ("lora-bf16", "lora-bf16-pure"):
        precision = Precision(get_policy(name), "cpu")
        model, optimizer = build_trainable(task, precision, torch.device("cpu"), 0)
        inputs, target = to_device(task.batch(0, 2), torch.device("cpu"))
        train_step(task, model, precision, optimizer, inputs, target)
        trained = [p for p in model.parameters() if p.requires_grad]
        states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        held[name] = {p.dtype for p in trained}, {t.dtype for t in states}
    assert held["lora-bf16"] == ({torch.float32}, {torch.float32})
    assert held["lora-bf16-pure"] == ({torch.bfloat16}, {torch.bfloat16})
    assert not get_policy("lora-bf16-pure").default.facts.keeps_updates  # its lost updates are probed
    with pytest.raises(DtypelabError, match="bfloat16 adapters are for a bfloat16 or quantized base"):
        from dtypelab.core.policies.kinds.lora import LoRA
        LoRA("float32", adapters="bfloat16")


def test_checkpointed_blocks_and_the_chunked_loss_trace_under_fsdp2():
    """FSDP2 shards each checkpointed block as a unit: its fully_shard swaps the wrapper's class (which went to the
    block inside it: "KeyError: '_lab_module'"), then finds the unit again among the root's modules (which named the
    block inside: its all-gather streams were never made). The chunked loss calls the model whole, so the root's
    weights (embeddings, head) are gathered as for its own loss."""
    report = dtypelab.forecast(f"hf:{TINY_LLAMA}", seq_len=32, device="cpu",
                               policies="amp-bf16+ckpt+fsdp,lora-bf16+ckpt+chunked-ce+fsdp", batch_search=False,
                               batch_size=4, nproc=2, launcher="inline", speed=False)
    for p in report.policies:
        assert p.status == "ok" and not p.untraced and p.method == "traced", (p.policy, p.reason, p.notes)


@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float32, 1e-5, 1e-6), (torch.bfloat16, 1.6e-2, 1e-3)])
def test_the_compiled_chunks_cross_entropy_equals_torchs(dtype, rtol, atol):
    """FusedChunk (what a compiled plan's chunk computes): the summed cross-entropy over the positions with a target
    and its gradient, as F.cross_entropy on the upcast logits gives them, to the logits' dtype's rounding."""
    from dtypelab.core.policies.loss import FusedChunk

    torch.manual_seed(0)
    logits = (torch.randn(12, 300) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, 300, (12,))
    targets[[2, 7]] = IGNORE_INDEX
    expected = F.cross_entropy(logits.float(), targets, reduction="sum", ignore_index=IGNORE_INDEX)
    (expected * 0.5).backward()
    want = logits.grad.clone()
    logits.grad = None
    got = FusedChunk.apply(logits, targets)
    (got * 0.5).backward()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    assert logits.grad.dtype == dtype and not logits.grad[[2, 7]].any()
    torch.testing.assert_close(logits.grad.float(), want.float(), rtol=rtol, atol=atol)


def test_a_compiled_plans_chunks_keep_their_logits_and_a_log_sum_exp_not_float32_log_probabilities():
    report = dtypelab.forecast(f"hf:{WIDE}", seq_len=64, policies="amp-bf16+chunked-ce,amp-bf16+compile+chunked-ce",
                               device="cpu", batch_search=False, batch_size=2, launcher="inline", speed=False)
    eager, compiled = report.result("amp-bf16+chunked-ce"), report.result("amp-bf16+compile+chunked-ce")
    assert eager.status == compiled.status == "ok", (eager.reason, compiled.reason)
    # what the backward keeps of the loss: 2 x 63 positions x 4,096 logits, float32 log-probabilities (4 bytes) in
    # the eager chunks, the bfloat16 logits (2 bytes) and a float32 log-sum-exp a position in the compiled ones
    assert compiled.train.peak_bytes < eager.train.peak_bytes
    assert compiled.train.breakdown["loss"] < eager.train.breakdown["loss"]


def test_the_batch_search_counts_the_loss_among_what_each_sample_adds():
    """The search's first jump goes where the traced peak's per-sample bytes meet the limit: with the loss counted
    apart, those bytes include it (they once did not, and a loss-heavy model's search overshot and traced more)."""
    report = dtypelab.forecast(f"hf:{WIDE}", seq_len=64, policies="fp32", device="H100", memory="40MiB", reserve="0",
                               batch_size=2, launcher="inline", speed=False)
    fit = report.result("fp32").train_fit
    assert fit.largest_batch is not None and fit.largest_batch > 4
    assert fit.traces == 2  # the estimate fits and the size after it does not (without the loss: 3 traces)
