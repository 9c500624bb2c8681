"""The collectives FSDP2 issues in one training step, in issue order (``_fsdp_collectives.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.engines.fsdp2.param import Unit, unit_shard_numel
from zeroplan.engines.fsdp2.settings import Settings, post_forward_group

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


def unit_collectives(units: tuple[Unit, ...], nd: int, settings: Settings,
                     replicate: int = 1) -> tuple[UnitCollective, ...]:
    """The collectives of one training step, in issue order (units in forward order, root first).

    Forward: one all-gather per unit (_fsdp_collectives.py:foreach_all_gather). Backward: the blocks are
    gathered again in reverse order when resharded after forward (over the post-forward group of k ranks
    for an int k; never the root: _fsdp_state.py:FSDPState._lazy_init), one reduce-scatter per unit in
    reverse order (_fsdp_collectives.py:foreach_reduce). Sizes are nd·S_u (dim-0 padded). One micro-step;
    with accumulation ``micro_steps`` says how many of them each runs in.
    """
    full = {u.name: nd * unit_shard_numel(u, nd) for u in units}
    out = [UnitCollective("all-gather", "forward", u.name, full[u.name], settings.param, nd) for u in units]
    group = post_forward_group(settings, nd)
    for u in reversed(units[1:]):  # blocks, last first
        if group > 1:
            out.append(UnitCollective("all-gather", "backward", u.name, full[u.name], settings.param, group))
    for u in reversed(units):
        out.append(UnitCollective("reduce-scatter", "backward", u.name, full[u.name], settings.reduce, nd))
        if replicate > 1:
            out.append(UnitCollective("all-reduce", "backward", u.name, full[u.name] // nd, settings.reduce,
                                      replicate, "dp_replicate"))  # fmt: skip
    return tuple(out)


def micro_steps(c: UnitCollective, grad_accum: int) -> int:
    """Micro-steps of one optimizer step ``c`` runs in, with accumulation as the snippet writes it
    (``set_requires_gradient_sync(False)`` on all but the last micro-step; launcher.py): every all-gather
    runs in every micro-step, since ``post_backward`` reshards whether or not it reduces
    (_fsdp_param_group.py:FSDPParamGroup.post_backward: ``if not self.reduce_grads: if
    self.reshard_after_backward: self.reshard()``, default True, the root too), so each forward gathers again;
    the reduce-scatter runs once, in the last micro-step's backward (``reduce_grads`` False skips
    ``foreach_reduce``; the gradients accumulate unsharded until then), and so does HSDP's all-reduce."""
    return grad_accum if c.op == "all-gather" else 1
