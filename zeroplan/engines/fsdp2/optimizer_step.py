"""FSDP2's optimizer step as a moment: Adam on the sharded DTensor parameters, with the temporaries of the
optimizer's path (``torch/optim/adam.py``: foreach, single-tensor, fused), beside what every step holds."""

from __future__ import annotations

from zeroplan.engines.fsdp2.hf_tree import rotary_buffers
from zeroplan.engines.fsdp2.param import local_numel_sum, local_shard_numel
from zeroplan.engines.fsdp2.settings import ADAM
from zeroplan.engines.fsdp2.terms import Fsdp2Run, adam, grads, mesh_ranks, params
from zeroplan.formulas.peak import Moment, Term


def optimizer_moments(run: Fsdp2Run) -> tuple[Moment, ...]:
    """Adam on the sharded DTensor parameters. ``_multi_tensor_adam`` (foreach) makes ``sqrt(v)`` for every
    tensor at once (one local shard's worth); ``_single_tensor_adam`` computes ``v.sqrt() /
    bias_correction2_sqrt`` per tensor, two temporaries of the largest local shard alive at once."""
    shapes = run.param_order or tuple(s for u in run.units for s in u.shapes)
    if run.settings.fused:  # _fused_adam: torch._fused_adam_ writes every state in place (measured on CPU: none)
        temps = ()
    elif run.foreach:
        temps = (Term("Adam temporaries (foreach sqrt(v))", local_numel_sum(shapes, run.nd, run.settings.described_rank)
                      * run.m, f"{ADAM}:_multi_tensor_adam", len(shapes)),)  # fmt: skip
    else:
        local = [local_shard_numel(s, run.nd, run.settings.described_rank) for s in shapes]
        # ``denom`` stays bound to the previous tensor's quotient until this tensor's is assigned (measured)
        worst = max(2 * n + (local[i - 1] if i else 0) for i, n in enumerate(local))
        temps = (Term("Adam temporaries (sqrt(v), its quotient, the previous tensor's denom)", worst * run.m,
                      f"{ADAM}:_single_tensor_adam", 3),)  # fmt: skip
    held = (*mesh_ranks(run), *rotary_buffers(run), params(run), adam(run), grads(run, range(len(run.units))))
    return (Moment("optimizer_step", "Adam update", (*held, *temps)),)
