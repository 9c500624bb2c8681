"""``estimate`` of FSDP2 with tensor parallelism (``Settings.tp`` = T > 1): the flat or HSDP profile of the
TP-local model (engines/fsdp2/tp.py) on N_d / T data-parallel ranks, plus the TP collectives of every
micro-step over the ``tp`` group."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from zeroplan.engines.fsdp2.collectives import one_row
from zeroplan.engines.fsdp2.memo import by_identity
from zeroplan.engines.fsdp2.tp import (check_plan, colwise_inputs, local_shapes, local_spec, norm_grad_collectives,
                                       tp_collectives)  # fmt: skip
from zeroplan.formulas.collectives import Collective, counted_rows
from zeroplan.formulas.peak import PeakEstimate, PhasePeak, Term


def tp_workload(workload, t: int):
    """The workload one TP rank trains: TP-local parameter shapes and the TP-local architecture."""
    try:
        shapes, spec = _local(workload.shapes, workload.spec, t)
    except TypeError:  # unhashable shapes (lists): built each time
        shapes, spec = local_shapes(workload.shapes, t), local_spec(workload.spec, t)
    return replace(workload, shapes=shapes, spec=spec)


@by_identity  # one shapes tuple for every candidate, shard group and rank of a plan at one T: not hashed (a speed-up)
def _local(shapes, spec, t: int):
    return local_shapes(shapes, t), local_spec(spec, t)


def tp_rows(workload, settings) -> tuple[Collective, ...]:
    """The TP collectives of one optimizer step: ``tp_collectives`` in every micro-step (``grad_accum`` of
    them), the norms' gradient all-reduces once (``norm_grad_collectives``: FSDP2's reduction)."""
    spec = workload.spec
    # activations and autograd's gradients in the param dtype (FSDPParam.init_dtype_attrs)
    return _tp_rows(spec.n_layer, workload.micro_batch * workload.seq_len, spec.d_model, settings.param,
                    settings.tp, settings.sequence_parallel, workload.checkpointing != "none",
                    workload.grad_accum, None if settings.loss_parallel else spec.vocab_size,
                    colwise_inputs(settings.tp_plan))  # fmt: skip


@lru_cache(maxsize=64)  # the same for every candidate and rank of a plan at one T (a speed-up: plan's mesh search)
def _tp_rows(n_layer: int, tokens: int, d_model: int, dtype: str, t: int, sequence_parallel: bool,
             checkpointing: bool, grad_accum: int, vocab: int | None, colwise_inputs: int) -> tuple[Collective, ...]:
    made: dict = {}  # equal rows as one object, without a UnitCollective each (collectives.one_row: a speed-up)

    def rows(m: int):  # the rows of m micro-steps, from a UnitCollective's fields (over the tp group, T ranks)
        return lambda op, phase, unit, elements, dtype, t, dim: one_row(made, op, phase, elements, dtype, t, dim, m)

    return (*tp_collectives(n_layer, tokens, d_model, dtype, t, sequence_parallel, checkpointing, vocab,
                            colwise_inputs, rows(grad_accum)),
            *norm_grad_collectives(n_layer, d_model, dtype, t, sequence_parallel, rows(1)))  # fmt: skip


def mesh_rank_map(settings, nd: int) -> tuple[Term, ...]:
    """The 2-D mesh's rank map, with ``device`` cpu: ``init_device_mesh`` keeps the world's ranks as one int32
    tensor on the host (torch 2.13 ``distributed/device_mesh.py``: ``DeviceMesh.__init__``, ``torch.tensor(mesh,
    device="cpu", dtype=torch.int)`` flattened to ``_rank_map``), which every slice (``mesh["tp"]``,
    ``mesh["dp_shard"]``) shares (``_create_sub_mesh``: ``_rank_map=root_mesh._rank_map``): 4·N_d bytes on every
    rank, from init on. Made before the model, but MemTracker counts it from its first use by DTensor in init
    (``DeviceMesh.mesh`` views it): measured, an int32 (4,) tensor held by the DeviceMesh objects at world 4 (16 B
    in every phase of every rank), (8,) at world 8 (dp_shard 4 x tp 2; 4·(S + T) would be 24 B). On
    CUDA it is host memory, outside the GPU's peak (none). Not DTensor's RNG state: on CPU there is none
    (``_random.py``: ``OffsetBasedRNGTracker`` refuses a cpu mesh, ``is_rng_supported_mesh`` is False)."""
    if settings.device != "cpu":
        return ()
    return (Term("device mesh rank map (int32, host)", 4 * nd, "distributed/device_mesh.py:DeviceMesh._rank_map"),)


def with_resident(peak: PeakEstimate | None, terms: tuple[Term, ...]) -> PeakEstimate | None:
    """``peak`` with ``terms`` live in every phase, init included (held from before the model is built)."""
    if peak is None or not terms:
        return peak
    extra = sum(t.bytes for t in terms)
    phases = tuple(PhasePeak(p.phase, p.bytes + extra, p.moment, (*p.terms, *terms)) for p in peak.phases)
    return PeakEstimate(phases, peak.peak_bytes + extra, peak.peak_phase, peak.peak_terms)


def tp_local(workload, nd: int, settings):
    """(the TP-local workload, the data-parallel ranks N_d / T, the settings of the data-parallel rank of
    ``settings.rank``): what one TP rank runs, ``check_plan`` passed. ``settings`` keeps ``tp`` (the
    SP activations, the label)."""
    t = settings.tp
    check_plan(workload.spec, t, nd, workload.seq_len, settings.sequence_parallel)
    rank = None if settings.rank is None else settings.rank // t
    return tp_workload(workload, t), nd // t, settings.model_copy(update={"rank": rank})


def tp_estimate(workload, nd: int, settings, estimate, made: dict | None = None, collectives: bool = True,
                over: int | None = None):
    """The rows of ``estimate`` (FSDP2's, passed in: no import cycle) for T = ``settings.tp`` on ``nd`` GPUs:
    global rank r is TP rank r mod T of data-parallel rank r // T (``tp`` innermost), and every TP rank of a
    data-parallel rank holds the same (``check_plan``), so a row's rank is its data-parallel rank times T.
    ``made``: filled with {data-parallel rank: its TP-local run}; ``collectives`` False: none; ``over``: no row where
    the peak is proven over it (``plan.estimate``; the rank map below only adds)."""
    t = settings.tp
    rows = estimate(*tp_local(workload, nd, settings), made, collectives, over)  # the data-parallel profile (dp_estimate)
    extra, ranks = tp_rows(workload, settings) if collectives else (), mesh_rank_map(settings, nd)
    return tuple(replace(r, collectives=(*r.collectives, *extra), peak=with_resident(r.peak, ranks),
                         beside_states=(*r.beside_states, *ranks),
                         peak_rank=None if r.peak_rank is None else r.peak_rank * t)
                 for r in rows)  # fmt: skip


def tp_mesh(settings, nd: int):
    """``mesh.resolve_mesh`` on the data-parallel ranks N_d / T; with TP the shard group S is always named
    (the snippet's ``init_device_mesh`` needs it)."""
    from zeroplan.engines.fsdp2.mesh import resolve_mesh, shard_groups

    t = settings.tp or 1
    if t == 1:
        return resolve_mesh(settings, nd)
    if nd % t:
        raise ValueError(f"tp={t}: must divide the GPUs ({nd})")
    resolved = resolve_mesh(settings, nd // t)
    if resolved.dp_replicate:
        return resolved
    return resolved.model_copy(update={"dp_shard": shard_groups(resolved, nd // t)[1]})


def at_degree(own: dict, t: int) -> dict:
    """The engine's own options at TP degree ``t`` of a search: ``tp`` None at 1, where ``loss_parallel`` (a
    setting of the TP plan's head, ``tp_loss.check_loss_parallel``) does not apply and is dropped."""
    if t > 1:
        return {**own, "tp": t}
    return {**{k: v for k, v in own.items() if k != "loss_parallel"}, "tp": None}


def tp_search(workload, nd: int, capacity_bytes: int, options, plan):
    """``plan --tp auto``: ``plan`` (FSDP2's ``mesh_plan``) at each TP degree of ``tp.tp_sizes`` (within a
    node, dividing the GPUs, held by the plan), smallest first; the first that recommends a candidate, else the
    largest degree's plan. Smaller first: TP's collectives carry every micro-step's activations."""
    from zeroplan.engines.fsdp2.tp import tp_sizes
    from zeroplan.formulas.mesh import DEFAULT_GPUS_PER_NODE

    node = options.own.get("gpus_per_node") or DEFAULT_GPUS_PER_NODE
    own = {k: v for k, v in options.own.items() if k != "tp"}
    result = None
    sp = options.own.get("sequence_parallel", True) is not False
    for t in tp_sizes(workload.spec, nd, node, workload.seq_len, sp):
        result = plan(workload, nd, capacity_bytes, replace(options, own=at_degree(own, t)))
        if result.recommended is not None:
            return result
    return result


def inter_node_bytes(collectives, nd: int, gpus_per_node: int) -> int:
    """Bytes one rank sends per optimizer step over collectives whose group crosses a node (``link`` inter:
    ``formulas.collectives.on_mesh`` places each on the mesh its rows name, tp innermost; one of each
    (dimension, group size) placed, every row of it on the same link). Summed over the distinct rows times
    their counts (``counted_rows``: integers, exact)."""
    counted = counted_rows(collectives)
    return _inter(counted, _links(tuple(c for c, _ in counted), nd, gpus_per_node))


def _inter(counted: tuple, links: dict) -> int:
    """The bytes of the ``counted_rows`` whose (dimension, group size) ``links`` puts across nodes."""
    return sum(c.bytes_per_rank * n for c, n in counted if links[(c.mesh_dim, c.group_size)] == "inter")


def _links(collectives, nd: int, gpus_per_node: int) -> dict:
    """{(dimension, group size): its link class} of ``collectives`` placed by ``on_mesh``, one row of each."""
    from zeroplan.formulas.collectives import on_mesh

    kinds = {(c.mesh_dim, c.group_size): c for c in collectives}
    return {k: c.link for k, c in zip(kinds, on_mesh(tuple(kinds.values()), nd, 1, gpus_per_node))}


def row_inter_node_bytes(workload, settings, run, nd: int, gpus_per_node: int) -> int:
    """``inter_node_bytes`` of the row ``plan.with_collectives`` gives (``run``'s collectives, then with TP the TP
    group's, ``tp_rows``), the TP rows built only if their group crosses a node: every one is of one kind ("tp",
    T) (``_tp_rows``), placed by a row of that kind that sends nothing (``on_mesh`` reads a row's dimension and
    group size, and the mesh from the replicas' and TP's group sizes: the same with one TP row as with all)."""
    from zeroplan.engines.fsdp2.collectives import run_collectives

    counted, t = counted_rows(run_collectives(run, workload.grad_accum)), settings.tp or 1
    rows = tuple(c for c, _ in counted)
    if t == 1:
        return _inter(counted, _links(rows, nd, gpus_per_node))
    links = _links((*rows, Collective("all-reduce", "forward", 0, settings.param, 0, mesh_dim="tp", group_size=t)),
                   nd, gpus_per_node)  # fmt: skip
    tp = sum(c.bytes_per_rank * n for c, n in counted_rows(tp_rows(workload, settings))) if links["tp", t] == "inter" else 0
    return _inter(counted, links) + tp


def _in_plan(workload, t: int) -> bool:
    """Whether every parameter is in torchtitan's llama TP plan (``tp.local_shape``; a module tree of other
    names, a live model's, is planned without TP by the default search)."""
    try:
        tp_workload(workload, t)
    except ValueError:
        return False
    return True


def mesh_search(workload, nd: int, capacity_bytes: int, options, plan, first_fit):
    """``plan --tp auto --dp-shard auto`` (``plan``'s default): replicate x shard x tp. Each TP degree of
    ``tp.tp_sizes`` (within a node) is planned with ``--dp-shard auto`` (each candidate on the smallest shard group
    of whole nodes that fits, HSDP across the rest: ``mesh.shard_sizes`` on the N_d / T data-parallel ranks, G / T
    per node); of the degrees whose plan recommends a candidate, the winner is the one whose recommendation comes
    first in the plan's order (the same fit rule: cheapest candidate that fits), then the fewest bytes per rank on
    links across nodes (``inter_node_bytes``), then the smaller T. None fits: the largest degree's plan.

    In two passes, each configuration estimated once (``memo``): first each degree, largest T first, up to its
    first candidate that fits on its largest shard group (the flat data-parallel group; ``first_fit``,
    ``plan.first_fit`` passed in: it skips a candidate whose gathered parameters, or without checkpointing whose
    saved activations, alone cannot fit), which is its first candidate that fits on any
    (``mesh.smallest_fitting``'s premise: a larger group never holds more), and no further than the earliest first fit of the degrees before it (``upto``: a later one cannot win, the first
    key); then only the degrees whose first fit is the earliest search their shard groups for that candidate
    alone (``only``: those before it fit on no group), peaks only (``row_inter_node_bytes`` for the one
    compared); the winner is planned in full. The plan's ``order`` says what each degree gave."""
    from zeroplan.engines.fsdp2.mesh import AUTO
    from zeroplan.engines.fsdp2.tp import tp_sizes
    from zeroplan.formulas.mesh import DEFAULT_GPUS_PER_NODE

    node = options.own.get("gpus_per_node") or DEFAULT_GPUS_PER_NODE
    sp = options.own.get("sequence_parallel", True) is not False
    memo: dict = {}  # (settings, checkpointing) -> estimate, across both passes (plan_options)

    def at(t: int, shard, until_fit: bool = True, only: int | None = None):  # until_fit: the ranking's, peaks only
        own = {**at_degree(options.own, t), "dp_shard": shard}
        return plan(workload, nd, capacity_bytes, replace(options, own=own), until_fit=until_fit, memo=memo,
                    peaks_only=until_fit, only=only)  # fmt: skip

    degrees = tuple(t for t in tp_sizes(workload.spec, nd, node, workload.seq_len, sp)
                    if t == 1 or _in_plan(workload, t))  # fmt: skip
    first: dict = {}  # T -> (its first fit on the flat data-parallel group or None, candidates tried)
    earliest = None
    for t in reversed(degrees):  # the largest T holds the least: its first fit bounds the others' early
        first[t] = first_fit(workload, nd, capacity_bytes, replace(options, own={**at_degree(options.own, t),
                                                                                 "dp_shard": None}), memo, earliest)
        earliest = first[t][0] if first[t][0] is not None else earliest
    tried = []
    for t in degrees:
        if earliest is None or first[t][0] != earliest:  # none fits, or not by the earliest: cannot win
            tried.append((t, None, first[t]))
            continue
        result = at(t, AUTO, only=earliest)  # the same first fit, on its smallest shard group (none before it fits)
        chosen = result.candidates[0]
        w, _, s, run = chosen.trace_inputs  # its collectives, which the ranking left out (plan.with_collectives)
        tried.append((t, result, row_inter_node_bytes(w, s, run, nd, node)))
    searched = [x for x in tried if x[1] is not None]
    t = min(searched, key=lambda x: (x[2], x[0]))[0] if searched else degrees[-1]
    best = at(t, AUTO, until_fit=False)  # every candidate

    def said(t: int, result, inter) -> str:
        if result is None:
            k, n = inter
            return (f"tp {t}: candidate {k + 1} (later: not searched)" if k is not None else
                    f"tp {t}: nothing fits up to candidate {n} (later: not searched)" if earliest is not None else
                    f"tp {t}: none fits")  # fmt: skip
        s = result.candidates[0].trace_inputs[2]
        mesh = f"{s.dp_replicate} x {s.dp_shard}" if s.dp_replicate else f"{nd // t}"
        return f"tp {t}: candidate {earliest + 1} on dp {mesh}, {inter / 1e9:.3g} GB/rank across nodes"

    summary = "; ".join(said(*x) for x in tried)
    return replace(best, order=f"{best.order}; mesh searched (tp within a node of {node}, shard groups of whole "
                               f"nodes; ranked by the first candidate whose live peak fits, in that order, then "
                               f"bytes across nodes): {summary}; chose tp {t}")
