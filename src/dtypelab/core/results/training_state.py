"""The training state in the records: where a run's memory goes (``MemoryBreakdown``) and which updates round away
(``UpdateLoss``), as ``core.footprint`` and ``core.updates`` count them."""

from __future__ import annotations

from typing_extensions import TypedDict


class MemoryPart(TypedDict):
    """Of the activations, what some modules keep, counted apart by the kind that names them
    (``Config.activation_parts``): its label (a column of the table), bytes, and what it is (the table's note)."""

    label: str
    bytes: int
    note: str


class MemoryBreakdown(TypedDict, total=False):
    """Bytes, counted from the tensors after the run's steps (a quantized state by its inner tensors, shared storage
    once): the weights, their gradients, the optimizer's state, what a kind keeps as the weights' exact values (a
    float32 master copy, Kahan's compensation), and the activations one forward pass of a training batch keeps
    for the backward (None where they cannot be counted: a compiled model). ``total`` adds them up."""

    frozen_weights: int  # the weights that do not train (a fine-tuned model's frozen base); older records: none
    parameters: int  # the weights that train
    gradients: int
    optimizer_state: int
    master_weights: int
    activations: int | None
    parts: list[MemoryPart]  # of the activations, the parts a kind counts apart (LoRA: its adapters' inputs)
    total: int


class UpdateLoss(TypedDict):
    """One parameter tensor over the sampled steps: the share of the elements each step meant to move (gradient not
    zero, or moved) whose update rounds away when the weight is stored in each format."""

    parameter: str
    numel: int
    dtype: str  # as the run stored it
    steps: int
    moved: int  # elements x steps meant to move
    lost: dict[str, float]  # format -> share lost
    ratio: float | None  # median |update| / |weight|; None when nothing moved
