"""Pydantic models of the JSON that ``estimate --json``, ``plan --json`` and ``sweep --json`` print.

The renderers build their JSON through these models (field order = key order), so the documented
schema and the output cannot drift. ``python -m zeroplan.render.schemas docs/schemas`` writes the JSON
Schema of each (``tests/test_schemas.py`` checks the committed files equal the generated ones).
Numbers typed ``Number`` keep whether they were computed as int or float, so the output is unchanged.
"""

import json
import sys
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from zeroplan.render.schema_parts import (  # noqa: F401 - the documents' shared pieces, re-exported
    AUTO_DESCRIPTION, AutoKeyOut, CollectiveOut, Number, PeakTermOut, PhasesOut, PolicyOut, StageOut, StepOut, _Out,
    _WithAuto, auto_out, json_text,
)
from zeroplan.sweeping.records import SweepRow


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
    "gpu_bytes", "host_bytes_per_gpu", "host_bytes_per_node", "host_steady_bytes_per_gpu",
    "host_init_peak_bytes_per_gpu", "host_peak_at", "nvme_bytes_per_gpu", "nvme_bytes_per_node",
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
    fits: Optional[bool] = Field(description="whether the option fits within the GPU less the headroom; null: no "
                                 "memory given, or a row of an engine's plan after the recommendation, not replayed "
                                 "(reserved_not_replayed; --replay-all decides every row)")
    min_gpus: Optional[int] = Field(description="fewest GPUs that fit; null: none up to 2**20, no model, or an "
                                    "engine's own candidate")
    gpu_bytes: Optional[GpuBytesOut] = None
    host_bytes_per_gpu: Optional[int] = None
    host_bytes_per_node: Optional[int] = None
    host_steady_bytes_per_gpu: Optional[int] = Field(
        None, description="one rank's host memory during training steps (an engine's offload: the sum of estimate's "
        "host_terms; a reference offload row: the offloaded model states, ZeRO-Offload sec. 4); 0 without offload")
    host_init_peak_bytes_per_gpu: Optional[int] = Field(
        None, description="one rank's host memory at init's peak (an engine's offload, as estimate's); null for a "
        "reference offload row (the reference runtime builds the states on the GPU: not modelled); 0 without offload")
    host_peak_at: Optional[Literal["init", "steady"]] = Field(
        None, description="which of the two host_bytes_per_gpu (the table's host/node) is: what a reference plan's "
        "--host-memory is compared with (plan --engine takes no --host-memory)")
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
    reserved_not_replayed: Optional[str] = Field(
        None, description="why reserved_bytes is null though the engine has an allocation trace: the live peak alone "
        "exceeds the GPU less the headroom, so reserved (>= live) cannot fit and the trace was not replayed "
        "(docs/allocator.md), or a CPU run (--device cpu) has no CUDA caching allocator (fits on the live peak), or "
        "an engine's plan recommends a row above it (the first that fits) and replays no further (fits null; "
        "--replay-all replays every row); the key is absent on rows replayed or without a trace",
    )  # fmt: skip

    @model_serializer(mode="wrap")
    def _without_model(self, handler: SerializerFunctionWrapHandler):  # no return type: the schema stays the model's
        out = handler(self)
        if self.gpu_bytes is None:
            for key in _MODEL_KEYS:
                out.pop(key)
        if self.peak_rank is None:
            out.pop("peak_rank")
        return _absent_if_none(out, "reserved_not_replayed")


def _absent_if_none(out: dict, key: str) -> dict:
    """``out`` without ``key`` where it is null: a key written only where it applies (earlier outputs keep theirs)."""
    if out.get(key) is None:
        out.pop(key, None)
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
        "(the script's own deepspeed.zero.Init(config_dict_or_path=...), or with --hf-zero-init transformers' own "
        "build: an HfDeepSpeedConfig alive around from_config); absent otherwise",
    )

    @model_serializer(mode="wrap")
    def _absent_build(self, handler: SerializerFunctionWrapHandler):
        """``deepspeed_build`` is written only where it applies: earlier outputs keep their keys."""
        return _absent_if_none(handler(self), "deepspeed_build")


class LargestConfigurationOut(_Out):
    """One configuration of ``plan --max-micro-batch`` (planning/largest_batch.py ``Bracket``)."""

    label: str = Field(description="the configuration: its row's label in stages[] / offload[]")
    largest: int = Field(description="the largest micro-batch that fits on the plan's own fits; 0: not even 1")
    smallest_over: Optional[int] = Field(description="the smallest micro-batch found not to fit; null: every one "
                                         "up to up_to fits")  # fmt: skip
    tried: list[int] = Field(description="the micro-batches planned for it, in order (doubling, then bisection)")


class LargestMicroBatchOut(_Out):
    """``plan --max-micro-batch UP_TO``: the largest micro-batch that fits, per configuration (docs/allocator.md)."""

    up_to: int = Field(description="the search's limit (--max-micro-batch)")
    configurations: list[LargestConfigurationOut]


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
    largest_micro_batch: Optional[LargestMicroBatchOut] = Field(
        None, description="with --max-micro-batch only (the key is absent otherwise): the largest micro-batch each "
        "configuration fits at, the table's last lines")  # fmt: skip

    @model_serializer(mode="wrap")
    def _absent_largest(self, handler: SerializerFunctionWrapHandler):
        """``largest_micro_batch`` is written only when searched: earlier outputs keep their keys."""
        return _absent_if_none(handler(self), "largest_micro_batch")


class SweepInputs(_Out):
    gpu_memory_bytes: Optional[int]
    policy: PolicyOut
    model: Optional[str] = Field(description="--model as given; null for --params or --shapes")
    seq_len: Optional[int] = Field(description="tokens per sequence of the activation and peak columns")
    checkpointing: Optional[str] = Field(description="recomputation of the activation and peak columns")
    foreach: Optional[bool] = Field(description="Adam's foreach path of the peak columns")
    engine: Optional[str] = Field(description="the engine of the peak columns")
    headroom: float = Field(description="the fraction of GPU memory every *fits column keeps free (--headroom)")
    alloc_conf: Optional[str] = Field(description="the PYTORCH_CUDA_ALLOC_CONF the reserved_bytes column assumes "
                                      "(--alloc-conf; \"\": torch's defaults); null without --model")


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
