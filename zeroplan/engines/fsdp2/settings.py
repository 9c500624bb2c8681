"""FSDP2's settings in its own vocabulary (``fully_shard``, ``MixedPrecisionPolicy``) and the sources the
terms were read from. FSDP2 keeps the same split: ``_fsdp_api.py`` (the policies), ``_fsdp_init.py``
(the post-forward mesh)."""

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from zeroplan.engines.fsdp2.wrap import Wrapping
from zeroplan.formulas.dtypes import canonical_dtype

TORCH_VERSION = "2.13.0"  # the source the terms were read from
SRC = "torch/distributed/fsdp/_fully_shard/"
ADAM = "torch/optim/adam.py"
STEP_BYTES = 4  # Adam's ``step`` (torch.tensor(0.0, dtype=_get_scalar_dtype()): fp32), one per tensor


Dtype = Literal["fp32", "bf16", "fp16"]


class Settings(BaseModel):
    """One FSDP2 configuration: ``fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype,
    reduce_dtype), reshard_after_forward=...)`` per decoder layer, then ``fully_shard(model, mp_policy)``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reshard_after_forward: StrictBool | StrictInt = Field(
        True, description="True: blocks gathered again in backward (ZeRO-3); False: kept (ZeRO-2); an int k: "
        "kept sharded over k ranks between forward and backward (FSDP2's int option)",
    )  # fmt: skip
    module_dtype: Dtype = Field("fp32", description="dtype the model is built in; the shards keep it")
    param_dtype: Dtype | None = Field(None, description="MixedPrecisionPolicy.param_dtype; None: module dtype")
    reduce_dtype: Dtype | None = Field(None, description="MixedPrecisionPolicy.reduce_dtype; None: param dtype")
    foreach: bool | None = Field(None, description="Adam's foreach path; None: Workload.foreach")
    amsgrad: StrictBool = Field(False, description="Adam(amsgrad=True): a third state max_exp_avg_sq, like exp_avg_sq")
    fused: StrictBool = Field(False, description="Adam(fused=True): torch._fused_adam_ in place, no step temporaries")
    device: Literal["cuda", "cpu"] = Field(
        "cuda", description="cuda: 512-byte allocator blocks and fp32 LayerNorm statistics; cpu: neither"
    )
    backend: Literal["nccl", "gloo", "fake"] = Field(
        "nccl", description="process group backend: gloo's reduce-scatter copies its whole input (a term); "
        "nccl and the fake group (simulation) add nothing",
    )  # fmt: skip
    rank: Optional[StrictInt] = Field(
        None, ge=0, description="the rank described; None: the worst rank, every rank whose shards differ "
        "predicted (param.py distinct_ranks) and the one peaking highest named (EngineEstimate.peak_rank)",
    )  # fmt: skip
    init: Literal["meta", "materialized"] = Field(
        "meta", description="meta: built on the meta device, fully_shard, to_empty, initialised shard by shard "
        "(FSDP2's pattern for models larger than one GPU; the planner's default); materialized: built whole "
        "on the device, then fully_shard (init holds the whole model)",
    )  # fmt: skip
    loss_in_forward: StrictBool = Field(
        True, description="transformers' module tree only (Workload.transformers): the loss computed inside the "
        "root's forward, model(input_ids, labels=...) as transformers' Trainer calls it; False: from the logits "
        "the root returns",
    )  # fmt: skip
    dp_replicate: StrictInt | None = Field(
        None, ge=1, description="HSDP: replicas R of the 2-D mesh init_device_mesh(device, (R, S), mesh_dim_names="
        "('dp_replicate', 'dp_shard')) given to fully_shard(mesh=...); None: N_d / dp_shard, else 1 (a flat mesh)",
    )  # fmt: skip
    dp_shard: StrictInt | None = Field(
        None, ge=1, description="HSDP: ranks S each parameter is sharded over; None: N_d / dp_replicate "
        "(engines/fsdp2/mesh.py shard_groups)",
    )  # fmt: skip
    wrap: Union[Literal["blocks", "torchtitan"], Wrapping] = Field(
        "blocks", description="the fully_shard calls (engines/fsdp2/wrap.py): blocks (each decoder layer, then the "
        "root), torchtitan (embeddings, each block, [norm, output] kept gathered, the root) or a Wrapping; "
        "reshard_after_forward is the blocks' value (a Wrapping's own blocks' values decide there)",
    )  # fmt: skip
    offload_policy: Literal["none", "cpu"] = Field(
        "none", description="fully_shard(offload_policy=...): none (OffloadPolicy(), FSDP2's default) or cpu "
        "(CPUOffloadPolicy: sharded parameters, gradients and the optimizer step on the host; engines/fsdp2/offload.py)",
    )  # fmt: skip
    pin_memory: StrictBool = Field(
        True, description="CPUOffloadPolicy.pin_memory (torch's default True): page-locked host shards and gradients",
    )  # fmt: skip
    tp: StrictInt | None = Field(
        None, ge=1, description="tensor parallelism: ranks T of the innermost mesh dimension 'tp', torchtitan's llama "
        "plan (engines/fsdp2/tp.py); FSDP2 shards the TP-local tensors over the N_d / T data-parallel ranks",
    )  # fmt: skip
    sequence_parallel: StrictBool = Field(
        True, description="with tp: SequenceParallel norms, activations Shard(1) between blocks (torchtitan's default)",
    )  # fmt: skip
    loss_parallel: StrictBool = Field(
        True, description="with tp: the head's output Shard(-1) and the loss under loss_parallel() (torchtitan's "
        "default); false: Replicate (all-gathered logits) and the plain loss (torchtitan's disable_loss_parallel)",
    )  # fmt: skip
    tp_plan: Literal["torchtitan", "transformers"] = Field(
        "torchtitan", description="with tp: whose plan (engines/fsdp2/tp.py). transformers: the model's own tp_plan "
        "(from_pretrained(tp_plan='auto'), accelerate's TP): torchtitan's placements without sequence parallelism "
        "or loss parallel (both must be false), each colwise input's gradient all-reduced on its own",
    )  # fmt: skip
    selective_ac: Union[StrictInt, Literal["op"]] = Field(
        1, description="with checkpointing full, torchtitan's selective_ac_option (engines/fsdp2/selective_ac.py): "
        "k, checkpoint_wrapper on layers k, 2k, ... only (counted from 1; 1: every layer); op, every layer under "
        "its per-op policy (the outputs of its matmuls kept but every second one's)",
    )  # fmt: skip
    cuda_capability: tuple[StrictInt, StrictInt] = Field(
        (9, 0), description="device cuda: the GPU's compute capability, which sizes the cuBLAS workspaces "
        "(formulas.cuda_workspaces); (9, 0) is H100/H200",
    )  # fmt: skip

    @model_validator(mode="after")
    def _transformers_plan(self) -> "Settings":
        if self.tp_plan == "transformers" and (self.sequence_parallel or self.loss_parallel):
            raise ValueError("tp_plan=transformers: its plan has no sequence parallelism and gathers the logits "
                             "(transformers distributed/tensor_parallel.py); set sequence_parallel and "
                             "loss_parallel false")  # fmt: skip
        return self

    @field_validator("selective_ac")
    @classmethod
    def _sac(cls, v: int | str) -> int | str:
        if v != "op" and v < 1:
            raise ValueError(f"selective_ac={v}: layers k >= 1, or op")
        return v

    @field_validator("reshard_after_forward")
    @classmethod
    def _k(cls, v: bool | int) -> bool | int:
        if not isinstance(v, bool) and v < 1:
            raise ValueError(f"reshard_after_forward={v}: an int must be >= 1")
        return v

    @property
    def described_rank(self) -> int:
        """The rank the terms describe: ``rank``, or 0 where the caller asked no rank of ``fsdp2_run``
        directly (``estimate`` resolves None to each rank of ``distinct_ranks``)."""
        return 0 if self.rank is None else self.rank

    @property
    def module(self) -> str:
        return canonical_dtype(self.module_dtype)

    @property
    def param(self) -> str:
        """Gathered parameters and autograd's gradients (_fsdp_param.py:FSDPParam.init_dtype_attrs)."""
        return canonical_dtype(self.param_dtype or self.module_dtype)

    @property
    def reduce(self) -> str:
        """Reduce-scatter dtype (_fsdp_collectives.py:foreach_reduce: ``reduce_dtype or grad_dtype``)."""
        return canonical_dtype(self.reduce_dtype or self.param)

    def label(self) -> str:
        mp = f", param {self.param}, reduce {self.reduce}" if self.param != self.module else ""
        wrap = "" if self.wrap == "blocks" else f", wrap {self.wrap if isinstance(self.wrap, str) else 'file'}"
        hsdp = f", HSDP mesh {self.dp_replicate} x {self.dp_shard}" if (self.dp_replicate or 1) > 1 else ""
        off = f", CPUOffloadPolicy(pin_memory={self.pin_memory})" if self.offload_policy == "cpu" else ""
        plain = ", no SP" * (not self.sequence_parallel) + ", no loss parallel" * (not self.loss_parallel)
        plain = ", transformers' tp_plan" if self.tp_plan == "transformers" else plain
        tp = f", tp {self.tp}{f' ({plain[2:]})' if plain else ''}" if (self.tp or 1) > 1 else ""
        sac = "" if self.selective_ac == 1 else ", selective AC per op" if self.selective_ac == "op" else \
            f", checkpoint every {self.selective_ac} layers"
        return f"fully_shard reshard_after_forward={self.reshard_after_forward}{mp}{wrap}{hsdp}{tp}{off}{sac}"


def post_forward_group(settings: Settings, nd: int) -> int:
    """Ranks a block stays sharded over between its forward and backward: nd (True), 1 (False, kept
    whole) or k (_fsdp_init.py:_get_post_forward_mesh_info; k must divide nd)."""
    rsf = settings.reshard_after_forward
    if rsf is True:
        return nd
    if rsf is False:
        return 1
    if nd % rsf:
        raise ValueError(f"reshard_after_forward={rsf}: must divide N_d={nd}")
    return rsf
