"""The report of ``zeroplan validate --json`` as pydantic models: one home for its schema.

No torch here: ``zeroplan plot --view validate`` reads reports with ``ValidationRow`` on a machine
without torch. ``validate.report`` builds every report through ``ValidationReport``, so a row that
lacks a key, or has one not declared here, fails when it is made, not when it is read.

Measured vs derived: a key named ``measured_*`` holds an observation (live tensor bytes, calls and
elements seen at dispatch, bytes on the wire); ``derived_*`` is a formula applied to an observation
(the ring rule applied to each observed call). ``RENAMED_FROM_V1`` maps the keys of schema
``zeroplan.validate/1`` to their names in ``/2``; ``ValidationRow`` still reads ``/1`` files.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from zeroplan.plot_data import ValidationRow  # the keys every row has: what zeroplan plot reads, its home

SCHEMA = "zeroplan.validate/2"

# zeroplan.validate/1 key -> zeroplan.validate/2 key (row level unless dotted)
RENAMED_FROM_V1 = {
    "measured_comm_bytes_per_rank": "derived_comm_bytes_per_rank",
    "comm_rel_error": "derived_comm_rel_error",
    "wire_to_logical": "wire_to_derived",
    "checks.comm_exact": "checks.collectives_match",
    "measured_collectives.*.bytes_per_rank": "measured_collectives.*.derived_bytes_per_rank",
}


class PredictedCollective(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    elements: int = Field(description="elements of the collective per step")
    bytes_per_rank: int = Field(description="bytes one rank sends per step, ring rule")


class ObservedCollective(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    calls: int = Field(description="calls observed at dispatch in one step")
    elements: int = Field(description="their elements summed (measured)")
    derived_bytes_per_rank: Optional[int] = Field(
        description="ring rule applied to each call (derived); None for a collective it does not cover"
    )


class Checks(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_states_within_tolerance: bool = Field(description="|measured - predicted| <= tolerance x predicted")
    model_states_steady: bool = Field(description="the same live bytes at every step boundary of every rank")
    collectives_match: bool = Field(
        description="observed elements per (collective, phase, dtype) = prediction, every step and rank"
    )
    peak_within_tolerance: Optional[bool] = Field(
        description="largest per-phase |measured - predicted| / measured <= peak_tolerance; None: no peak model"
    )
    parity: Optional[bool] = Field(description="parity with the single-process reference; None: simulated")


class StepTime(BaseModel):
    """Median seconds of one step, slowest rank: what the probes cost."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    probed: float = Field(description="steps 2..k under every probe (step 1 creates Adam's states)")
    unprobed: float = Field(description="extra steps after the parity check, no probe at all")
    unprobed_steps: int


class ReportRow(ValidationRow):
    """One (world size, stage) of a report: prediction, measurement, derived figures and verdict."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["real", "simulated"]
    device: str
    model: str = Field(description="preset name, or gpt~PSI for --params")
    psi: int = Field(description="parameters of the model built")
    model_states_rel_error: float = Field(description="(measured - predicted) / predicted model states")
    model_states_extra_bytes: int = Field(description="measured - predicted model states (bytes)")
    predicted_beside_states_terms: Optional[list[dict[str, Union[str, int]]]] = Field(
        None, description="terms of the profile live beside the model states where they are read, part of "
        "predicted_model_states_bytes (name, bytes, source; e.g. FSDP2's post-forward mesh ranks); None: none",
    )  # fmt: skip
    adam_step_bytes: int = Field(description="Adam's step counters (the expected excess: 4 bytes)")
    predicted_breakdown_bytes: dict[str, int]
    probe_breakdown: dict[str, Union[int, float]] = Field(
        description="CPU: MemTracker's categories in bytes; CUDA: the allocator's memory_stats counters"
    )
    predicted_collective_elements: int
    measured_collective_elements: int = Field(description="elements of all collectives of the last step")
    collective_elements_rel_error: float
    derived_comm_rel_error: float
    predicted_collectives: dict[str, PredictedCollective] = Field(description="key: op|phase|dtype")
    measured_collectives: dict[str, ObservedCollective] = Field(description="last step, rank 0")
    measured_setup_collectives: dict[str, ObservedCollective] = Field(
        description="issued while the runtime was built (none predicted; reported, not checked)"
    )
    observed_calls_last_step: list[tuple[str, str, str, int]] = Field(
        description="rank 0's calls of the last step in order: op, phase, dtype, elements"
    )
    measured_peak_bytes: int
    measured_peak_bytes_by_phase: dict[str, int] = Field(
        description="largest live bytes within each phase (init, forward, backward, optimizer_step), max over ranks"
    )
    predicted_peak_bytes_by_phase: Optional[dict[str, int]] = Field(
        description="the engine profile's peak per phase (zeroplan.engines.reference); None: no peak model"
    )
    peak_rel_error_by_phase: Optional[dict[str, float]] = Field(
        None, description="(measured - predicted) / measured per phase"
    )
    peak_rel_error_rank_by_phase: Optional[dict[str, int]] = Field(
        None, description="the rank each phase's error is of: every rank is compared with its own prediction "
        "and the furthest reported; None: the largest of the ranks' readings against the largest prediction",
    )  # fmt: skip
    measured_reserved_bytes_by_phase: Optional[dict[str, int]] = Field(
        None, description="CUDA: torch.cuda.max_memory_reserved per phase (peaks reset per phase, cached segments "
        "returned at the row's start: validate/probes.py); null on CPU"
    )
    predicted_reserved_bytes_by_phase: Optional[dict[str, int]] = Field(
        None, description="CUDA: the allocator model's reserved bytes per phase for the engine's allocation trace "
        "(zeroplan.allocator.reserved, docs/allocator.md); null on CPU or where not predicted"
    )
    peak_rel_error: Optional[float] = Field(description="the largest of peak_rel_error_by_phase, by magnitude")
    predicted_peak_phase: Optional[str] = Field(None, description="the phase of the predicted peak")
    predicted_peak_terms: Optional[list[dict[str, Union[str, int]]]] = Field(
        description="the largest live terms at the predicted peak: name, bytes, source"
    )
    engine: Literal["reference", "fsdp2", "deepspeed"] = Field("reference", description="what trained")
    engine_label: Optional[str] = Field(None, description="the engine's configuration in its own words")
    peak_unchecked_phases: Optional[dict[str, str]] = Field(
        None, description="phases whose peak is reported but not checked, each with the reason"
    )
    checkpointing: Literal["none", "full"]
    seq_len: Optional[int] = Field(description="tokens per sequence as given (None: the model's positions)")
    micro_batch: int = Field(description="sequences (samples) per rank per step")
    grad_accum: int = Field(
        1, description="micro-steps per optimizer step (collectives and boundaries are per optimizer step)"
    )
    foreach: Optional[bool] = Field(description="Adam's foreach path as the runtime ran it")
    parity: Optional[dict[str, Union[bool, int, float, None]]] = Field(
        description="the rank furthest from the reference (a failing one if any); None when simulated"
    )
    seconds: float = Field(description="wall time of the probed steps, slowest rank")
    step_time_s: StepTime
    wire_bytes_per_rank: Optional[float] = Field(description="--wire: bytes on loopback per rank per step")
    profiler_comms: Optional[dict[str, dict]] = Field(description="profiler communication events, last step")
    wire_to_derived: Optional[float] = Field(description="wire_bytes_per_rank / derived_comm_bytes_per_rank")
    checks: Checks
    ok: bool
    runner_changes: list[str] = Field(
        default_factory=list, description="what the runner changes in the engine it measures, beyond the probes "
        "(synchronous collectives, GC off, a capability answered): each change in words, with where it is made",
    )  # fmt: skip
    engine: Optional[str] = Field(None, description="what trained (--engine); None: the reference runtime")
    engine_label: Optional[str] = Field(None, description="the engine's configuration in its own words")
    deepspeed_estimator_bytes: Optional[int] = Field(
        None, description="--engine deepspeed: DeepSpeed's own estimate_zero2/3_model_states_mem_needs for the run "
        "(restated in zeroplan.engines.deepspeed), beside the prediction",
    )
    deepspeed_estimator_rel_error: Optional[float] = Field(
        None, description="(measured peak - DeepSpeed's estimate) / measured peak"
    )


class ValidationReport(BaseModel):
    """The whole ``--json`` document."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_id: Literal["zeroplan.validate/2"] = Field(SCHEMA, alias="schema")
    config: dict = Field(description="the ValidateConfig that was run")
    torch: Optional[str] = Field(description="torch version of the ranks")
    rows: list[ReportRow]
    notes: list[str]
    baseline_drift: Optional[dict] = Field(
        None, description="--baseline: {tolerance, lines}: each figure that moved beyond the tolerance"
    )
    ok: bool
