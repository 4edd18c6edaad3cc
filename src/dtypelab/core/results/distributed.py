"""What a distributed policy's run measured beyond the single-process fields, and the scaling estimate built from
it (an estimate, never a measurement: it says so wherever it is shown)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DistStats:
    """One distributed policy on ``nproc`` ranks (``nnodes`` nodes), per training step after warm-up (medians)."""

    nproc: int
    nnodes: int
    backend: str  # gloo or nccl
    strategy: str  # ddp or fsdp
    modifier: str  # the Distributed label: ddp, ddp-fp16, fsdp-bf16-params-fp32-reduce, ...
    payload_bytes: dict[str, int] = field(default_factory=dict)  # per rank per step, by collective kind
    wire_bytes: int = 0  # per rank per step on a ring with these ranks (payload × 2(N−1)/N or (N−1)/N)
    collectives: int = 0  # collectives per step
    comm_in_flight_s: float = 0.0  # collectives' issue-to-completion time per step (overlaps the backward)
    compute_s: float = 0.0  # the same step on a one-rank group each (hooks and casts, no peer): slowest rank
    rank_peak_bytes: tuple[int, ...] = ()  # each rank's peak memory above its baseline
    rank_step_s: tuple[float, ...] = ()  # each rank's median step
    link_latency_s: float = 0.0  # a 4-byte all-reduce between these ranks
    link_gbps: float = 0.0  # what a ring all-reduce of ``link_probe_bytes`` achieved between these ranks
    link_probe_bytes: int = 0


@dataclass(frozen=True)
class ScalingPoint:
    """The estimated step time of one policy at ``nproc`` ranks over a ``gbps`` link, and its speedup vs fp32."""

    policy: str
    link: str  # preset name or "X Gbit/s"
    gbps: float
    nproc: int
    step_s: float
    speedup: float  # estimated, vs the baseline policy's estimate at the same point


@dataclass(frozen=True)
class ScalingEstimate:
    """A ring all-reduce model: step(N, B) = compute + Σ collectives (latency + wire_factor(N) × payload / B), no
    overlap. ``validation``: the model at the measured ranks and measured link against the measured step."""

    model: str
    points: tuple[ScalingPoint, ...] = ()
    validation: dict[str, float] = field(default_factory=dict)  # policy -> predicted / measured − 1
    verdicts: dict[str, str] = field(default_factory=dict)  # policy -> where it starts to pay, or "not worth it"
