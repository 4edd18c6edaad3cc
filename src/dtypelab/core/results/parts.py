"""The parts of a bench result that are not results of their own: GradScaler's history, sizes, what a conversion
took and left out, per-layer fidelity, emulated layers, other processes' disturbance, the interleaved rounds' blocks
and the paired speedup interval."""

from __future__ import annotations

from dataclasses import dataclass

from typing_extensions import TypedDict


class ScalerSkip(TypedDict):
    step: int
    scale: float
    nonfinite_params: list[str]
    n_nonfinite_params: int


class ScalerStats(TypedDict, total=False):
    """GradScaler's history (core.scaler.ScalerLog.stats())."""

    grad_scale: list[float]
    skipped_steps: int
    first_skipped_step: int | None
    skips: list[ScalerSkip]
    min_scale: float | None
    collapse_step: int | None


class SizeInfo(TypedDict):
    format: str  # "safetensors", "torch.save" or "executorch .pte"
    file_bytes: int
    linear_weight_bytes: int | None  # None for a .pte: its weights are inside the program


class LeftOut(TypedDict):
    layer: str
    why: str  # its shape and the rule that kept it out


class Conversion(TypedDict, total=False):
    """Which Linear layers a float8 / int4 policy converted, and those it left out with why: what explains a
    format that gains less than its datasheet says (small layers, where casting costs more than the matmul saves)."""

    format: str
    converted: list[str]
    left_out: list[LeftOut]
    # a whole-model program (ExecuTorch): its delegate, the subgraphs delegated, the operators left outside the
    # delegate with their call counts, and the activations' arena its memory planning gives it
    delegate: str
    delegated: int
    fallback: dict[str, int]
    planned_bytes: int
    # a generation program's: the batch and positions it was exported for, and its cache's bytes (in the arena)
    batch: int
    max_len: int
    cache_bytes: int


class LayerFidelity(TypedDict):
    layer: str
    type: str
    sqnr_db: float | None  # the layer's output, every earlier layer converted too
    own_sqnr_db: float | None  # the converted layer alone, fed fp32's input


class EmulatedLayer(TypedDict):
    """A layer an emulated format converted (float8 training without float8 tensor cores), on one training batch."""

    layer: str
    shape: str  # out × in
    sqnr_db: float | None  # its output against the bfloat16 matmul of the same input (median over rows, in dB)
    input_underflow: float  # share of the input's non-zero values that flush to zero in the format
    weight_underflow: float


class DisturbanceInfo(TypedDict, total=False):
    """core.disturbance.Disturbance.to_dict(): what other processes did while the policy's steps were timed."""

    wall_s: float
    other_cpu_s: float  # less the counters' resolution
    other_cores: float
    steal_s: float
    pressure_s: float | None
    involuntary_switches: int
    resolution_s: float
    disturbed: bool  # the meter's verdict (older records: other_cores >= 0.25)


@dataclass(frozen=True)
class RoundBlock:
    """One policy's block of timed steps in one round of the interleaved timing."""

    round: int
    median_s: float
    n: int
    other_cores: float = 0.0  # other processes' CPU use meanwhile, in cores
    pressure_s: float | None = None  # time runnable tasks waited for a CPU meanwhile
    disturbed: bool = False
    # the energy counter's joules over the block's window (its steps between two synchronized readings) and that
    # window's seconds; None where nothing measured it, or the window was too short for the counter
    joules: float | None = None
    window_s: float | None = None


@dataclass(frozen=True)
class SpeedupInterval:
    """A policy's speedup vs the baseline from paired rounds: geometric mean and a 95% interval."""

    point: float
    low: float
    high: float
    rounds: int  # pairs used
    dropped: int = 0  # disturbed pairs left out
    disturbed: int = 0  # disturbed pairs seen


class Fidelity(TypedDict, total=False):
    max_abs_err: float
    sqnr_db: float
    cos_min: float
    cos_mean: float


__all__ = [
    "Conversion",
    "DisturbanceInfo",
    "EmulatedLayer",
    "Fidelity",
    "LayerFidelity",
    "LeftOut",
    "RoundBlock",
    "ScalerSkip",
    "ScalerStats",
    "SizeInfo",
    "SpeedupInterval",
]
