"""tinylm: a small pretrained causal language model that works offline, for serving (``--mode generate``).

A Llama (RMSNorm, rotary positions, grouped-query attention: 4 query heads over 2 key/value heads, SwiGLU), 4
layers, width 128, 1,024 positions, over UTF-8 bytes (a 256-token vocabulary: no tokenizer to ship), trained here on
Python's reference documentation (``scripts/train_tinylm.py``; the weights ship in ``data/tinylm``). Its held-out
text is the CPython docstrings ``data/corpus.txt`` holds, which it never saw: prompts and perplexity come from there.
As a task it is inference-only (its held-out loss and perplexity, teacher-forced); ``hf:`` can load the same folder.
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from dtypelab.core.task import Task
from dtypelab.core.tasks.charlm import _corpus

HELD_OUT_SEQ = 128  # the task's own evaluation windows (serving takes its own lengths)


def folder() -> Path:
    return Path(str(resources.files("dtypelab.core.tasks").joinpath("data/tinylm")))


def held_out_bytes() -> torch.Tensor:
    """The held-out text as byte ids: the CPython docstrings, which the model never saw."""
    return torch.frombuffer(bytearray(_corpus().encode("utf-8")), dtype=torch.uint8).long()


def text_windows(data: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """``n`` non-overlapping windows of ``length`` tokens, evenly spread over ``data`` (the same for every policy);
    fewer when the text is too short for ``n``."""
    if length > len(data):
        raise ValueError(f"the held-out text has {len(data)} tokens; {length} were asked for")
    count = min(n, len(data) // length)
    stride = len(data) // count
    return torch.stack([data[i * stride:i * stride + length] for i in range(count)])


def make_task() -> Task:
    from transformers import AutoModelForCausalLM

    from dtypelab.core.tasks.hub import config_of, factory

    path = folder()
    data = held_out_bytes()
    windows = text_windows(data, 32, HELD_OUT_SEQ)
    make_model = factory(path, config_of(path), AutoModelForCausalLM)  # its config alone on the meta device

    def evaluate(predict: Any) -> dict[str, float]:
        nats = 0.0
        for i in range(0, len(windows), 8):
            x = windows[i:i + 8]
            out = predict({"input_ids": x})
            out = out.logits if hasattr(out, "logits") else out
            nats += F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]).float(), x[:, 1:].reshape(-1)).item() \
                * len(x)
        nats /= len(windows)
        return {"val_loss": nats, "perplexity": math.exp(nats)}

    return Task(name="tinylm", make_model=make_model, evaluate=evaluate, metric="val_loss", higher_is_better=False,
                infer_batch=lambda n: {"input_ids": windows[:n]}, inference_only=True, pretrained=True,
                batch_size=8, steps=20, text=lambda n, length: text_windows(data, n, length), context=1024,
                description="a 4-layer Llama (grouped-query attention) over bytes, trained here on Python's "
                            "reference documentation; held-out text: CPython docstrings")
