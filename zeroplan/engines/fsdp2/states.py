"""What one FSDP2 rank holds between steps (its model states), per term: padded parameter shards
(``_fsdp_param.py FSDPParam._init_sharded_param``), gradient shards per unit, Adam's states on the real rows
(``torch/optim/adam.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.engines.fsdp2.param import Unit, local_numel_sum, padded_shard_numel, shape_counts, unit_shard_numel
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
    module = dtype_bytes(settings.module)
    return ModelStates(
        params_bytes=sum(n * padded_shard_numel(s, nd) for s, n in shape_counts(shapes)) * module,  # distinct shapes
        grads_bytes=sum(unit_shard_numel(u, nd) for u in units) * module,
        adam_moments_bytes=adam_moments(settings) * local_numel_sum(shapes, nd, settings.described_rank)
        * module,
        adam_step_bytes=len(shapes) * STEP_BYTES,
    )


def adam_moments(settings: Settings) -> int:
    """Adam's states of a parameter's size: exp_avg and exp_avg_sq, and with amsgrad max_exp_avg_sq, each
    ``torch.zeros_like(p, memory_format=torch.preserve_format)`` (torch/optim/adam.py ``Adam._init_group``).
    The step allocates nothing more for it: ``torch._foreach_maximum_`` (``_multi_tensor_adam``) and
    ``torch.maximum(..., out=max_exp_avg_sq)`` (``_single_tensor_adam``) write in place, and ``sqrt`` of the
    maximum replaces ``sqrt`` of exp_avg_sq (torch 2.11-2.13)."""
    return 3 if settings.amsgrad else 2


# ---- the run: what one rank trains ----
