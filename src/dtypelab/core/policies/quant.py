"""Shared base of the quantized inference policies (int8, fp8) and quiet access to their backends.

Two backends: torchao's ``quantize_`` (maintained; weights become int8/fp8 tensor subclasses on the
same ``nn.Linear`` modules) and ``torch.ao.quantization.quantize_dynamic`` (deprecated; swaps
``nn.Linear`` for packed fbgemm/x86 modules, CPU only). Both only touch ``nn.Linear``.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from dtypelab.core.backends import quiet, torchao_missing, torchao_module
from dtypelab.core.hardware import HardwareInfo
from dtypelab.core.policies.base import Policy


class QuantPolicy(Policy):
    """An inference-only policy that rewrites the model's linear layers."""

    modes: ClassVar[tuple[str, ...]] = ("infer",)
    backend: ClassVar[str]
    # What the arithmetic really is, shown under the table; "emulated" when the format is stored but
    # not computed in (the speed is then that of the wider type, never the format's own).
    arithmetic: ClassVar[str]
    emulated: ClassVar[bool] = False


class TorchaoPolicy(QuantPolicy):
    backend = "torchao"

    def supported(self, hw: HardwareInfo) -> str | None:
        missing = torchao_missing()
        if missing:
            return missing
        if self.compiles and not hw.is_cuda and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            return "torch.compile on the CPU needs a C++ compiler (g++ or clang++), none found"
        return None

    def config(self) -> Any:
        raise NotImplementedError

    def convert_module(self, model: nn.Module) -> nn.Module:
        quantization = torchao_module("quantization")
        with quiet():  # also torch.compile's first import of inductor, which warns about torch.jit
            quantization.quantize_(model, self.config())
            # static shapes: one compile per input shape, rather than a dynamic-shape graph that is slower
            return torch.compile(model, dynamic=False) if self.compiles else model

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        if not self.compiles:
            yield
            return
        # torchao's recommended inductor settings, patched for the run only (its configs would set them
        # process-wide; every config here passes set_inductor_config=False).
        from torch._inductor import config

        with config.patch(coordinate_descent_tuning=True, force_fuse_int_mm_with_mul=True), quiet():
            yield


class LegacyDynamicPolicy(QuantPolicy):
    """torch.ao.quantization.quantize_dynamic: int8 weights packed for fbgemm/x86, activations quantized
    per batch with one scale per tensor."""

    backend = "torch.ao.quantization (deprecated)"
    compute_dtype = "int8"
    per_channel: ClassVar[bool] = False

    def supported(self, hw: HardwareInfo) -> str | None:
        if hw.is_cuda:
            return "torch.ao dynamic quantization runs on the CPU only (fbgemm/x86 kernels)"
        engines = [e for e in torch.backends.quantized.supported_engines if e in ("x86", "fbgemm", "qnnpack")]
        return None if engines else "this torch build has no quantized CPU engine (x86, fbgemm or qnnpack)"

    def convert_module(self, model: nn.Module) -> nn.Module:
        with warnings.catch_warnings():
            # its deprecation notices (and torch.jit's, from its packed modules): the summary says so already
            warnings.simplefilter("ignore")
            from torch.ao import quantization as tq

            qconfig = tq.per_channel_dynamic_qconfig if self.per_channel else tq.default_dynamic_qconfig
            return tq.quantize_dynamic(model, {nn.Linear: qconfig}, dtype=torch.qint8)
