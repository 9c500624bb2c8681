"""The reference runtime's model states and collectives per stage: the paper's stage table
(``zeroplan.formulas.stage_table``) with the runtime's padding, which the runtime follows exactly.

Collectives per step (``formulas.collectives.step_collectives``): stage 0 all-reduces each gradient bucket
(validate/stage0.py:Stage0.unit_grads_ready); stages 1-2 reduce-scatter gradients
(validate/stage1.py:Stage1.unit_grads_ready, validate/stage2.py:Stage2.unit_grads_ready) and all-gather the
updated 16-bit parameters (validate/stage1.py:Stage1.publish); stage 3 all-gathers each unit before forward
and again before backward (validate/stage3.py:Stage3._gather) and reduce-scatters gradients. Per optimizer
step with accumulation: ``zeroplan.formulas.commtime.calls_per_optimizer_step``.
"""

from __future__ import annotations

from zeroplan.engines.reference.settings import Settings
from zeroplan.formulas.stage_table import StageRow, stage_table


def stage_rows(numels: tuple[int, ...], nd: int, settings: Settings) -> tuple[StageRow, ...]:
    """Model states and collectives of each of ``settings.stages`` for tensors of ``numels`` elements."""
    return stage_table(numels, nd, settings.policy, settings.stages, settings.flat_layout)
