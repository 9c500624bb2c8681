"""Validated inputs of ``zeroplan plan`` (pydantic): a model, a GPU, a cluster shape, a training shape.

Every field states its unit; every bad value raises with a message that quotes it. Presets are resolved
here (``zeroplan.presets``), overrides win over presets.
"""

from dataclasses import replace
from functools import cached_property
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationInfo, field_validator, model_validator

from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.architectures.spec import TransformerSpec, gpt_for_params, numels, transformer_shapes
from zeroplan.engines import EngineName, get_engine, planner_options
from zeroplan.engines.base import PLANNER_INPUTS, EngineOptions, PlannerOptions
from zeroplan.estimation.workload import check_seq_len, device_foreach
from zeroplan.formulas.activations import activation_bytes
from zeroplan.formulas.collectives import DEFAULT_BUCKET_NUMEL
from zeroplan.formulas.commtime import ALGORITHMS
from zeroplan.formulas.cuda_workspaces import capability_of
from zeroplan.formulas.offload import DEVICES
from zeroplan.policy import BF16_MIXED, PrecisionPolicy
from zeroplan.presets import (
    DEFAULT_SEQ_LEN, GpuName, GpuSpec, LinkSpec, ModelPreset, get_gpu, get_interconnect, get_model, is_config_path,
    ModelRef, model_seq_len, resolve_model,
)  # fmt: skip
from zeroplan.types import model_name
from zeroplan.types import (
    Bandwidth, BatchCount, ByteSize, Checkpointing, Count, Flag, Fraction, GpuCount, Params, SeqLen, Tflops,
    Utilisation, check_bytes, check_split,
)  # fmt: skip

DEFAULT_HEADROOM = 0.0
"""Share of GPU memory kept free beyond what the plan predicts: 0. With an architecture, "fits" compares the
allocator's reserved bytes (``zeroplan.allocator``, fragmentation included) with the card; the CUDA context
and NCCL buffers are not counted (docs/allocator.md), so a run that needs a margin for them, or for a
configuration the plan fits on model states alone (no --model), passes ``--headroom``. It replaces a 10%
"allocator overhead" guess that was never measured."""
DEFAULT_MFU = 0.4
"""Model FLOPs utilisation for the compute-time estimate: Llama 3 reports 38-43% BF16 MFU on H100s
(Llama Team 2024, The Llama 3 Herd of Models, Table 4)."""
DEFAULT_INTRA = "nvlink4"
DEFAULT_INTER = "ib-ndr"


class PlanConfig(BaseModel):
    """One capacity-planning question. Give the model as a preset (``model``) or a count (``params``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, ignored_types=(cached_property,))

    model: Optional[Annotated[ModelRef, BeforeValidator(model_name)]] = None
    """model preset (``zeroplan.presets.model_presets``) or the path of a Hugging Face ``config.json``: exact
    per-tensor padding, and the peak of a training step."""
    params: Optional[Params] = None
    """Ψ of the whole model in parameters, when no preset is named. Neither: only max model sizes."""
    gpu: Optional[GpuName] = None
    """GPU preset (``zeroplan.presets.gpu_presets``): memory, peak FLOP/s and default links."""
    gpu_memory_bytes: Optional[ByteSize] = None
    """memory of one GPU in bytes; overrides the preset's."""
    gpus: GpuCount = 8
    """total GPUs = N_d x N_m."""
    gpus_per_node: GpuCount = 8
    model_parallel: GpuCount = 1
    """N_m, tensor/pipeline model-parallel degree."""
    headroom: Fraction = DEFAULT_HEADROOM
    """fraction of GPU memory kept free beyond what is predicted, in [0, 1) (``DEFAULT_HEADROOM``)."""
    alloc_conf: str = ""
    """``PYTORCH_CUDA_ALLOC_CONF`` of the run, for its reserved bytes ("": torch's defaults)."""
    replay_all: Flag = False
    """an engine's plan (fsdp2, deepspeed): replay every row's allocation trace, not only the rows up to the first
    that fits (``planning/reserved_fit.py AFTER_FIT``); the reference engine's plan replays every row always."""
    interconnect: Optional[str] = None
    """intra-node link preset; default the GPU preset's, else nvlink4."""
    bw_gbps: Optional[Bandwidth] = None
    """intra-node bandwidth per GPU, GB/s one direction; overrides the preset's."""
    inter_interconnect: str = DEFAULT_INTER
    """inter-node link preset (one NIC per GPU)."""
    inter_bw_gbps: Optional[Bandwidth] = None
    """inter-node bandwidth per GPU, GB/s one direction; overrides the preset's."""
    algorithm: Literal[ALGORITHMS] = "ring"
    """all-reduce algorithm for the latency term (reduce-scatter and all-gather are always ring)."""
    micro_batch: BatchCount = 1
    """sequences per GPU per micro-step."""
    grad_accum: BatchCount = 1
    """micro-steps per optimizer step."""
    seq_len: Optional[SeqLen] = None
    """tokens per sequence; default the preset's, else 2048."""
    checkpointing: Checkpointing = "full"
    """activation recomputation assumed by the activation estimate (``zeroplan.formulas.activations``) and
    the peak (which knows none and full; full stays the default here, as before the peak existed)."""
    foreach: Flag = True
    """the optimizer's multi-tensor path, for the peak; not given (or None): torch's default for the run's device
    (``zeroplan.estimation.workload.device_foreach``)."""
    engine: EngineName = "reference"
    """the training engine whose peak decides the fit (``zeroplan.engines.get_engine``)."""
    engine_options: EngineOptions = EngineOptions()
    """options in the engine's own vocabulary (``--deepspeed-config``, ``--param-dtype``/``--reduce-dtype``
    of FSDP2's ``MixedPrecisionPolicy``); an engine's own plan chooses the rest."""
    offload: Literal[DEVICES] = "none"
    """the most offload the recommendation may use (all options are always listed)."""
    host_memory_bytes: Optional[ByteSize] = None
    """CPU memory per node in bytes; when given, offload options must also fit in it."""
    peak_tflops: Optional[Tflops] = None
    """dense peak TFLOP/s (1e12 FLOP/s) per GPU; overrides the preset's. None without a preset: no compute
    estimate."""
    mfu: Utilisation = DEFAULT_MFU
    """model FLOPs utilisation in (0, 1] for the compute-time estimate."""
    bucket_numel: Count = DEFAULT_BUCKET_NUMEL
    """elements per collective call (gradient bucket / all-gather bucket)."""
    policy: PrecisionPolicy = BF16_MIXED

    @field_validator("alloc_conf")
    @classmethod
    def _alloc_conf(cls, v: str) -> str:
        parse_alloc_conf(v)  # one line naming the bad part
        return v

    @field_validator("interconnect", "inter_interconnect")
    @classmethod
    def _link(cls, v: Optional[str], info: ValidationInfo) -> Optional[str]:
        if v is None:
            return v
        link = get_interconnect(v)
        want = "intra" if info.field_name == "interconnect" else "inter"
        if link.scope != want:
            where = "inside a node" if link.scope == "intra" else "between nodes"
            raise ValueError(f"{info.field_name}={v!r} links GPUs {where}; expected an {want}-node link")
        return link.name

    @model_validator(mode="before")
    @classmethod
    def _device_foreach(cls, data: object) -> object:
        return device_foreach(data)

    @model_validator(mode="after")
    def _consistent(self) -> "PlanConfig":
        if self.model is not None and self.params is not None:
            raise ValueError("give at most one of model and params")
        if self.gpu is None and self.gpu_memory_bytes is None:
            raise ValueError(
                "give a GPU preset (gpu, --gpu) or the GPU memory (gpu_memory_bytes, --gpu-memory)"
            )
        check_split(self.gpus, self.model_parallel)
        _ = self.planner_options  # options outside the engine's vocabulary: one line
        engine = get_engine(self.engine)
        if engine.plan is not None:  # the engine's own search by predicted peak
            chosen = [k for k in engine.plan_chooses if k in self.model_fields_set]
            if chosen:
                raise ValueError(f"{chosen[0]} does not apply to plan --engine {self.engine}, which chooses it by "
                                 "predicted peak")  # fmt: skip
            # asked as the plan uses them (``Engine.plan_options``): what it chooses itself is not the file's
            limit = engine.peak_limits(engine.plan_options(self.planner_options), self.model_architecture,
                                       self.checkpointing, self.model_parallel)  # fmt: skip
            why = {"offload": self.offload != "none", "host_memory_bytes": self.host_memory_bytes is not None}
            bad = limit.option if limit is not None else next((k for k, v in why.items() if v), None)
            if bad is not None and bad not in (*PLANNER_INPUTS, *why):
                raise ValueError(limit.reason)  # the architecture or the engine's own options
            if bad is not None:
                raise ValueError(
                    f"plan --engine {self.engine} searches its own options by predicted peak, which needs a model "
                    "(an architecture), model_parallel=1, checkpointing none or full and no offload; got "
                    f"{bad}={getattr(self, bad)!r}"
                )
        if self.model is not None:
            check_seq_len(self.transformer, self.sequence_length)
        if self.transformer is not None:  # keep every printed size a sane byte count
            s, b = self.sequence_length, self.micro_batch
            act = activation_bytes(self.transformer, s, b, self.checkpointing, 1)
            check_bytes(act or 0, f"activations at seq_len={s}, micro_batch={b}")
        return self

    # Resolved values: overrides first, then presets, then documented defaults.

    @property
    def planner_options(self) -> PlannerOptions:
        """What the engine's ``planner_settings`` reads (the reference engine: the policy)."""
        engine = get_engine(self.engine)
        reads_policy = "policy" in engine.options or self.policy != BF16_MIXED  # else refused, not ignored
        options = planner_options(engine, self.engine_options, policy=self.policy if reads_policy else None)
        return replace(options, gpu_capability=self.gpu_capability, grad_accum=self.grad_accum)

    @property
    def gpu_capability(self) -> Optional[tuple[int, int]]:
        """The ``gpu`` preset's compute capability (``capability_of``: sizes the cuBLAS workspaces); None
        without a preset or for one whose workspaces are not modelled."""
        return None if self.gpu is None else capability_of(self.gpu)

    @property
    def nd(self) -> int:
        return self.gpus // self.model_parallel

    @property
    def gpu_spec(self) -> Optional[GpuSpec]:
        return None if self.gpu is None else get_gpu(self.gpu)

    @property
    def model_spec(self) -> Optional[ModelPreset]:
        """The preset ``model`` names; None for a config file or no model."""
        return None if self.model is None or is_config_path(self.model) else get_model(self.model)

    @cached_property
    def model_architecture(self) -> Optional[TransformerSpec]:
        """The architecture ``model`` names (preset or config file); None without one."""
        return None if self.model is None else resolve_model(self.model)

    @property
    def memory_bytes(self) -> int:
        return self.gpu_memory_bytes if self.gpu_memory_bytes is not None else self.gpu_spec.memory_bytes

    @cached_property
    def tensor_numels(self) -> Optional[tuple[int, ...]]:
        """Every tensor of the whole model (preset), Ψ as one tensor (params), or None (no model); built once
        (1,137 shapes for llama3-405b)."""
        if self.model_architecture is not None:
            return numels(transformer_shapes(self.model_architecture))
        return None if self.params is None else (int(self.params),)

    @property
    def sequence_length(self) -> int:
        if self.seq_len is not None:
            return self.seq_len
        return DEFAULT_SEQ_LEN if self.model is None else model_seq_len(self.model, self.model_architecture)

    @property
    def tokens_per_micro_step(self) -> int:
        return self.micro_batch * self.sequence_length

    @property
    def transformer(self) -> Optional[TransformerSpec]:
        """The preset's architecture, or for ``params`` a GPT-style shape of about Ψ (``gpt_for_params``)."""
        if self.model_architecture is not None:
            return self.model_architecture
        return None if self.params is None else gpt_for_params(self.params)

    @property
    def flops(self) -> Optional[float]:
        if self.peak_tflops is not None:
            return self.peak_tflops * 1e12
        return None if self.gpu_spec is None else self.gpu_spec.peak_flops

    def _resolve_link(self, name: str, bw: Optional[float]) -> LinkSpec:
        link = get_interconnect(name)
        if bw is None:
            return link
        return link.model_copy(update={"bandwidth_gbps": bw, "name": f"{bw:g} GB/s", "source": "--bw option"})

    @property
    def intra_link(self) -> LinkSpec:
        name = self.interconnect or (self.gpu_spec.intra_node if self.gpu_spec else DEFAULT_INTRA)
        return self._resolve_link(name, self.bw_gbps)

    @property
    def inter_link(self) -> LinkSpec:
        return self._resolve_link(self.inter_interconnect, self.inter_bw_gbps)

    @property
    def host_link(self) -> LinkSpec:
        return get_interconnect(self.gpu_spec.host_link if self.gpu_spec else "pcie4")
