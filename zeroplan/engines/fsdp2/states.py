"""What one FSDP2 rank holds between steps (its model states), per term: padded parameter shards
(``_fsdp_param.py FSDPParam._init_sharded_param``), gradient shards per unit, Adam's states on the real rows
(``torch/optim/adam.py``)."""

from dataclasses import dataclass

from zeroplan.engines.fsdp2.memo import by_identity, memo_term
from zeroplan.engines.fsdp2.param import (Shape, Unit, local_shard_numel, padded_shard_numel, shape_counts,
                                         unit_shard_numel)
from zeroplan.engines.fsdp2.settings import STEP_BYTES, Settings
from zeroplan.formulas.dtypes import dtype_bytes


@dataclass(frozen=True)
class ModelStates:
    """Persistent bytes of one rank, per term, and what the step boundaries hold."""

    params_bytes: int
    grads_bytes: int
    adam_moments_bytes: int  # exp_avg + exp_avg_sq (+ max_exp_avg_sq with amsgrad)
    adam_step_bytes: int

    @property
    def after_init_bytes(self) -> int:
        """After fully_shard and the optimizer's construction: the sharded parameters alone."""
        return self.params_bytes

    def after_backward_bytes(self, step: int) -> int:
        """After backward of step ``step`` (0-based): parameters, gradients, and Adam's states from step 1."""
        return self.params_bytes + self.grads_bytes + (self.optimizer_bytes if step >= 1 else 0)

    @property
    def optimizer_bytes(self) -> int:
        return self.adam_moments_bytes + self.adam_step_bytes

    @property
    def boundary_bytes(self) -> int:
        """After optimizer.step() and zero_grad(set_to_none=True): parameters and Adam's states."""
        return self.params_bytes + self.optimizer_bytes


def model_states(units: tuple[Unit, ...], nd: int, settings: Settings) -> ModelStates:
    """Model states of ``settings.rank`` under FSDP2 with Adam (terms: ``params``, ``grads``, ``adam``)."""
    shapes = tuple(s for u in units for s in u.shapes)
    return states_of(shape_counts(shapes), sum(unit_shard_numel(u, nd) for u in units), nd, settings)


def states_of(counts: tuple[tuple[Shape, int], ...], shards: int, nd: int, settings: Settings) -> ModelStates:
    """``model_states`` from the distinct parameter shapes with their counts (``shape_counts``) and the units'
    padded shards summed (S_u, ``unit_shard_numel``): the parameters' bytes over the distinct shapes, Adam's
    over the rank's real rows of each (``local_numel_sum``'s sum), one step tensor per parameter."""
    module = dtype_bytes(settings.module)
    rank = settings.described_rank
    return ModelStates(
        params_bytes=sum(n * padded_shard_numel(s, nd) for s, n in counts) * module,
        grads_bytes=shards * module,
        adam_moments_bytes=adam_moments(settings) * sum(n * local_shard_numel(s, nd, rank) for s, n in counts)
        * module,
        adam_step_bytes=sum(n for _, n in counts) * STEP_BYTES,
    )


@memo_term  # the same on every rank of a run (not in memo.RANKED: ``Fsdp2Run.for_rank`` keeps it; a speed-up)
def shape_census(run) -> tuple[tuple[tuple[Shape, int], ...], int]:
    """What ``model_states`` reads of a run's units, rank-independent: the distinct shapes with their counts
    and the units' padded shards summed (``Fsdp2Run.shards``)."""
    return units_counts(run.units), sum(run.shards)


@by_identity  # the runs of one profile's units (a plan's estimates at one T) share them: counted once (a speed-up)
def units_counts(units: tuple[Unit, ...]) -> tuple[tuple[Shape, int], ...]:
    """``shape_counts`` of every parameter shape of ``units``."""
    return shape_counts(tuple(s for u in units for s in u.shapes))


@memo_term
def run_states(run) -> ModelStates:
    """``model_states`` of the run's units, ranks and settings (asked by ``adam`` and the estimate)."""
    return states_of(*shape_census(run), run.nd, run.settings)


def adam_moments(settings: Settings) -> int:
    """Adam's states of a parameter's size: exp_avg and exp_avg_sq, and with amsgrad max_exp_avg_sq, each
    ``torch.zeros_like(p, memory_format=torch.preserve_format)`` (torch/optim/adam.py ``Adam._init_group``).
    The step allocates nothing more for it: ``torch._foreach_maximum_`` (``_multi_tensor_adam``) and
    ``torch.maximum(..., out=max_exp_avg_sq)`` (``_single_tensor_adam``) write in place, and ``sqrt`` of the
    maximum replaces ``sqrt`` of exp_avg_sq (torch 2.11-2.13)."""
    return 3 if settings.amsgrad else 2


# ---- the run: what one rank trains ----
