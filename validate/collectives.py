"""The three collectives of ZeRO, on any process group, averaging gradients and skipping N_d = 1.

Gradients are divided by N_d before they are summed (gloo has no AVG reduction; pre-dividing also keeps
fp16 sums from overflowing, as DeepSpeed's ``gradient_predivide_factor`` does); under gradient
accumulation by N_d·G, G micro-steps' gradients being summed too (the mean over the N_d·G micro-batches,
as DeepSpeed's loss scaling by 1/G gives, without a scaled-loss tensor). With N_d = 1 nothing is
communicated, as ``zeroplan.formulas.collectives.step_collectives`` predicts: the calls become local copies.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

# torch 2.13 renames these (``*_single``) but 2.11 only has the old names; both run the same c10d op.
warnings.filterwarnings(
    "ignore", message=".*is deprecated. Please use `torch.distributed.*", category=FutureWarning
)


def all_reduce_mean(t: torch.Tensor, nd: int, micro_steps: int = 1) -> None:
    """In place: ``t`` (a sum of ``micro_steps`` micro-steps' gradients) becomes the mean over ranks
    and micro-steps."""
    if nd * micro_steps > 1:
        t.div_(nd * micro_steps)
    if nd > 1:
        dist.all_reduce(t)


def reduce_scatter_mean(out: torch.Tensor, full: torch.Tensor, nd: int, micro_steps: int = 1) -> None:
    """``out`` (shard) becomes this rank's slice of the sum over ranks of ``full`` / (N_d·``micro_steps``);
    ``full`` is clobbered."""
    if nd * micro_steps > 1:
        full.div_(nd * micro_steps)
    if nd > 1:
        dist.reduce_scatter_tensor(out, full)
    else:
        out.copy_(full)


def all_gather(full: torch.Tensor, shard: torch.Tensor, nd: int) -> None:
    """``full`` becomes every rank's ``shard`` end to end (``shard`` may be this rank's slice of ``full``)."""
    if nd > 1:
        dist.all_gather_into_tensor(full, shard)
    else:
        full.copy_(shard)  # harmless when shard already is full (stages 1-2 at N_d = 1)
