"""The pieces the JSON documents of ``zeroplan.render.schemas`` share: the byte conventions, a collective, the
phases and their terms, one stage row, and the ``"auto"`` keys of a ds_config (``estimate`` and ``plan`` both print
them). Field order = key order, as in the documents."""

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from zeroplan.render.json_text import json_text  # noqa: F401 (re-exported: the one JSON writer)

Number = Union[int, float]
"""A number as computed: exact integers stay integers."""


class _Out(BaseModel):
    # defer_build: a model's validator is built when it is first used (a document validates its parts within its
    # own), so ``plan --json`` builds PlanDoc's alone, not the thirty of every document (issue 16: 25 ms)
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, defer_build=True)

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

    op: Literal["all-reduce", "reduce-scatter", "all-gather", "all-to-all"]
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


HOST_KEYS = ("host_bytes_per_gpu", "host_bytes_per_node", "host_pinned_bytes_per_node", "host_terms",
             "host_steady_bytes_per_gpu", "host_init_peak_bytes_per_gpu", "host_peak_at", "host_init_peak_terms")
"""``StageOut``'s offload keys, written only where the engine offloads."""
NVME_KEYS = ("nvme_read_bytes_per_step", "nvme_write_bytes_per_step")
"""``StageOut``'s NVMe keys, written where the engine offloads: null without NVMe (``HostMemory.nvme_read_bytes``)."""


class StageOut(_Out):
    """One ZeRO stage of ``estimate``: per-GPU model states in bytes and per-step communication."""

    stage: int
    name: str = Field(description="the paper's name: DP, P_os, P_os+g, P_os+g+p")
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    model_states_bytes: int
    reduction_vs_dp: Optional[float] = Field(
        description="DP model states / this stage's model states; null when none stay on the GPU (offload)")
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
    reserved_not_replayed: Optional[str] = Field(
        None, description="why reserved_bytes is null though the engine has an allocation trace: a CPU run (--device "
        "cpu) has no CUDA caching allocator, and fits is on the live peak; absent otherwise",
    )  # fmt: skip
    own_estimator_bytes: Optional[int] = Field(
        None, description="the engine's own estimator for the same run (deepspeed: DeepSpeed's "
        "estimate_zero2/3_model_states_mem_needs), beside the prediction; the key is absent for engines without one",
    )  # fmt: skip
    host_bytes_per_gpu: Optional[int] = Field(
        None, description="the engine's offload (DeepSpeed offload_optimizer/offload_param, FSDP2 CPUOffloadPolicy): "
        "host memory one rank needs, pinned buffers included: the larger of host_steady_bytes_per_gpu and "
        "host_init_peak_bytes_per_gpu (host_peak_at names which); the key is absent without offload",
    )  # fmt: skip
    host_bytes_per_node: Optional[int] = Field(
        None, description="host_bytes_per_gpu times the GPUs per node; absent without offload")
    host_pinned_bytes_per_node: Optional[int] = Field(
        None, description="the page-locked part of host_bytes_per_node; absent without offload")
    host_terms: Optional[list[PeakTermOut]] = Field(
        None, description="host memory of one rank, term by term with its source; absent without offload")
    host_steady_bytes_per_gpu: Optional[int] = Field(
        None, description="the sum of host_terms: one rank's host memory during training steps; absent without offload")
    host_init_peak_bytes_per_gpu: Optional[int] = Field(
        None, description="one rank's host memory at init's peak (FSDP2 init=materialized: the whole model built on "
        "the CPU; DeepSpeed ZeRO-3 offload_optimizer: initialize_optimizer_states); absent without offload")
    host_peak_at: Optional[Literal["init", "steady"]] = Field(
        None, description="which of the two host_bytes_per_gpu is; absent without offload")
    host_init_peak_terms: Optional[list[PeakTermOut]] = Field(
        None, description="host memory of one rank at init's peak, term by term; empty where init holds no "
        "more than the steady terms made at init; absent without offload")
    nvme_read_bytes_per_step: Optional[int] = Field(
        None, description="NVMe -> host bytes of one rank's steady optimizer step (DeepSpeed ZeRO-3 offload_optimizer "
        "nvme: fp32 master, m, v and the swapped fp32 gradient slices; the first step reads the master only of the "
        "three); 0 when the partition is too small to swap; null without NVMe offload; absent without offload")
    nvme_write_bytes_per_step: Optional[int] = Field(
        None, description="host -> NVMe bytes of one rank's optimizer step (the same tensors); 0 when the partition "
        "is too small to swap; null without NVMe offload; absent without offload")

    peak_rank: Optional[int] = Field(
        None, description="the rank whose peak this row is, the largest over ranks (fsdp2: the ranks whose shards "
        "differ; deepspeed ZeRO-1/2: whose flat-group slices differ); the key is absent where every rank holds the same",
    )  # fmt: skip

    @model_serializer(mode="wrap")
    def _without_own(self, handler: SerializerFunctionWrapHandler):  # no return type: the schema stays the model's
        out = handler(self)
        for key in ("own_estimator_bytes", "peak_rank", *HOST_KEYS):  # the host keys: only where the engine offloads
            if getattr(self, key) is None:
                out.pop(key)
        if self.host_bytes_per_gpu is None:  # the NVMe keys: null without NVMe, absent without offload
            for key in NVME_KEYS:
                out.pop(key)
        if self.reserved_not_replayed is None:
            out.pop("reserved_not_replayed")
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


