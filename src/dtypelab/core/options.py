"""Options objects: what a command is asked to do, validated once (pydantic, already a dependency) whether the CLI or
a Python caller builds it, then passed whole to the one public function that does it.

A field's ``json_schema_extra`` may say how the CLI spells it (``flag``, ``short``), where its help goes (``panel``)
and which environment variable fills it (``envvar``); the CLI builds each command's flags from the fields.
A value that does not validate is a one-line ``DtypelabError`` naming the option and its flag:
``steps: must be at least 1, got 0 (--steps)``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from dtypelab.core.errors import DtypelabError
from dtypelab.core.objectives import for_mode

T = TypeVar("T", bound="Options")

_PHRASES = {
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
    "int_parsing": "must be a whole number",
    "int_type": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "string_type": "must be text",
    "literal_error": "must be one of {expected}",
    "extra_forbidden": "is not an option of this command",
}


class Options(BaseModel):
    """Base of every command's options: frozen, no unknown names, every field validated, defaults included."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True, validate_default=True)

    @classmethod
    def flag(cls, name: str) -> str:
        """The CLI flag of a field: its ``flag`` or ``--name-with-dashes``."""
        field = cls.model_fields.get(name)
        extra = (field.json_schema_extra if field is not None and isinstance(field.json_schema_extra, dict)
                 else None) or {}
        return str(extra.get("flag") or "--" + name.replace("_", "-"))

    @classmethod
    def build(cls: type[T], given: Options | None = None, **values: Any) -> T:
        """``given`` (options already built) with ``values`` over it, validated; a one-line error otherwise."""
        data = {**(dict(given) if given is not None else {}), **values}
        try:
            return cls(**data)
        except ValidationError as exc:
            raise option_error(cls, exc) from None

    def but(self: T, **values: Any) -> T:
        """A copy with some values changed (validated again)."""
        return type(self).build(self, **values)

    def refuse_given(self, names: Iterable[str], mode: str) -> None:
        """A ValueError naming the fields of ``names`` given a value of their own (not their default), which ``mode``
        does not read: refused in one line, never ignored."""
        given = [n for n in names if self._given(n)]
        if given:
            flags = ", ".join(self.flag(n) for n in given)
            raise ValueError(f"{flags} {'does' if len(given) == 1 else 'do'} not apply to --mode {mode}: "
                             f"leave {'it' if len(given) == 1 else 'them'} out")

    def _given(self, name: str) -> bool:
        value, default = getattr(self, name), type(self).model_fields[name].default
        return value != default and not (value in ((), None) and default in ((), None))


def option_error(cls: type[Options], exc: ValidationError) -> DtypelabError:
    """The first validation error, in one line: the option, what it must be, what it got, and its flag."""
    err = exc.errors()[0]
    name = str(err["loc"][0]) if err.get("loc") else ""
    kind, ctx = err.get("type", ""), err.get("ctx") or {}
    if kind == "value_error":  # a validator's own words
        phrase = str(ctx.get("error", err.get("msg", ""))).removeprefix("Value error, ")
    else:
        phrase = _PHRASES.get(kind, err.get("msg", "is not valid")).format(**ctx)
    got = err.get("input")
    shown = "" if kind == "extra_forbidden" or isinstance(got, dict) else f", got {got!r}"
    where = f" ({cls.flag(name)})" if name in cls.model_fields else ""
    return DtypelabError(f"{name}: {phrase}{shown}{where}" if name else phrase)


def parse_duration(text: str | float | None, what: str = "duration") -> float | None:
    """'15m', '900', '90s', '1.5h' -> seconds; '0', 'none', 'off' or None -> None (no limit)."""
    if text is None or isinstance(text, int | float):
        value = None if text is None else float(text)
    else:
        raw = str(text).strip().lower()
        if raw in ("0", "none", "off", "inf"):
            return None
        m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*(s|m|min|h)?", raw)
        if not m:
            raise DtypelabError(f"bad {what} {text!r}: use seconds (900, 90s), minutes (15m), hours (1h) or 0 for "
                                "none")
        value = float(m.group(1)) * {"s": 1, None: 1, "m": 60, "min": 60, "h": 3600}[m.group(2)]
    if value is not None and (not math.isfinite(value) or value < 0):
        raise DtypelabError(f"bad {what} {text!r}: must be a finite number of seconds >= 0")
    return value or None


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | float | None, what: str = "size") -> int | None:
    """'24GiB', '512MB', '1.5 GB', '1000000' (bytes) -> bytes; None, '0', 'none' -> None (no limit). GB is 10^9,
    GiB 2^30, as datasheets and torch.cuda write them."""
    if text is None:
        return None
    raw = str(text).strip().lower().replace(" ", "")
    if raw in ("0", "none", "off"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)([a-z]*)", raw)
    if not m or m.group(2) not in _UNITS:
        raise DtypelabError(f"bad {what} {text!r}: use bytes with a unit, such as 24GiB, 512MB or 1.5GB")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(value) or value < 1:
        raise DtypelabError(f"bad {what} {text!r}: must be at least one byte")
    return int(value)


def _check_size(value: str | float | None) -> str | float | None:
    parse_size(value, "memory size")
    return value


# ``--memory-budget``: a size as typed ('24GiB'), checked when the options are built
MemorySize = Annotated[str | float | None, AfterValidator(_check_size)]


# Fields many commands share, spelled once so their flags and help read the same everywhere.
def _check_budget(value: str | float | None) -> str | float | None:
    parse_duration(value, "budget")  # a DtypelabError is a ValueError: its words become the option's error
    return value


# ``--budget``: a time limit as typed ('15m', 900, 0 for none), checked when the options are built
Budget = Annotated[str | float | None, AfterValidator(_check_budget)]


def budget_field(default: str, what: str) -> Any:
    """``--budget``: a duration (see ``parse_duration``), kept as typed; ``what`` says what it limits."""
    return Field(default, description=f"{what}; {default}, 0 for none", json_schema_extra={"cli_type": "str"})


def batch_size_field(what: str = "samples per step") -> Any:
    """``--batch-size/-b``: the task's batch size unless given."""
    return Field(None, ge=1, description=f"{what} [default: the task's]", json_schema_extra={"short": "-b"})


CALIBRATION_SAMPLES = 32  # calibration windows GPTQ, AWQ and kv-fp8-cal read unless told


def calibration_field(when: str, panel: dict[str, Any] | None = None) -> Any:
    """``--calibration``: the text calibrated methods read (``serving.calibration_windows``)."""
    return Field(None, description=f"{when}: a text file the calibrated methods (w4a16-gptq, w4a16-awq, "
                                   "POLICY+kv-fp8-cal) read, in the model's tokens [default: held-out windows apart "
                                   "from those quality is judged on]", json_schema_extra=panel)


def calibration_samples_field(when: str, panel: dict[str, Any] | None = None) -> Any:
    """``--calibration-samples``: how many calibration windows."""
    return Field(CALIBRATION_SAMPLES, ge=1, description=f"{when}: calibration windows (of 512 tokens, or the "
                                                         "model's positions)", json_schema_extra=panel)


def device_field(what: str = "cpu, cuda, cuda:N [default: cuda if present]") -> Any:
    """``--device``: where to run (or whose support to show)."""
    return Field(None, description=what)


def threads_field(what: str = "torch threads [default: torch's]") -> Any:
    """``--threads``: torch's intra-op threads for the run."""
    return Field(None, ge=1, description=what)


def json_field(what: str = "result file [default: dtypelab-results/…]") -> Any:
    """``--json``: where the record goes."""
    return Field(None, description=what, json_schema_extra={"flag": "--json"})


def hardware_field(what: str = "decide with this saved hardware probe instead of probing") -> Any:
    """``--hardware FILE`` (or ``DTYPELAB_HARDWARE``): a saved probe, or a ``HardwareInfo`` from Python."""
    return Field(None, description=what, json_schema_extra={"cli_type": "str", "envvar": "DTYPELAB_HARDWARE"})


def script_args_field() -> Any:
    """A training script's own arguments: what follows ``--`` on the command line, no flag of its own."""
    return Field((), description="a training script's own arguments (after --)", json_schema_extra={"cli": False})


def format_field() -> Any:
    """``--format``: how a record or table is shown."""
    return Field("table", description="table, markdown, html or json", json_schema_extra={"flag": "--format"})


def check_regex(value: str | None) -> str | None:
    """A validator's check that ``value`` (when given) is a regular expression, in the option's own error line."""
    if value:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"{value!r} is not a valid regular expression: {exc}") from None
    return value


class TrainingOptions(Options):
    """The fields every single-process training command shares (audit, trace, autopilot): batch, seed, device,
    threads, the record's path and a saved hardware probe. Subclasses add theirs after these."""

    batch_size: int | None = batch_size_field()
    seed: int = Field(0, description="seed of the initial weights, batches and dropout")
    device: str | None = device_field()
    threads: int | None = threads_field()
    json_path: str | None = json_field()
    hardware: Any = hardware_field()


TRAINING_OBJECTIVES = for_mode("train")  # what a training or inference sweep chooses for (not --mode generate's)


def training_objective(objective: str | None) -> str:
    """``--objective`` for training and inference: speed (the default) or energy; a one-line error for generate's."""
    if objective not in (None, *TRAINING_OBJECTIVES):
        raise DtypelabError(f"--objective {objective} is for --mode generate: training and inference choose for "
                            "speed or energy")
    return objective or "speed"


PANEL_FT = {"panel": "Fine-tuning (the LoRA policies; hf: tasks)"}  # the fine-tuning fields' help panel
PANEL_SERVE: dict[str, Any] = {"panel": "Serving (--mode generate)"}


class FineTuneOptions(Options):
    """The fields of the commands that fine-tune: the LoRA policies' settings and an ``hf:`` language model's sequence
    length."""

    lora_rank: int | None = Field(None, ge=1, description="the LoRA adapters' rank [default: 8]",
                                  json_schema_extra=PANEL_FT)
    lora_alpha: float | None = Field(None, gt=0, allow_inf_nan=False,
                                     description="LoRA's alpha: the adapters are scaled by alpha / rank [default: 16]",
                                     json_schema_extra=PANEL_FT)
    lora_targets: str | None = Field(None, description="the Linear layers LoRA adapts, comma-separated: names, a "
                                                       "name's last parts (q_proj), globs, re:PATTERN [default: every "
                                                       "Linear but the output head]", json_schema_extra=PANEL_FT)
    kbit_upcast: bool = Field(False, description="as peft's prepare_model_for_kbit_training: a quantized base's "
                                                 "other weights (norms, embeddings, head) upcast to float32",
                              json_schema_extra=PANEL_FT)
    seq_len: int | None = Field(None, ge=2, description="tokens per sequence of an hf: language model [default: "
                                                        "512, at most its context]", json_schema_extra=PANEL_FT)


class ModeOptions(FineTuneOptions):
    """The fields of the commands with modes (bench, forecast): fine-tuning's, then what ``--mode generate`` serves
    (its prompt and generation) and what the chosen policy is best at (``--objective``: ``core.objectives``).
    Subclasses add theirs after these."""

    prompt_len: int = Field(128, ge=1, description="--mode generate: tokens of each prompt (the prefill)",
                            json_schema_extra=PANEL_SERVE)
    gen_len: int = Field(64, ge=1, description="--mode generate: tokens generated for each prompt (the decode)",
                         json_schema_extra=PANEL_SERVE)
    objective: Literal["speed", "energy", "decode", "prefill", "latency"] | None = Field(
        None, description="what the chosen policy is best at within tolerance: speed or energy (the least joules per "
                          "sample, measured by the GPU's or CPU's energy counter); with --mode generate: decode, "
                          "prefill, latency, or energy (per generated token) [default: speed; decode with --mode "
                          "generate]")
