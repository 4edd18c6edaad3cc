"""What a decision ranks policies by (``--objective``), as data: where each objective decides (bench's training and
inference sweeps, ``--mode generate``, the forecasts), what a round's block is paired by (its median seconds, or the
joules the energy counter read over it), the record's interval the decision reads, and its words. Every capability
asks this table instead of testing an objective's name."""

from __future__ import annotations

from dataclasses import dataclass

from dtypelab.core.errors import DtypelabError


@dataclass(frozen=True)
class Objective:
    name: str
    measured: tuple[str, ...]  # the bench modes that choose by it (train, infer, generate)
    forecast: tuple[str, ...]  # the forecast modes that answer by it (step, generate)
    what: str  # what the best policy is best at, in words
    # how a sentence says a policy gains by it: (the quantity, what it might do on a quiet machine, what it did)
    gain: tuple[str, str, str] = ("speed", "be faster", "came out faster")
    best_at: str = ""  # a serving forecast's answer: the policy with ... (core.bands: ``band``'s error)
    band: str = "serve-speed"  # the validation family whose band a serving forecast's comparison by it carries
    paired_by: str = "median_s"  # a round's block's field the pairing reads (core.pairing): seconds, or joules
    interval: str = "speedup_ci"  # a bench record's field with the paired interval it decides by

    @property
    def counts_joules(self) -> bool:
        """Measured by an energy counter: it needs one, and rounds whose windows it reads."""
        return self.paired_by == "joules"


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    Objective("speed", ("train", "infer"), ("step",), "the fastest step"),
    Objective("decode", ("generate",), ("generate",), "decode tokens per second", best_at="the fastest decode"),
    Objective("prefill", ("generate",), ("generate",), "prefill tokens per second", best_at="the fastest prefill"),
    Objective("latency", ("generate",), ("generate",), "time to first token plus the generation's per-token latency",
              best_at="the shortest generation"),
    Objective("energy", ("train", "infer", "generate"), ("generate",), "the least energy per sample (per generated "
              "token under --mode generate)", ("energy", "use less energy per sample", "used less energy per sample"),
              best_at="the least energy per token", band="energy", paired_by="joules", interval="energy_ci"),
)}


def objective(name: str | None, default: str = "speed") -> Objective:
    """The objective named (``default`` for none); a one-line error for a name the table does not hold."""
    found = OBJECTIVES.get(name or default)
    if found is None:
        raise DtypelabError(f"--objective {name}: use {', '.join(OBJECTIVES)}")
    return found


def for_mode(mode: str, forecast: bool = False) -> tuple[str, ...]:
    """The objectives a bench mode (or, ``forecast``, a forecast mode) chooses by, in the table's order."""
    return tuple(o.name for o in OBJECTIVES.values() if mode in (o.forecast if forecast else o.measured))


__all__ = ["OBJECTIVES", "Objective", "for_mode", "objective"]
