"""The KV cache a served model decodes with: a static cache (allocated once for the whole context, as gpt-fast and
serving engines do, so that its bytes are what a server reserves and ``torch.compile`` can capture it), one layer of
keys and values per attention layer, stored in a format of its own (``+kv-fp8``...), whatever the weights are in.

The formats are kinds of the registry (``core.policies.kinds.kv_cache``: each one's scales and how a tensor goes in
and comes out are its own hooks); this module is the cache that holds them.
"""

from __future__ import annotations

from typing import Any

import torch

from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies import KV_FORMATS
from dtypelab.core.policies.kinds import NATIVE, KVFormat

FORMATS: dict[str, KVFormat] = KV_FORMATS  # every registered format by label


def kv_format(label: str | None) -> KVFormat:
    if label is None or label == NATIVE.label:
        return NATIVE
    if label not in FORMATS:
        raise DtypelabError(f"unknown KV-cache format {label!r}: use one of {', '.join(FORMATS)}")
    fmt: KVFormat = FORMATS[label]
    return fmt


class KVLayer:
    """One attention layer's keys and values for ``max_len`` tokens, in ``fmt``: the interface of transformers'
    cache layers (``update`` returns every cached position, masked beyond the tokens written, as its StaticLayer
    does). ``layer_class()`` makes it one of transformers' ``CacheLayerMixin`` (imported only when a cache is
    made: transformers is an extra).

    A sliding-window layer (``window`` shorter than ``max_len``) holds the last ``window`` tokens only, as
    transformers' ``StaticSlidingWindowLayer`` does and with its mask sizes, but in a ring: token ``p`` lives in slot
    ``p % window``, so a decode step writes one slot instead of rolling the whole window (every slot of a full window
    is attended, in any order); a chunk of several tokens gets the window's tokens in order before its own."""

    is_compileable = True
    is_sliding = False
    is_initialized = False

    def __init__(self, max_len: int, fmt: KVFormat, window: int | None = None,
                 preset: tuple[float, float] | None = None) -> None:
        self.is_initialized = self.calibrated = False
        self.preset = preset  # the (key, value) scales calibration text set, kept through resets
        self.is_sliding = window is not None and window < max_len
        self.max_cache_len, self.fmt = (window if self.is_sliding and window else max_len), fmt
        self.cumulative_length = torch.tensor(0, dtype=torch.long)
        self.seen = 0  # tokens written, as a Python int (a sliding layer's slots and mask sizes)
        self.keys: Any = None
        self.values: Any = None

    # what transformers asks of a layer ---------------------------------------------------------------------------
    def allocate(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """The whole context's storage, before the first token (a server reserves its cache up front)."""
        self.dtype, self.device = dtype, device
        self.cumulative_length = self.cumulative_length.to(device)
        storage = self.fmt.storage or dtype
        self.keys = torch.zeros((batch, kv_heads, self.max_cache_len, head_dim), dtype=storage, device=device)
        self.values = torch.zeros_like(self.keys)
        shape = self.fmt.scale_shape(batch, kv_heads, self.max_cache_len)
        if shape is not None:  # the format's scales beside keys and values
            self.key_scale = torch.ones(shape, dtype=torch.float32, device=device)
            self.value_scale = torch.ones_like(self.key_scale)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.allocate(b, h, d, key_states.dtype, key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if not self.calibrated and hasattr(self, "key_scale"):  # a format that fixes its scales from the prompt
            if self.preset is not None:
                self.key_scale.fill_(self.preset[0])
                self.value_scale.fill_(self.preset[1])
            else:
                self.fmt.calibrate(self.key_scale, key_states)
                self.fmt.calibrate(self.value_scale, value_states)
            self.calibrated = True
        if self.is_sliding and self.seen + n > self.max_cache_len:
            return self._slide(key_states, value_states)
        # the positions as a tensor (as transformers' StaticLayer keeps them): a compiled decode step is then one
        # graph for every position, not one per position
        at = torch.arange(n, device=self.device) + self.cumulative_length
        self._write(self.keys, getattr(self, "key_scale", None), key_states, at)
        self._write(self.values, getattr(self, "value_scale", None), value_states, at)
        self.cumulative_length.add_(n)
        self.seen += n
        return self._read(self.keys, getattr(self, "key_scale", None)), \
            self._read(self.values, getattr(self, "value_scale", None))

    def _slide(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A sliding layer's update past its window: one token into its slot (the whole window returned), or a chunk
        returned after the window's tokens in order (all of them before the window fills; after, all but the oldest,
        which the chunk's first token no longer sees), its last ``window`` tokens kept."""
        n, window, seen = key_states.shape[-2], self.max_cache_len, self.seen
        stores = ((self.keys, getattr(self, "key_scale", None), key_states),
                  (self.values, getattr(self, "value_scale", None), value_states))
        if n == 1 and seen >= window:
            at = torch.tensor([seen % window], device=self.device)
            for store, scale, x in stores:
                self._write(store, scale, x, at)
            out = tuple(self._read(store, scale) for store, scale, _ in stores)
        else:
            keep = seen if seen < window else window - 1
            order = torch.arange(seen - keep, seen, device=self.device) % window
            out = tuple(torch.cat([self._read(_select(store, order), _rows(scale, order)), x], dim=-2)
                        for store, scale, x in stores)
            kept = min(n, window)
            last = torch.arange(seen + n - kept, seen + n, device=self.device)
            for store, scale, x in stores:
                self._write(store, scale, x[:, :, n - kept:], last % window)
        self.cumulative_length.add_(n)
        self.seen += n
        return out[0], out[1]

    def _write(self, store: torch.Tensor, scale: torch.Tensor | None, x: torch.Tensor, at: torch.Tensor) -> None:
        q = self.fmt.encode(x, scale, at, store.dtype)
        if store.element_size() == 1 and store.is_floating_point():  # no index_copy_ for float8 on every device
            store.view(torch.uint8).index_copy_(2, at, q.view(torch.uint8))
        else:
            store.index_copy_(2, at, q)

    def _read(self, store: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        return self.fmt.decode(store, scale, self.dtype)

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        """(keys the mask spans, position of the first): transformers' StaticSlidingWindowLayer's for a sliding
        layer (asked before the update)."""
        window, seen = self.max_cache_len, self.seen
        if not self.is_sliding:
            return window, 0
        offset = max(seen - window + 1, 0)
        if seen >= window:
            return window + query_length - 1, offset
        return (seen + query_length if seen + query_length > window else window), offset

    def seek(self, position: int) -> None:
        """As if ``position`` tokens had been written (a trace's decode step with the cache full)."""
        self.cumulative_length.fill_(position)
        self.seen = position

    def get_seq_length(self) -> Any:
        return self.cumulative_length  # a tensor, as transformers' StaticLayer returns (see update)

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.cumulative_length.zero_()
        self.seen = 0
        self.calibrated = False

    def written(self) -> int:
        return self.seen

    def tensors(self) -> list[torch.Tensor]:
        """What the layer stores (keys, values and their scales)."""
        return [t for t in (self.keys, self.values, getattr(self, "key_scale", None),
                            getattr(self, "value_scale", None)) if isinstance(t, torch.Tensor)]


def _select(store: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The slots ``order`` of a store (a float8 one through its bytes: not every device selects float8)."""
    if store.element_size() == 1 and store.is_floating_point():
        return store.view(torch.uint8).index_select(2, order).view(store.dtype)
    return store.index_select(2, order)


def _rows(scale: torch.Tensor | None, order: torch.Tensor) -> torch.Tensor | None:
    """A scale's entries for the slots ``order``: per-token scales are per slot, a per-head scale is for all."""
    if scale is None or scale.shape[2] == 1:
        return scale
    return scale.index_select(2, order)


def text_config(config: Any) -> Any:
    """The decoder's config of a model's (a multimodal one's text part)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


HELD = ("full_attention", "sliding_attention")  # the layer kinds a cache here holds


def windows(config: Any) -> list[int | None]:
    """Each attention layer's sliding window (None: full attention), as transformers lays out its cache: the
    config's ``layer_types`` where it has them, else every layer sliding when it names a window (Mistral, Phi-3);
    one line for a layout these layers cannot hold (linear or chunked attention, compressed keys and values)."""
    text = text_config(config)
    n = int(text.num_hidden_layers)
    window = getattr(text, "sliding_window", None)
    if getattr(text, "use_sliding_window", True) is False:
        window = None
    kinds = list(getattr(text, "layer_types", None) or [])
    if not kinds:
        kinds = ["sliding_attention" if window else "full_attention"] * n
    odd = sorted(set(kinds) - set(HELD))
    if odd:
        raise DtypelabError(f"{getattr(text, 'model_type', 'this model')}'s cache has {', '.join(odd)} layers: the "
                            "KV cache here holds full and sliding-window attention layers only (linear and chunked "
                            "attention are not modelled yet)")
    if getattr(text, "kv_lora_rank", None):
        raise DtypelabError(f"{text.model_type} compresses its keys and values (multi-head latent attention): the "
                            "static KV cache holds plain keys and values only")
    if "sliding_attention" in kinds and not window:
        raise DtypelabError(f"{getattr(text, 'model_type', 'this model')} has sliding-window layers but its config "
                            "names no sliding_window")
    return [window if kind == "sliding_attention" else None for kind in kinds[:n]]


def held_tokens(config: Any, context: int) -> list[int]:
    """The tokens each attention layer's cache holds at ``context``: a sliding layer its window at most."""
    return [context if w is None else min(w, context) for w in windows(config)]


def attention_layers(config: Any) -> int:
    """The number of attention layers a cache holds, refusing a layout these layers cannot hold."""
    return len(windows(config))


def make_cache(config: Any, fmt: KVFormat, max_len: int, scales: list[tuple[float, float]] | None = None) -> Any:
    """A transformers ``Cache`` of ``KVLayer`` s for ``config``'s model: what its forward takes as
    ``past_key_values`` (a sliding-window layer holds its window only); ``scales``: each layer's calibrated (key,
    value) scales."""
    from transformers.cache_utils import Cache

    layer = _layer_class()
    found = windows(config)
    presets = scales if scales is not None else [None] * len(found)
    return Cache(layers=[layer(max_len, fmt, w, p) for w, p in zip(found, presets, strict=True)])


def kv_scales(model: Any, config: Any, fmt: KVFormat, ids: torch.Tensor) -> list[tuple[float, float]]:
    """Each layer's (key, value) scale for ``fmt`` from the largest magnitude the calibration windows ``ids`` give
    its keys and values (as llm-compressor calibrates a checkpoint's KV scales)."""
    from transformers.cache_utils import DynamicCache

    assert fmt.storage is not None
    top = float(torch.finfo(fmt.storage).max)
    amax = [[0.0, 0.0] for _ in windows(config)]
    with torch.no_grad():
        for i in range(0, len(ids), 8):
            cache = DynamicCache(config=config)
            model(input_ids=ids[i:i + 8], past_key_values=cache, use_cache=True, logits_to_keep=1)
            for j, layer in enumerate(cache.layers):
                keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
                assert keys is not None and values is not None  # every attention layer was written
                amax[j][0] = max(amax[j][0], float(keys.abs().amax()))
                amax[j][1] = max(amax[j][1], float(values.abs().amax()))
    return [(max(k / top, 1e-12), max(v / top, 1e-12)) for k, v in amax]


_LAYER: list[type] = []


def _layer_class() -> type:
    """``KVLayer`` as one of transformers' cache layers (its ``Cache`` tells attention layers by that base)."""
    if not _LAYER:
        from transformers.cache_utils import CacheLayerMixin

        _LAYER.append(type("KVCacheLayer", (KVLayer, CacheLayerMixin), {"__module__": __name__}))
    return _LAYER[0]


def cache_bytes(cache: Any) -> int:
    """The bytes a cache's layers store (keys, values and their scales): exact, from its tensors."""
    return sum(t.untyped_storage().nbytes() for layer in cache.layers for t in layer.tensors())


def geometry(config: Any) -> tuple[int, int]:
    """(key/value heads, head dim) of a decoder's attention: grouped-query attention stores ``num_key_value_heads``
    heads, not ``num_attention_heads``."""
    text = text_config(config)
    heads = text.num_attention_heads
    return getattr(text, "num_key_value_heads", None) or heads, getattr(text, "head_dim", None) or \
        text.hidden_size // heads


def bytes_per_token(config: Any, fmt: KVFormat, compute: torch.dtype) -> int:
    """What one token of context takes in one layer's cache times the layers, by the formula (layers x 2 x kv heads
    x head dim x bytes): the check of what a trace counts, and what the docs explain. Grouped-query attention stores
    ``num_key_value_heads``, not ``num_attention_heads``. A sliding-window layer holds its window at most: for the
    bytes at a context, ``cache_bytes_at``."""
    return attention_layers(config) * layer_bytes_per_token(config, fmt, compute)


def layer_bytes_per_token(config: Any, fmt: KVFormat, compute: torch.dtype) -> int:
    """One token in one layer's cache: keys, values and per-token scales."""
    kv_heads, head_dim = geometry(config)
    element = fmt.element_bytes or torch.empty((), dtype=compute).element_size()
    return 2 * kv_heads * head_dim * element + fmt.scale_bytes_per_token(kv_heads)


def cache_bytes_at(config: Any, fmt: KVFormat, compute: torch.dtype, context: int, batch: int = 1) -> int:
    """The keys, values and per-token scales a cache holds at ``context`` (each sliding layer its window at most),
    per-head scales left out."""
    return sum(held_tokens(config, context)) * batch * layer_bytes_per_token(config, fmt, compute)


__all__ = [
    "FORMATS",
    "NATIVE",
    "KVFormat",
    "KVLayer",
    "attention_layers",
    "bytes_per_token",
    "cache_bytes",
    "cache_bytes_at",
    "geometry",
    "held_tokens",
    "kv_format",
    "kv_scales",
    "layer_bytes_per_token",
    "make_cache",
    "text_config",
    "windows",
]
