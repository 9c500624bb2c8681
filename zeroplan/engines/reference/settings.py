"""The reference runtime's settings (``validate/runtime.py``): which stages, dtypes and device, and the
run its peak model describes (16-bit parameters and gradients, an fp32 master, fp32 Adam)."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from zeroplan.architectures.spec import TransformerSpec
from zeroplan.engines.base import PeakLimit
from zeroplan.formulas.dropout import dropout_limit
from zeroplan.formulas.peak import CUDA_BLOCK_BYTES
from zeroplan.policy import PrecisionPolicy
from zeroplan.types import StageNumber

MASTER_BYTES = 4  # fp32 master, m, v (validate/runtime.py:Runtime.__init__)
ADAM_STEP_BYTES = 4  # Adam's fp32 ``step`` tensor (torch/optim/adam.py:_init_group)

CUDA_STAT_BYTES = 4
"""Bytes of LayerNorm's saved mean/rstd on CUDA, which keeps them in fp32 (``activation_terms`` docstring)."""
PEAK_OPTIMIZERS: tuple[str, ...] = ("adam", "adamw")
"""Optimizers whose step the reference profile models (``torch.optim.Adam``/``AdamW``: fp32 m, v, step)."""


class Settings(BaseModel):
    """The reference runtime's options (``validate/runtime.py``): which ZeRO stages, which dtypes, which device.

    The peak model is the runtime as built: 16-bit parameters and gradients, an fp32 master and fp32
    Adam states (``validate/runtime.py:Runtime.__init__``); another policy still gets model states and
    collectives, but asking for a peak with it is refused rather than answered for a different run.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    stages: tuple[StageNumber, ...] = Field((0, 1, 2, 3), min_length=1)
    """ZeRO stages to estimate, one row each, in this order."""
    policy: PrecisionPolicy = PrecisionPolicy()
    """dtypes of model states and the optimizer (model states and collectives)."""
    flat_layout: bool = True
    """the shapes are the model's real tensors (padded per tensor as the runtime pads); False for a bare Ψ."""
    block_bytes: Annotated[int, Field(ge=1)] = CUDA_BLOCK_BYTES
    """allocator block size every tensor rounds up to: 512 on CUDA (the planner's target), 1 for none."""
    allocator_overhead_bytes: Annotated[int, Field(ge=0)] = 0
    """reserved - allocated, a separate term of every phase; 0 until measured on a GPU."""
    stat_bytes: Literal[2, 4] = CUDA_STAT_BYTES
    """bytes of LayerNorm's saved statistics: 4 on CUDA (fp32), 2 on CPU (the input dtype)."""
    cuda_capability: Optional[tuple[StrictInt, StrictInt]] = (9, 0)
    """the GPU's compute capability, which sizes the cuBLAS workspaces every phase after init holds
    (``formulas.cuda_workspaces``); (9, 0) is H100/H200; None: no GPU (CPU runs)."""
    amsgrad: StrictBool = False
    """``torch.optim.Adam(amsgrad=True)`` (``validate/runtime.py:Runtime``): a third fp32 state of the master
    shard, ``max_exp_avg_sq`` (``formulas.optimizers.optimizer_states``), in model states and every phase after
    the first step; set by a live optimizer (``estimate(model=..., optimizer=...)``)."""
    backend: Literal["nccl", "gloo", "fake"] = "nccl"
    """the process group's backend: gloo's reduce-scatter copies its whole input (a term,
    ``terms.gloo_copy``); nccl (the planner's target) and the simulator's fake group allocate nothing."""

    @field_validator("stages")
    @classmethod
    def _distinct(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if len(set(v)) != len(v):
            raise ValueError(f"stages={list(v)}: give each stage once")
        return v


def peak_limit(policy: PrecisionPolicy, spec: TransformerSpec) -> Optional[PeakLimit]:
    """None when the profile describes this run; else why not (``Engine.own_peak_limits``, and ``estimate``
    raises it): the runtime as built (16-bit params and grads, an fp32 master, fp32 Adam), and no dropout
    (``dropout.dropout_limit``, every engine's; validate/transformer.py runs no dropout op at
    p = 0)."""
    ok = (
        policy.param_bytes == 2 and policy.grad_bytes == 2 and policy.master_dtype == "fp32"
        and policy.optimizer in PEAK_OPTIMIZERS and policy.optimizer_dtype == "fp32"
    )  # fmt: skip
    if not ok:
        p = policy.resolved()
        return PeakLimit("policy", (
            "the reference engine's peak models 16-bit params and grads, an fp32 master and fp32 Adam "
            f"(validate/runtime.py); got params {p['param_dtype']}, grads {p['grad_dtype']}, master "
            f"{p['master_dtype']}, optimizer {p['optimizer']} ({p['optimizer_dtype']})"
        ))
    why = dropout_limit(spec, "reference")
    if why is None and spec.moe is not None:  # validate/transformer.py builds no sparse block: nothing measured
        why = (f"model_type {spec.model_type!r}: the reference runtime builds no routed experts "
               "(validate/transformer.py), so its peak of a sparse model is not measured; use --engine fsdp2 "
               "(measured exact: docs/models.md)")
    return None if why is None else PeakLimit("architecture", why)
