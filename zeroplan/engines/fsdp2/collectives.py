"""The collectives FSDP2 issues in one training step, in issue order (``_fsdp_collectives.py``)."""

from dataclasses import dataclass

from zeroplan.engines.fsdp2.memo import by_identity, memo_term
from zeroplan.engines.fsdp2.param import Unit, unit_shard_numel
from zeroplan.engines.fsdp2.settings import Settings
from zeroplan.engines.fsdp2.wrap import ShardUnit, forward_order
from zeroplan.formulas.collectives import Collective, ring_bytes_per_rank
from zeroplan.formulas.dtypes import dtype_bytes

@dataclass(frozen=True)
class UnitCollective:
    """One collective as FSDP2 issues it: full size in elements (all-gather output, reduce-scatter input)."""

    op: str
    phase: str
    unit: str
    elements: int
    dtype: str
    group_size: int
    mesh_dim: str = "dp_shard"  # HSDP's gradient all-reduce: dp_replicate (engines/fsdp2/mesh.py)


def unit_collectives(units, nd: int, settings: Settings, replicate: int = 1, row=UnitCollective) -> tuple:
    """The collectives of one training step, in issue order. ``units``: the resolved ``fully_shard`` calls
    (``wrap.ShardUnit``, call order), or the profile's ``Unit``s (root first, then the blocks, which take
    ``settings.reshard_after_forward``).

    Forward: one all-gather per unit with parameters, in forward order (``wrap.forward_order``: the root's
    pre-forward first; _fsdp_collectives.py:foreach_all_gather). Backward: the root again first when it was
    resharded after forward (its pre-backward), then every other unit resharded after forward in reverse
    forward order (over its post-forward group of k ranks for an int k; a unit kept gathered, False, is not
    gathered again: _fsdp_param_group.py:FSDPParamGroup.pre_backward), then one reduce-scatter per unit in
    reverse forward order, the root's last (_fsdp_state.py:FSDPState._root_post_backward_final_callback;
    _fsdp_collectives.py:foreach_reduce). Sizes are nd·S_u (dim-0 padded). One micro-step; with accumulation
    ``micro_steps`` says how many of them each runs in. HSDP (``replicate`` R > 1, ``nd`` the shard group S):
    each reduce-scatter's output, S_u elements in the reduce dtype, is all-reduced over the R replicas right
    after it (foreach_reduce: ``dist.all_reduce(reduce_output, group=all_reduce_group)``; engines/fsdp2/mesh.py).
    ``row``: what each collective is made as, from ``UnitCollective``'s fields (``run_collectives``: the engine's
    rows, without a ``UnitCollective`` each).
    """
    if units and isinstance(units[0], Unit):
        units = (*(ShardUnit((u.name,), tuple(("", s) for s in u.shapes), settings.reshard_after_forward)
                   for u in units[1:]), ShardUnit(("",), tuple(("", s) for s in units[0].shapes), None, True))  # fmt: skip
    order = forward_order(units)
    # each unit's nd·S_u, by identity (a unit's dataclass hash walks its parameters' names and shapes at each look-up)
    full = {id(u): nd * unit_shard_numel(v, nd) for u, v in zip(units, _as_units(units))}
    param, reduce = settings.param, settings.reduce  # each a property that canonicalises its dtype
    out = [row("all-gather", "forward", u.name, full[id(u)], param, nd) for u in order]
    root = [u for u in order if u.root and u.post_forward_group(nd) > 1]
    for u in (*root, *reversed([u for u in order if not u.root])):
        group = u.post_forward_group(nd)
        if group > 1:
            out.append(row("all-gather", "backward", u.name, full[id(u)], param, group))
    for u in (*reversed([u for u in order if not u.root]), *(u for u in order if u.root)):
        out.append(row("reduce-scatter", "backward", u.name, full[id(u)], reduce, nd))
        if replicate > 1:
            out.append(row("all-reduce", "backward", u.name, full[id(u)] // nd, reduce, replicate,
                           "dp_replicate"))  # fmt: skip
    return tuple(out)


@by_identity  # a run's fully_shard calls are one tuple for every run of a profile (wrap.resolve): once (a speed-up)
def _as_units(units: tuple[ShardUnit, ...]) -> tuple[Unit, ...]:
    """Each ``fully_shard`` call as a ``Unit`` (its name and its parameters' shapes): ``unit_shard_numel``'s key."""
    return tuple(Unit(u.name, tuple(s for _, s in u.params)) for u in units)


def micro_steps(c: UnitCollective, grad_accum: int) -> int:
    """Micro-steps of one optimizer step ``c`` runs in, with accumulation as the snippet writes it
    (``set_requires_gradient_sync(False)`` on all but the last micro-step; launcher.py): every all-gather
    runs in every micro-step, since ``post_backward`` reshards whether or not it reduces
    (_fsdp_param_group.py:FSDPParamGroup.post_backward: ``if not self.reduce_grads: if
    self.reshard_after_backward: self.reshard()``, default True, the root too), so each forward gathers again;
    the reduce-scatter runs once, in the last micro-step's backward (``reduce_grads`` False skips
    ``foreach_reduce``; the gradients accumulate unsharded until then), and so does HSDP's all-reduce."""
    return op_micro_steps(c.op, grad_accum)


def op_micro_steps(op: str, grad_accum: int) -> int:
    """``micro_steps`` of a collective ``op``: G for an all-gather, else 1."""
    return grad_accum if op == "all-gather" else 1


@memo_term  # the same for every rank of a run (no rank in unit_collectives): built once (a speed-up)
def run_collectives(run, grad_accum: int) -> tuple[Collective, ...]:
    """The collectives of one optimizer step of ``grad_accum`` micro-steps (``micro_steps``), per rank. Equal
    rows (the identical blocks') are one object, built once (``one_row``: a speed-up, no rule)."""
    made: dict = {}

    def row(op: str, phase: str, unit: str, elements: int, dtype: str, group_size: int,
            mesh_dim: str = "dp_shard") -> Collective:  # a UnitCollective's fields, the unit's name not kept
        return one_row(made, op, phase, elements, dtype, group_size, mesh_dim, op_micro_steps(op, grad_accum))

    return unit_collectives(run.shard_units, run.nd, run.settings, run.replicate, row)


def one_row(made: dict, op: str, phase: str, elements: int, dtype: str, group_size: int, mesh_dim: str,
            m: int) -> Collective:
    """The row of ``m`` micro-steps of a collective of ``elements`` over ``group_size`` ranks (its bytes per rank
    on a ring, ``ring_bytes_per_rank``), the one object ``made`` holds for those arguments (made there the first
    time): equal rows shared, which ``commtime.distinct_rows`` groups at no ``__eq__`` (rows are frozen)."""
    key = (op, phase, elements, dtype, group_size, mesh_dim, m)
    row = made.get(key)
    if row is None:
        row = made[key] = Collective(op, phase, m * elements, dtype,
                                     m * ring_bytes_per_rank(op, elements, group_size, dtype_bytes(dtype)), m,
                                     mesh_dim=mesh_dim, group_size=group_size)  # fmt: skip
    return row
