"""``Float8Train``: training on float8 tensor cores (torchao's ``convert_to_float8_training``), GPU only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from dtypelab.core.backends import quiet, torchao_missing, torchao_module
from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.hardware import HardwareInfo
from dtypelab.core.policies.configs import Config, Emulable, Facts, cuda_missing
from dtypelab.core.policies.registry import in_default, register


def float8_unfit(out_features: int, in_features: int) -> str | None:
    """Why float8 tensor cores cannot multiply by a weight of this shape (training or inference), or None."""
    if out_features % 16 or in_features % 16:
        return f"{out_features}×{in_features}: float8 matmuls need dimensions divisible by 16"
    return None


def _autocast_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Float8Linear casts its input to the autocast dtype before quantizing it, under CUDA's autocast only; the same
    under the CPU's, so that emulated numerics are the GPU's (and the high-precision weight gradient of
    rowwise_with_gw_hp meets operands of one dtype)."""
    if args and isinstance(args[0], torch.Tensor) and torch.is_autocast_enabled("cpu"):
        return (args[0].to(torch.get_autocast_dtype("cpu")), *args[1:])
    return None


FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
FLOAT8_FLOOR = (8, 9)  # Ada and Hopper: float8 tensor cores


@dataclass(frozen=True)
class Float8Train(Emulable, Config):
    """Training on float8 tensor cores (torchao's ``convert_to_float8_training``): each ``nn.Linear`` large enough
    to pay runs its three matmuls (forward, input and weight gradients) in float8 with scales per tensor
    (``tensorwise``) or per row (``rowwise``); every other op runs under bfloat16 autocast; the model is compiled,
    which torchao needs to fuse the casts. ``min_size``: "auto" leaves out layers whose shapes torchao measured
    slower in float8 on an H100 (casting costs more than the matmul saves), "none" converts every layer whose
    dimensions are multiples of 16 (the hardware's requirement)."""

    kind: ClassVar[str] = "float8-train"
    needs: ClassVar[str] = "a GPU with float8 tensor cores (compute capability 8.9+: Ada, Hopper)"
    recipe: str = "tensorwise"
    min_size: str = "auto"
    # the numerics without float8 tensor cores: torchao quantizes and dequantizes each matmul's operands as the
    # recipe says and multiplies in float32 (Float8LinearConfig(emulate=True)); eager, any device, numerics only
    emulate: bool = False

    def __post_init__(self) -> None:
        if self.recipe not in FLOAT8_RECIPES:
            raise DtypelabError(f"float8-train: unknown recipe {self.recipe!r}; use one of {', '.join(FLOAT8_RECIPES)}")
        if self.min_size not in ("auto", "none"):
            raise DtypelabError(f"float8-train: min_size must be auto or none, not {self.min_size!r}")

    @property
    def facts(self) -> Facts:
        # torchao fuses the casts under compile; emulation is about numbers, not speed
        return self.emulable(Facts(
            modes=("train",), compute_dtype="float8_e4m3fn", autocast_dtype="bfloat16", backend="torchao",
            arithmetic=self._arithmetic(), probe="float32" if self.emulate else "fp8", compiles=not self.emulate,
            always_compiles=not self.emulate))

    @property
    def label(self) -> str:
        recipe = self.recipe.replace("_with_", "-").replace("_", "-")  # rowwise_with_gw_hp: rowwise-gw-hp
        return f"fp8-{recipe}" + ("-all" if self.min_size == "none" else "") + ("-emu" if self.emulate else "")

    def _arithmetic(self) -> str:
        scales = {"tensorwise": "one scale per tensor", "rowwise": "scales per row",
                  "rowwise_with_gw_hp": "scales per row, the weight gradient in high precision"}[self.recipe]
        if self.emulate:
            return (f"emulated float8 (e4m3, {scales}): each matmul's operands quantized and dequantized as on float8 "
                    "tensor cores, multiplied in float32; bfloat16 autocast elsewhere; numerics only")
        return (f"float8 tensor-core matmuls (e4m3, {scales}) in the converted Linear layers, bfloat16 autocast "
                "elsewhere")

    def describe(self) -> str:
        which = "large enough to pay (on an H100)" if self.min_size == "auto" else "with dimensions divisible by 16"
        if self.emulate:
            return (f"float8 training ({self.recipe} scales, torchao) emulated: its numerics in the Linear layers "
                    f"{which}, bfloat16 autocast elsewhere; numerics only, no speed")
        return (f"float8 training ({self.recipe} scales, torchao) in the Linear layers {which}, bfloat16 autocast "
                "elsewhere, under torch.compile")

    def supported(self, hw: HardwareInfo) -> str | None:
        if self.emulate:
            return torchao_missing()
        return torchao_missing() or cuda_missing(hw, "float8 training runs float8 tensor-core matmuls: it",
                                                 FLOAT8_FLOOR)

    def left_out(self, out_features: int, in_features: int) -> str | None:
        """Why a Linear layer of this shape stays out of float8, or None to convert it. The size thresholds are
        torchao's own (``_auto_filter_for_recipe``), from its float8 microbenchmarks on an H100."""
        n, k = out_features, in_features
        if float8_unfit(n, k) or self.min_size == "none":
            return float8_unfit(n, k)
        if self.recipe == "tensorwise" and k <= 4096 and n <= 1024:
            return f"{n}×{k}: too small to pay (tensorwise gains need out > 1024 or in > 4096)"
        if self.recipe != "tensorwise" and (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)):
            return f"{n}×{k}: too small to pay (rowwise gains need out > 2048 and in > 1024, and more than 4096×2048)"
        return None

    def region(self, parent: Config, outer: Any) -> Config | None:
        return None  # a float8 layer takes whatever its neighbours compute in

    def convert_module(self, model: nn.Module, names: list[str]) -> tuple[nn.Module, dict[str, Any]]:
        """The linear layers called ``names`` converted to torchao's ``Float8Linear`` where their shape pays
        (``left_out``); the rest stay as they are."""
        modules = dict(model.named_modules())
        names = [n for n in names if isinstance(modules[n], nn.Linear)]
        if not names:
            return model, {}
        chosen, left_out = set(), []
        for name in names:
            why = self.left_out(modules[name].out_features, modules[name].in_features)
            if why:
                left_out.append({"layer": name, "why": why})
            else:
                chosen.add(name)
        if chosen:
            float8 = torchao_module("float8")
            config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
            if self.emulate:
                config = dataclasses.replace(config, emulate=True)
            with quiet():
                model = float8.convert_to_float8_training(model, config=config,
                                                          module_filter_fn=lambda m, fqn: fqn in chosen)
            if self.emulate:  # off CUDA, torchao's Float8Linear does not see the autocast: cast as it does there
                for name, module in model.named_modules():
                    if name in chosen:
                        module.register_forward_pre_hook(_autocast_input)
        what = f"float8 training ({self.recipe}{', emulated' if self.emulate else ''})"
        return model, {"format": what, "converted": sorted(chosen), "left_out": left_out}


# float8 training (CUDA, compute capability >= 8.9), and its numerics where it cannot run (bench --emulate picks them:
# torchao's emulation, numerics only, the same layer filter; the -all variants convert every eligible layer)
register("fp8-tensorwise", Float8Train("tensorwise"), rank=17)
register("fp8-rowwise", Float8Train("rowwise"), rank=18)
register("fp8-rowwise-gw-hp", Float8Train("rowwise_with_gw_hp"), rank=19)
for _i, _real in enumerate(Float8Train(r, s) for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp")
                           for s in ("auto", "none")):
    _emulated = dataclasses.replace(_real, emulate=True)
    register(_emulated.label, _emulated, sweeps=frozenset(), rank=40 + _i)  # with --emulate, or by name
in_default("forecast-train", "fp8-tensorwise", 6)
