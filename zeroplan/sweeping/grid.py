"""Sweeps: ``zeroplan.estimate`` over a grid of configurations, as one pandas DataFrame.

The grid is evaluated in one pass of numpy int64 arrays through the very functions ``estimate`` uses
(``zeroplan.estimation.estimate.stage_estimates``, hence ``sharding``, ``memory`` and ``comm``): no formula is written
twice, so a sweep row and ``estimate(...)`` cannot drift (``tests/test_sweep.py`` checks it row by row).
A million rows take about a second (``benchmarks/sweep_speed.py``). This is the one planner module
that imports pandas.

Byte counts stay exact integers: int64 holds 9.2e18, and the largest count here is bounded by
64 bytes per parameter (``MAX_PARAMS`` keeps that below 2**63).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from zeroplan.estimation.estimate import stage_estimates
from zeroplan.estimation.config import EstimateConfig, PrecisionPolicy, error_line
from zeroplan.formulas.offload import DEVICES, NO_OFFLOAD, Offload, check_offload
from zeroplan.planning.plan import rank_states
from zeroplan.estimation.records import Collective, StageEstimate
from zeroplan.formulas.sharding import shard_numel
from zeroplan.formulas.stages import STAGES

SCHEMA = "zeroplan.sweep/1"
MAX_PARAMS = 2**57
"""Largest Ψ a sweep accepts (1.4e17): no per-GPU byte count exceeds 64·Ψ (at most 20 bytes of model
state per parameter, 2·4 bytes sent per parameter by an fp32 all-reduce), so int64 stays exact."""

MAX_GPUS = 2**40
"""Largest GPU count a sweep accepts; with ``MAX_PARAMS`` it keeps ring byte counts below 2**63."""

COLUMNS = (
    "params", "gpus", "model_parallel", "nd", "psi", "micro_batch", "stage", "name", "offload",
    "params_bytes", "grads_bytes", "optimizer_bytes", "model_states_bytes", "reduction_vs_dp", "fits",
    "comm_volume_elements", "comm_bytes_per_rank", "collectives",
    "host_bytes", "nvme_bytes", "h2d_bytes", "d2h_bytes",
    "activation_bytes", "total_bytes", "total_fits",
)  # fmt: skip
"""Columns of a sweep: the configuration, then the keys of ``estimate --json`` ``stages[]``
(``zeroplan.render.stage_dict``) with the collectives list summarised by ``collectives_summary``, then
where offloaded states live and the host traffic per step (``zeroplan.formulas.offload``; 0 without offload).
With offload, the memory columns are what stays in GPU memory. With a reference ``model``, activations
per GPU for each micro-batch (``zeroplan.formulas.activations``), ``total_bytes`` = GPU model states +
activations and ``total_fits``; these are empty without a model or where no estimate exists."""

OFFLOAD_HELP = (
    "offload: 'none', or OPT[/PARAMS] with each of none, cpu, nvme: where the optimizer states "
    "(and the parameters, stage 3 only) live, e.g. cpu, nvme, cpu/cpu, nvme/nvme, none/cpu"
)


def _check(**fields: object) -> None:
    """Validate one value with ``EstimateConfig``'s rules, re-raised as a one-line ValueError."""
    try:
        EstimateConfig(**fields)
    except ValidationError as exc:
        raise ValueError(error_line(exc)) from None


class SweepConfig(BaseModel):
    """A grid of planner questions: every combination of ``params`` x ``gpus`` x ``model_parallel``,
    each answered for every stage in ``stages``. Each value is checked by ``EstimateConfig``'s rules."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    params: Optional[tuple[float, ...]] = None
    """Ψ values of the whole model, in parameters; give this or ``tensor_numels``."""
    tensor_numels: Optional[tuple[int, ...]] = None
    """elements of every parameter tensor of one model (exact padding); replaces ``params``."""
    model: Optional[str] = None
    """reference model preset (``zeroplan.presets``): its tensors, and its shape for activations."""
    micro_batch: tuple[int, ...] = (1,)
    """sequences per GPU per micro-step; changes only the activation columns (needs ``model``)."""
    seq_len: Optional[int] = None
    """tokens per sequence for activations; default the preset's."""
    checkpointing: str = "full"
    """activation recomputation assumed: none, selective or full (``zeroplan.formulas.activations``)."""
    gpus: tuple[int, ...] = (1,)
    """total GPU counts = N_d x N_m."""
    model_parallel: tuple[int, ...] = (1,)
    """N_m values; combinations where N_m does not divide ``gpus`` are left out of the grid."""
    stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages (0-3) to report for every configuration."""
    offload: tuple[Offload, ...] = (NO_OFFLOAD,)
    """where states live (``parse_offload``); (stage, offload) pairs DeepSpeed lacks are left out."""
    gpu_memory_bytes: Optional[int] = None
    """memory of one GPU in bytes, for the ``fits`` column; None leaves it empty."""
    policy: PrecisionPolicy = PrecisionPolicy()

    @field_validator("gpus", "model_parallel", "stages", "micro_batch", mode="before")
    @classmethod
    def _whole(cls, v: object, info) -> object:
        if isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
                    raise ValueError(f"{info.field_name}={x!r}: must be a whole number")
            return tuple(int(x) for x in v)
        return v

    @field_validator("params", mode="before")
    @classmethod
    def _numbers(cls, v: object) -> object:
        if isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, (bool, np.bool_)) or not isinstance(
                    x, (int, float, np.integer, np.floating)
                ):
                    raise ValueError(f"params={x!r}: must be a number of parameters")
            return tuple(float(x) for x in v)
        return v

    @field_validator("offload", mode="before")
    @classmethod
    def _offload(cls, v: object) -> object:
        if isinstance(v, (list, tuple)):
            return tuple(x if isinstance(x, Offload) else parse_offload(x) for x in v)
        return v

    @field_validator("model")
    @classmethod
    def _model(cls, v: Optional[str]) -> Optional[str]:
        from zeroplan.presets import get_model

        return None if v is None else get_model(v).name

    @field_validator("micro_batch")
    @classmethod
    def _micro_batch(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        for b in v:
            if b < 1:
                raise ValueError(f"micro_batch={b}: must be >= 1")
        return v

    @field_validator("seq_len")
    @classmethod
    def _seq_len(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and v < 1:
            raise ValueError(f"seq_len={v}: must be >= 1")
        return v

    @field_validator("checkpointing")
    @classmethod
    def _checkpointing(cls, v: str) -> str:
        from zeroplan.formulas.activations import CHECKPOINTING

        if v not in CHECKPOINTING:
            raise ValueError(f"checkpointing={v!r}: expected one of {', '.join(CHECKPOINTING)}")
        return v

    @field_validator("params", "gpus", "model_parallel", "stages", "offload", "micro_batch")
    @classmethod
    def _listed(cls, v: Optional[tuple], info) -> Optional[tuple]:
        if v is None:
            return v
        if not v:
            raise ValueError(f"{info.field_name}: give at least one value")
        seen = set()
        for x in v:
            if x in seen:
                shown = x.label if isinstance(x, Offload) else f"{x:g}"
                raise ValueError(f"{info.field_name}: {shown} is listed twice")
            seen.add(x)
        return v

    @field_validator("params")
    @classmethod
    def _params(cls, v: Optional[tuple[float, ...]]) -> Optional[tuple[float, ...]]:
        for p in v or ():
            _check(params=p)  # the single-estimate rules and messages
            if p > MAX_PARAMS:
                raise ValueError(f"params={p:g}: above {MAX_PARAMS:.3g}, byte counts would overflow int64")
        return v

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        for g in v:
            _check(params=1, gpus=g)
            if g > MAX_GPUS:
                raise ValueError(f"gpus={g}: above {MAX_GPUS}, byte counts could overflow int64")
        return v

    @field_validator("model_parallel")
    @classmethod
    def _model_parallel(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        for m in v:
            _check(params=1, gpus=max(m, 1), model_parallel=m)  # this field's own message
        return v

    @field_validator("stages")
    @classmethod
    def _stages(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        for s in v:
            if s not in range(len(STAGES)):
                raise ValueError(f"stages={list(v)}: {s} is not a ZeRO stage (0, 1, 2 or 3)")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "SweepConfig":
        if sum(x is not None for x in (self.params, self.tensor_numels, self.model)) != 1:
            raise ValueError("give exactly one of params, tensor_numels and model")
        if self.model is None and (self.micro_batch != (1,) or self.seq_len is not None):
            raise ValueError("micro_batch and seq_len change only activations, which need a reference model")
        # One representative EstimateConfig checks tensor_numels, gpu_memory_bytes and params-xor-shapes.
        _check(
            params=self.params[0] if self.params else None,
            tensor_numels=self.numels,
            gpu_memory_bytes=self.gpu_memory_bytes,
        )
        if self.numels and sum(self.numels) > MAX_PARAMS:
            raise ValueError(f"tensor_numels: {sum(self.numels):g} elements, above {MAX_PARAMS:.3g}")
        if not any(g % m == 0 for g in self.gpus for m in self.model_parallel):
            raise ValueError(
                f"no model_parallel in {list(self.model_parallel)} divides any gpus in {list(self.gpus)}"
            )
        if not self.pairs:
            offloads = ", ".join(o.label for o in self.offload)
            raise ValueError(
                f"offload ({offloads}) is possible at none of stages {list(self.stages)}: {_why(self)}"
            )
        return self

    @property
    def numels(self) -> Optional[tuple[int, ...]]:
        """Every tensor of the model: ``tensor_numels`` or the preset's; None for a bare Ψ."""
        if self.model is not None:
            from zeroplan.presets import get_model

            return get_model(self.model).tensor_numels
        return self.tensor_numels

    @property
    def pairs(self) -> tuple[tuple[int, Offload], ...]:
        """The (stage, offload) pairs to report, stage-major; pairs DeepSpeed lacks are left out."""
        return tuple((s, o) for s in self.stages for o in self.offload if _possible(s, o))


def _possible(stage: int, offload: Offload) -> bool:
    try:
        check_offload(stage, offload)
    except ValueError:
        return False
    return True


def _why(config: SweepConfig) -> str:
    """``check_offload``'s reason for the first pair, e.g. 'stage 0: optimizer offload needs ...'."""
    try:
        check_offload(config.stages[0], config.offload[0])
    except ValueError as exc:
        return str(exc)
    return ""


def parse_offload(text: str) -> Offload:
    """'none' | 'cpu' | 'nvme' | 'cpu/cpu' | 'none/cpu' ... -> Offload(optimizer, params); else ValueError."""
    if isinstance(text, Offload):
        return text
    parts = str(text).strip().lower().split("/")
    if len(parts) > 2 or not all(p in DEVICES for p in parts):
        raise ValueError(f"offload={text!r}: expected {OFFLOAD_HELP.removeprefix('offload: ')}")
    return Offload(parts[0], parts[1] if len(parts) == 2 else "none")


def collectives_summary(collectives: Sequence[Collective]) -> str:
    """One string for a step's collectives, e.g. 'reduce-scatter(backward) + all-gather(optimizer step)'."""
    return " + ".join(f"{c.op}({c.phase})" for c in collectives)


def _collectives_column(sweep_rows: list, nd: np.ndarray) -> pd.Categorical:
    """The summary per row: a stage's list, or '' where N_d = 1 (nothing is sent, as in ``estimate``)."""
    categories = [""]
    for row in sweep_rows:
        if (label := collectives_summary(row.collectives)) not in categories:
            categories.append(label)
    codes = [np.where(nd > 1, categories.index(collectives_summary(r.collectives)), 0) for r in sweep_rows]
    return pd.Categorical.from_codes(np.stack(codes, axis=1).ravel(), categories=categories)


def _grid(config: SweepConfig) -> dict[str, np.ndarray]:
    """Every valid (params, gpus, model_parallel, micro_batch) combination, params slowest, int64 arrays."""
    params = [int(p) for p in config.params] if config.params else [sum(config.numels)]
    p, g, m, b = np.meshgrid(
        np.array(params, dtype=np.int64),
        np.array(config.gpus, dtype=np.int64),
        np.array(config.model_parallel, dtype=np.int64),
        np.array(config.micro_batch, dtype=np.int64),
        indexing="ij",
    )
    p, g, m, b = p.ravel(), g.ravel(), m.ravel(), b.ravel()
    keep = g % m == 0
    return {"params": p[keep], "gpus": g[keep], "model_parallel": m[keep], "micro_batch": b[keep]}


def _activations(config: SweepConfig, m: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bytes, known) per configuration: ``zeroplan.formulas.activations`` once per distinct (N_m, micro-batch),
    with N_m taken as tensor parallelism as ``zeroplan.plan`` does; unknown without a model."""
    out, known = np.zeros(m.shape, dtype=np.int64), np.zeros(m.shape, dtype=bool)
    if config.model is None:
        return out, known
    from zeroplan.formulas.activations import activation_bytes
    from zeroplan.presets import get_model

    preset = get_model(config.model)
    seq_len = config.seq_len or preset.seq_len
    for nm in config.model_parallel:
        for mb in config.micro_batch:
            value = activation_bytes(preset.spec, seq_len, mb, config.checkpointing, nm)
            if value is not None:
                where = (m == nm) & (b == mb)
                out[where], known[where] = value, True
    return out, known


def sweep_config(config: SweepConfig) -> pd.DataFrame:
    """One row per configuration, stage and offload, in grid order: params, gpus, model_parallel,
    micro_batch, stage, offload (the last fastest)."""
    grid = _grid(config)
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
            numels, nd, config.policy, config.stages, config.gpu_memory_bytes, flat_layout
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

    def categorical(labels: list[str]) -> pd.Categorical:
        categories = list(dict.fromkeys(labels))
        codes = np.array([categories.index(x) for x in labels])
        return pd.Categorical.from_codes(np.tile(codes, nd.size), categories=categories)

    if config.gpu_memory_bytes is None:  # unknown: all missing, as ``fits: null`` in ``estimate --json``
        fits = pd.arrays.BooleanArray(np.zeros(n_rows, dtype=bool), mask=np.ones(n_rows, dtype=bool))
    else:
        fits = pd.arrays.BooleanArray(per_row("fits"), mask=np.zeros(n_rows, dtype=bool))
    act, known = (repeat(a) for a in _activations(config, m, grid["micro_batch"]))
    total = per_row("model_states_bytes") + act
    total_fits = total <= (config.gpu_memory_bytes or 0)
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
        "activation_bytes": pd.arrays.IntegerArray(act, mask=~known),
        "total_bytes": pd.arrays.IntegerArray(total, mask=~known),
        "total_fits": pd.arrays.BooleanArray(total_fits, mask=~known | (config.gpu_memory_bytes is None)),
    }
    return pd.DataFrame(columns, columns=list(COLUMNS))


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
            None if config.gpu_memory_bytes is None else memory.model_states_bytes <= config.gpu_memory_bytes
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
    micro_batch: Sequence[int] = (1,),
    seq_len: int | None = None,
    checkpointing: str = "full",
    gpu_memory_bytes: int | None = None,
    **policy: object,
) -> pd.DataFrame:
    """``zeroplan.estimate`` for every combination of ``params`` x ``gpus`` x ``model_parallel``.

    Returns one row per configuration, stage and ``offload`` (columns ``COLUMNS``); byte columns are exact
    int64. ``offload`` items are ``parse_offload`` strings ('none', 'cpu', 'nvme', 'cpu/cpu', ...).
    Remaining keywords are ``PrecisionPolicy`` fields, as for ``estimate``. Raises
    ``pydantic.ValidationError`` on bad input.
    """
    config = SweepConfig(
        params=tuple(params) if params is not None else None,
        tensor_numels=tuple(tensor_numels) if tensor_numels is not None else None,
        gpus=tuple(gpus),
        model_parallel=tuple(model_parallel),
        stages=tuple(stages),
        offload=tuple(offload),
        model=model,
        micro_batch=tuple(micro_batch),
        seq_len=seq_len,
        checkpointing=checkpointing,
        gpu_memory_bytes=gpu_memory_bytes,
        policy=PrecisionPolicy(**policy),
    )
    return sweep_config(config)


def parse_list(text: str, what: str, parse: Callable[[str], object]) -> tuple:
    """'8,64,512' -> (8, 64, 512) with ``parse`` per item; ValueError naming the option and the item."""
    items = [t.strip() for t in str(text).split(",")]
    if not any(items):
        raise ValueError(f"{what}={text!r}: give one or more comma-separated values")
    if "" in items:
        raise ValueError(f"{what}={text!r}: empty item between commas")
    return tuple(parse(t) for t in items)


def gpu_capacity(gpu: Optional[str], gpu_memory: Optional[str]) -> tuple[Optional[int], Optional[str]]:
    """(bytes, label) from a GPU preset name or a size such as '80GiB' (not both); (None, None) if neither."""
    from zeroplan.presets import get_gpu
    from zeroplan.parsing import parse_bytes

    if gpu is not None and gpu_memory is not None:
        raise ValueError("give at most one of --gpu and --gpu-memory")
    if gpu is not None:
        spec = get_gpu(gpu)
        return spec.memory_bytes, spec.name
    if gpu_memory is not None:
        return parse_bytes(gpu_memory), None
    return None, None


def parse_whole(text: str, what: str) -> int:
    """'64' -> 64; ValueError for '6.5', 'x', '1e3' (GPU counts and degrees are written as integers)."""
    if not re.fullmatch(r"[-+]?[0-9]+", text):
        raise ValueError(f"{what}={text!r}: not a whole number")
    return int(text)


def to_records(frame: pd.DataFrame) -> list[dict]:
    """Rows as plain Python values (``fits`` None when unknown), for JSON."""
    nullable = ("fits", "reduction_vs_dp", "activation_bytes", "total_bytes", "total_fits")
    out = frame.astype({**dict.fromkeys(nullable, object), "name": str, "offload": str, "collectives": str})
    for column in nullable:  # unknown fit or activations, no ratio when nothing stays on the GPU
        out[column] = out[column].where(out[column].notna(), None)
    return out.to_dict(orient="records")


def to_json(frame: pd.DataFrame, config: SweepConfig) -> str:
    """The sweep as one JSON object: schema, the fixed inputs, and ``rows`` (one per configuration, stage)."""
    doc = {
        "schema": SCHEMA,
        "inputs": {
            "gpu_memory_bytes": config.gpu_memory_bytes,
            "policy": config.policy.resolved(),
        },
        "columns": list(frame.columns),
        "rows": [],
    }
    # One row per line keeps a big sweep greppable and diffable; the rest is indented as usual.
    head = json.dumps(doc, indent=2).removesuffix("[]\n}").removesuffix("[]}")
    rows = ",\n".join("    " + json.dumps(r) for r in to_records(frame))
    return f"{head}[\n{rows}\n  ]\n}}\n"


def to_csv(frame: pd.DataFrame) -> str:
    """The sweep as CSV with a header row; ``fits`` is empty when no GPU memory was given."""
    return frame.to_csv(index=False, lineterminator="\n")

