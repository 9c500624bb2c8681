"""FSDP2's step as an ordered allocation trace (``zeroplan.allocator.step_trace``): its moments walked in order,
each tensor on the stream FSDP2 allocates it on (torch 2.13, ``_fully_shard/``):

- all-gather copy-in and output: ``all_gather_copy_in_stream`` (``_fsdp_collectives.py:foreach_all_gather``,
  ``with device_handle.stream(all_gather_copy_in_stream)``; ``_fsdp_param_group.py:get_all_gather_streams``:
  the separate streams in forward and pre-backward);
- reduce-scatter output, its cast to the module dtype and so the sharded gradients (views into it):
  ``reduce_scatter_stream`` (``foreach_reduce``, ``with device_handle.stream(reduce_scatter_stream)``); the
  reduce-scatter input is allocated before that block, on the default stream;
- everything else (shards, unsharded parameters of the copy-out, activations, Adam): the default stream.

The caching allocator keeps one pool per stream: a block cached by the all-gather stream is never handed to a
default-stream tensor, which is what makes FSDP2's reserved bytes grow beyond its allocated ones."""

from __future__ import annotations

from zeroplan.allocator.step_trace import AllocTrace, step_trace
from zeroplan.engines.base import Workload
from zeroplan.engines.fsdp2.moments import moments
from zeroplan.engines.fsdp2.settings import Settings
from zeroplan.engines.fsdp2.terms import Fsdp2Run
from zeroplan.formulas.cuda_workspaces import library_workspaces
from zeroplan.formulas.peak import CUDA_BLOCK_BYTES, Term

DEFAULT, ALL_GATHER, REDUCE_SCATTER = 0, 1, 2
STREAMS = {DEFAULT: "default", ALL_GATHER: "all_gather_copy_in_stream", REDUCE_SCATTER: "reduce_scatter_stream"}
_BY_PREFIX = (("all-gather copy-in", ALL_GATHER), ("all-gather output", ALL_GATHER),
              ("reduce-scatter output", REDUCE_SCATTER), ("gradient cast to the module dtype", REDUCE_SCATTER),
              ("gloo reduce-scatter copy", REDUCE_SCATTER), ("sharded gradients of", REDUCE_SCATTER))  # fmt: skip


def stream_of(term: Term) -> int:
    """The stream a term's tensors are allocated on (the module docstring); each name looked up once (a
    speed-up: the trace asks every term of every moment, ~250,000 times for llama3-405b's plan)."""
    try:
        return _STREAM_OF_NAME[term.name]
    except KeyError:
        name = term.name
        # most names start with none of the prefixes: one ``startswith`` of them all (in C) says so
        out = _STREAM_OF_NAME[name] = DEFAULT if not name.startswith(_PREFIXES) else \
            next(s for prefix, s in _BY_PREFIX if name.startswith(prefix))
        return out


_STREAM_OF_NAME: dict[str, int] = {}
_PREFIXES = tuple(prefix for prefix, _ in _BY_PREFIX)


def alloc_traces(workload: Workload, nd: int, settings: Settings,
                 run: Fsdp2Run | None = None) -> tuple[AllocTrace, ...]:
    """The trace of ``estimate``'s one row (needs an architecture): of the rank it describes (``settings.rank``,
    else the one it names as peaking highest, ``EngineEstimate.peak_rank``), on its HSDP shard group; ``run``:
    that rank's run as the estimate made it (the plan's ``Candidate.trace_inputs``), not built again."""
    from zeroplan.engines.fsdp2.mesh import resolve_mesh
    from zeroplan.engines.fsdp2.plan import estimate, rank_run
    from zeroplan.engines.fsdp2.tp_estimate import tp_local

    if run is not None:
        return _trace(run)
    if (settings.tp or 1) > 1:  # FSDP2 + TP: the TP-local run of the rank described (engines/fsdp2/tp_estimate.py)
        rank = settings.rank if settings.rank is not None else estimate(workload, nd, settings)[0].peak_rank or 0
        workload, nd, settings = tp_local(workload, nd, settings.model_copy(update={"rank": rank}))
    settings = resolve_mesh(settings, nd)
    if settings.rank is None:
        (row,) = estimate(workload, nd, settings)
        settings = settings.model_copy(update={"rank": row.peak_rank or 0})
    return _trace(rank_run(workload, nd, settings)[0])


def _trace(run: Fsdp2Run) -> tuple[AllocTrace, ...]:
    """The allocation trace of one rank's run: its moments walked in order, on their streams."""
    if run.acts is None:
        raise ValueError("an allocation trace needs an architecture (activations): give a model")
    settings = run.settings
    if settings.device != "cuda":
        return (step_trace(moments(run), stream_of=stream_of),)
    resident = (library_workspaces(settings.cuda_capability, run.biased_linear),)
    return (step_trace(moments(run), CUDA_BLOCK_BYTES, resident, stream_of),)
