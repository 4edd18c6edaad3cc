"""What ``bench`` is asked to do, validated once: the CLI builds it from its flags (and makes the flags from these
fields), a Python caller from keywords. A new option is one field here and its use in the sweep."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dtypelab.core.options import (
    PANEL_SERVE,
    Budget,
    MemorySize,
    ModeOptions,
    batch_size_field,
    budget_field,
    calibration_field,
    calibration_samples_field,
    device_field,
    hardware_field,
    json_field,
    script_args_field,
    threads_field,
)
from dtypelab.core.tolerance import Tolerance
from dtypelab.profiling import PROFILE_STEPS
from dtypelab.run import parse_gpus, parse_minutes, parse_slurm_args

DIST = {"panel": "Distributed"}
# what --mode generate reads (serving.bench: the policies measured, their quality's tolerance, the rounds that time
# them); any other field given a value of its own under it is refused, not ignored, and its own fields elsewhere too
GENERATE_READS = frozenset({"policies", "mode", "batch_size", "tolerance", "baseline", "device", "seed", "timeout_s",
                            "threads", "json_path", "memory_budget", "rounds", "launcher", "prompt_len", "gen_len",
                            "objective", "calibration", "calibration_samples"})
GENERATE_ONLY = ("prompt_len", "gen_len", "calibration", "calibration_samples")
FAN = {"panel": "Fan-out (--launcher local-gpus or slurm)"}


class BenchOptions(ModeOptions):
    policies: str | tuple[Any, ...] | None = Field(
        None, description="comma-separated policy names, plan files or your own kinds' FILE.py:NAME [default: every "
                          "policy that applies]",
        json_schema_extra={"short": "-p", "cli_type": "str"})
    plan: str | tuple[Any, ...] | None = Field(
        None, description="plan file(s) (dtypelab tune -o), measured beside --policies or, without it, beside the "
                          "default policies", json_schema_extra={"cli_type": "str"})
    mode: Literal["train", "infer", "generate"] = Field(
        "train", description="train, infer (forward latency and output fidelity), or generate (a causal language "
                             "model serving: prefill, decode with a KV cache, tokens/s, quality on held-out text)")
    steps: int | None = Field(None, ge=1, description="training steps (infer: timed forward passes)")
    batch_size: int | None = batch_size_field()
    warmup: int | None = Field(None, ge=0, description="steps excluded from timing [default: steps/10, ≤10]")
    tolerance: str = Field("1%", description="allowed metric change vs the baseline: 1% or an absolute 0.005")
    baseline: str | None = Field(None, description="the policy every other is judged against (speed, metric "
                                                   "tolerance) [default: fp32; fp64 for a script that builds its "
                                                   "model in float64]")
    runs: int = Field(5, ge=1, description="a training script: the most runs of the baseline and of each policy "
                                           "that could be the answer, in ABBA order, until their run-level speeds "
                                           "separate (1: one run each, no speed verdict between separate runs)")
    device: str | None = device_field()
    seed: int = Field(0, description="seed of the initial weights, batches and dropout (a script: of its process)")
    force: bool = Field(False, description="run policies measured to be pathologically slow here")
    keep_going: bool = Field(False, description="run the other policies even when the baseline failed "
                                                "(their results then have nothing to be compared with)")
    timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False, description="time limit per policy, seconds",
                             json_schema_extra={"flag": "--timeout"})
    threads: int | None = threads_field("torch threads per run [default: torch's]")
    json_path: str | None = json_field()
    per_layer: bool = Field(False, description="infer: SQNR of every layer's output vs fp32")
    calibration: str | None = calibration_field("--mode generate", PANEL_SERVE)
    calibration_samples: int = calibration_samples_field("--mode generate", PANEL_SERVE)
    min_cosine: float = Field(0.99, ge=0, le=1, description="infer: lowest worst-sample output cosine vs fp32 to "
                                                            "accept")
    emulate: bool = Field(False, description="run the formats this hardware cannot (float8 training) with emulated "
                                             "numerics: their metric and per-layer fidelity, no speed (slow: "
                                             "float32 matmuls)")
    memory_budget: MemorySize = Field(None, description="the most memory a policy may need (24GiB, 512MB): the "
                                      "fastest policy within tolerance that fits is chosen (training: its weights, "
                                      "gradients, optimizer state, master copy and activations; inference: its peak)",
                                      json_schema_extra={"cli_type": "str"})
    budget: Budget = budget_field("15m", "time for the whole sweep: policies estimated (from the fp32 run and the "
                                         "probe) not to fit are skipped; a script's repeated runs stop within it")
    rounds: int | None = Field(None, ge=0, description="interleaved timing rounds after the runs, for paired "
                                                       "speedups with intervals; 0: off [default: 5 train, 3 infer]")
    profile: bool | int = Field(False, description="after each policy, profile a few steps: step breakdown, top ops, "
                                                   "achieved FLOP/s, dtype coverage, and why",
                                json_schema_extra={"cli_type": "bool"})
    trace_dir: str | None = Field(None, description="with --profile: write each policy's raw Chrome trace "
                                                    "(TensorBoard, Perfetto) to this folder")
    launcher: Any = Field(None, description="how each policy runs: process (its own, the default), inline (in this "
                                            "process: no isolation), local-gpus (one policy per GPU of this "
                                            "machine at once) or slurm (a submitit job array)",
                          json_schema_extra={"cli_type": "str"})
    gpus: str | None = Field(None, description="local-gpus: the GPUs to use, such as 0,1,2,3 [default: every GPU]",
                             json_schema_extra=FAN)
    partition: str | None = Field(None, description="slurm: the partition to submit to", json_schema_extra=FAN)
    slurm_time: str | None = Field(None, description="slurm: each job's time limit, minutes or HH:MM:SS [default: "
                                                     "--timeout plus 5 minutes]",
                                   json_schema_extra={**FAN, "flag": "--time"})
    gpus_per_job: int = Field(1, ge=0, description="slurm: GPUs each job asks for", json_schema_extra=FAN)
    slurm_args: str | None = Field(None, description="slurm: more sbatch options, KEY=VALUE,…: 'account=ml,qos=high'",
                                   json_schema_extra=FAN)
    jobs_folder: str = Field("dtypelab-jobs", description="local-gpus, slurm: submitit's folder (pickles, logs) and "
                                                          "the runs' shared files; on Slurm it must be on a "
                                                          "filesystem the nodes share", json_schema_extra=FAN)
    fresh: bool = Field(False, description="measure every policy again, even when --json holds an interrupted sweep "
                                           "of the same settings (whose finished runs a re-run otherwise keeps)")
    hardware: Any = hardware_field("decide with this saved hardware probe (dtypelab hardware --json FILE, or any "
                                   "record) instead of probing")
    script_args: tuple[str, ...] = script_args_field()
    nproc: int | None = Field(None, ge=1, description="run every policy under torchrun on N ranks per node (gloo on "
                                                      "CPU, NCCL on CUDA); policies may add +ddp-fp16, +ddp-bf16, "
                                                      "+ddp-powersgd, +fsdp, +fsdp-bf16-params-fp32-reduce",
                              json_schema_extra=DIST)
    nnodes: int = Field(1, ge=1, description="nodes (torchrun --nnodes); run the same command on each",
                        json_schema_extra=DIST)
    rdzv_endpoint: str | None = Field(None, description="HOST:PORT of the rendezvous (torchrun --rdzv-endpoint)",
                                      json_schema_extra=DIST)
    torchrun_args: str | tuple[str, ...] | None = Field(
        None, description="more torchrun arguments, unchanged: '--node-rank 1 --rdzv-id job7'",
        json_schema_extra={**DIST, "cli_type": "str"})
    link_gbps: str | tuple[Any, ...] | None = Field(
        None, description="links for the scaling estimate: Gbit/s numbers or presets 25gbe, 100gbe, pcie4, nvlink4 "
                          "[default: all four presets]", json_schema_extra={**DIST, "cli_type": "str"})

    @field_validator("tolerance")
    @classmethod
    def _tolerance(cls, v: str) -> str:
        Tolerance.parse(v)  # a DtypelabError is a ValueError: its words become the option's error
        return v

    @field_validator("rounds")
    @classmethod
    def _rounds(cls, v: int | None) -> int | None:
        if v == 1:
            raise ValueError("must be 0 (off) or at least 2 (an interval needs two pairs)")
        return v

    @field_validator("profile")
    @classmethod
    def _profile(cls, v: bool | int) -> bool | int:
        if not isinstance(v, bool) and v < 0:
            raise ValueError("must be true or a number of steps >= 0")
        return v

    @field_validator("timeout_s")
    @classmethod
    def _timeout(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number of seconds")
        return v

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: str | None) -> str | None:
        parse_gpus(v)
        return v

    @field_validator("slurm_time")
    @classmethod
    def _slurm_time(cls, v: str | None) -> str | None:
        parse_minutes(v)
        return v

    @field_validator("slurm_args")
    @classmethod
    def _slurm_args(cls, v: str | None) -> str | None:
        parse_slurm_args(v)
        return v

    @model_validator(mode="after")
    def _together(self) -> BenchOptions:
        fan = self.launcher if isinstance(self.launcher, str) else None
        if self.gpus is not None and fan != "local-gpus":
            raise ValueError("--gpus picks the GPUs of --launcher local-gpus: give that launcher too")
        slurm_only = [f for f, v in (("--partition", self.partition), ("--time", self.slurm_time),
                                     ("--slurm-args", self.slurm_args)) if v]
        if slurm_only and fan != "slurm":
            raise ValueError(f"{slurm_only[0]} is a Slurm setting: give --launcher slurm too")
        if fan in ("local-gpus", "slurm") and self.nproc is not None:
            raise ValueError(f"--launcher {fan} fans single-process runs out; --nproc runs each under torchrun: "
                             "use one or the other")
        self._mode_fields()
        if self.per_layer and self.mode != "infer":
            raise ValueError("per_layer compares inference outputs: use it with mode infer (--per-layer --mode infer)")
        distributed = self.nnodes != 1 or self.rdzv_endpoint or self.torchrun_args or self.link_gbps
        if self.nproc is None and distributed:
            if self.link_gbps and self.nnodes == 1 and not self.rdzv_endpoint and not self.torchrun_args:
                raise ValueError("link_gbps (--link-gbps) is for the scaling estimate of a distributed run: give "
                                 "--nproc N")
            raise ValueError("--nnodes, --rdzv-endpoint and --torchrun-args need --nproc N (ranks per node)")
        return self

    def _mode_fields(self) -> None:
        """A field the mode does not read, given a value of its own, in one line."""
        if self.mode == "generate" and isinstance(self.launcher, str) and self.launcher not in ("process", "inline"):
            raise ValueError(f"--launcher {self.launcher}: --mode generate measures each serving policy here, in a "
                             "process of its own (process, the default) or in this one (inline)")
        self.refuse_given([n for n in type(self).model_fields if n not in GENERATE_READS]
                          if self.mode == "generate" else GENERATE_ONLY, self.mode)

    @property
    def profile_steps(self) -> int:
        """Steps profiled per policy: --profile's default, a number given, or the default when only a trace folder
        was given; 0 for none."""
        if self.profile is True or (self.trace_dir and self.profile is False):
            return PROFILE_STEPS
        return int(self.profile)
