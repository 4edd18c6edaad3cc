"""A served plan written as a compressed-tensors checkpoint (safetensors and a ``quantization_config`` in
config.json): what llm-compressor writes and what transformers and vLLM load. Layers in a ``WeightQuant`` layout
(``w4a16-*``, ``w8a16-*``) are packed as ``pack-quantized`` int4/int8 with their scales (one config group per
layout, its targets the layers by name); every other linear layer is listed in ``ignore``, as vLLM's loader requires
of a layer it should leave unquantized. The model is saved in the plan's dtype (bfloat16). Written, the checkpoint is
loaded back by transformers (``AutoModelForCausalLM.from_pretrained``: safetensors, no code runs) and its logits on
held-out text compared with the plan's model saved plainly (its dequantized bfloat16 weights) and loaded the same
way: equal logits, the same weights bit for bit. (Compared with the plan's model as dtypelab runs it instead, they
differ: ``model.to(bfloat16)`` rounds the rotary table that transformers' loader keeps in float32.)"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtypelab.core.backends import quiet
from dtypelab.core.calibration import calibrating
from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies import Plan, WeightQuant
from dtypelab.serving.bench import calibration_windows
from dtypelab.serving.measure import built
from dtypelab.serving.served import load_served

COMPRESSED_TENSORS = "compressed-tensors>=0.20 (pip install 'dtypelab[quantize]')"


@dataclass(frozen=True)
class Compressed:
    path: str
    layers: dict[str, str]  # quantized layer -> its layout
    ignored: list[str]
    file_bytes: int
    max_abs_diff: float  # the reloaded checkpoint's logits against the plan's own
    calibration: str


def _scheme(layout: str) -> Any:
    from compressed_tensors.quantization import QuantizationArgs

    if layout == "w4a16":
        return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)
    return QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")


def _config(plan_layers: dict[str, str], ignored: list[str]) -> Any:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    groups = {}
    for i, layout in enumerate(sorted(set(plan_layers.values()))):
        targets = sorted(n for n, lay in plan_layers.items() if lay == layout)
        groups[f"group_{i}"] = QuantizationScheme(targets=targets, weights=_scheme(layout))
    return QuantizationConfig(config_groups=groups, ignore=ignored, quantization_status="frozen",
                              format="pack-quantized")


def _layers(model: nn.Module, plan: Plan) -> dict[str, str]:
    """The linear layers the plan quantized, with their layouts (those holding scales: converted)."""
    out = {}
    for name, config in plan.assign(model).items():
        module = dict(model.named_modules()).get(name)
        if isinstance(config, WeightQuant) and isinstance(module, nn.Linear) and "weight_scale" in module._buffers:
            out[name] = config.layout
    return out


# the layers vLLM's Llama-family models fuse into one (``packed_modules_mapping``): qkv_proj, gate_up_proj
VLLM_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def vllm_refusal(layers: dict[str, str], linears: list[str]) -> str | None:
    """Why vLLM's compressed-tensors loader would refuse these quantized ``layers`` among the model's ``linears``,
    or None. As its ``compressed_tensors/utils.py`` reads a config: a fused layer's parts must all be ignored or all
    be quantized (``should_ignore_layer``), and a quantized one matches a config group only when every part is among
    that group's targets (``_match_fused_layer``), so its parts must share one format."""
    names = set(linears)
    for n in linears:
        parent, _, leaf = n.rpartition(".")
        group = next((g for g in VLLM_FUSED if leaf == g[0]), None)
        if group is None:
            continue
        parts = [f"{parent}.{g}" for g in group if f"{parent}.{g}" in names]
        formats = {layers.get(p, "unquantized") for p in parts}
        if len(formats) > 1:
            return (f"{' and '.join(p.rpartition('.')[2] for p in parts)} of {parent} are {', '.join(sorted(formats))}"
                    ": vLLM fuses them and requires one scheme (give them the same format)")
    return None


def export_compressed(spec: str, plan: Plan, path: str, seed: int = 0, calibration: str | None = None,
                      samples: int = 32) -> Compressed:
    try:
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import apply_quantization_config
    except ImportError:
        raise DtypelabError(f"a compressed-tensors checkpoint needs {COMPRESSED_TENSORS}") from None
    bad = sorted({c.label for c in plan.configs if isinstance(c, WeightQuant) and c.layout not in ("w4a16", "w8a16")})
    if bad:
        raise DtypelabError(f"{', '.join(bad)}: torchao's layouts are not compressed-tensors'; export w4a16-* or "
                            "w8a16-* as a checkpoint vLLM loads")
    served = load_served(spec)
    ids, words = calibration_windows(served, calibration, samples, min(served.context, 256)) \
        if any(isinstance(c, WeightQuant) and c.calibrated for c in plan.configs) else (None, "")
    model: Any = _converted(served, plan, seed, ids)
    layers = _layers(model, plan)
    if not layers:
        raise DtypelabError(f"plan {plan.name} quantizes no linear layer in a compressed-tensors layout")
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    refusal = vllm_refusal(layers, linears)
    if refusal:
        raise DtypelabError(f"plan {plan.name}: {refusal}")
    windows = served.text(4, min(served.context, 128))
    with tempfile.TemporaryDirectory(prefix="dtypelab-plain-") as plain:
        _plain_copy(model, layers, plain)
        expected = _logits(plain, windows)
    ignored = [n for n in linears if n not in layers]
    scales = {n: dict(model.named_modules())[n]._buffers.pop("weight_scale") for n in layers}
    apply_quantization_config(model, _config(layers, ignored))
    modules = dict(model.named_modules())
    for n, s in scales.items():
        modules[n].weight_scale.data = s.to(modules[n].weight_scale.dtype).reshape(modules[n].weight_scale.shape)
        modules[n].weight_zero_point.data.zero_()
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    # said outright: compressed-tensors rebuilds the list from module classes, and a plan's per-layer regions
    # (dtypelab's LabLinear) are another class than the head's Linear
    compressor.quantization_config.ignore = ignored
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    diff = _reloaded_diff(path, windows, expected)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return Compressed(path, layers, ignored, size, diff, words)


def _converted(served: Any, plan: Plan, seed: int, ids: torch.Tensor | None) -> Any:
    with calibrating(ids):
        model, _, _ = built(served, plan, seed, torch.device("cpu"))
    return model


def _plain_copy(model: Any, layers: dict[str, str], path: str) -> None:
    """The plan's model saved plainly (its dequantized weights in bfloat16), its scales set aside for the while."""
    modules: dict[str, Any] = dict(model.named_modules())
    kept = {n: modules[n]._buffers.pop("weight_scale") for n in layers}
    try:
        model.save_pretrained(path)
    finally:
        for n, s in kept.items():
            modules[n].register_buffer("weight_scale", s, persistent=False)


def _logits(path: str, windows: torch.Tensor) -> torch.Tensor:
    """A checkpoint's logits as transformers loads it (the same loader for both: the plan's own rounding of the
    rotary table and the rest is the loader's, not the format's)."""
    from transformers import AutoModelForCausalLM

    with quiet():
        loaded: Any = AutoModelForCausalLM.from_pretrained(path)
    loaded.eval()
    with torch.no_grad():
        logits: torch.Tensor = loaded(windows).logits.float()
    return logits


def _reloaded_diff(path: str, windows: torch.Tensor, expected: torch.Tensor) -> float:
    return float((_logits(path, windows) - expected).abs().max())


__all__ = ["COMPRESSED_TENSORS", "VLLM_FUSED", "Compressed", "export_compressed", "vllm_refusal"]
