"""Collectives per training step and the bytes each rank sends (ZeRO paper, section 7).

The paper counts data movement in elements: a reduce-scatter or all-gather of Ψ elements moves Ψ, an
all-reduce (reduce-scatter + all-gather) 2Ψ, so stages 0-2 move 2Ψ and stage 3 moves 3Ψ per step.
What a rank actually puts on the wire with ring algorithms is (N_d-1)/N_d of that (Patarasuk & Yuan
2009; the nccl-tests "bus bandwidth" convention): each rank sends N_d-1 chunks of ceil(n/N_d)
elements per reduce-scatter or all-gather, twice that per all-reduce.
"""

from __future__ import annotations

from zeroplan.estimation.records import Collective
from zeroplan.formulas.sharding import shard_numel
from zeroplan.formulas.stages import get_stage


def ring_bytes_per_rank(op: str, elements: int, nd: int, element_bytes: int) -> int:
    """Bytes one rank sends for a ring ``op`` over ``nd`` ranks: (nd-1)·ceil(n/nd)·b, x2 for all-reduce."""
    passes = {"all-reduce": 2, "reduce-scatter": 1, "all-gather": 1}[op]
    return passes * (nd - 1) * shard_numel(elements, nd) * element_bytes


def paper_comm_volume(psi: float, stage: int) -> float:
    """ZeRO section 7.2: 2Ψ elements per step for DP, P_os and P_os+g; 3Ψ for P_os+g+p."""
    return 3 * psi if get_stage(stage).shards_parameters else 2 * psi


def step_collectives(
    stage: int,
    full_numel: int,
    nd: int,
    param_dtype: str,
    grad_dtype: str,
    param_bytes: int,
    grad_bytes: int,
) -> tuple[Collective, ...]:
    """The collectives of one step without gradient accumulation, per ZeRO section 7.2.

    Stage 0: all-reduce of gradients during backward. Stages 1-2: reduce-scatter of gradients
    (during backward, bucket by bucket at stage 2), all-gather of the updated 16-bit parameters after
    the optimizer step. Stage 3: all-gather of parameters before forward and again before backward,
    reduce-scatter of gradients during backward. With N_d = 1 nothing is communicated: the list is empty.
    ``full_numel`` and ``nd`` may be numpy arrays (``zeroplan.sweep``); entries with N_d = 1 then get
    collectives of 0 elements and 0 bytes.
    """
    if getattr(nd, "ndim", 0) == 0 and nd == 1:
        return ()
    row = get_stage(stage)
    elements = full_numel * (nd > 1)

    def make(op: str, phase: str, dtype: str, element_bytes: int) -> Collective:
        return Collective(op, phase, elements, dtype, ring_bytes_per_rank(op, full_numel, nd, element_bytes))

    if not row.shards_optimizer:
        return (make("all-reduce", "backward", grad_dtype, grad_bytes),)
    if not row.shards_parameters:
        return (
            make("reduce-scatter", "backward", grad_dtype, grad_bytes),
            make("all-gather", "optimizer step", param_dtype, param_bytes),
        )
    return (
        make("all-gather", "forward", param_dtype, param_bytes),
        make("all-gather", "backward", param_dtype, param_bytes),
        make("reduce-scatter", "backward", grad_dtype, grad_bytes),
    )
