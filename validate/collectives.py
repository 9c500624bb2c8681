"""The three collectives of ZeRO, on any process group, averaging gradients and skipping N_d = 1.

Gradients are divided by N_d before they are summed (gloo has no AVG reduction; pre-dividing also keeps
fp16 sums from overflowing, as DeepSpeed's ``gradient_predivide_factor`` does). With N_d = 1 nothing is
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


def all_reduce_mean(t: torch.Tensor, nd: int) -> None:
    """In place: ``t`` becomes the mean of every rank's ``t``."""
    if nd > 1:
        t.div_(nd)
        dist.all_reduce(t)


def reduce_scatter_mean(out: torch.Tensor, full: torch.Tensor, nd: int) -> None:
    """``out`` (shard) becomes this rank's slice of the mean over ranks of ``full``; ``full`` is clobbered."""
    if nd > 1:
        full.div_(nd)
        dist.reduce_scatter_tensor(out, full)
    else:
        out.copy_(full)


def all_gather(full: torch.Tensor, shard: torch.Tensor, nd: int) -> None:
    """``full`` becomes every rank's ``shard`` end to end (``shard`` may be this rank's slice of ``full``)."""
    if nd > 1:
        dist.all_gather_into_tensor(full, shard)
    else:
        full.copy_(shard)  # harmless when shard already is full (stages 1-2 at N_d = 1)
