"""The sweep's grid without pandas: its axes and slices (numpy int64), the activation column, and the
engine answers a frame is built from, cached per (N_d, micro-batch, stage): a one-row engine's
``StageEstimate`` and any engine's peaks. ``zeroplan.sweeping.grid`` (the one planner module that imports
pandas) turns them into frames."""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Optional

import numpy as np

from zeroplan.allocator.reserved import ReservedEstimate, engine_reserved
from zeroplan.engines import get_engine
from zeroplan.estimation.estimate import stage_estimates
from zeroplan.estimation.records import StageEstimate
from zeroplan.estimation.workload import model_workload
from zeroplan.formulas.activations import activation_bytes
from zeroplan.formulas.peak import PeakEstimate
from zeroplan.sweeping.config import SweepConfig

CHUNK_ROWS = 2**17
"""Rows per frame of ``sweep_frames`` (about 50 MB of DataFrame): what the command holds at a time."""


def grid_axes(config: SweepConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """params, then the (gpus, model_parallel) pairs where N_m divides gpus (gpus-major), then
    micro-batches."""
    values = [int(p) for p in config.params] if config.params else [sum(config.numels)]
    params = np.array(values, dtype=np.int64)
    g, m = np.array(config.gpus, dtype=np.int64), np.array(config.model_parallel, dtype=np.int64)
    gi, mi = np.nonzero(g[:, None] % m[None, :] == 0)
    return params, g[gi], m[mi], np.array(config.micro_batch, dtype=np.int64)


def n_configurations(config: SweepConfig) -> int:
    """Configurations of the grid (rows = this x the (stage, offload) pairs)."""
    params, g, _, b = grid_axes(config)
    return params.size * g.size * b.size


def grid_slice(config: SweepConfig, start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
    """Configurations ``start`` to ``stop`` of the grid in order (params slowest, then gpus, model_parallel,
    micro_batch), as int64 arrays; combinations where N_m does not divide gpus are not in the grid."""
    params, g, m, b = grid_axes(config)
    n = params.size * g.size * b.size
    index = np.arange(start, n if stop is None else min(stop, n), dtype=np.int64)
    i_params, rest = np.divmod(index, g.size * b.size)
    i_pair, i_batch = np.divmod(rest, b.size)
    return {
        "params": params[i_params], "gpus": g[i_pair], "model_parallel": m[i_pair], "micro_batch": b[i_batch]
    }


def activation_column(config: SweepConfig, m: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bytes, known) per configuration: ``formulas.activations`` once per distinct (N_m, micro-batch),
    with N_m taken as tensor parallelism as ``zeroplan.plan`` does; unknown without a model."""
    out, known = np.zeros(m.shape, dtype=np.int64), np.zeros(m.shape, dtype=bool)
    if config.model is None:
        return out, known
    for nm in config.model_parallel:
        for mb in config.micro_batch:
            value = activation_bytes(config.spec, config.sequence_length, mb, config.checkpointing, nm)
            if value is not None:
                where = (m == nm) & (b == mb)
                out[where], known[where] = value, True
    return out, known


class StagePeak(NamedTuple):
    """One stage's peak columns: the engine's peak, the rank it is on (``EngineEstimate.peak_rank``; None: every
    rank alike) and the allocator model's reserved bytes (None: the engine has no trace)."""

    peak: PeakEstimate
    peak_rank: Optional[int]
    reserved: Optional[ReservedEstimate]


@lru_cache(maxsize=4096)
def stage_peaks(config: SweepConfig, nd: int, micro_batch: int) -> dict[int, StagePeak]:
    """{stage: its peak, peak rank and reserved bytes} of the engine for one (N_d, micro-batch) of the grid
    (``zeroplan.engines``; reserved: the allocation trace replayed under ``config.alloc_conf``, as ``estimate``)."""
    engine = get_engine(config.engine)
    workload = model_workload(config.spec, config.sequence_length, micro_batch, config.checkpointing, 1,
                              config.foreach)  # fmt: skip
    settings = engine.planner_settings(config.planner_options())
    rows = engine.estimate(workload, nd, settings)
    reserved = engine_reserved(engine, workload, nd, settings, config.alloc_conf) or (None,) * len(rows)
    return {r.stage: StagePeak(r.peak, r.peak_rank, held) for r, held in zip(rows, reserved, strict=True)
            if r.peak is not None}


@lru_cache(maxsize=64)
def peak_possible(config: SweepConfig) -> bool:
    """Whether the grid gets peak columns: the engine's peak model covers its runs (``Engine.peak_limits``;
    rows with N_m > 1 get none, ``grid._peaks``)."""
    engine = get_engine(config.engine)
    return engine.peak_limits(config.planner_options(), config.spec, config.checkpointing) is None


@lru_cache(maxsize=4096)
def engine_row(config: SweepConfig, nd: int, micro_batch: int, stage: int | None) -> StageEstimate:
    """One configuration of a one-row engine (``Engine.one_row``) as a ``StageEstimate``: model states,
    collectives and peak from ``Engine.estimate``, "vs DP" against the reference stage 0 in the engine's
    byte convention, and its offload (``EngineEstimate.host``: DeepSpeed offload_optimizer/offload_param, FSDP2
    CPUOffloadPolicy), as ``zeroplan.estimate`` computes them."""
    engine = get_engine(config.engine)
    workload = model_workload(config.spec, config.sequence_length, micro_batch, config.checkpointing, 1,
                              config.foreach)  # fmt: skip
    settings = engine.planner_settings(config.planner_options(stage))
    (row,) = engine.estimate(workload, nd, settings)
    (reserved,) = engine_reserved(engine, workload, nd, settings, config.alloc_conf) or (None,)
    (dp,) = stage_estimates(config.numels, nd, engine.policy(settings), (0,), None, True)
    budget = config.budget_bytes
    fits = None if budget is None else row.model_states_bytes <= budget
    reduction = dp.memory.model_states_bytes / row.model_states_bytes if row.model_states_bytes else None
    return StageEstimate(row.stage, row.label, row.memory, reduction, row.collectives, fits, row.peak, None,
                         row.peak_rank, reserved, row.host)


def whole_lists(*lists: object) -> bool:
    """Each of ``lists`` is None or a list/tuple of whole numbers >= 1 (else the config refuses it by name)."""
    return all(v is None or (isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool)
               and x >= 1 for x in v)) for v in lists)  # fmt: skip
