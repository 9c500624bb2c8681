"""``zeroplan.estimate``: the Python entry point the CLI, the notebooks and the validator share."""

from __future__ import annotations

from zeroplan.estimation.config import EstimateConfig
from zeroplan.estimation.records import Estimate, StageEstimate
from zeroplan.formulas.collectives import step_collectives
from zeroplan.formulas.memory import model_states
from zeroplan.formulas.sharding import shard_numel
from zeroplan.formulas.stages import get_stage
from zeroplan.policy import PrecisionPolicy


def model_numels(config: EstimateConfig) -> tuple[int, ...]:
    """Per-tensor elements one model-parallel rank holds: Ψ/N_m (ZeRO section 5), rounded up per tensor."""
    numels = config.tensor_numels or (int(config.params),)
    return tuple(shard_numel(n, config.model_parallel) for n in numels)


def stage_estimates(
    numels: tuple[int, ...],
    nd: int,
    policy: PrecisionPolicy,
    stages: tuple[int, ...] = (0, 1, 2, 3),
    gpu_memory_bytes: int | None = None,
    flat_layout: bool = False,
) -> tuple[StageEstimate, ...]:
    """Memory and communication of each of ``stages`` for tensors of ``numels`` elements on ``nd`` ranks.

    The entries of ``numels`` and ``nd`` may also be numpy int64 arrays of one shape: ``zeroplan.sweep``
    evaluates a whole grid through this same code, so the vectorised and scalar answers cannot drift.
    ``flat_layout``: the numels are the model's real tensors, so full buffers are padded as the runtime
    pads them (``zeroplan.formulas.memory.buffer_numels``); False for a bare Ψ.
    """
    states = policy.states

    def memory(stage: int):
        return model_states(
            numels, nd, stage, policy.param_bytes, policy.grad_bytes, states, policy.master_dtype, flat_layout
        )

    dp_total = memory(0).model_states_bytes
    rows = []
    for number in stages:
        row = get_stage(number)
        mem = memory(row.number)
        collectives = step_collectives(
            row.number, numels, nd, policy.param_dtype, policy.resolved_grad_dtype, flat_layout
        )
        fits = None if gpu_memory_bytes is None else mem.model_states_bytes <= gpu_memory_bytes
        rows.append(
            StageEstimate(row.number, row.name, mem, dp_total / mem.model_states_bytes, collectives, fits)
        )
    return tuple(rows)


def estimate_config(config: EstimateConfig) -> Estimate:
    """Memory and communication per GPU for every requested stage of ``config``."""
    policy = config.policy
    numels = model_numels(config)
    stages = (0, 1, 2, 3) if config.stage is None else (config.stage,)
    flat_layout = config.tensor_numels is not None
    rows = stage_estimates(numels, config.nd, policy, stages, config.gpu_memory_bytes, flat_layout)
    return Estimate(
        psi=sum(numels),
        total_params=int(config.params) if config.params else sum(config.tensor_numels),
        gpus=config.gpus,
        nd=config.nd,
        nm=config.model_parallel,
        gpu_memory_bytes=config.gpu_memory_bytes,
        policy=policy,
        bytes_per_param=policy.bytes_per_param,
        k=policy.k,
        stages=tuple(rows),
    )


def estimate(
    params: float | None = None,
    gpus: int = 1,
    *,
    model_parallel: int = 1,
    stage: int | None = None,
    tensor_numels: tuple[int, ...] | list[int] | None = None,
    gpu_memory_bytes: int | None = None,
    **policy: object,
) -> Estimate:
    """Estimate per-GPU model states and per-step communication of ZeRO stages 0-3.

    ``params`` is Ψ of the whole model (or give ``tensor_numels`` for exact padding); ``gpus`` =
    N_d x ``model_parallel``. Remaining keywords are ``PrecisionPolicy`` fields (``param_dtype``,
    ``grad_dtype``, ``master_weights``, ``optimizer``, ``optimizer_dtype``). Raises
    ``pydantic.ValidationError`` on bad input.
    """
    config = EstimateConfig(
        params=params,
        tensor_numels=tensor_numels,  # the config checks and converts lists (never a str)
        gpus=gpus,
        model_parallel=model_parallel,
        stage=stage,
        gpu_memory_bytes=gpu_memory_bytes,
        policy=PrecisionPolicy(**policy),
    )
    return estimate_config(config)
