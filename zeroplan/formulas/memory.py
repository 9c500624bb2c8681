"""Per-GPU model states of ZeRO-DP (Rajbhandari et al., SC20, sections 3.1 and 5, Figure 1).

Two forms of the same model:
- ``paper_model_states_bytes``: the paper's closed forms on a bare Ψ, for checking against its tables;
- ``model_states``: what a runtime allocates, counted in elements (with the shared padding rule when the
  tensor sizes are known) and turned into bytes once.
"""

from dataclasses import dataclass

from zeroplan.formulas.optimizers import StateTensor, optimizer_bytes
from zeroplan.formulas.sharding import flat_padded_numel, flat_shard_numel
from zeroplan.formulas.stages import get_stage


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-GPU model states in bytes (ZeRO paper, section 3.1)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int

    @property
    def model_states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def paper_model_states_bytes(psi: float, nd: int, k: float, stage: int) -> float:
    """ZeRO eq. (Fig. 1): DP (2+2+K)Ψ; P_os 4Ψ+KΨ/Nd; P_os+g 2Ψ+(2+K)Ψ/Nd; P_os+g+p (2+2+K)Ψ/Nd."""
    return (
        (4 + k) * psi,
        4 * psi + k * psi / nd,
        2 * psi + (2 + k) * psi / nd,
        (4 + k) * psi / nd,
    )[get_stage(stage).number]


def buffer_numels(numels: tuple[int, ...], nd: int, stage: int, flat_layout: bool) -> tuple[int, int]:
    """(full, shard): elements of an unsharded buffer and of one rank's shard at ``stage``.

    A shard is always ``flat_shard_numel`` (each tensor padded to a multiple of N_d, never losing an
    element). A full buffer is the exact element count at stage 0 (DDP keeps tensors whole) and for a
    bare Ψ (the paper's 2Ψ); when the tensor sizes are known (``flat_layout``), stages 1-3 keep full
    buffers as the flat, padded all-gather output the runtime allocates (``flat_padded_numel``).
    """
    shard = flat_shard_numel(numels, nd)
    padded = flat_layout and get_stage(stage).number > 0
    return (flat_padded_numel(numels, nd) if padded else sum(numels)), shard


def state_numels(
    numels: tuple[int, ...], nd: int, stage: int, flat_layout: bool = True
) -> tuple[int, int, int]:
    """(params, grads, optimizer) elements one rank holds: shards where the stage table says so, else full."""
    row = get_stage(stage)
    full, shard = buffer_numels(numels, nd, stage, flat_layout)
    return (
        shard if row.shards_parameters else full,
        shard if row.shards_gradients else full,
        shard if row.shards_optimizer else full,
    )


def model_states(
    numels: tuple[int, ...],
    nd: int,
    stage: int,
    param_bytes: int,
    grad_bytes: int,
    states: tuple[StateTensor, ...],
    master_dtype: str | None,
    flat_layout: bool = True,
) -> MemoryBreakdown:
    """Model-state bytes one rank holds between steps, for tensors of ``numels`` elements.

    Element counts come from ``state_numels``; bytes follow from the dtypes once.
    """
    param_numel, grad_numel, opt_numel = state_numels(numels, nd, stage, flat_layout)
    return MemoryBreakdown(
        params_bytes=param_numel * param_bytes,
        grads_bytes=grad_numel * grad_bytes,
        optimizer_bytes=optimizer_bytes(states, master_dtype, opt_numel),
    )
