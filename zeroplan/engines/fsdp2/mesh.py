"""FSDP2 on a 2-D mesh (HSDP): ``fully_shard(mesh=init_device_mesh("cuda", (R, S), mesh_dim_names=
("dp_replicate", "dp_shard")))`` shards every parameter over the S ranks of its ``dp_shard`` group and
replicates the shards over the R groups (torch 2.13.0, ``_fully_shard/``).

What changes against a flat run of N_d = R·S ranks (read from ``_fsdp_init.py:_get_device_from_mesh``,
``_fsdp_param_group.py:FSDPParamGroup.post_backward`` and ``_fsdp_collectives.py:foreach_reduce``):

- sizes: every shard, gathered buffer and reduce-scatter buffer is sized by S, not N_d (the mesh's
  ``shard_mesh_dim``; ``HSDPMeshInfo``): the flat profile at N_d = S;
- all-gathers and reduce-scatters run over the ``dp_shard`` group (S ranks);
- after each unit's reduce-scatter, ``foreach_reduce`` all-reduces its output (S_u elements in the reduce
  dtype) over the ``dp_replicate`` group (R ranks), in place, before the cast to the module dtype;
- the all-reduce's buffer is kept in ``FSDPParamGroup._all_reduce_state`` until the root's
  ``finalize_backward`` (pytorch PR #180900: held so the next unit's reduce-scatter cannot reuse its block
  while the all-reduce is in flight). When the reduce dtype is the module dtype that buffer is the sharded
  gradient itself (nothing more); else each reduced unit keeps S_u·r bytes until backward ends.

Gradient accumulation (``set_requires_gradient_sync(False)`` on all but the last micro-step) skips
``foreach_reduce`` entirely, so the all-reduce runs once per optimizer step, like the reduce-scatter.
``_all_reduce_state`` was read in 2.13 only (it cites PR #180900, newer than some 2.11 builds): re-read
2.11's ``foreach_reduce`` before claiming a 2.11 HSDP row exact (with it gone, the held term is not there).
"""

from __future__ import annotations

from zeroplan.engines.fsdp2.settings import SRC, Settings
from zeroplan.formulas.peak import Moment, Term

REDUCED = " cast to the module dtype"
"""The end of the backward moment at which a unit's reduction is done (``moments.reduce_scatter_moments``): its
all-reduce buffer is held from there on."""

def check_group(name: str):
    """The check of the ``dp_replicate``/``dp_shard`` option (``EngineOption.check``): a whole number >= 1."""

    def check(v: object) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 2**24:
            raise ValueError(f"{name}={v!r}: expected a whole number from 1 to 2**24")
        return v

    return check


AUTO = "auto"
"""``--dp-shard auto`` (``plan`` only): search the shard group (``shard_sizes``, ``smallest_fitting``)."""


def check_shard(v: object) -> int | str:
    """``dp_shard``'s check: a whole number >= 1 (or its digits, from the command line), or ``auto``."""
    if v == AUTO:
        return AUTO
    if isinstance(v, str) and v.isdigit():
        v = int(v)
    return check_group("dp_shard")(v)


MESH_HELP = {
    "dp_replicate": "HSDP: replicas R of fully_shard's 2-D mesh (R, S), gradients all-reduced across them",
    "dp_shard": "HSDP: ranks S each parameter is sharded over (R x S = N_d); plan: auto searches it",
}


def shard_groups(settings: Settings, nd: int) -> tuple[int, int]:
    """(R, S): replicas and ranks per shard group for N_d ranks; ValueError (one line) when they do not
    multiply to N_d. Neither given: (1, N_d), a flat run; one given: the other is N_d divided by it."""
    r, s = settings.dp_replicate, settings.dp_shard
    if r is None and s is None:
        return 1, nd
    if r is None:
        r = nd // s if nd % s == 0 else 0
    if s is None:
        s = nd // r if nd % r == 0 else 0
    if r * s != nd:
        given = ", ".join(f"{k}={v}" for k, v in (("dp_replicate", settings.dp_replicate),
                                                   ("dp_shard", settings.dp_shard)) if v is not None)  # fmt: skip
        raise ValueError(f"{given}: dp_replicate x dp_shard must equal N_d={nd} (GPUs / model parallel)")
    return r, s


def resolve_mesh(settings: Settings, nd: int) -> Settings:
    """``settings`` with R and S both given on an HSDP mesh (so the label and the snippet name them), neither
    on a flat one (R = 1: the flat profile, unchanged); ValueError (one line) as ``shard_groups``."""
    r, s = shard_groups(settings, nd)
    if r > 1 and not isinstance(settings.reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward={settings.reshard_after_forward} with dp_replicate={r}: an int "
                         "post-forward group on an HSDP mesh is not modelled; use true or false")  # fmt: skip
    return settings.model_copy(update={"dp_replicate": r, "dp_shard": s} if r > 1 else
                               {"dp_replicate": None, "dp_shard": None})  # fmt: skip


def shard_rank(settings: Settings, nd: int) -> int:
    """``settings.rank``'s place in its shard group, which decides its real (unpadded) rows: the mesh is
    row-major with ``dp_shard`` innermost (``init_device_mesh``), so rank r is shard r mod S."""
    return settings.rank % shard_groups(settings, nd)[1]


def shard_sizes(nd: int, gpus_per_node: int) -> tuple[int, ...]:
    """The shard groups ``plan --dp-shard auto`` tries, smallest first: whole nodes that divide N_d (one node,
    two, ...), ending with N_d itself (flat); N_d alone when it fits in one node. A group smaller than a node
    is never better than one node: the all-reduce across replicas carries S_u = Ψ/S, so it only grows."""
    if nd <= gpus_per_node:
        return (nd,)
    return tuple(dict.fromkeys((*(s for s in range(gpus_per_node, nd, gpus_per_node) if nd % s == 0), nd)))


def smallest_fitting(sizes: tuple[int, ...], try_at):
    """``try_at(S) -> (result, fits)`` bisected over ``sizes`` (ascending): the result at the smallest S that
    fits, else at the largest. Assumes a larger shard group never holds more (every sharded term scales as
    1/S; activations and gathered units do not depend on S): the largest is tried first (none fits: one
    estimate, the plan's mesh search meets that often), then log2 of the rest."""
    top = try_at(sizes[-1])
    if not top[1]:
        return top[0]
    lo, hi, best, tried = 0, len(sizes) - 2, len(sizes) - 1, {len(sizes) - 1: top}
    while lo <= hi:
        mid = (lo + hi) // 2
        tried[mid] = try_at(sizes[mid])
        if tried[mid][1]:
            best, hi = mid, mid - 1
        else:
            lo = mid + 1
    return tried[best][0]


def states_floor(numel: int, s: int, settings: Settings) -> int:
    """A lower bound on the predicted peak of rank 0 on a shard group of ``s`` (so on the worst rank's, which
    ``estimate`` takes): its model states, all live at the optimizer step (``states.ModelStates``: the
    parameter shards, the gradient shards, Adam's exp_avg and exp_avg_sq, and max_exp_avg_sq with amsgrad,
    each in the module dtype) of at least ``numel`` / S elements each, ``numel`` being the (TP-local)
    parameters: rank 0's shard of a (d0, *rest) parameter is ceil(d0 / S) full rows (``param.shard_rows``), at
    least its numel / S. 0 with ``CPUOffloadPolicy`` (the states live on the host)."""
    from zeroplan.engines.fsdp2.states import adam_moments
    from zeroplan.formulas.dtypes import dtype_bytes

    if settings.offload_policy == "cpu":
        return 0
    return numel * (2 + adam_moments(settings)) * dtype_bytes(settings.module) // s


def gathered_floor(numel: int, settings: Settings) -> int:
    """A lower bound on the predicted peak of a run with ``reshard_after_forward=False`` (0 otherwise): no
    unit is resharded after its forward (torch 2.13 ``_fsdp_param_group.py``: ``FSDPParamGroup.post_forward``
    calls ``reshard``, which returns in forward unless ``_reshard_after_forward``), so at the loss every unit's
    unsharded parameters are live (``moments.forward_moments``: "unsharded parameters (root)", "(block i)"),
    each unit's all-gather output of ``padded_shard_numel`` x S >= its numel elements in the param dtype
    (``MixedPrecisionPolicy.param_dtype``, else the module dtype), ``numel`` being the (TP-local) parameters."""
    from zeroplan.formulas.dtypes import dtype_bytes

    return numel * dtype_bytes(settings.param) if settings.reshard_after_forward is False else 0


def possible_sizes(sizes: tuple[int, ...], numel: int, settings: Settings, capacity: int) -> tuple[int, ...]:
    """``sizes`` (ascending) less those whose ``states_floor`` alone exceeds ``capacity``: none of them can fit,
    so ``smallest_fitting`` over the rest finds the same group with fewer estimates. The largest is kept (its
    estimate is the answer when none fits); the floor shrinks as S grows, so the rest is a suffix."""
    return (*(s for s in sizes[:-1] if states_floor(numel, s, settings) <= capacity), sizes[-1])


def mesh_pins(settings: Settings, nd: int) -> tuple[tuple[str, object], ...]:
    """``Candidate.pins``: the mesh a candidate runs on as given options (T; R and S, R = 1 the flat group), so
    that no search runs again (``planner_plan``); at T = 1 without ``loss_parallel``, which the search dropped
    there (``tp_estimate.at_degree``)."""
    t = settings.tp or 1
    r, s = shard_groups(settings, nd // t)
    return (("tp", t), *((("loss_parallel", None),) if t == 1 else ()), ("dp_replicate", r), ("dp_shard", s))


def mesh_names(r: int) -> tuple[str, ...]:
    """The mesh's dimension names: torchtitan's (``parallel_dims.py``); one dimension for a flat run."""
    return ("dp_replicate", "dp_shard") if r > 1 else ("dp_shard",)


def allreduce_held(units: int, nbytes: int) -> tuple[Term, ...]:
    """HSDP: the reduce-dtype all-reduce buffers of the ``units`` units reduced so far (their reduce-scatter outputs,
    ``nbytes`` in all: S_u elements in the reduce dtype each, which the all-reduce runs on in place), held in
    ``_all_reduce_state`` until ``finalize_backward``; only with replicas and a reduce dtype other than the module
    dtype, where the buffer is not the sharded gradient (``holds_allreduce``, ``with_allreduce_held``)."""
    return (Term(f"HSDP all-reduce buffers held ({units} unit(s), reduce dtype)", nbytes,
                 SRC + "_fsdp_param_group.py:FSDPParamGroup._all_reduce_state (foreach_reduce's all_reduce_input)",
                 units),)  # fmt: skip


def holds_allreduce(run) -> bool:
    """Whether ``run``'s backward holds all-reduce buffers (``allreduce_held``: replicas, and a reduce dtype
    other than the module dtype), which grow with every unit reduced."""
    return run.replicate > 1 and run.settings.reduce != run.settings.module


def with_allreduce_held(run, backward: tuple[Moment, ...], dropped: str | None = None) -> tuple[Moment, ...]:
    """The backward moments of ``run`` with the all-reduce buffers of the units reduced before each
    (``allreduce_held``): a unit counts from the moment after its cast (``moments.reduce_scatter_moments``;
    during the cast its buffer is the reduce-scatter output, already a term), whatever the wrapping. A flat
    run's moments come back unchanged. ``dropped``: moments whose name holds it are read for their units'
    reduce-scatter outputs only and left out (``moments.NOT_BUILT``: the blocks a sampled profile does not
    build); the held term is made only for a moment that keeps it, once per change (a speed-up, no rule: the
    same term, by value, as one made at every change; a reduced moment's terms picked by name in C: a speed-up)."""
    from itertools import compress, repeat
    from operator import attrgetter

    if not holds_allreduce(run):
        return backward
    reduced: dict[str, int] = {}  # by name: a unit's output may be listed again in a later unit's moments
    out, held, total, stale, names, prefix = [], (), 0, False, attrgetter("name"), "reduce-scatter output"
    for m in backward:
        name = m.name
        if dropped is None or dropped not in name:
            if stale:  # the units reduced changed since the term was last made
                held, stale = allreduce_held(len(reduced), total), False
            out.append(Moment(m.phase, name, m.terms + held) if held else m)
        if name.endswith(REDUCED):  # ``held`` changes only here
            terms = m.terms
            for t in compress(terms, map(str.startswith, map(names, terms), repeat(prefix))):
                total += t.bytes - reduced.get(t.name, 0)  # their bytes summed as they come
                reduced[t.name] = t.bytes
            stale = bool(reduced)
    return tuple(out)


def mesh_snippet(r: int, s: int, device: str = "cuda") -> str:
    """The ``init_device_mesh`` line for R x S (a flat run: one dimension of S)."""
    if r == 1:
        return f"mesh = init_device_mesh({device!r}, ({s},), mesh_dim_names=(\"dp_shard\",))\n"
    return (f"mesh = init_device_mesh({device!r}, ({r}, {s}), mesh_dim_names=(\"dp_replicate\", \"dp_shard\"))"
            f"  # HSDP: shards over {s} ranks, gradients all-reduced over {r} replicas\n")
