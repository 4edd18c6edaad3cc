"""What ``forecast`` is asked to do, validated once (the CLI's flags are made from these fields)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from dtypelab.core.objectives import for_mode, objective
from dtypelab.core.options import PANEL_SERVE, MemorySize, ModeOptions, batch_size_field, json_field

# what each mode reads; a field of the other mode given a value of its own is refused, not ignored
STEP_ONLY = ("nproc", "lora_rank", "lora_alpha", "lora_targets", "kbit_upcast", "seq_len", "baseline", "workers")
VLLM_ONLY = ("gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs", "block_size", "kv_cache_dtype",
             "max_model_len", "tensor_parallel_size")
GENERATE_ONLY = ("prompt_len", "gen_len", "engine", *VLLM_ONLY)
PANEL_VLLM: dict[str, Any] = {"panel": "The vLLM engine (--engine vllm: its own flags)"}
OBJECTIVES = {mode: for_mode(mode, forecast=True) for mode in ("step", "generate")}


class ForecastOptions(ModeOptions):
    mode: Literal["step", "generate"] = Field("step", description="step (the task's training step, or an "
                                                                   "inference task's pass), or generate (a causal "
                                                                   "language model serving: prefill and decode with "
                                                                   "a KV cache)")
    policies: str | None = Field(None, description="comma-separated policies, POLICY+adam8bit, plan files or "
                                                   "FILE.py:NAME [default: one of each memory layout (an hf: "
                                                   "model: its fine-tuning policies); all: every registered "
                                                   "policy]", json_schema_extra={"short": "-p"})
    device: str | None = Field(None, description="the GPU to fit (a name from --devices: H100, A100-40GB, L4, …), "
                                                 "or cpu / cuda for this machine's")
    memory: MemorySize = Field(None, description="the memory to fit instead of the device's (24GiB, 80GB)",
                               json_schema_extra={"cli_type": "str"})
    reserve: MemorySize = Field(None, description="memory kept aside, not traced: the CUDA context and libraries' "
                                                  "workspaces [default: 0.5GiB on a GPU, none on a CPU]",
                                json_schema_extra={"cli_type": "str"})
    batch_size: int | None = batch_size_field("samples per step, all ranks together")
    nproc: int = Field(1, ge=1, le=65536, description="data-parallel ranks: FSDP2 shards parameters, gradients and "
                                                      "optimizer state over them (the +fsdp policies); DDP does not")
    seed: int = Field(0, description="seed of the model's initial weights")
    batch_search: bool = Field(True, description="with a memory limit, also find the largest batch size that fits")
    check: bool = Field(False, description="also run the steps here on real tensors and show the measured peaks "
                                           "and step times beside the forecast (where the model fits this machine)")
    speed: bool = Field(True, description="also forecast each policy's step time (for --device cpu this times "
                                          "this CPU's kernels, and --check times its steps): --no-speed for memory "
                                          "alone, in a fraction of the time")
    baseline: str | None = Field(None, description="the policy speedups are against [default: fp32 when forecast, "
                                                   "else the first policy]")
    energy_from: str | None = Field(None, description="a bench record measured on the same GPU (its energy counter "
                                                      "read): its idle and measured power calibrate the energy "
                                                      "forecast")
    workers: int | None = Field(None, ge=1, le=64, description="processes tracing at once [default: the CPU cores, "
                                                                "at most 2]")
    engine: Literal["static", "vllm"] = Field(
        "static", description="--mode generate: the serving program: static (one batch decoded in lockstep over a "
                              "static cache read whole, gpt-fast's and torchao's harness) or vllm (vLLM v0.11's "
                              "memory accounting, paged KV cache, continuous batching at the concurrency -b)",
        json_schema_extra=PANEL_SERVE)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="the share of the card vLLM takes "
                                                 "[default: 0.9]", json_schema_extra=PANEL_VLLM)
    max_num_batched_tokens: int | None = Field(None, ge=1, description="tokens in one step, prefill chunks "
                                               "included: the profile run's size [default: vLLM's, 8192 on a card "
                                               "of 70 GiB or more but an A100, else 2048]",
                                               json_schema_extra=PANEL_VLLM)
    max_num_seqs: int | None = Field(None, ge=1, description="requests in one step [default: vLLM's, 1024 on a card "
                                                             "of 70 GiB or more but an A100, else 256]",
                                     json_schema_extra=PANEL_VLLM)
    block_size: int | None = Field(None, ge=1, le=256, description="tokens in a page of the KV cache [default: 16]",
                                   json_schema_extra=PANEL_VLLM)
    kv_cache_dtype: Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"] | None = Field(
        None, description="the KV cache's format for every policy [default: auto, the policy's own]",
        json_schema_extra=PANEL_VLLM)
    max_model_len: int | None = Field(None, ge=1, description="the longest request, prompt and output [default: "
                                                              "the model's context]", json_schema_extra=PANEL_VLLM)
    tensor_parallel_size: int | None = Field(None, ge=1, le=8, description="cards one model is split over "
                                                                           "[default: 1]",
                                             json_schema_extra=PANEL_VLLM)
    json_path: str | None = json_field()
    launcher: Any = Field(None, description="process (default) or inline (this process: tests, debugging)",
                          json_schema_extra={"cli": False})

    @model_validator(mode="after")
    def _one_mode(self) -> ForecastOptions:
        self.refuse_given(STEP_ONLY if self.mode == "generate" else GENERATE_ONLY, self.mode)
        if self.mode == "generate" and self.engine == "static":
            given = [self.flag(n) for n in VLLM_ONLY if self._given(n)]
            if given:
                raise ValueError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} vLLM's: add --engine vllm")
        if self.engine == "vllm" and (not self.batch_search or self.reserve is not None):
            raise ValueError("--no-batch-search and --reserve do not apply to --engine vllm: its KV pool says how "
                             "many requests fit, within --gpu-memory-utilization of the card")
        if self.objective is not None and self.objective not in OBJECTIVES[self.mode]:
            counted = self.mode == "step" and objective(self.objective).counts_joules
            raise ValueError(f"--objective {self.objective} is not forecast for --mode {self.mode}: use "
                             f"{' or '.join(OBJECTIVES[self.mode])}"
                             + (" (energy is measured by bench --objective energy; the forecast shows each "
                                "policy's J/step)" if counted else ""))
        return self
