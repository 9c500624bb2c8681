"""The one sharding rule, shared by the planner and the reference runtime (``validate/``).

Every sharded tensor is padded to a multiple of N_d and split evenly, so rank r owns elements
``[r * shard, (r + 1) * shard)`` of the padded tensor, with ``shard = ceil(numel / nd)``. This is
how FSDP pads a flat parameter and DeepSpeed pads its flat partitions; padding adds fewer than
N_d elements per tensor and never drops one.
"""

from __future__ import annotations

from collections.abc import Iterable


def ceil_div(n: int, d: int) -> int:
    """ceil(n / d) in exact integer arithmetic (also on numpy integer arrays); the one ceiling division."""
    return -(-n // d)


def shard_numel(numel: int, nd: int) -> int:
    """Elements each of ``nd`` ranks owns of a tensor of ``numel`` elements: ceil(numel / nd).

    Also takes integer numpy arrays (``zeroplan.sweep`` evaluates a whole grid in one call); their values
    are checked where the grid is built, so only scalars are checked here.
    """
    if getattr(numel, "ndim", 0) == 0 and getattr(nd, "ndim", 0) == 0 and (numel < 0 or nd < 1):
        raise ValueError(f"numel={numel}, nd={nd}: need numel >= 0 and nd >= 1")
    return ceil_div(numel, nd)


def padded_numel(numel: int, nd: int) -> int:
    """Length of the tensor once padded to a multiple of ``nd``."""
    return shard_numel(numel, nd) * nd


def flat_shard_numel(numels: Iterable[int], nd: int) -> int:
    """Elements a rank owns of a flat buffer whose tensors are each padded to a multiple of ``nd``."""
    return sum(shard_numel(n, nd) for n in numels)


def flat_padded_numel(numels: Iterable[int], nd: int) -> int:
    """Length of a flat buffer whose tensors are each padded to a multiple of ``nd``."""
    return flat_shard_numel(numels, nd) * nd
