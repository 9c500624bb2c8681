"""The engine profile's settings: the ds_config keys that change memory or traffic, with DeepSpeed 0.19.8's
defaults (``Settings``; read from a ds_config by ``Settings.from_ds_config``, written back by ``to_ds_config``),
the dtype table, and which optimizer classes DeepSpeed builds for them."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from zeroplan.engines.deepspeed.config import (DEFAULT_BUCKET_NUMEL, STAGE3_PREFETCH_NUMEL, _batch_keys, _ds_dtype,
                                               _OptimizerParams, _precision_keys, from_deepspeed, parse_ds_config)
from zeroplan.engines.deepspeed.nvme import check_aio
from zeroplan.engines.deepspeed.offload_settings import NO_TARGET, OffloadTarget, check_offload, read_target, target_block
from zeroplan.engines.deepspeed.zeropp_settings import check_zeropp, check_zeropp_keys, zeropp_keys
from zeroplan.formulas.dtypes import BYTES_PER_ELEMENT
from zeroplan.formulas.mesh import DEFAULT_GPUS_PER_NODE
from zeroplan.formulas.peak import CUDA_BLOCK_BYTES

DEEPSPEED_VERSION = "0.19.8"
DTYPE_BYTES = BYTES_PER_ELEMENT  # the one byte table (zeroplan.formulas.dtypes), under DeepSpeed's old name
DsDtype = Literal["fp32", "bf16", "fp16"]
# stage_1_and_2.py / bf16_optimizer.py __init__: "4-byte alignment/sizeof(fp16) = 2"; the flat group is
# padded to a multiple of this times N_d (``flatten_dense_tensors_aligned``).
NCCL_START_ALIGNMENT_FACTOR = 2
_ZERO_KEYS = {  # ds_config zero_optimization key -> Settings field
    "reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size",
    "contiguous_gradients": "contiguous_gradients", "overlap_comm": "overlap_comm",
    "reduce_scatter": "reduce_scatter", "use_multi_rank_bucket_allreduce": "use_multi_rank_bucket_allreduce",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters", "stage3_max_reuse_distance": "max_reuse_distance",
    "zero_hpz_partition_size": "hpz_partition_size", "zero_quantized_weights": "quantized_weights",
    "zero_quantized_gradients": "quantized_gradients",
}  # fmt: skip


class Settings(BaseModel):
    """The ds_config keys that change memory or traffic, with DeepSpeed 0.19.8's defaults.

    Defaults: ``runtime/zero/config.py`` ``DeepSpeedZeroConfig`` (reduce/allgather buckets 5e8
    elements, prefetch 5e7, persistence threshold 1e5, max live parameters / reuse distance 1e9,
    ``contiguous_gradients``, ``reduce_scatter`` and ``use_multi_rank_bucket_allreduce`` true,
    ``overlap_comm`` None -> ``stage == 3`` in ``overlap_comm_valid``); precision from ``fp16`` / ``bf16``
    ``enabled`` (fp32 when neither), ``grad_accum_dtype`` defaulting to the model dtype
    (``runtime/engine.py`` ``DeepSpeedEngine.get_data_types``); ``optimizer.params.torch_adam`` (false),
    ``adam_w_mode`` (true) and ``foreach`` (``DeepSpeedEngine._configure_basic_optimizer``). Sizes are
    elements.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    stage: Literal[1, 2, 3]
    dtype: DsDtype = "fp32"
    grad_accum_dtype: Optional[DsDtype] = None
    reduce_bucket_size: int = Field(DEFAULT_BUCKET_NUMEL, ge=1)
    allgather_bucket_size: int = Field(DEFAULT_BUCKET_NUMEL, ge=1)
    contiguous_gradients: bool = True
    overlap_comm: Optional[bool] = None
    reduce_scatter: bool = True
    use_multi_rank_bucket_allreduce: bool = True
    prefetch_bucket_size: int = Field(STAGE3_PREFETCH_NUMEL, ge=0)
    param_persistence_threshold: int = Field(100_000, ge=0)
    max_live_parameters: int = Field(1_000_000_000, ge=0)
    max_reuse_distance: int = Field(1_000_000_000, ge=0)
    optimizer: Literal["adam", "adamw"] = "adam"
    adam_w_mode: bool = True
    torch_adam: bool = False
    foreach: Optional[bool] = None
    amsgrad: bool = False
    """torch's ``Adam(amsgrad=True)`` as the inner optimizer (a client ``torch.optim.Adam``/``AdamW``, which
    ``deepspeed.initialize(optimizer=...)`` wraps over the fp32 partition): a third fp32 state of the partition,
    ``max_exp_avg_sq`` (``terms._adam_moments``). Needs ``torch_adam`` (FusedAdam raises on amsgrad,
    ops/adam/fused_adam.py); measured at fp32 without offload only. Not a ds_config key: read from the object."""
    weight_decay: float = Field(0.0, ge=0.0)
    """``optimizer.params.weight_decay`` (0: torch's and DeepSpeed's Adam default); with ``adam_w_mode`` false and
    ``torch_adam`` it is an L2 term that allocates (offload_terms.py ``adam_step_fp32_temporaries``)."""
    zero_init: Optional[bool] = None
    """ZeRO-3: the model built under ``deepspeed.zero.Init(config_dict_or_path=ds_config)``
    (runtime/zero/partition_parameters.py ``Init``: each module's parameters are created in the config's
    dtype and partitioned right after its ``__init__``, so no rank holds the whole model) or, False, built
    whole and partitioned by ``deepspeed.initialize``. Not a ds_config key: how the script builds the model.
    None: True at stage 3, DeepSpeed's documented way to build a model larger than one device (and what
    Hugging Face ``from_pretrained`` does when the config is ZeRO-3: ``is_deepspeed_zero3_enabled``);
    stages 1-2 never (``Init`` partitions parameters, which only ZeRO-3 does)."""
    hf_zero3_build: bool = False
    """ZeRO-3 under ``zero_init``: a transformers model built by transformers itself, an ``HfDeepSpeedConfig`` of the
    ds_config alive (``from_config`` opens ``zero.Init`` and initialises the weights with ``initialize_weights_zero3``,
    each module gathered with its direct children: zero3.py ``zero_init_moments``), not under the script's own
    ``zero.Init`` with ``Module.apply``. Not a ds_config key: the planner's ``--hf-zero-init`` (own option
    ``hf_zero3_build``), set by the HF Trainer's and accelerate's readers (build.py; docs/integrations.md), and the
    validator's ``hf_zero3_build`` (validate/engines/deepspeed.py); the plan's build snippet says which
    (build.py ``build_snippet``). At ZeRO-3 under ``zero_init`` only; read for a transformers model
    (``Workload.transformers``)."""

    offload_optimizer: OffloadTarget = NO_TARGET
    """``zero_optimization.offload_optimizer`` (offload_settings.py): the fp32 master, Adam's states and the
    step on the host (``DeepSpeedCPUAdam``)."""
    offload_param: OffloadTarget = NO_TARGET
    """``zero_optimization.offload_param`` (ZeRO-3): the 16-bit parameter partitions on the host."""

    hpz_partition_size: int = Field(1, ge=0)
    """``zero_hpz_partition_size`` (ZeRO++ hpZ; 0 and 1: off): ranks of the secondary partition group each
    parameter is also partitioned over, in which backward gathers (``zeropp.py``)."""
    quantized_weights: bool = False
    """``zero_quantized_weights`` (ZeRO++ qwZ): ZeRO-3's parameter all-gathers in int8 with fp32 scales (``zeropp.py``)."""
    quantized_gradients: bool = False
    """``zero_quantized_gradients`` (ZeRO++ qgZ): ZeRO-3's gradient reduce in 4-bit all-to-alls, in a node then
    across nodes (``zeropp_qgz.py``)."""
    devices_per_node: int = Field(DEFAULT_GPUS_PER_NODE, ge=1)
    """``get_accelerator().device_count()``: the GPUs per node, which sets qgZ's local group and its node count
    (``zeropp_qgz.qgz_nodes``); the CPU accelerator's is ``LOCAL_SIZE``, else its NUMA nodes with cores (1 on the
    validator's machine). Not a ds_config key: the machine's."""

    device: Literal["cuda", "cpu"] = "cpu"
    """cuda: every peak term rounded to the caching allocator's 512-byte blocks (``peak.CUDA_BLOCK_BYTES``) and the
    cuBLAS / cuBLASLt workspaces held from the first backward on (``formulas.cuda_workspaces``); cpu (the CPU
    accelerator the validator's gloo rows run on): neither, the terms as allocated. Not a ds_config key: where the
    run trains. Every planner entry (``plan.planner_settings``, ``plan.planner_plan``: estimate, plan, sweep, the
    Python API) predicts the GPU, cuda unless ``device`` cpu is given (``plan.on_device``), as FSDP2's default; a
    ``Settings`` built directly keeps the profile's own unit, bytes as allocated (what the CPU rows measured)."""
    cuda_capability: tuple[int, int] = (9, 0)
    """device cuda: the GPU's compute capability, which sizes the cuBLAS workspaces (``cuda_workspaces``); (9, 0):
    H100/H200. Not a ds_config key: the ``--gpu`` preset's."""

    rank: Optional[int] = Field(None, ge=0)
    """The rank described: ZeRO-1/2 ranks differ by the parameters their slice of the flat group overlaps
    (``grads_in_partition``). None: the worst rank (``profile.estimate`` predicts every rank whose slice
    differs and names the one peaking highest in ``peak_rank``). Not a ds_config key."""

    @model_validator(mode="after")
    def _zero_init_stage(self) -> Settings:
        if self.zero_init and self.stage != 3:
            raise ValueError(f"zero_init: deepspeed.zero.Init partitions parameters for ZeRO-3 only, not stage {self.stage}")
        if self.hf_zero3_build and not self.builds_partitioned:
            why = f"not stage {self.stage}" if self.stage != 3 else "not with zero_init false (built whole)"
            raise ValueError(f"hf_zero3_build (--hf-zero-init): transformers builds the model under deepspeed.zero.Init "
                             f"at ZeRO-3 only, {why}")  # fmt: skip
        _check_offload(self.stage, self.dtype, self.grad_dtype, self.contiguous_gradients, self.offload_optimizer,
                       self.offload_param)
        check_zeropp(self)
        if self.amsgrad and (not self.torch_adam or self.dtype != "fp32" or self.offload_optimizer.on):
            raise ValueError("amsgrad: measured with torch's Adam (torch_adam), fp32, no offload_optimizer only "
                             f"(got torch_adam={self.torch_adam}, dtype {self.dtype}, offload_optimizer "
                             f"{self.offload_optimizer.device})")  # fmt: skip
        return self

    @property
    def builds_partitioned(self) -> bool:
        """Whether the model is built under ``deepspeed.zero.Init`` (``zero_init``; None: at stage 3)."""
        return self.stage == 3 and self.zero_init is not False

    @property
    def block_bytes(self) -> int:
        """The allocator block every peak term is rounded to (``device``): 512 on cuda, none (1) on cpu."""
        return CUDA_BLOCK_BYTES if self.device == "cuda" else 1

    @property
    def grad_dtype(self) -> str:
        """The gradient accumulation dtype (engine.py ``get_data_types``: the model dtype when absent)."""
        return self.grad_accum_dtype or self.dtype

    @property
    def partition_gradients(self) -> bool:
        """ZeRO-2's gradient partitioning in ``DeepSpeedZeroOptimizer`` (engine.py ``_configure_zero_optimizer``:
        ``partition_grads=zero_stage == ZeroStageEnum.gradients``): reduce every micro-step, keep the partition."""
        return self.stage == 2

    @property
    def overlaps(self) -> bool:
        """``overlap_comm`` as DeepSpeed resolves it (config.py ``overlap_comm_valid``)."""
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    @classmethod
    def from_ds_config(cls, config: object, stage: Optional[int] = None, zero_init: Optional[bool] = None,
                       hf_zero3_build: Optional[bool] = None) -> Settings:
        """Read a parsed ds_config.json strictly; absent keys take DeepSpeed 0.19.8's defaults.

        ``stage`` (``--stage``) fills in a config without ``zero_optimization.stage``; one that
        contradicts the file is refused. ``zero_init``, ``hf_zero3_build``: how the model is built (not in a
        ds_config; the fields' docs). ValueError with one line naming the key.
        """
        ds = parse_ds_config(config)
        base = from_deepspeed(config, offload=True)  # dtypes and optimizer checked, one line each
        zero = ds.zero_optimization
        given = "stage" in (config.get("zero_optimization") or {})
        if stage is not None and given and stage != base["stage"]:
            raise ValueError(f"--stage {stage} contradicts zero_optimization.stage={base['stage']}; drop one of them")
        number = base["stage"] if given or stage is None else stage
        if number not in (1, 2, 3):
            raise ValueError(f"deepspeed config: zero_optimization.stage={number}: the DeepSpeed profile covers 1-3")
        if base.get("optimizer", "adamw") != "adamw":
            raise ValueError(f"deepspeed config: optimizer.type={ds.optimizer.type!r}: the profile covers Adam and AdamW")
        params = ds.optimizer.params if ds.optimizer is not None else _OptimizerParams()
        grad = ds.data_types.grad_accum_dtype
        found = {field: getattr(zero, key) for key, field in _ZERO_KEYS.items() if getattr(zero, key) is not None}
        kind = (ds.optimizer.type.lower() if ds.optimizer is not None and ds.optimizer.type else "adam")
        targets = {k: read_target(getattr(zero, k), k) for k in ("offload_optimizer", "offload_param")}
        if any(t.device == "nvme" for t in targets.values()):
            check_aio(config)
        dtype = base["param_dtype"]
        _check_offload(number, dtype, _ds_dtype(grad, "data_types.grad_accum_dtype") if grad else dtype,
                       zero.contiguous_gradients is not False, *targets.values())  # one line before pydantic wraps it
        check_zeropp_keys(number, found, targets)  # one line, naming the key, before pydantic wraps it
        return cls(
            stage=number,
            dtype=base["param_dtype"],
            grad_accum_dtype=None if grad is None else _ds_dtype(grad, "data_types.grad_accum_dtype"),
            optimizer="adamw" if kind == "adamw" else "adam",
            **{k: v for k, v in (("adam_w_mode", params.adam_w_mode), ("torch_adam", params.torch_adam),
                                 ("foreach", params.foreach), ("weight_decay", params.weight_decay),
                                 ("amsgrad", params.amsgrad)) if v is not None},
            **found,
            **({} if zero_init is None else {"zero_init": zero_init}),
            **({} if hf_zero3_build is None else {"hf_zero3_build": hf_zero3_build}),
            **targets,
        )  # fmt: skip


def _check_offload(stage: int, dtype: str, grad_dtype: str, contiguous: bool,
                   optimizer: OffloadTarget, param: OffloadTarget) -> None:
    """``offload_settings.check_offload``; with offload, BF16_Optimizer (ZeRO-1, bf16, fp32 gradients) is refused, and
    ``contiguous_gradients: false`` at ZeRO-1/2 (DeepSpeed turns it on: the profile would predict no bucket)."""
    check_offload(stage, optimizer, param)
    if optimizer.on and stage < 3 and not contiguous:
        raise ValueError("deepspeed config: zero_optimization.contiguous_gradients=false with offload_optimizer: "
                         "DeepSpeed turns it on (stage_1_and_2.py: contiguous_gradients or cpu_offload); drop the key")
    if optimizer.on and stage == 1 and dtype == "bf16" and grad_dtype == "fp32":
        raise ValueError("deepspeed config: offload_optimizer with BF16_Optimizer (ZeRO-1, bf16, fp32 gradient "
                         "accumulation): not modelled by the profile")  # fmt: skip


def optimizer_class(s: Settings) -> str:
    """The wrapper DeepSpeed builds (engine.py ``_do_optimizer_sanity_check`` then ``_configure_optimizer``)."""
    if s.stage == 1 and s.dtype == "bf16" and s.grad_dtype == "fp32":
        return "BF16_Optimizer"  # engine.py _configure_bf16_optimizer -> runtime/bf16_optimizer.py
    if s.stage == 3:
        return "DeepSpeedZeroOptimizer_Stage3"  # engine.py _configure_zero_optimizer -> zero/stage3.py
    return "DeepSpeedZeroOptimizer"  # engine.py _configure_zero_optimizer -> zero/stage_1_and_2.py


def inner_optimizer_class(s: Settings) -> str:
    """The Adam inside (engine.py ``_configure_basic_optimizer``): torch's with ``torch_adam``, else
    ``DeepSpeedCPUAdam`` with ``offload_optimizer`` (``zero_use_cpu_optimizer``; ops/adam/cpu_adam.py, a JIT-built
    C++ op, ``cpu_adam``) or DeepSpeed's ``FusedAdam`` (ops/adam/fused_adam.py; on CPU a JIT-built op, ``fused_adam``)."""
    if s.torch_adam:  # type "Adam" runs AdamW unless adam_w_mode is false
        return "AdamW" if s.optimizer == "adamw" or s.adam_w_mode else "Adam"
    return "DeepSpeedCPUAdam" if s.offload_optimizer.on else "FusedAdam"

def to_ds_config(s: Settings, micro_batch: int = 1, grad_accum: int = 1) -> dict:
    """The ds_config.json that ``Settings.from_ds_config`` reads back as ``s``: every key the profile
    reads is written, so the run is the configuration that was predicted."""
    zero: dict = {"stage": s.stage, "reduce_bucket_size": s.reduce_bucket_size,
                  "allgather_bucket_size": s.allgather_bucket_size, "contiguous_gradients": s.contiguous_gradients,
                  "reduce_scatter": s.reduce_scatter, "use_multi_rank_bucket_allreduce": s.use_multi_rank_bucket_allreduce}
    if s.overlap_comm is not None:  # absent: DeepSpeed resolves it by stage (config.py overlap_comm_valid)
        zero["overlap_comm"] = s.overlap_comm  # fmt: skip
    if s.stage == 3:
        zero.update(stage3_prefetch_bucket_size=s.prefetch_bucket_size,
                    stage3_param_persistence_threshold=s.param_persistence_threshold,
                    stage3_max_live_parameters=s.max_live_parameters,
                    stage3_max_reuse_distance=s.max_reuse_distance)  # fmt: skip
    zero.update(zeropp_keys(s))
    for key in ("offload_optimizer", "offload_param"):
        if getattr(s, key).on:
            zero[key] = target_block(getattr(s, key))
    params: dict = {"torch_adam": s.torch_adam, "adam_w_mode": s.adam_w_mode}
    if s.foreach is not None:
        params["foreach"] = s.foreach
    if s.weight_decay:
        params["weight_decay"] = s.weight_decay
    if s.amsgrad:  # torch's Adam(amsgrad=True), handed on by DeepSpeed with torch_adam
        params["amsgrad"] = True
    config: dict = {
        **_batch_keys(micro_batch, grad_accum),
        "optimizer": {"type": "AdamW" if s.optimizer == "adamw" else "Adam", "params": params},
        "zero_optimization": zero,
        **_precision_keys(s.dtype),
    }
    if s.grad_accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": s.grad_accum_dtype}
    return config
