"""``hf:ORG/NAME`` or ``hf:PATH``: a Hugging Face model as a task, found by its id in the local hub cache or as a
directory with ``config.json``; nothing is downloaded unless the hub can be reached and the model is not cached (then
its ``config.json`` alone, which is all a forecast needs).

The model is built from its config (``transformers``' Auto classes): on the meta device for a forecast (no weights,
as accelerate's ``init_empty_weights`` does), with its weights where the directory or the cache has them (otherwise
from its config's initialization, and the description says so).

- A causal language model (``*ForCausalLM``): sequences of ``seq`` tokens (``hf:PATH#seq=N``, what ``--seq-len``
  writes; default 512, at most the model's context) from gpt2's generated corpus over the model's vocabulary, the
  model's own causal-LM loss (``labels=input_ids``), held-out loss and perplexity.
- An encoder (BERT-like): sequence-pair classification on the paraphrase pairs dtypelab ships (is the second sentence
  a paraphrase of the first?), a new two-way head, held-out accuracy (``minilm-ft`` is MiniLM's).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import socket
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dtypelab.core.backends import quiet
from dtypelab.core.errors import TaskError
from dtypelab.core.task import Task
from dtypelab.core.tasks.gpt2 import EVAL_SEQUENCES, HELD_OUT_SEED, Chain

PREFIX = "hf:"
DEFAULT_SEQ = 512
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
EXTRA = "pip install 'dtypelab[hf]' (transformers)"


def split_spec(spec: str) -> tuple[str, int | None]:
    """``hf:WHERE#seq=N`` -> (WHERE, N or None)."""
    where, _, tail = spec.removeprefix(PREFIX).partition("#")
    seq = None
    for part in filter(None, tail.split("&")):
        key, _, value = part.partition("=")
        if key != "seq" or not value.isdigit() or int(value) < 2:
            raise TaskError(f"{spec}: after # only seq=N (N >= 2 tokens) is understood")
        seq = int(value)
    return where, seq


def with_seq_len(spec: Any, seq: int | None) -> Any:
    """The spec of an ``hf:`` task with ``seq`` tokens per sequence (``--seq-len``); a one-line error for another."""
    if seq is None:
        return spec
    if not isinstance(spec, str) or not spec.startswith(PREFIX):
        raise TaskError(f"--seq-len is for a Hugging Face language model (hf:ORG/NAME or hf:PATH); {spec} has its own "
                        "sequence length")
    where, _ = split_spec(spec)
    return f"{PREFIX}{where}#seq={seq}"


def locate(where: str) -> Path:
    """The directory holding the model's ``config.json``: ``where`` itself, or the hub cache's snapshot of the id
    ``where``; the config alone is fetched when neither has it and the hub answers."""
    path = Path(where).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TaskError(f"hf:{where}: the directory has no config.json")
        return path
    if where.count("/") != 1 or where.startswith((".", "/", "~")):
        raise TaskError(f"hf:{where}: no such directory, and not a hub id (ORG/NAME)")
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
    except ImportError:
        raise TaskError(f"hf:{where} needs huggingface_hub to find a hub id: {EXTRA}") from None
    cached = try_to_load_from_cache(where, "config.json")
    if isinstance(cached, str):
        return Path(cached).parent
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
    missing = f"hf:{where} is neither a local directory nor in the Hugging Face cache ({cache})"
    unreachable = _unreachable()
    if unreachable:  # said at once, rather than after the hub client's retries (half a minute)
        raise TaskError(f"{missing}, and the hub cannot be reached ({unreachable})")
    try:
        with quiet():
            return Path(hf_hub_download(where, "config.json", etag_timeout=5)).parent
    except Exception as exc:
        why = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise TaskError(f"{missing}, and the hub did not give its config.json ({type(exc).__name__}: {why})") from None


def _unreachable() -> str | None:
    """Why the hub cannot be asked (offline mode, or no connection to its host within 3 s), or None."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((host.hostname or "huggingface.co", host.port or 443), timeout=3).close()
    except OSError as exc:
        return f"no connection to {host.hostname}: {exc}"
    return None


def _config(path: Path) -> Any:
    try:
        with quiet():
            from transformers import AutoConfig
    except ImportError:
        raise TaskError(f"an hf: task needs transformers: {EXTRA}") from None
    try:
        with quiet():
            return AutoConfig.from_pretrained(str(path))
    except Exception as exc:
        raise TaskError(f"{path}/config.json: transformers cannot read it ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:160]})") from None


def causal(config: Any) -> bool:
    """Whether the config's model is a causal language model."""
    architectures = getattr(config, "architectures", None) or ()
    if architectures:
        return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    # an encoder (BERT) has a causal-LM head class too, and a masked one: a decoder has no masked one
    return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and config.model_type not in \
        MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_encoder_decoder", False)


def has_weights(path: Path) -> bool:
    return any((path / w).is_file() for w in WEIGHTS)


def _building_on_meta() -> bool:
    return torch.empty(0).device.type == "meta"


@contextlib.contextmanager
def _hushed() -> Iterator[None]:
    """transformers' loading report and progress bar (the new head's weights are missing by design), silenced."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _factory(path: Path, config: Any, auto: Any, **extra: Any) -> Any:
    """The model: its weights from ``path`` when there and not building on the meta device, else its config's."""
    weights = has_weights(path)

    def make() -> nn.Module:
        with quiet(), _hushed():
            if weights and not _building_on_meta():
                return auto.from_pretrained(str(path), dtype=torch.float32, **extra)
            for key, value in extra.items():
                setattr(config, key, value)
            return auto.from_config(config, dtype=torch.float32)

    return make


def make_task(spec: str) -> Task:
    """The task for ``hf:WHERE[#seq=N]``."""
    where, seq = split_spec(spec)
    path = locate(where)
    config = _config(path)
    name = where.rstrip("/").rpartition("/")[2] or where
    if causal(config):
        return _causal_task(name, path, config, seq)
    if seq is not None:
        raise TaskError(f"--seq-len: {where} is not a causal language model (its sequences are the task's own)")
    return pairs_task(name, path, config)


def _causal_task(name: str, path: Path, config: Any, seq: int | None) -> Task:
    from transformers import AutoModelForCausalLM

    context = getattr(config, "max_position_embeddings", None) or DEFAULT_SEQ
    seq = seq or min(DEFAULT_SEQ, context)
    if seq > context:
        raise TaskError(f"--seq-len {seq}: {name} takes at most {context} tokens (max_position_embeddings)")
    vocab = config.vocab_size
    chain = Chain(vocab, seq)
    held = chain.sample(EVAL_SEQUENCES // 4, seed=HELD_OUT_SEED)

    def train_batch(step: int, batch_size: int) -> dict[str, torch.Tensor]:
        return {"input_ids": chain.sample(batch_size, seed=step)[:, :-1]}

    def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def evaluate(predict: Any) -> dict[str, float]:
        nats = 0.0
        for i in range(len(held)):
            x = held[i:i + 1, :-1]
            logits = _logits(predict({"input_ids": x}))
            nats += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1)).item()
        nats /= len(held)
        return {"val_loss": nats, "perplexity": math.exp(min(nats, 50.0))}

    params = _parameter_count(config)
    return Task(
        name=name, make_model=_factory(path, config, AutoModelForCausalLM), train_batch=train_batch,
        blocks=getattr(config, "num_hidden_layers", 0) or 0, with_blocks=lambda n: _with_blocks(config, n),
        compute_loss=compute_loss, evaluate=evaluate, metric="val_loss", higher_is_better=False,
        make_optimizer=lambda p: torch.optim.AdamW(p, lr=2e-4, weight_decay=0.0), steps=20, batch_size=4,
        infer_batch=lambda n: {"input_ids": held[:n, :-1]},
        description=f"{config.model_type} causal language model from {path}"
                    + (f" ({_count(params)} parameters)" if params else "") + f", {seq} tokens per sequence; "
                    + ("its weights" if has_weights(path) else "no weights there: its config's initialization")
                    + "; gpt2's generated corpus over its vocabulary; held-out loss and perplexity")


def _with_blocks(config: Any, n: int) -> nn.Module:
    """The model with ``n`` of its decoder layers, from its config (untrained: what a forecast traces)."""
    from transformers import AutoModelForCausalLM

    shallow = copy.deepcopy(config)
    shallow.num_hidden_layers = n
    if isinstance(getattr(shallow, "layer_types", None), list):  # per-layer attention kinds, kept in order
        shallow.layer_types = shallow.layer_types[:n]
    with quiet(), _hushed():
        return AutoModelForCausalLM.from_config(shallow, dtype=torch.float32)


def _count(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _parameter_count(config: Any) -> int | None:
    try:
        with quiet():
            from accelerate import init_empty_weights
            from transformers import AutoModelForCausalLM

            with init_empty_weights():
                model = AutoModelForCausalLM.from_config(config)
        return sum(p.numel() for p in model.parameters())
    except Exception:
        return None


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out["logits"] if isinstance(out, dict) else out


# --- an encoder fine-tuned on sentence pairs ---------------------------------------------------------------
PAIR_SEQ = 64
PAIR_EVAL_SHARE = 3  # every third pair is held out


def _pair_data(path: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(train inputs, labels, held-out inputs, labels): each shipped pair as a positive, and its first sentence beside
    the next pair's paraphrase as a negative (the same topic often: not separable by words alone)."""
    from dtypelab.core.tasks.minilm import pairs

    if not (path / "tokenizer.json").is_file():
        raise TaskError(f"{path}: an encoder's pair-classification task needs its tokenizer.json")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.enable_truncation(PAIR_SEQ)
    tok.enable_padding(length=PAIR_SEQ, pad_id=0, pad_token="[PAD]")
    p = pairs()
    rows = [(a, b, 1) for a, b in p] + [(a, p[(i + 1) % len(p)][1], 0) for i, (a, _) in enumerate(p)]
    held = [i for i in range(len(rows)) if (i % len(p)) % PAIR_EVAL_SHARE == 0]
    train = [i for i in range(len(rows)) if i not in set(held)]

    def encode(index: list[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        enc = tok.encode_batch([(rows[i][0], rows[i][1]) for i in index])
        inputs = {"input_ids": torch.tensor([e.ids for e in enc]),
                  "attention_mask": torch.tensor([e.attention_mask for e in enc]),
                  "token_type_ids": torch.tensor([e.type_ids for e in enc])}
        return inputs, torch.tensor([rows[i][2] for i in index])

    return (*encode(train), *encode(held))


def pairs_task(name: str, path: Path, config: Any, task_name: str | None = None) -> Task:
    """Fine-tuning an encoder (with a new two-way head, ``classifier``) to tell paraphrases from other sentences."""
    from transformers import AutoModelForSequenceClassification

    x, y, hx, hy = _pair_data(path)

    def train_batch(step: int, batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, len(y), (batch_size,), generator=g)
        return {k: v[idx] for k, v in x.items()}, y[idx]

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_logits(out).float(), target)

    def evaluate(predict: Any) -> dict[str, float]:
        logits = torch.cat([_logits(predict({k: v[i:i + 32] for k, v in hx.items()})).float()
                            for i in range(0, len(hy), 32)])
        return {"accuracy": (logits.argmax(-1) == hy).float().mean().item(),
                "val_loss": F.cross_entropy(logits, hy).item()}

    make = _factory(path, config, AutoModelForSequenceClassification, num_labels=2)

    def make_model() -> nn.Module:
        torch.manual_seed(0)  # the new head's initialization: the same for every policy
        return make()

    return Task(
        name=task_name or name, make_model=make_model, train_batch=train_batch, loss_fn=loss_fn, evaluate=evaluate,
        metric="accuracy", make_optimizer=lambda p: torch.optim.AdamW(p, lr=2e-4, weight_decay=0.0), steps=60,
        batch_size=16, infer_batch=lambda n: {k: v[:n] for k, v in hx.items()},
        description=f"{config.model_type} encoder from {path} fine-tuned with a new two-way head to tell paraphrases "
                    f"from other sentences ({len(y)} training pairs, {len(hy)} held out, {PAIR_SEQ} tokens); held-out "
                    "accuracy" + ("" if has_weights(path) else "; no weights there: its config's initialization"))


def make_minilm_finetune() -> Task:
    """``minilm-ft``: the pretrained MiniLM the ``minilm`` task ships, fine-tuned on the paraphrase pairs."""
    from dtypelab.core.tasks.minilm import model_dir

    path = model_dir()
    return pairs_task("minilm", path, _config(path), task_name="minilm-ft")


def read_config(path: str | Path) -> dict[str, Any]:
    """A model directory's config.json as data (nothing imported, nothing run)."""
    return json.loads((Path(path) / "config.json").read_text())


__all__ = ["PREFIX", "causal", "locate", "make_minilm_finetune", "make_task", "split_spec", "with_seq_len"]
