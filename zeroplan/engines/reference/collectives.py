"""The reference runtime's model states and collectives per stage: the paper's stage table
(``zeroplan.formulas.stage_table``) with the runtime's padding, which the runtime follows exactly.

Collectives per step (``formulas.collectives.step_collectives``): stage 0 all-reduces each gradient bucket
(validate/stage0.py:Stage0.unit_grads_ready); stages 1-2 reduce-scatter gradients
(validate/stage1.py:Stage1.unit_grads_ready, validate/stage2.py:Stage2.unit_grads_ready) and all-gather the
updated 16-bit parameters (validate/stage1.py:Stage1.publish); stage 3 all-gathers each unit before forward
and again before backward (validate/stage3.py:Stage3._gather) and reduce-scatters gradients. The stage table
counts one micro-step; ``optimizer_step`` turns it into the engine contract's one optimizer step
(``EngineEstimate.collectives``): with accumulation a collective runs every micro-step or once
(``zeroplan.formulas.commtime.calls_per_optimizer_step``, which the runtime follows).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zeroplan.engines.reference.settings import Settings
from zeroplan.formulas.collectives import Collective
from zeroplan.formulas.commtime import calls_per_optimizer_step
from zeroplan.formulas.optimizers import StateTensor, optimizer_states
from zeroplan.formulas.stage_table import StageRow, stage_table
from zeroplan.policy import PrecisionPolicy


@dataclass(frozen=True)
class _AmsgradPolicy:
    """The policy with Adam's third state (``Settings.amsgrad``): the stage table reads ``states`` of it."""

    policy: PrecisionPolicy

    def __getattr__(self, name: str):
        return getattr(self.policy, name)

    @property
    def states(self) -> tuple[StateTensor, ...]:
        return optimizer_states(self.policy.optimizer, self.policy.optimizer_dtype, amsgrad=True)


def stage_rows(numels: tuple[int, ...], nd: int, settings: Settings) -> tuple[StageRow, ...]:
    """Model states and collectives of each of ``settings.stages`` for tensors of ``numels`` elements; with
    ``amsgrad`` the optimizer's states hold ``max_exp_avg_sq`` too (``formulas.optimizers.optimizer_states``)."""
    policy = _AmsgradPolicy(settings.policy) if settings.amsgrad else settings.policy
    return stage_table(numels, nd, policy, settings.stages, settings.flat_layout)


def optimizer_step(collectives: tuple[Collective, ...], stage: int, grad_accum: int) -> tuple[Collective, ...]:
    """One optimizer step of ``grad_accum`` micro-steps from the stage table's one micro-step: a collective
    that runs every micro-step (stage >= 2 reductions, stage 3 all-gathers: ``calls_per_optimizer_step``) is
    summed over the G micro-steps it runs in (``Collective.micro_steps`` = G), the others run once."""
    out = []
    for c in collectives:
        n = calls_per_optimizer_step(stage, c.op, grad_accum)
        out.append(replace(c, elements=c.elements * n, bytes_per_rank=c.bytes_per_rank * n, micro_steps=n))
    return tuple(out)
