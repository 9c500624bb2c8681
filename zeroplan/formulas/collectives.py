"""Collectives per training step and the bytes each rank sends (ZeRO paper, section 7).

The paper counts data movement in elements: a reduce-scatter or all-gather of Ψ elements moves Ψ, an
all-reduce (reduce-scatter + all-gather) 2Ψ, so stages 0-2 move 2Ψ and stage 3 moves 3Ψ per step.
What a rank actually puts on the wire with ring algorithms is (N_d-1)/N_d of that (Patarasuk & Yuan
2009; the nccl-tests "bus bandwidth" convention): each rank sends N_d-1 chunks of ceil(n/N_d)
elements per reduce-scatter or all-gather, twice that per all-reduce.
"""

from collections import Counter
from dataclasses import dataclass, fields

from zeroplan.formulas.dtypes import dtype_bytes
from zeroplan.formulas.memory import buffer_numels
from zeroplan.formulas.mesh import DEFAULT_GPUS_PER_NODE, data_parallel_mesh, link_class
from zeroplan.formulas.sharding import shard_numel
from zeroplan.formulas.stages import get_stage

DEFAULT_BUCKET_NUMEL = 500_000_000
"""Elements per gradient bucket / all-gather call: DeepSpeed 0.19.8's default ``reduce_bucket_size`` and
``allgather_bucket_size`` (5e8, ``runtime/zero/config.py``); the plan's latency estimate uses it for the
ladder's collectives, and the DeepSpeed profile as its default (``zeroplan.engines.deepspeed.config``)."""

PASSES: dict[str, int] = {"all-reduce": 2, "reduce-scatter": 1, "all-gather": 1, "all-to-all": 1}
"""Passes of a collective over its data. An all-reduce is a reduce-scatter followed by an all-gather
(ZeRO paper, section 7.1), so it moves twice its size; the nccl-tests bus-bandwidth factors 2(n-1)/n
and (n-1)/n and the ring's step counts 2(n-1) and n-1 (Patarasuk & Yuan 2009) follow from the same table.
An all-to-all of a rank's n elements (``all_to_all_single``: ZeRO++ qgZ) sends n/N to each of the N-1 others:
(N-1)/N·n per rank, one pass; nccl-tests' all-to-all bus bandwidth uses the same (n-1)/n
(src/alltoall.cu ``AlltoAllGetBw``), and pairwise exchange takes N-1 steps (Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 2005, sec. 4.4: (p-1)α + (p-1)/p·nβ)."""


@dataclass(frozen=True)
class Collective:
    """One collective a rank takes part in per training step."""

    op: str  # a key of PASSES: "all-reduce" | "reduce-scatter" | "all-gather" | "all-to-all"
    phase: str  # "forward" | "backward" | "optimizer step"
    elements: int  # full (unsharded) size of the collective, in elements
    dtype: str
    bytes_per_rank: int  # bytes one rank sends on a ring algorithm
    micro_steps: int = 1
    """micro-steps of one optimizer step it runs in: 1 (once) or G (every micro-step of ``grad_accum`` = G);
    ``elements`` and ``bytes_per_rank`` are summed over them (an engine's rows, ``EngineEstimate.collectives``,
    count one optimizer step; the paper's rows, ``step_collectives``, one micro-step: 1)."""
    mesh_dim: str = "dp_shard"
    """the mesh dimension it runs over (``zeroplan.formulas.mesh.MESH_DIMS``): a flat run's all run over
    ``dp_shard``, the whole data-parallel group; HSDP's gradient all-reduce over ``dp_replicate``."""
    group_size: int = 0
    """ranks in its process group; 0: the whole dimension (``on_mesh`` fills it in)."""
    link: str = ""
    """the link class its group spans, ``intra`` or ``inter`` (``zeroplan.formulas.mesh``); "": not placed
    yet (``on_mesh`` places it for a node size)."""

    @property
    def volume_elements(self) -> int:
        """The paper's count of data moved (section 7): the size times its passes."""
        return self.elements * PASSES[self.op]

    def as_dict(self) -> dict:
        """The JSON output's collective (``render/schemas.py CollectiveOut``): its size per optimizer step;
        ``micro_steps`` is for the time model (``plan --json`` prints it as each row's ``calls_per_step``)."""
        return {name: getattr(self, name) for name in _OUT_FIELDS}  # shallow: every field is a number or a string


_OUT_FIELDS = tuple(f.name for f in fields(Collective) if f.name != "micro_steps")
"""``Collective.as_dict``'s keys, in field order (``dataclasses.asdict``'s deep copy took ~25 ms of CPU for the
1,268 rows of a 2,048-GPU FSDP2 ``plan --json``)."""


def tp_degree(collectives: tuple[Collective, ...]) -> int:
    """T, the tensor-parallel group the rows name (``mesh_dim`` tp; FSDP2's ``--tp``, engines/fsdp2/tp.py); 1: none."""
    return max((c.group_size for c in collectives if c.mesh_dim == "tp"), default=1)


def on_mesh(collectives: tuple[Collective, ...], nd: int, nm: int = 1,
            gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> tuple[Collective, ...]:
    """``collectives`` with their group size and link class filled in, on the mesh they name: N_d
    data-parallel ranks (``dp_replicate`` R of them when a collective runs over that dimension, the rest
    ``dp_shard``), N_m model-parallel GPUs each, ``gpus_per_node`` per node (``zeroplan.formulas.mesh``).
    A group smaller than its dimension (FSDP2's post-forward group of k ranks) is k consecutive ranks of it."""
    replicate = max((c.group_size for c in collectives if c.mesh_dim == "dp_replicate"), default=1)
    tp = tp_degree(collectives)
    if tp > 1 and nm == 1:  # FSDP2's --tp: N_d counts every GPU, T of them per data-parallel rank (engines/fsdp2/tp.py)
        nd, nm = nd // tp, tp
    mesh = data_parallel_mesh(nd, replicate, nm, gpus_per_node)
    placed: dict[tuple[str, int], tuple[int, str]] = {}  # (dimension, group size) -> (size, link class), once each

    def place(c: Collective) -> Collective:
        key = (c.mesh_dim, c.group_size)
        got = placed.get(key)
        if got is None:
            size = c.group_size or mesh.size(c.mesh_dim)
            got = placed[key] = (size, link_class(size, mesh.stride(c.mesh_dim), mesh.world, gpus_per_node))
        # ``replace(c, group_size=..., link=...)``, its fields named (a FSDP2 plan places ~1,300 rows per candidate)
        return Collective(c.op, c.phase, c.elements, c.dtype, c.bytes_per_rank, c.micro_steps, c.mesh_dim, *got)

    return tuple(map(place, collectives))


def distinct_rows(collectives: tuple[Collective, ...]) -> tuple[tuple[Collective, ...], tuple[int, ...]]:
    """(the distinct rows of ``collectives`` in order of first appearance, the index of each row among them):
    ``commtime.engine_step_time`` places and times each distinct row once and gives every equal row the same
    ``TimedCollective`` (a speed-up, no rule: an FSDP2 plan's ~1,500-2,200 rows per candidate are 10-13 distinct
    ones, one per unit of identical blocks). Exact: placing and timing read only a row's fields, and ``on_mesh``
    the largest replicate and TP groups, the same over the distinct rows as over all; the step's sums
    (``exposed_comm_s``, ``StepTime.comm_s``) still run over every row, in order. Rows are grouped by object
    first (FSDP2's producers give equal rows as one object: ``run_collectives``, ``tp_rows``), then by value.
    The answer for the last tuple asked is kept, that tuple held beside it (a plan row asks twice, ``counted_rows``
    and ``engine_step_time``: a speed-up, no rule; the answer is immutable), and the ids are mapped in C (the same
    dict, in the same order, as a loop over the rows)."""
    if _LAST_ROWS[0] is collectives:
        return _LAST_ROWS[1]
    ids = tuple(map(id, collectives))
    objects = dict(zip(ids, collectives))  # one per object: equal rows that are one object, at no __eq__
    index: dict[Collective, int] = {}
    slot = {k: index.setdefault(c, len(index)) for k, c in objects.items()}
    out = tuple(index), tuple(map(slot.__getitem__, ids))
    if type(collectives) is tuple:  # kept only for rows that cannot change
        _LAST_ROWS[:] = (collectives, out)
    return out


_LAST_ROWS: list = [None, None]
"""``distinct_rows``' last rows (a tuple, held so that its id stays its own) and its answer."""


def counted_rows(collectives: tuple[Collective, ...]) -> tuple[tuple[Collective, int], ...]:
    """Each distinct row of ``collectives`` (``distinct_rows``) with how many rows equal it: a sum of a row's
    integer field (bytes, elements) over them is the sum over every row, exactly (a speed-up, no rule)."""
    kinds, rows = distinct_rows(collectives)
    counts = Counter(rows)
    return tuple((k, counts[i]) for i, k in enumerate(kinds))


def ring_bytes_per_rank(op: str, elements: int, nd: int, element_bytes: int) -> int:
    """Bytes one rank sends for a ring ``op`` over ``nd`` ranks: passes·(nd-1)·ceil(n/nd)·b (an all-to-all: its
    n/nd-element chunks to the nd-1 others, ``PASSES``)."""
    return PASSES[op] * (nd - 1) * shard_numel(elements, nd) * element_bytes


def paper_comm_volume(psi: float, stage: int) -> float:
    """ZeRO section 7.2: 2Ψ elements per step for DP, P_os and P_os+g; 3Ψ for P_os+g+p."""
    return 3 * psi if get_stage(stage).shards_parameters else 2 * psi


def step_collectives(
    stage: int,
    numels: tuple[int, ...],
    nd: int,
    param_dtype: str,
    grad_dtype: str,
    flat_layout: bool = False,
) -> tuple[Collective, ...]:
    """The collectives of one step without gradient accumulation, per ZeRO section 7.2.

    Stage 0: all-reduce of gradients during backward. Stages 1-2: reduce-scatter of gradients
    (during backward, bucket by bucket at stage 2), all-gather of the updated 16-bit parameters after
    the optimizer step. Stage 3: all-gather of parameters before forward and again before backward,
    reduce-scatter of gradients during backward. With N_d = 1 nothing is communicated: the list is empty.
    Each collective spans the full buffer of the tensors of ``numels`` elements
    (``zeroplan.formulas.memory.buffer_numels``: padded to N_d when ``flat_layout``). ``numels`` entries
    and ``nd`` may be numpy arrays (``zeroplan.sweep``); entries with N_d = 1 then get collectives of
    0 elements and 0 bytes.
    """
    if getattr(nd, "ndim", 0) == 0 and nd == 1:
        return ()
    row = get_stage(stage)
    full_numel, _ = buffer_numels(numels, nd, stage, flat_layout)
    elements = full_numel * (nd > 1)

    def make(op: str, phase: str, dtype: str) -> Collective:
        sent = ring_bytes_per_rank(op, full_numel, nd, dtype_bytes(dtype))
        return Collective(op, phase, elements, dtype, sent)

    if not row.shards_optimizer:
        return (make("all-reduce", "backward", grad_dtype),)
    if not row.shards_parameters:
        return (
            make("reduce-scatter", "backward", grad_dtype),
            make("all-gather", "optimizer step", param_dtype),
        )
    return (
        make("all-gather", "forward", param_dtype),
        make("all-gather", "backward", param_dtype),
        make("reduce-scatter", "backward", grad_dtype),
    )
