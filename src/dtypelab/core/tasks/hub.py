"""Finding and building a Hugging Face model for an ``hf:`` task: ``hf:ORG/NAME`` in the local hub cache (its
``config.json`` alone fetched when it is not cached and the hub answers: all a forecast needs) or ``hf:PATH``, a
directory with ``config.json``; the model from its config (on the meta device for a forecast, as accelerate's
``init_empty_weights`` does) or with its weights where the directory or the cache has them."""

from __future__ import annotations

import contextlib
import os
import socket
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtypelab.core.backends import quiet
from dtypelab.core.errors import TaskError
from dtypelab.core.task import HF_PREFIX

PREFIX = HF_PREFIX
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
    if path.is_file() and path.name == "config.json":  # the file itself: its folder is the model's
        path = path.parent
    elif path.is_file():
        raise TaskError(f"hf:{where} is a file: give the directory that holds the model's config.json")
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


def config_of(path: Path) -> Any:
    """``path``'s config as transformers reads it, its shape checked first: the sizes a model is built from present
    (not transformers' defaults, an 8B Llama's) and positive, the heads dividing into key/value heads."""
    try:
        with quiet():
            from transformers import AutoConfig
    except ImportError:
        raise TaskError(f"an hf: task needs transformers: {EXTRA}") from None
    try:
        with quiet():
            config = AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # an unknown model_type said as such, else transformers' own first sentence
        raise TaskError(_unknown_model_type(path) or f"{path}/config.json: transformers cannot read it "
                        f"({type(exc).__name__}: {_first_sentence(str(exc))})") from None
    _check_shape(path, config)
    return config


def quantized_note(config: Any) -> str:
    """What a config's ``quantization_config`` says its checkpoint stores, and that the policies ignore it, in one
    line ("" for none): a policy converts the model's own weights, as built from the config."""
    q = getattr(config, "quantization_config", None)
    if not q:
        return ""
    q = q if isinstance(q, dict) else getattr(q, "to_dict", lambda: {})()
    method = q.get("quant_method") or q.get("format") or "a quantization method"
    bits = q.get("bits") or q.get("w_bit")
    group = q.get("group_size") or q.get("q_group_size")
    said = f"{method}" + (f", {bits}-bit" if bits else "") + (f", groups of {group}" if group else "")
    return (f"the config's quantization_config ({said}) is not applied: each policy starts from the model in "
            "bfloat16 and converts it itself (int4-wo is the nearest to a 4-bit checkpoint's weights)")


SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads")  # what every model here is built from


def _check_shape(path: Path, config: Any) -> None:
    """One line for a config whose sizes are missing (transformers would fill its defaults), not positive, or whose
    attention heads do not divide into its key/value heads."""
    import json

    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return  # transformers read it from elsewhere (a hub cache's snapshot): nothing to compare with
    raw = raw.get("text_config", raw) if isinstance(raw, dict) else {}
    names = {v: k for k, v in getattr(type(text), "attribute_map", {}).items()}  # n_embd -> hidden_size, ...
    given = {names.get(k, k) for k in raw}
    missing = [k for k in SIZES if k not in given and hasattr(text, k)]
    if missing:
        raise TaskError(f"{path}/config.json has no {', '.join(missing)}: transformers would build its default "
                        "model in their place; give the model's own")
    for key in (*SIZES, "num_key_value_heads", "vocab_size", "head_dim", "intermediate_size"):
        value = getattr(text, key, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise TaskError(f"{path}/config.json: {key} is {value!r}: it must be a whole number of at least 1")
    heads, kv = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if heads and kv and heads % kv:
        raise TaskError(f"{path}/config.json: num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                        f"({kv})")


def _first_sentence(text: str, most: int = 240) -> str:
    """An exception's first sentence, whole (cut at a word, with an ellipsis, only past ``most`` characters); a
    first line that ends in a colon takes the line its cause is on (pydantic's and transformers' validators')."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()] or [""]
    line = lines[0]
    for more in lines[1:]:
        if not line.endswith(":"):
            break
        line = f"{line} {more}"
    first = line.split(". ")[0].rstrip(".")
    return first if len(first) <= most else first[:most].rsplit(" ", 1)[0] + " …"


def _unknown_model_type(path: Path) -> str | None:
    """Why the config's ``model_type`` is one this transformers does not know, in one line, or None."""
    import json

    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # transformers says what is wrong with the file
    if not isinstance(model_type, str) or model_type in CONFIG_MAPPING_NAMES:
        return None
    return (f"{path}/config.json: model_type {model_type!r} is not one transformers {__version__} knows (a newer "
            "transformers, or a model whose code is its own: hf: tasks load only transformers' own models)")


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
def hushed() -> Iterator[None]:
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


def factory(path: Path, config: Any, auto: Any, **extra: Any) -> Any:
    """The model: its weights from ``path`` when there and not building on the meta device, else its config's."""
    weights = has_weights(path)

    def make() -> nn.Module:
        with quiet(), hushed():
            if weights and not _building_on_meta():
                return auto.from_pretrained(str(path), dtype=torch.float32, **extra)
            for key, value in extra.items():
                setattr(config, key, value)
            return auto.from_config(config, dtype=torch.float32)

    return make


def logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out["logits"] if isinstance(out, dict) else out


def at_depth(config: Any, n: int) -> Any:
    """A copy of a decoder's config with ``n`` of its layers (per-layer attention kinds kept in order)."""
    import copy

    shallow = copy.deepcopy(config)
    shallow.num_hidden_layers = n
    if isinstance(getattr(shallow, "layer_types", None), list):
        shallow.layer_types = shallow.layer_types[:n]
    return shallow


__all__ = ["DEFAULT_SEQ", "PREFIX", "at_depth", "causal", "config_of", "factory", "has_weights", "hushed", "locate",
           "logits", "quantized_note", "split_spec", "with_seq_len"]
