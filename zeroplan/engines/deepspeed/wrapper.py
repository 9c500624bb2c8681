"""The optimizer wrapper DeepSpeed builds, chosen once from the settings: ``wrapper_for``.

DeepSpeed's engine picks one class per run (runtime/engine.py ``_configure_optimizer``), and so does the
profile: ``Wrapper`` is what each one allocates (``terms``), sends (``collectives``), gathers (``schedule``)
and the moments only it has; ``phases.py`` walks the phases and asks the run's wrapper, never the stage.

- ``DeepSpeedZeroOptimizer`` (runtime/zero/stage_1_and_2.py; ZeRO-1 and 2): ``zero12.py``
- ``BF16_Optimizer`` (runtime/bf16_optimizer.py; ZeRO-1, bf16 with fp32 gradients): ``bf16.py``
- ``DeepSpeedZeroOptimizer_Stage3`` (runtime/zero/stage3.py): ``zero3.py``
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from zeroplan.engines.deepspeed.settings import Settings, optimizer_class
from zeroplan.engines.deepspeed.terms import flat_padded_numel

if TYPE_CHECKING:
    from zeroplan.engines.deepspeed.coordinator import Stage3Schedule
    from zeroplan.engines.deepspeed.run import DSRun
    from zeroplan.formulas.peak import Moment, Term


class Wrapper:
    """One DeepSpeed optimizer wrapper: the defaults are those of the flat-group wrappers (ZeRO-1/2 and
    BF16_Optimizer), which gather nothing and partition one padded flat group."""

    name: str
    """DeepSpeed's class name."""
    terms: Callable
    """``(settings, numels, nd) -> tuple[DSTerm, ...]``: its model states and buckets (terms.py)."""
    collectives: Callable
    """``(settings, numels, nd, grad_accum, trace) -> tuple[DSCollective, ...]`` (collectives.py)."""

    def partition_numel(self, s: Settings, numels: tuple[int, ...], nd: int) -> int:
        """Elements of one rank's fp32 master partition."""
        return flat_padded_numel(numels, nd) // nd

    def schedule(self, run: DSRun) -> Optional[Stage3Schedule]:
        """The replayed parameter coordinator; None: every parameter is always there."""
        return None

    def init_moments(self, run: DSRun) -> tuple[Moment, ...]:
        raise NotImplementedError

    def held_between_micro_steps(self, run: DSRun) -> tuple[Term, ...]:
        """With ``gradient_accumulation_steps`` > 1, what an earlier micro-step leaves for the next one."""
        return ()

    def keeps_gradients(self, run: DSRun) -> bool:
        """Whether autograd's gradients stay in ``param.grad`` to the end of backward (reduced after it)."""
        return False

    def last_block_bucket(self, run: DSRun) -> tuple[Term, ...]:
        """The reduce bucket(s) alive at the last block's backward."""
        return ()

    def backward_after_last_block(self, run: DSRun, last: tuple[Term, ...],
                                  inflight: tuple[Term, ...]) -> tuple[Moment, ...]:
        """The last block's backward moment (``last``: its terms) and the wrapper's moments after it."""
        raise NotImplementedError

    def optimizer_moments(self, run: DSRun, part: int, inner: str, temps: int) -> tuple[Moment, ...]:
        raise NotImplementedError


def wrapper_for(s: Settings) -> Wrapper:
    """The wrapper DeepSpeed builds for ``s`` (``optimizer_class``)."""
    # imported here: the wrappers' modules import the shared pieces (run.py, phases.py), which ask for this
    from zeroplan.engines.deepspeed.bf16 import BF16_OPTIMIZER
    from zeroplan.engines.deepspeed.zero3 import ZERO3_OPTIMIZER
    from zeroplan.engines.deepspeed.zero12 import ZERO12_OPTIMIZER

    wrappers = {w.name: w for w in (ZERO12_OPTIMIZER, BF16_OPTIMIZER, ZERO3_OPTIMIZER)}
    return wrappers[optimizer_class(s)]
