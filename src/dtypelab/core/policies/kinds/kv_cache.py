"""KV-cache formats: how a served model's cache stores keys and values (``+kv-FORMAT``, a modifier of a weight format
under ``--mode generate``), each format a kind with its own hooks, registered here like any precision's policies.

A scaled format stores ``round(x / scale)`` and hands attention ``stored * scale`` in the model's compute dtype, every
step, over the whole cache: eager PyTorch has no attention kernel that reads fp8 or int8 keys (engines such as vLLM
fuse the dequantization into theirs), so the cost of the dequantization is in what is measured and traced.

- ``Stored``: kept as is, in the format's dtype (or, the native format, what the model's attention produces);
- ``PerHead``: one scale per layer, key/value and head, from the prompt's largest magnitude (the first update); later
  tokens beyond it saturate at the format's largest value (vLLM's fp8 cache keeps per-tensor scales the same way);
- ``PerToken``: one float32 scale per token and head (symmetric int8): no token saturates, 4 bytes per token and head
  more.

A new format is a ``register_kv(...)`` line here, or a subclass with its own hooks in a file of your own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtypelab.core.policies.registry import in_default, register_kv

SCALE = torch.float32  # what every scale is stored in
TINY = torch.finfo(torch.float32).tiny


def largest(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max)


@dataclass(frozen=True)
class KVFormat:
    """A format of the cache's keys and values: what it stores (``storage``; None: the model's compute dtype), its
    words, and its hooks: the scales it keeps and how a tensor goes in and comes out."""

    label: str  # the modifier's name: kv-fp8
    storage: torch.dtype | None
    words: str

    @property
    def element_bytes(self) -> int | None:
        return None if self.storage is None else torch.empty((), dtype=self.storage).element_size()

    def scale_shape(self, batch: int, kv_heads: int, length: int) -> tuple[int, ...] | None:
        """The shape of the scales kept beside keys (and beside values); None: none."""
        return None

    def scale_bytes_per_token(self, kv_heads: int) -> int:
        """The scales' bytes per token and layer (keys and values): per-token scales only; per-head ones are fixed."""
        return 0

    def calibrate(self, scale: torch.Tensor, x: torch.Tensor) -> None:
        """Set the scales from the first update (the prompt), where the format fixes them then."""

    def encode(self, x: torch.Tensor, scale: torch.Tensor | None, at: torch.Tensor, storage: torch.dtype
               ) -> torch.Tensor:
        """``x`` as stored at positions ``at`` (a per-token format writes its scales there too)."""
        return x.to(storage)

    def decode(self, store: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """What attention reads: the stored tensor in the model's compute dtype."""
        return store if store.dtype == dtype else store.to(dtype)


@dataclass(frozen=True)
class Stored(KVFormat):
    """Kept as is, in its dtype."""


@dataclass(frozen=True)
class PerHead(KVFormat):
    """One scale per head, from the prompt's largest magnitude."""

    def scale_shape(self, batch: int, kv_heads: int, length: int) -> tuple[int, ...] | None:
        return (1, kv_heads, 1, 1)

    def calibrate(self, scale: torch.Tensor, x: torch.Tensor) -> None:
        assert self.storage is not None
        amax = x.detach().abs().amax(dim=(0, 2, 3), keepdim=True).float()
        scale.copy_((amax / largest(self.storage)).clamp(min=TINY))

    def encode(self, x: torch.Tensor, scale: torch.Tensor | None, at: torch.Tensor, storage: torch.dtype
               ) -> torch.Tensor:
        assert scale is not None and self.storage is not None
        top = largest(self.storage)
        return (x.float() / scale).clamp(-top, top).to(storage)

    def decode(self, store: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        assert scale is not None
        return (store.float() * scale).to(dtype)


@dataclass(frozen=True)
class PerToken(PerHead):
    """One float32 scale per token and head, from that token's largest magnitude."""

    def scale_shape(self, batch: int, kv_heads: int, length: int) -> tuple[int, ...] | None:
        return (batch, kv_heads, length, 1)

    def scale_bytes_per_token(self, kv_heads: int) -> int:
        return 2 * kv_heads * torch.empty((), dtype=SCALE).element_size()

    def calibrate(self, scale: torch.Tensor, x: torch.Tensor) -> None:
        """Each token's scale is its own, set as it is written."""

    def encode(self, x: torch.Tensor, scale: torch.Tensor | None, at: torch.Tensor, storage: torch.dtype
               ) -> torch.Tensor:
        assert scale is not None and self.storage is not None
        top = largest(self.storage)
        here = (x.detach().abs().amax(dim=-1, keepdim=True).float() / top).clamp(min=TINY)
        scale.index_copy_(2, at, here)
        return (x.float() / here).round().clamp(-top, top).to(storage)


@dataclass(frozen=True)
class UnitScale(KVFormat):
    """Cast as they are, saturating at the format's largest value: scale 1.0, what an engine uses for an fp8 cache
    when the checkpoint carries no scales (vLLM's ``k_scale = v_scale = 1.0``)."""

    def encode(self, x: torch.Tensor, scale: torch.Tensor | None, at: torch.Tensor, storage: torch.dtype
               ) -> torch.Tensor:
        assert self.storage is not None
        top = largest(self.storage)
        return x.float().clamp(-top, top).to(storage)


@dataclass(frozen=True)
class PerTensor(PerHead):
    """One scale per layer for its keys and one for its values, calibrated on calibration text before serving (as
    llm-compressor's ``kv_cache_scheme`` writes them into a checkpoint and vLLM reads them); the serving measurement
    sets them (``calibrated_by_text``). Without text, from the prompt's largest magnitude (vLLM's
    ``--calculate-kv-scales``)."""

    calibrated_by_text = True

    def scale_shape(self, batch: int, kv_heads: int, length: int) -> tuple[int, ...] | None:
        return (1, 1, 1, 1)

    def calibrate(self, scale: torch.Tensor, x: torch.Tensor) -> None:
        assert self.storage is not None
        scale.fill_(max(float(x.detach().abs().amax()) / largest(self.storage), TINY))


NATIVE = Stored("kv-native", None, "keys and values in the model's compute dtype")
for _fmt in (Stored("kv-bf16", torch.bfloat16, "keys and values stored in bfloat16"),
             Stored("kv-fp16", torch.float16, "keys and values stored in float16"),
             PerHead("kv-fp8", torch.float8_e4m3fn, "keys and values stored in fp8 e4m3, one scale per head (from the "
                     "prompt)"),
             PerHead("kv-fp8-e5m2", torch.float8_e5m2, "keys and values stored in fp8 e5m2, one scale per head (from "
                     "the prompt)"),
             PerToken("kv-int8", torch.int8, "keys and values stored in int8, one float32 scale per token and head"),
             UnitScale("kv-fp8-s1", torch.float8_e4m3fn, "keys and values stored in fp8 e4m3 at scale 1.0 (an engine's "
                       "default for a checkpoint without KV scales)"),
             PerTensor("kv-fp8-cal", torch.float8_e4m3fn, "keys and values stored in fp8 e4m3, one scale per layer "
                       "for keys and one for values, calibrated on calibration text")):
    register_kv(_fmt)
for _listing, _entries in (("serve-measured", (("fp32+kv-bf16", 6), ("fp32+kv-fp8", 7), ("fp32+kv-int8", 8),
                                               ("int8-wo+kv-int8", 9))),
                           ("serve-forecast", (("bf16+kv-fp8", 5), ("int4-wo+kv-fp8", 6))),
                           ("serve-forecast-cpu", (("fp32+kv-int8", 4), ("fp32+kv-fp8", 5)))):
    for _name, _rank in _entries:
        in_default(_listing, _name, _rank)

__all__ = ["NATIVE", "KVFormat", "PerHead", "PerTensor", "PerToken", "Stored", "UnitScale", "largest"]
