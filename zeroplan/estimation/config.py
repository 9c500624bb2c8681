"""``EstimateConfig``: one question to ``zeroplan.estimate`` (pydantic). Every field states its unit."""

import math
from dataclasses import replace
from functools import cached_property
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.architectures.spec import TransformerSpec, numels
from zeroplan.engines import get_engine, planner_options
from zeroplan.engines.base import EngineOptions, PlannerOptions, Workload
from zeroplan.estimation.workload import default_foreach, device_foreach, model_workload, resolve
from zeroplan.policy import PrecisionPolicy
from zeroplan.formulas.cuda_workspaces import capability_of
from zeroplan.presets import DEFAULT_SEQ_LEN, GpuName, get_gpu
from zeroplan.types import (
    BatchCount, ByteSize, DType, Flag, GpuCount, ModelName, Numel, Params, SeqLen, StageNumber, check_split,
    check_total,
)  # fmt: skip


def preset_memory(data: object) -> object:
    """A config's input with ``gpu_memory_bytes`` from its ``gpu`` preset where only the preset is given (the
    planner configs' one rule: an explicit memory overrides the preset's, as ``PlanConfig.memory_bytes``)."""
    if isinstance(data, dict) and isinstance(data.get("gpu"), str) and data.get("gpu_memory_bytes") is None:
        return {**data, "gpu_memory_bytes": get_gpu(data["gpu"]).memory_bytes}
    return data


class EstimateConfig(BaseModel):
    """One question to the planner: a model on ``gpus`` GPUs, N_d = gpus / model_parallel.

    The model is ``params`` (a bare Ψ), ``tensor_numels`` (real tensors, exact padding) or ``model`` (an
    architecture: exact shapes, and the peak of a training step of ``micro_batch`` x ``seq_len``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True, defer_build=True)

    params: Optional[Params] = None
    """Ψ for the whole model, in parameters (elements); give this, ``tensor_numels`` or ``model``."""
    tensor_numels: Optional[tuple[Numel, ...]] = Field(None, min_length=1)
    """elements of every parameter tensor of the whole model; enables exact per-tensor padding."""
    tensor_shapes: Optional[tuple[tuple[str, tuple[int, ...]], ...]] = None
    """with ``tensor_numels``: each tensor's name and shape (a live module's, ``estimate(model=<nn.Module>)``), so
    an engine that pads a dimension (FSDP2's dim 0) pads the real one; None: 1-D tensors of those sizes."""
    model: Optional[ModelName] = None
    """a model preset name or the path of a Hugging Face ``config.json`` (``zeroplan.presets.resolve_model``)."""
    architecture: Optional[TransformerSpec] = None
    """instead of ``model``: the architecture itself (e.g. read from an ``nn.Module``'s config)."""
    seq_len: Optional[SeqLen] = None
    """tokens per sequence; default the preset's, or a config file's maximum positions capped at 2048."""
    micro_batch: BatchCount = 1
    """sequences per GPU per micro-step."""
    checkpointing: Literal["none", "full"] = "none"
    """``full``: every decoder layer recomputed in backward (``torch.utils.checkpoint`` per block)."""
    grad_accum: BatchCount = 1
    """micro-steps per optimizer step."""
    foreach: Flag = True
    """the optimizer's multi-tensor path; not given (or None): torch's default for the run's device
    (``device_foreach``: True on CUDA, the planner's target; False with ``device`` cpu)."""
    engine: str = "reference"
    """the training engine whose allocations and collectives are estimated (``zeroplan.engines.get_engine``)."""
    gpus: GpuCount = 1
    """total GPUs = N_d x N_m."""
    gpus_per_node: GpuCount = 8
    """GPUs per node: which mesh dimension's collectives stay in a node (``link`` in the JSON,
    ``zeroplan.formulas.mesh``) and DeepSpeed qgZ's local group (``Settings.devices_per_node``)."""
    model_parallel: GpuCount = 1
    """N_m, the tensor/pipeline model-parallel degree; the paper divides model states by it."""
    stage: Optional[StageNumber] = None
    """show only this ZeRO stage (0-3); None shows all four."""
    gpu: Optional[GpuName] = None
    """GPU preset (``zeroplan.presets.gpu_presets``): its memory to mark which stages fit (unless
    ``gpu_memory_bytes`` is given) and its compute capability for the peak's cuBLAS workspaces, as ``plan``."""
    gpu_memory_bytes: Optional[ByteSize] = None
    """memory of one GPU in bytes, to mark which stages fit (on the peak when known); overrides the preset's;
    None (and no preset) to skip."""
    policy: PrecisionPolicy = PrecisionPolicy()
    """the reference engine's precision policy (the paper's vocabulary); refused for the other engines."""
    engine_options: EngineOptions = EngineOptions()
    """options in the engine's own vocabulary (``--reshard-after-forward``, ``--deepspeed-config``, ...)."""
    live_settings: tuple[tuple[str, str | bool], ...] = ()
    """(field, value) of the engine's ``Settings`` read from a live module and optimizer (``zeroplan.estimation.live``:
    fsdp2's ``module_dtype`` and ``amsgrad``, deepspeed's ``optimizer``); set by ``estimate(model=<nn.Module>)``,
    not by users."""
    module_dtype: Optional[DType] = None
    """the dtype of a live module's parameters (``estimate(model=<nn.Module>)``): a 16-bit module must be the
    dtype the engine trains in (``zeroplan.estimation.live.check_module_dtype``); None: no module."""
    alloc_conf: str = ""
    """``PYTORCH_CUDA_ALLOC_CONF`` the run will use, for the reserved bytes (``zeroplan.allocator``); "": torch's
    defaults."""

    @field_validator("alloc_conf")
    @classmethod
    def _alloc_conf(cls, v: str) -> str:
        parse_alloc_conf(v)  # one line naming the bad part
        return v

    @model_validator(mode="before")
    @classmethod
    def _preset_memory(cls, data: object) -> object:
        return device_foreach(preset_memory(data))

    @model_validator(mode="after")
    def _consistent(self) -> "EstimateConfig":
        given = [self.params, self.tensor_numels, self.model, self.architecture]
        if sum(x is not None for x in given) != 1:
            raise ValueError("give exactly one of params, tensor_numels and model")
        check_split(self.gpus, self.model_parallel)
        check_total(self.tensor_numels or ())
        if self.tensor_shapes is not None and tuple(math.prod(s) for _, s in self.tensor_shapes) != self.tensor_numels:
            raise ValueError("tensor_shapes: their sizes must be tensor_numels")
        _ = self.planner_options  # options outside the engine's vocabulary: one line
        if self.spec is None:
            step = dict(seq_len=self.seq_len, micro_batch=self.micro_batch, checkpointing=self.checkpointing,
                        grad_accum=self.grad_accum)  # fmt: skip
            defaults = dict(seq_len=None, micro_batch=1, checkpointing="none", grad_accum=1)
            changed = [k for k, v in step.items() if v != defaults[k]]
            if changed:
                raise ValueError(f"{changed[0]} describes a training step, which needs model (an architecture)")
        else:
            if self.model_parallel != 1:
                raise ValueError(
                    f"model_parallel={self.model_parallel}: the peak of an architecture is modelled without "
                    "tensor or pipeline parallelism (model_parallel=1)"
                )
            check_total(numels(self.workload.shapes), "model")
        return self

    @cached_property
    def _resolved(self) -> Optional[tuple[TransformerSpec, int]]:
        if self.model is not None:
            return resolve(self.model, self.seq_len)
        if self.architecture is not None:
            default = min(self.architecture.max_seq_len, DEFAULT_SEQ_LEN)
            return self.architecture, self.seq_len if self.seq_len is not None else default
        return None

    @property
    def spec(self) -> Optional[TransformerSpec]:
        """The architecture, when ``model`` or ``architecture`` gives one."""
        return None if self._resolved is None else self._resolved[0]

    @property
    def sequence_length(self) -> Optional[int]:
        """``seq_len`` as resolved (the model's default when not given); None without an architecture."""
        return None if self._resolved is None else self._resolved[1]

    @cached_property
    def workload(self) -> Optional[Workload]:
        """One micro-step of the architecture (``zeroplan.estimation.workload``); None without one."""
        if self.spec is None:
            return None
        return model_workload(self.spec, self.sequence_length, self.micro_batch, self.checkpointing,
                              self.grad_accum, self.foreach)  # fmt: skip

    @property
    def planner_options(self) -> PlannerOptions:
        """What the engine's ``planner_settings`` reads (``zeroplan.engines.planner_options``)."""
        policy = self.policy if "policy" in self.model_fields_set else None
        options = planner_options(get_engine(self.engine), self.engine_options, stage=self.stage, policy=policy,
                                  flat_layout=self.params is None)  # fmt: skip
        return replace(options, gpu_capability=None if self.gpu is None else capability_of(self.gpu),
                       grad_accum=self.grad_accum)  # fmt: skip

    @property
    def nd(self) -> int:
        return self.gpus // self.model_parallel
