"""Each ZeRO stage's model states and collectives for one set of tensors: the paper's stage table as
numbers (Rajbhandari et al., SC20, sections 5 and 7.2). Pure: counts from ``memory.model_states`` and
``collectives.step_collectives``, what is sharded from ``stages``.

The reference engine reads its model states and collectives here (``zeroplan.engines.reference``);
``zeroplan.estimation.estimate.stage_estimates`` adds the "vs DP" ratio and the fit for estimate and sweep.
``numels`` entries and ``nd`` may be numpy int64 arrays of one shape (``zeroplan.sweep``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from zeroplan.formulas.collectives import Collective, step_collectives
from zeroplan.formulas.memory import MemoryBreakdown, model_states
from zeroplan.formulas.optimizers import StateTensor
from zeroplan.formulas.stages import Stage, get_stage


class StatesPolicy(Protocol):
    """What the table reads of a precision policy (``zeroplan.policy.PrecisionPolicy`` has it all)."""

    @property
    def param_dtype(self) -> str: ...
    @property
    def resolved_grad_dtype(self) -> str: ...
    @property
    def param_bytes(self) -> int: ...
    @property
    def grad_bytes(self) -> int: ...
    @property
    def states(self) -> tuple[StateTensor, ...]: ...
    @property
    def master_dtype(self) -> Optional[str]: ...


@dataclass(frozen=True)
class StageRow:
    """One stage's model states per rank and its collectives per step (no gradient accumulation)."""

    stage: Stage
    memory: MemoryBreakdown
    collectives: tuple[Collective, ...]


def stage_memory(numels, nd, stage: int, policy: StatesPolicy, flat_layout: bool = False) -> MemoryBreakdown:
    """Model states one rank holds at ``stage`` (``memory.model_states`` with the policy's bytes)."""
    return model_states(numels, nd, stage, policy.param_bytes, policy.grad_bytes, policy.states, policy.master_dtype,
                        flat_layout)  # fmt: skip


def stage_table(
    numels, nd, policy: StatesPolicy, stages: tuple[int, ...] = (0, 1, 2, 3), flat_layout: bool = False
) -> tuple[StageRow, ...]:
    """One row per stage of ``stages``, in that order. ``flat_layout``: the numels are the model's real tensors,
    so full buffers are padded as the runtime pads them (``memory.buffer_numels``); False for a bare Ψ."""
    rows = []
    for number in stages:
        row = get_stage(number)
        memory = stage_memory(numels, nd, row.number, policy, flat_layout)
        collectives = step_collectives(row.number, numels, nd, policy.param_dtype, policy.resolved_grad_dtype,
                                       flat_layout)  # fmt: skip
        rows.append(StageRow(row, memory, collectives))
    return tuple(rows)
