"""Pydantic models of the JSON that ``estimate --json``, ``plan --json`` and ``sweep --json`` print.

The renderers build their JSON through these models (field order = key order), so the documented
schema and the output cannot drift. ``python -m zeroplan.render.schemas docs/schemas`` writes the JSON
Schema of each (``tests/test_schemas.py`` checks the committed files equal the generated ones).
Numbers typed ``Number`` keep whether they were computed as int or float, so the output is unchanged.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from zeroplan.sweeping.records import SweepRow

Number = Union[int, float]
"""A number as computed: exact integers stay integers."""


def json_text(obj: object, indent: Optional[int] = None) -> str:
    """``obj`` as JSON text. Every JSON output goes through here: NaN and infinity are not JSON, so they
    raise ValueError (the ranges of ``zeroplan.types`` keep them from being computed at all)."""
    return json.dumps(obj, indent=indent, allow_nan=False)


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def dump(self) -> dict:
        """The object as the JSON output writes it (aliases as keys, in field order)."""
        return self.model_dump(by_alias=True)


class PolicyOut(_Out):
    """The precision policy with defaults filled in."""

    param_dtype: str
    grad_dtype: str
    master_dtype: Optional[str] = Field(description="'fp32' when an fp32 master copy is kept, else null")
    optimizer: str
    optimizer_dtype: str


class CollectiveOut(_Out):
    """One collective a rank takes part in per training step."""

    op: Literal["all-reduce", "reduce-scatter", "all-gather"]
    phase: str = Field(description="forward, backward or optimizer step")
    elements: int = Field(description="full (unsharded) size of the collective, in elements")
    dtype: str
    bytes_per_rank: int = Field(description="bytes one rank sends on a ring algorithm")
    mesh_dim: Literal["dp_replicate", "dp_shard", "tp"] = Field(
        description="the mesh dimension it runs over (zeroplan/formulas/mesh.py): dp_shard for a flat run's "
        "whole data-parallel group, dp_replicate for HSDP's gradient all-reduce across replicas",
    )  # fmt: skip
    group_size: int = Field(description="ranks in its process group")
    link: Literal["intra", "inter"] = Field(
        description="intra: every group inside one node (NVLink); inter: a group crosses nodes (the network), "
        "for the node size given (--gpus-per-node, default 8)",
    )  # fmt: skip


class PhasesOut(_Out):
    """Peak bytes per GPU in each phase of a training step (``zeroplan.formulas.peak.PHASES``)."""

    init: int
    forward: int
    backward: int
    optimizer_step: int


class PeakTermOut(_Out):
    """One live term at the peak: a buffer (or group of equal buffers) and where it is allocated."""

    name: str
    bytes: int = Field(description="as allocated, before the allocator's block rounding")
    source: str = Field(description="the engine file and function (or formula) it comes from")


class StepOut(_Out):
    """The training step the peak is for (an architecture is given)."""

    seq_len: int
    micro_batch: int
    checkpointing: Literal["none", "full"]
    grad_accum: int
    foreach: bool
    block_bytes: int = Field(description="every tensor rounded up to this (512: CUDA's caching allocator)")
    alloc_conf: str = Field(description="PYTORCH_CUDA_ALLOC_CONF the reserved bytes were replayed under (--alloc-conf; "
                            "empty: torch's defaults)")


class StageOut(_Out):
    """One ZeRO stage of ``estimate``: per-GPU model states in bytes and per-step communication."""

    stage: int
    name: str = Field(description="the paper's name: DP, P_os, P_os+g, P_os+g+p")
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    model_states_bytes: int
    reduction_vs_dp: float = Field(description="DP model states / this stage's model states")
    fits: Optional[bool] = Field(
        description="reserved bytes (when the engine has an allocation trace), else the peak (an architecture), else "
        "model states <= GPU memory; null when no memory was given"
    )
    comm_volume_elements: int = Field(description="elements moved per step as the ZeRO paper counts (sec. 7)")
    comm_bytes_per_rank: int = Field(description="bytes each rank sends per step with ring collectives")
    collectives: list[CollectiveOut]
    peak_bytes: Optional[int] = Field(
        description="the largest phase's peak per GPU (docs/peak.md); null without an architecture (--model)"
    )
    peak_phase: Optional[str] = Field(description="the phase the peak falls in; null without an architecture")
    phases: Optional[PhasesOut] = Field(description="peak per phase, bytes; null without an architecture")
    peak_terms: Optional[list[PeakTermOut]] = Field(
        description="the largest live terms at the peak, largest first; null without an architecture"
    )
    reserved_bytes: Optional[int] = Field(
        None, description="max_memory_reserved the allocator model predicts for the step (zeroplan.allocator: the "
        "engine's allocation trace replayed under --alloc-conf; docs/allocator.md); absent without an architecture",
    )  # fmt: skip
    reserved_phases: Optional[PhasesOut] = Field(
        None, description="reserved bytes per phase (peaks reset at each phase, as torch.cuda.reset_peak_memory_stats); "
        "absent without an architecture",
    )  # fmt: skip
    own_estimator_bytes: Optional[int] = Field(
        None, description="the engine's own estimator for the same run (deepspeed: DeepSpeed's "
        "estimate_zero2/3_model_states_mem_needs), beside the prediction; the key is absent for engines without one",
    )  # fmt: skip
    peak_rank: Optional[int] = Field(
        None, description="the rank whose peak this row is, the largest over ranks (fsdp2: the ranks whose shards "
        "differ; deepspeed ZeRO-1/2: whose flat-group slices differ); the key is absent where every rank holds the same",
    )  # fmt: skip

    @model_serializer(mode="wrap")
    def _without_own(self, handler: SerializerFunctionWrapHandler):  # no return type: the schema stays the model's
        out = handler(self)
        for key in ("own_estimator_bytes", "peak_rank"):
            if getattr(self, key) is None:
                out.pop(key)
        if self.reserved_bytes is None:  # no trace (no architecture): the keys are absent, as before them
            out.pop("reserved_bytes")
            out.pop("reserved_phases")
        return out


class AutoKeyOut(_Out):
    """One key of a ``--deepspeed-config`` that said ``"auto"``, as the HF Trainer resolves it
    (``zeroplan.integrations.hf_trainer.resolve_trainer_auto``; docs/integrations.md)."""

    key: str = Field(description="dotted key in the ds_config, e.g. zero_optimization.reduce_bucket_size")
    value: Any = Field(description="the value it became; 'auto' when left unresolved")
    source: Optional[str] = Field(description="the transformers or accelerate file and function that decides it, "
                                  "with the run's inputs it used; null when unresolved")  # fmt: skip
    reason: Optional[str] = Field(description="why it stays 'auto'; null when filled")


def auto_out(resolution: Any) -> Optional[list[AutoKeyOut]]:
    """``ds_config_auto`` of a JSON document from an ``AutoResolution`` (``zeroplan.integrations.ds_auto``):
    the filled keys in the order they were filled, then the unresolved ones; None without one."""
    if resolution is None:
        return None
    return [*(AutoKeyOut(key=f.key, value=f.value, source=f.source, reason=None) for f in resolution.filled),
            *(AutoKeyOut(key=k, value="auto", source=None, reason=why) for k, why in resolution.unresolved)]


AUTO_DESCRIPTION = ("each key of --deepspeed-config that said \"auto\", what it became and who decided it; "
                    "absent when the file has no \"auto\" or none was given")  # fmt: skip


class _WithAuto(_Out):
    """Inputs that may carry ``ds_config_auto``: written only where a file had ``"auto"`` (earlier outputs keep
    their keys)."""

    @model_serializer(mode="wrap")
    def _absent_auto(self, handler: SerializerFunctionWrapHandler):  # no return type: the schema stays the model's
        out = handler(self)
        if out.get("ds_config_auto") is None:
            out.pop("ds_config_auto", None)
        return out


class EstimateInputs(_WithAuto):
    params: int = Field(description="Ψ of the whole model")
    psi: int = Field(description="Ψ per model-parallel rank")
    gpus: int
    nd: int
    nm: int
    gpu_memory_bytes: Optional[int]
    policy: PolicyOut
    engine: str = Field(description="the engine estimated (--engine)")
    model: Optional[str] = Field(description="--model as given; null for --params or --shapes")
    step: Optional[StepOut] = Field(description="the training step of the peak; null without an architecture")
    ds_config_auto: Optional[list[AutoKeyOut]] = Field(None, description=AUTO_DESCRIPTION)


class EstimateDoc(_Out):
    """``zeroplan estimate --json``."""

    schema_: Literal["zeroplan.estimate/1"] = Field("zeroplan.estimate/1", alias="schema")
    inputs: EstimateInputs
    bytes_per_param: dict[str, Number] = Field(description="the byte convention: label -> bytes per param")
    k: Number = Field(description="the paper's K: optimizer-state bytes per parameter, master copy included")
    stages: list[StageOut]


class LinkOut(_Out):
    name: str
    bandwidth_gbps: Number = Field(description="GB/s one direction per GPU")
    alpha_s: Number = Field(description="latency of one ring step, seconds")


class LinksOut(_Out):
    intra: LinkOut
    inter: LinkOut
    ring: LinkOut = Field(description="the link that limits the data-parallel ring")
    host: LinkOut


class PlanInputs(_WithAuto):
    model: Optional[str]
    params: Optional[int]
    psi: Optional[int]
    gpu: Optional[str]
    gpu_memory_bytes: int
    headroom: Number
    alloc_conf: str = Field("", description="PYTORCH_CUDA_ALLOC_CONF the reserved bytes were replayed under "
                            "(--alloc-conf; empty: torch's defaults)")
    budget_bytes: int = Field(description="(1 - headroom) x GPU memory: what the fit quantity (fit_basis) may use")
    host_memory_bytes: Optional[int]
    gpus: int
    gpus_per_node: int
    nd: int
    nm: int
    micro_batch: int
    grad_accum: int
    tokens_per_step: int
    offload_allowed: Literal["none", "cpu", "nvme"]
    peak_flops: Optional[Number]
    mfu: Number
    bucket_numel: int
    links: LinksOut
    bytes_per_param: dict[str, Number]
    policy: PolicyOut
    engine: str = Field(description="the engine whose peak decides the fit (--engine)")
    foreach: bool = Field(description="Adam's foreach path, for the peak")
    ds_config_auto: Optional[list[AutoKeyOut]] = Field(None, description=AUTO_DESCRIPTION)


class OffloadOut(_Out):
    optimizer: Literal["none", "cpu", "nvme"]
    params: Literal["none", "cpu", "nvme"]


class GpuBytesOut(_Out):
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    model_states_bytes: int


class PcieOut(_Out):
    h2d_bytes: int
    d2h_bytes: int
    nvme_read_bytes: int
    nvme_write_bytes: int
    seconds: Number = Field(description="offload traffic time per step on the host link, full duplex")


class TimedCollectiveOut(CollectiveOut):
    calls_per_step: int
    seconds_per_call: Number


class CommTimeOut(_Out):
    link: str
    algorithm: str
    comm_s: Number
    compute_s: Optional[Number]
    exposed_comm_s: Optional[Number]
    step_s: Optional[Number]
    collectives: list[TimedCollectiveOut]


_MODEL_KEYS = (
    "gpu_bytes", "host_bytes_per_gpu", "host_bytes_per_node", "nvme_bytes_per_gpu", "nvme_bytes_per_node",
    "pcie", "comm_volume_elements", "comm_bytes_per_rank", "comm_time", "peak_bytes", "peak_phase", "phases",
    "peak_terms", "reserved_bytes", "reserved_phases",
)  # fmt: skip


class PlanOptionOut(_Out):
    """One (stage, offload) option of ``plan``; the keys after ``min_gpus`` only when a model was given."""

    stage: int
    name: str
    offload: OffloadOut
    label: str
    max_params: Optional[int] = Field(description="largest Ψ whose model states fill the GPU (ZeRO Table 2); "
                                      "null: no limit, or an engine's own candidate (plan --engine fsdp2|deepspeed)")
    max_params_with_headroom: Optional[int]
    fits: Optional[bool]
    min_gpus: Optional[int] = Field(description="fewest GPUs that fit; null: none up to 2**20, no model, or an "
                                    "engine's own candidate")
    gpu_bytes: Optional[GpuBytesOut] = None
    host_bytes_per_gpu: Optional[int] = None
    host_bytes_per_node: Optional[int] = None
    nvme_bytes_per_gpu: Optional[int] = None
    nvme_bytes_per_node: Optional[int] = None
    pcie: Optional[PcieOut] = None
    comm_volume_elements: Optional[int] = None
    comm_bytes_per_rank: Optional[int] = None
    comm_time: Optional[CommTimeOut] = None
    peak_bytes: Optional[int] = Field(None, description="the engine's peak per GPU; null with offload or "
                                      "without an architecture (--model)")  # fmt: skip
    peak_phase: Optional[str] = None
    phases: Optional[PhasesOut] = None
    peak_terms: Optional[list[PeakTermOut]] = None
    peak_rank: Optional[int] = Field(
        None, description="an engine's own candidate: the rank whose peak this is, the largest over ranks; the key "
        "is absent where every rank holds the same",
    )  # fmt: skip
    reserved_bytes: Optional[int] = Field(None, description="max_memory_reserved the allocator model predicts "
                                          "(docs/allocator.md); null with offload or without an architecture")
    reserved_phases: Optional[PhasesOut] = Field(None, description="reserved bytes per phase; null as reserved_bytes")

    @model_serializer(mode="wrap")
    def _without_model(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if self.gpu_bytes is None:
            for key in _MODEL_KEYS:
                out.pop(key)
        if self.peak_rank is None:
            out.pop("peak_rank")
        return out


class ActivationsOut(_Out):
    bytes: Optional[int] = Field(description="per GPU, Korthikanti et al. 2022; null where not estimated")
    checkpointing: str
    seq_len: int
    micro_batch: int
    tp: int
    headroom_bytes: int
    within_headroom: Optional[bool]


class RecommendationOut(_Out):
    stage: int
    offload: OffloadOut
    label: str
    deepspeed: Optional[dict[str, Any]] = Field(
        description="ds_config.json for this option (plan --engine deepspeed only); null with --engine fsdp2 or the "
        "reference engine, whose predictions are not DeepSpeed's"
    )
    fsdp2: Optional[str] = Field(
        description="FSDP2 fully_shard code for this option (plan --engine fsdp2 only); null with --engine "
        "deepspeed or the reference engine"
    )
    deepspeed_build: Optional[str] = Field(
        None, description="plan --engine deepspeed at ZeRO-3: how the model is built for the prediction to hold "
        "(under deepspeed.zero.Init(config_dict_or_path=...)); absent otherwise",
    )

    @model_serializer(mode="wrap")
    def _absent_build(self, handler: SerializerFunctionWrapHandler):
        """``deepspeed_build`` is written only where it applies: earlier outputs keep their keys."""
        out = handler(self)
        if out.get("deepspeed_build") is None:
            out.pop("deepspeed_build", None)
        return out


class PlanDoc(_Out):
    """``zeroplan plan --json``."""

    schema_: Literal["zeroplan.plan/1"] = Field("zeroplan.plan/1", alias="schema")
    inputs: PlanInputs
    stages: list[PlanOptionOut]
    offload: list[PlanOptionOut]
    activations: ActivationsOut
    recommendation: Optional[RecommendationOut]
    reason: str
    fit_basis: str = Field(description="how fits was decided: on the peak per GPU, or on model states and why")
    cut_first: Optional[str] = Field(description="which term to cut first, from the peak's largest terms; "
                                     "null without a peak")  # fmt: skip
    fragmentation: Optional[str] = Field(None, description="what to change when the cheapest configuration's live "
                                         "bytes fit and its reserved bytes do not (expandable_segments:True, a "
                                         "smaller micro-batch or buckets); null otherwise")  # fmt: skip
    notes: list[str]


class SweepInputs(_Out):
    gpu_memory_bytes: Optional[int]
    policy: PolicyOut
    model: Optional[str] = Field(description="--model as given; null for --params or --shapes")
    seq_len: Optional[int] = Field(description="tokens per sequence of the activation and peak columns")
    checkpointing: Optional[str] = Field(description="recomputation of the activation and peak columns")
    foreach: Optional[bool] = Field(description="Adam's foreach path of the peak columns")
    engine: Optional[str] = Field(description="the engine of the peak columns")


class SweepDoc(_Out):
    """``zeroplan sweep --json``."""

    schema_: Literal["zeroplan.sweep/1"] = Field("zeroplan.sweep/1", alias="schema")
    inputs: SweepInputs
    columns: list[str]
    rows: list[SweepRow]


DOCS: dict[str, type[_Out]] = {"estimate": EstimateDoc, "plan": PlanDoc, "sweep": SweepDoc}


def json_schemas() -> dict[str, str]:
    """File name -> JSON Schema text of each output, as written to docs/schemas/."""
    return {
        f"{name}.json": json.dumps(doc.model_json_schema(by_alias=True, mode="serialization"), indent=2) + "\n"
        for name, doc in DOCS.items()
    }


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m zeroplan.render.schemas DIRECTORY  (writes estimate, plan, sweep .json)")
    folder = Path(argv[0])
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in json_schemas().items():
        (folder / name).write_text(text)
        print(f"wrote {folder / name}")


if __name__ == "__main__":
    main(sys.argv[1:])
