"""Sweeps: ``zeroplan.estimate`` over a grid of configurations, as one pandas DataFrame.

The grid is evaluated in one pass of numpy int64 arrays through the very functions ``estimate`` uses
(``zeroplan.estimation.estimate.stage_estimates``, hence ``sharding``, ``memory`` and ``collectives``):
no formula is written twice, so a sweep row and ``estimate(...)`` cannot drift (``tests/test_sweep.py``
checks it row by row).
A million rows take about a second (``benchmarks/sweep_speed.py``). The rows are built as numpy
``Columns`` (``zeroplan.sweeping.columns``); this is the one planner module that imports pandas, in
``to_frame``, so the CSV writer never loads it.

Byte counts stay exact integers: int64 holds 9.2e18, and the largest count here is bounded by
64 bytes per parameter (``zeroplan.types.MAX_PARAMS`` keeps that below 2**63).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from zeroplan.engines import get_engine, split_keywords
from zeroplan.estimation.estimate import stage_estimates
from zeroplan.estimation.records import StageEstimate
from zeroplan.formulas.collectives import Collective
from zeroplan.formulas.offload import NO_OFFLOAD, Offload
from zeroplan.formulas.peak import PHASES
from zeroplan.formulas.sharding import shard_numel
from zeroplan.formulas.stages import STAGES
from zeroplan.planning.plan import rank_states
from zeroplan.policy import PrecisionPolicy
from zeroplan.sweeping.axes import (CHUNK_ROWS, activation_column, engine_row, grid_slice, n_configurations,
                                    peak_possible, stage_peaks, whole_lists)
from zeroplan.sweeping.columns import Columns, Labels, Masked, labels
from zeroplan.sweeping.config import SweepConfig
from zeroplan.sweeping.host import host_columns
from zeroplan.sweeping.records import SweepRow

if TYPE_CHECKING:
    import pandas as pd

COLUMNS: tuple[str, ...] = tuple(SweepRow.model_fields)
"""Columns of a sweep, in order: the fields of ``zeroplan.sweeping.records.SweepRow``."""


def collectives_summary(collectives: Sequence[Collective]) -> str:
    """One string for a step's collectives, e.g. 'reduce-scatter(backward) + all-gather(optimizer step)';
    kinds issued several times (FSDP2: one per unit) are counted: '13 x all-gather(forward) + ...'."""
    counts: dict[str, int] = {}
    for c in collectives:
        key = f"{c.op}({c.phase})"
        counts[key] = counts.get(key, 0) + 1
    return " + ".join(key if n == 1 else f"{n} x {key}" for key, n in counts.items())


def _collectives_column(sweep_rows: list, nd: np.ndarray) -> Labels:
    """The summary per row: a stage's list, or '' where N_d = 1 (nothing is sent, as in ``estimate``)."""
    categories = [""]
    for row in sweep_rows:
        if (label := collectives_summary(row.collectives)) not in categories:
            categories.append(label)
    codes = [np.where(nd > 1, categories.index(collectives_summary(r.collectives)), 0) for r in sweep_rows]
    return Labels(np.stack(codes, axis=1).ravel(), tuple(categories))


def _peaks(config: SweepConfig, nd, m, b, stage, offload_none) -> dict[str, np.ndarray]:
    """The peak columns' arrays per row (bytes, phase code, rank, reserved bytes, each with a known mask):
    rows without offload and with N_m = 1 (``axes.stage_peaks``, cached per N_d and micro-batch)."""
    out = {key: np.zeros(nd.shape, dtype=np.int64) for key in ("peak", "phase", "rank", "reserved")}
    known = {key: np.zeros(nd.shape, dtype=bool) for key in ("peak", "rank", "reserved")}
    if not peak_possible(config):
        return out | {f"{k}_known": v for k, v in known.items()}
    rows = np.flatnonzero((m == 1) & offload_none)
    for i in rows:
        row = stage_peaks(config, int(nd[i]), int(b[i])).get(int(stage[i]))
        if row is not None:
            out["peak"][i], out["phase"][i], known["peak"][i] = (row.peak.peak_bytes,
                                                                 1 + PHASES.index(row.peak.peak_phase), True)
            if row.peak_rank is not None:
                out["rank"][i], known["rank"][i] = row.peak_rank, True
            if row.reserved is not None:
                out["reserved"][i], known["reserved"][i] = row.reserved.reserved_bytes, True
    return out | {f"{k}_known": v for k, v in known.items()}


def _peak_columns(peaks: dict[str, np.ndarray], budget: int | None) -> Columns:
    """The columns peak_bytes to reserved_fits from ``_peaks``'s arrays; the fits against ``budget``
    ((1 - headroom) x GPU memory; None: unknown)."""
    unknown = budget is None
    return {
        "peak_bytes": Masked(peaks["peak"], ~peaks["peak_known"]),
        "peak_phase": Labels(peaks["phase"], ("", *PHASES)),
        "peak_fits": Masked(peaks["peak"] <= (budget or 0), ~peaks["peak_known"] | unknown),
        "peak_rank": Masked(peaks["rank"], ~peaks["rank_known"]),
        "reserved_bytes": Masked(peaks["reserved"], ~peaks["reserved_known"]),
        "reserved_fits": Masked(peaks["reserved"] <= (budget or 0), ~peaks["reserved_known"] | unknown),
    }  # fmt: skip


def to_frame(columns: Columns):
    """``columns`` as the sweep's DataFrame: ``Masked`` as pandas' nullable ``Int64``/``boolean``, ``Labels``
    as ``category``, arrays as they are. pandas is imported here, when a frame is asked for."""
    import pandas as pd

    def column(c):
        if isinstance(c, Labels):
            return pd.Categorical.from_codes(c.codes, categories=list(c.categories))
        if isinstance(c, Masked):
            kind = pd.arrays.BooleanArray if c.values.dtype == bool else pd.arrays.IntegerArray
            return kind(c.values, mask=c.missing)
        return c

    return pd.DataFrame({name: column(c) for name, c in columns.items()}, columns=list(COLUMNS))


def sweep_config(config: SweepConfig):
    """One row per configuration, stage and offload, in grid order: params, gpus, model_parallel,
    micro_batch, stage, offload (the last fastest); a pandas DataFrame."""
    return to_frame(_columns(config, grid_slice(config)))


def sweep_columns(config: SweepConfig, rows: int = CHUNK_ROWS) -> Iterator[Columns]:
    """The rows of ``sweep_config(config)`` in consecutive ``Columns`` of about ``rows`` rows, in the same
    order, without pandas: for writing a large sweep with bounded memory."""
    per = len(config.engine_stages) if get_engine(config.engine).one_row else len(config.pairs)
    step = max(1, rows // per)
    for start in range(0, n_configurations(config), step):
        yield _columns(config, grid_slice(config, start, start + step))


def sweep_frames(config: SweepConfig, rows: int = CHUNK_ROWS) -> Iterator:
    """``sweep_columns`` as DataFrames (``to_frame``)."""
    return map(to_frame, sweep_columns(config, rows))


def _engine_columns(config: SweepConfig, grid: dict[str, np.ndarray]) -> Columns:
    """The rows of ``grid`` for a one-row engine: every configuration through ``Engine.estimate`` (cached
    per N_d, micro-batch and stage), in the columns and dtypes of the vectorised frame."""
    m = grid["model_parallel"]
    nd, b = grid["gpus"] // m, grid["micro_batch"]
    stages = config.engine_stages
    rows = [engine_row(config, int(n), int(mb), st) for n, mb in zip(nd, b, strict=True) for st in stages]
    k = len(stages)

    def repeat(a: np.ndarray) -> np.ndarray:
        return np.repeat(a, k)

    def ints(values) -> np.ndarray:
        return np.array(list(values), dtype=np.int64)

    n_rows = len(rows)
    peaks = {
        "peak": ints(r.peak.peak_bytes if r.peak is not None else 0 for r in rows),
        "phase": ints(1 + PHASES.index(r.peak.peak_phase) if r.peak is not None else 0 for r in rows),
        "rank": ints(r.peak_rank or 0 for r in rows),
        "reserved": ints(r.reserved.reserved_bytes if r.reserved is not None else 0 for r in rows),
        "peak_known": np.array([r.peak is not None for r in rows], dtype=bool),
        "rank_known": np.array([r.peak is not None and r.peak_rank is not None for r in rows], dtype=bool),
        "reserved_known": np.array([r.peak is not None and r.reserved is not None for r in rows], dtype=bool),
    }
    states = ints(r.memory.model_states_bytes for r in rows)
    act, known = (repeat(a) for a in activation_column(config, m, b))
    memory = config.budget_bytes
    no_memory = np.full(n_rows, memory is None)
    columns = {
        "params": repeat(grid["params"]),
        "gpus": repeat(grid["gpus"]),
        "model_parallel": repeat(m),
        "nd": repeat(nd),
        "psi": repeat(np.broadcast_to(sum(config.numels), nd.shape)),
        "micro_batch": repeat(b),
        "stage": ints(r.stage for r in rows),
        "name": labels([r.name for r in rows]),
        "params_bytes": ints(r.memory.params_bytes for r in rows),
        "grads_bytes": ints(r.memory.grads_bytes for r in rows),
        "optimizer_bytes": ints(r.memory.optimizer_bytes for r in rows),
        "model_states_bytes": states,
        "reduction_vs_dp": np.array([r.reduction_vs_dp for r in rows], dtype=np.float64),
        "fits": Masked(states <= (memory or 0), no_memory),
        "comm_volume_elements": ints(r.comm_volume_elements for r in rows),
        "comm_bytes_per_rank": ints(r.comm_bytes_per_rank for r in rows),
        "collectives": labels([collectives_summary(r.collectives) for r in rows]),
        **host_columns([r.host for r in rows]),  # the engine's own offload, as estimate's host keys
        "activation_bytes": Masked(act, ~known),
        "total_bytes": Masked(states + act, ~known),
        "total_fits": Masked(states + act <= (memory or 0), ~known | no_memory),
        **_peak_columns(peaks, memory),
    }  # fmt: skip
    return {name: columns[name] for name in COLUMNS}


def _columns(config: SweepConfig, grid: dict[str, np.ndarray]) -> Columns:
    """The rows of the configurations in ``grid`` (see ``sweep_config``)."""
    if get_engine(config.engine).one_row:
        return _engine_columns(config, grid)
    m = grid["model_parallel"]
    nd = grid["gpus"] // m
    if config.numels:
        numels = tuple(shard_numel(n, m) for n in config.numels)
    else:
        numels = (shard_numel(grid["params"], m),)
    # Ψ per model-parallel rank, rounded up per tensor as in ``zeroplan.estimation.estimate.model_numels``.
    psi = sum(numels)
    flat_layout = config.numels is not None
    by_stage = {
        r.stage: r
        for r in stage_estimates(
            numels, nd, config.policy, config.stages, config.budget_bytes, flat_layout
        )
    }
    pairs = config.pairs
    blocks = [_block(by_stage[s], o, numels, nd, config, flat_layout) for s, o in pairs]
    n_pairs = len(pairs)
    n_rows = nd.size * n_pairs

    def per_row(key: str) -> np.ndarray:
        """Interleave per-pair arrays so each configuration's rows are adjacent."""
        return np.stack([np.broadcast_to(b[key], nd.shape) for b in blocks], axis=1).ravel()

    def repeat(a: np.ndarray) -> np.ndarray:
        return np.repeat(a, n_pairs)

    def categorical(names: list[str]) -> Labels:
        per_pair = labels(names)
        return Labels(np.tile(per_pair.codes, nd.size), per_pair.categories)

    if config.gpu_memory_bytes is None:  # unknown: all missing, as ``fits: null`` in ``estimate --json``
        fits = Masked(np.zeros(n_rows, dtype=bool), np.ones(n_rows, dtype=bool))
    else:
        fits = Masked(per_row("fits"), np.zeros(n_rows, dtype=bool))
    act, known = (repeat(a) for a in activation_column(config, m, grid["micro_batch"]))
    stage_rows = np.tile(np.array([s for s, _ in pairs], dtype=np.int64), nd.size)
    offload_none = np.tile(np.array([o == NO_OFFLOAD for _, o in pairs]), nd.size)
    peaks = _peaks(config, repeat(nd), repeat(m), repeat(grid["micro_batch"]), stage_rows, offload_none)
    total = per_row("model_states_bytes") + act
    total_fits = total <= (config.budget_bytes or 0)
    columns = {
        "params": repeat(grid["params"]),
        "gpus": repeat(grid["gpus"]),
        "model_parallel": repeat(m),
        "nd": repeat(nd),
        "psi": repeat(np.broadcast_to(psi, nd.shape)),
        "micro_batch": repeat(grid["micro_batch"]),
        "stage": np.tile(np.array([s for s, _ in pairs], dtype=np.int64), nd.size),
        "name": categorical([STAGES[s].name for s, _ in pairs]),
        "offload": categorical([o.label for _, o in pairs]),
        **{key: per_row(key) for key in COLUMNS if key in blocks[0] and key != "fits"},
        "fits": fits,
        "collectives": _collectives_column([by_stage[s] for s, _ in pairs], nd),
        "activation_bytes": Masked(act, ~known),
        "total_bytes": Masked(total, ~known),
        "total_fits": Masked(total_fits, ~known | (config.gpu_memory_bytes is None)),
        **_peak_columns(peaks, config.budget_bytes),
    }
    return {name: columns[name] for name in COLUMNS}


def _block(
    row: StageEstimate,
    offload: Offload,
    numels: tuple,
    nd: np.ndarray,
    config: SweepConfig,
    flat_layout: bool,
) -> dict[str, np.ndarray]:
    """The columns of one (stage, offload) pair for the whole grid, from ``stage_estimates`` and, with
    offload, ``zeroplan.formulas.offload`` (GPU-resident states, host and NVMe bytes, host traffic)."""
    out = {
        "comm_volume_elements": np.asarray(row.comm_volume_elements, dtype=np.int64),
        "comm_bytes_per_rank": np.asarray(row.comm_bytes_per_rank, dtype=np.int64),
    }
    if offload == NO_OFFLOAD:
        memory, reduction, fits = row.memory, row.reduction_vs_dp, row.fits
        host = nvme = h2d = d2h = 0
    else:
        placed = rank_states(numels, nd, row.stage, offload, config.policy, 1, flat_layout)
        memory = placed.gpu
        total = np.asarray(memory.model_states_bytes, dtype=np.int64)
        dp_bytes = _dp_bytes(numels, nd, config, flat_layout)
        reduction = np.where(total > 0, dp_bytes / np.maximum(total, 1), np.nan)  # NaN: nothing on the GPU
        fits = (
            None if config.budget_bytes is None else memory.model_states_bytes <= config.budget_bytes
        )
        host, nvme, h2d, d2h = placed.host_bytes, placed.nvme_bytes, placed.h2d_bytes, placed.d2h_bytes
    out.update(
        params_bytes=memory.params_bytes,
        grads_bytes=memory.grads_bytes,
        optimizer_bytes=memory.optimizer_bytes,
        model_states_bytes=memory.model_states_bytes,
        reduction_vs_dp=np.asarray(reduction, dtype=np.float64),
        fits=fits,
        host_bytes=host,
        nvme_bytes=nvme,
        h2d_bytes=h2d,
        d2h_bytes=d2h,
    )
    int_keys = ("params_bytes", "grads_bytes", "optimizer_bytes", "model_states_bytes")
    for key in (*int_keys, "host_bytes", "nvme_bytes", "h2d_bytes", "d2h_bytes"):
        out[key] = np.asarray(out[key], dtype=np.int64)
    return out


def _dp_bytes(numels: tuple, nd: np.ndarray, config: SweepConfig, flat_layout: bool) -> np.ndarray:
    """Stage-0 model states, the denominator of ``reduction_vs_dp``, by the same function as ``estimate``."""
    (dp,) = stage_estimates(numels, nd, config.policy, (0,), None, flat_layout)
    return np.asarray(dp.memory.model_states_bytes, dtype=np.int64)


def sweep(
    params: Sequence[float] | None = None,
    gpus: Sequence[int] = (1,),
    *,
    model_parallel: Sequence[int] = (1,),
    stages: Sequence[int] = (0, 1, 2, 3),
    offload: Sequence[str | Offload] = ("none",),
    tensor_numels: Sequence[int] | None = None,
    model: str | None = None,
    micro_batch: Sequence[int] | None = None,
    seq_len: int | None = None,
    checkpointing: str = "full",
    foreach: bool | None = None,
    engine: str = "reference",
    gpu_memory_bytes: int | None = None,
    gpu: str | None = None,
    headroom: float = 0.0,
    alloc_conf: str = "",
    **options: object,
) -> pd.DataFrame:
    """``zeroplan.estimate`` for every combination of ``params`` x ``gpus`` x ``model_parallel``.

    Returns one row per configuration, stage and ``offload`` (columns ``COLUMNS``); byte columns are exact
    int64. ``offload`` items are ``zeroplan.parsing.parse_offload`` strings ('none', 'cpu', 'cpu/cpu', ...).
    Remaining keywords are the engine's options, as for ``estimate`` (``PrecisionPolicy`` fields for the
    reference engine). ``gpu``: a GPU preset, as for ``estimate``. ``micro_batch``: a ds_config's where it sets the batch
    (the engine's ``Engine.sweep_batches``), else as given (None: 1). ``headroom``: the fraction of GPU memory
    every ``*fits`` column keeps free; ``alloc_conf``: the ``PYTORCH_CUDA_ALLOC_CONF`` ``reserved_bytes`` are
    replayed under (needs ``model``). Raises
    ``pydantic.ValidationError`` or ValueError on bad input.
    """
    policy, engine_options = split_keywords(engine, options)
    if model is not None and engine_options.ds_config is not None and whole_lists(gpus, model_parallel, micro_batch):
        micro_batch = get_engine(engine).sweep_batches(engine_options.ds_config, tuple(gpus), tuple(model_parallel),
                                                       None if micro_batch is None else tuple(micro_batch),
                                                       "micro_batch") or micro_batch  # fmt: skip
    micro_batch = (1,) if micro_batch is None else micro_batch
    config = SweepConfig(  # the config checks and converts the sequences (a str or a number is refused)
        params=params,
        tensor_numels=tensor_numels,
        gpus=gpus,
        model_parallel=model_parallel,
        **({} if isinstance(stages, (list, tuple)) and tuple(stages) == (0, 1, 2, 3) else {"stages": stages}),  # given:
        # one row per stage (deepspeed); anything but a sequence is the config's one-line error
        offload=offload,
        model=model,
        micro_batch=micro_batch,
        seq_len=seq_len,
        checkpointing=checkpointing,
        foreach=foreach,
        engine=engine,
        gpu=gpu,
        gpu_memory_bytes=gpu_memory_bytes,
        headroom=headroom,
        alloc_conf=alloc_conf,
        policy=PrecisionPolicy(**(policy or {})),
        engine_options=engine_options,
    )
    return sweep_config(config)


