"""FSDP2's dim-0 padding rule and its units: what one rank stores of each parameter
(``_fsdp_common.py:_chunk_with_empty``, ``_get_dim0_padded_size``; ``_fsdp_param.py:FSDPParam``).

FSDP2 pads each parameter on dim 0 to ``ceil(d0 / nd)`` rows per rank; the reference runtime pads a flat
buffer instead (``zeroplan.formulas.sharding``): two engines, two rules, each named for its engine."""

import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from zeroplan.engines.fsdp2.memo import by_identity

Shape = tuple[int, ...]


# ---- the dim-0 padding rule (_fsdp_common.py:_chunk_with_empty, _get_dim0_padded_size) ----


def shard_rows(d0: int, nd: int) -> int:
    """Rows of dim 0 each rank stores, padding included: ceil(d0 / nd) (_fsdp_common.py:_chunk_with_empty)."""
    if d0 < 0 or nd < 1:
        raise ValueError(f"d0={d0}, nd={nd}: need d0 >= 0 and nd >= 1")
    return -(-d0 // nd)


@lru_cache(maxsize=1 << 16)  # a speed-up: every rank of every estimate asks each of ~900 parameters (few distinct)
def padded_shard_numel(shape: Shape, nd: int) -> int:
    """Elements a rank stores of one parameter: ceil(d0 / nd)·prod(rest) (FSDPParam._init_sharded_param)."""
    return shard_rows(shape[0], nd) * math.prod(shape[1:]) if shape else 1


@lru_cache(maxsize=1 << 16)  # a speed-up, as padded_shard_numel
def local_shard_numel(shape: Shape, nd: int, rank: int) -> int:
    """Real (unpadded) elements of rank ``rank``'s shard: what ``zeros_like`` of the DTensor allocates."""
    if not shape:
        return 1 if rank == 0 else 0
    c = shard_rows(shape[0], nd)
    return min(c, max(0, shape[0] - rank * c)) * math.prod(shape[1:])


@by_identity  # a run's shapes tuple passed again by its estimates: not hashed (~1,100 shapes), a speed-up
def shape_counts(shapes: tuple[Shape, ...]) -> tuple[tuple[Shape, int], ...]:
    """Each distinct shape of ``shapes`` once, with how many parameters have it (a speed-up: identical layers
    give ~10 distinct shapes in ~900 parameters, and a rank's sums over them need each once)."""
    return tuple(Counter(shapes).items())


def local_numel_sum(shapes: tuple[Shape, ...], nd: int, rank: int) -> int:
    """Σ ``local_shard_numel`` over ``shapes`` (``shape_counts``)."""
    return sum(n * local_shard_numel(s, nd, rank) for s, n in shape_counts(shapes))


@by_identity  # a plan's estimates pass one workload's shapes again and again (a speed-up)
def distinct_shapes(named_shapes) -> tuple[Shape, ...]:
    """The distinct parameter shapes of (name, shape) pairs, in order of first appearance (what ``distinct_ranks``
    reads of them)."""
    return tuple(dict.fromkeys(tuple(s) for _, s in named_shapes))


@by_identity  # the mesh search's floors ask it of one workload's shapes at every plan and first fit (a speed-up)
def total_numel(named_shapes) -> int:
    """Elements of every parameter of (name, shape) pairs."""
    return sum(math.prod(s) for _, s in named_shapes)


def distinct_ranks(shapes: tuple[Shape, ...], nd: int) -> tuple[int, ...]:
    """The first rank of each run of ranks whose shards are alike, parameter by parameter: the profile reads
    a rank only through ``local_shard_numel``, so these ranks' predictions are every rank's.

    Of a parameter of d0 rows, ``c = ceil(d0 / nd)`` rows per rank, ranks below ``t = d0 // c`` hold c real
    rows, rank t the rest (``d0 - t·c``, possibly none) and every rank above it none; a 0-d tensor lives on
    rank 0 (``_chunk_with_empty``). So the shards change only at t (and t + 1 when rank t holds a tail) of some
    parameter: rank 0, the owners of the tails and the first ranks past them (at most 2 per distinct dim 0,
    whatever N_d)."""
    out = {0}
    for shape in set(shapes):
        if not shape:
            out.add(1)
            continue
        if shape[0] == 0:
            continue
        c = shard_rows(shape[0], nd)
        t = shape[0] // c
        out.update((t, t + 1) if shape[0] % c else (t,))  # rank t holds a tail, or is the first with none
    return tuple(sorted(r for r in out if r < nd))


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard`` unit: its name and the shapes of the parameters it manages, in order."""

    name: str
    shapes: tuple[Shape, ...]

    @property
    def numel(self) -> int:
        return sum(map(math.prod, self.shapes))  # in C (a speed-up, no rule: asked for every block of every run)


def unit_shard_numel(unit: Unit, nd: int) -> int:
    """S_u: the unit's padded shard, the all-gather input and reduce-scatter output per rank (cached by its shapes,
    ``shapes_shard_numel``: hashed in C, where a ``Unit`` key hashes and compares in Python; a speed-up)."""
    return shapes_shard_numel(unit.shapes, nd)


@by_identity  # a profile's units, shared by the runs of a plan's estimates at one T: once per N_d (a speed-up)
def units_shard_numel(units: tuple[Unit, ...], nd: int) -> tuple[int, ...]:
    """``unit_shard_numel`` of each of ``units`` (a unit's hash walks its shapes in Python: ~130 a run)."""
    return tuple(unit_shard_numel(u, nd) for u in units)


@lru_cache(maxsize=1024)  # identical decoder layers: one sum for all of them at each N_d (a speed-up)
def shapes_shard_numel(shapes: tuple[Shape, ...], nd: int) -> int:
    """``unit_shard_numel`` of a unit of parameters of ``shapes``."""
    return sum(padded_shard_numel(s, nd) for s in shapes)


def units_of(named_shapes: tuple[tuple[str, Shape], ...], prefix: str) -> tuple[Unit, ...]:
    """FSDP2's documented wrapping: one unit per decoder layer (``<prefix><i>.``), the rest in the root (first)."""
    root: list[Shape] = []
    blocks: dict[str, list[Shape]] = {}
    for name, shape in named_shapes:
        if name.startswith(prefix):
            index = name[len(prefix) :].split(".", 1)[0]
            blocks.setdefault(prefix + index, []).append(tuple(shape))
        else:
            root.append(tuple(shape))
    return (Unit("root", tuple(root)), *(Unit(n, tuple(s)) for n, s in blocks.items()))
