"""The error a forecast's figures carry, per family, from the validation set's held-out cases (a sourced table).

``bands.json`` beside this file is written by ``python benchmarks/validate.py --write`` (never by hand): for each
family of forecast figures, the largest error of the published measurements it was held against that no constant was
fitted to (docs/validation.md lists every case). CI's gate fails when this table is not what the evidence says.
Families: train-speed (one policy's step time over another's on a GPU), train-tok-s (a step's absolute time on a
GPU, as samples or tokens a second), train-peak (training and fine-tuning peak
memory), serve-tok-s (decode tokens a second), serve-speed (a weight format's decode speed over bfloat16's),
serve-peak, kv-bytes, energy (joules: the only published energy figures are serving's, so a training step's joules
carry the same band).
"""

from __future__ import annotations

import functools
import json
from importlib import resources

SOURCE = "the validation set's held-out published measurements (docs/validation.md)"


@functools.lru_cache(maxsize=1)
def _table() -> dict[str, dict]:
    try:
        return json.loads(resources.files("dtypelab.core").joinpath("bands.json").read_text())
    except (OSError, ValueError):  # an install without the table: no band is claimed
        return {}


def band(family: str, default: float = 0.0) -> float:
    """The family's band (0.12: ±12%), or ``default`` where the set has no held-out case of it."""
    entry = _table().get(family)
    return float(entry["band"]) if entry else default


def overlaps(a: float, b: float, error: float) -> bool:
    """Two predictions whose bands, [x (1 - error), x (1 + error)], overlap: a tie (step times, tokens a second or
    joules alike: the rule is symmetric)."""
    return min(a, b) * (1 + error) >= max(a, b) * (1 - error)
