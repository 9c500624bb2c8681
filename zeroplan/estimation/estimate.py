"""``zeroplan.estimate``: the Python entry point the CLI, the notebooks and the validator share."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import replace

from zeroplan.allocator.reserved import NO_CUDA_ALLOCATOR, engine_reserved, fit_bytes, replayed_on
from zeroplan.engines import get_engine, split_keywords
from zeroplan.engines.base import Workload
from zeroplan.estimation.config import EstimateConfig
from zeroplan.estimation.live import check_module_dtype, is_optimizer
from zeroplan.estimation.records import Estimate, StageEstimate
from zeroplan.estimation.workload import layered_zero3
from zeroplan.formulas.sharding import shard_numel
from zeroplan.formulas.stage_table import stage_memory, stage_table
from zeroplan.formulas.stages import get_stage
from zeroplan.policy import PrecisionPolicy
from zeroplan.types import show


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
    """Memory and communication of each of ``stages`` for tensors of ``numels`` elements on ``nd`` ranks
    (``zeroplan.formulas.stage_table``), with the reduction against plain DP and whether it fits.

    The entries of ``numels`` and ``nd`` may also be numpy int64 arrays of one shape: ``zeroplan.sweep``
    evaluates a whole grid through this same code, so the vectorised and scalar answers cannot drift.
    ``flat_layout``: the numels are the model's real tensors, so full buffers are padded as the runtime
    pads them (``zeroplan.formulas.memory.buffer_numels``); False for a bare Ψ.
    """
    dp_total = stage_memory(numels, nd, 0, policy, flat_layout).model_states_bytes
    rows = []
    for r in stage_table(numels, nd, policy, stages, flat_layout):
        fits = None if gpu_memory_bytes is None else r.memory.model_states_bytes <= gpu_memory_bytes
        rows.append(StageEstimate(r.stage.number, r.stage.name, r.memory, dp_total / r.memory.model_states_bytes,
                                  r.collectives, fits))  # fmt: skip
    return tuple(rows)


def workload_of(config: EstimateConfig) -> Workload:
    """What the engine is asked about: the architecture's step, or the tensors of one MP rank."""
    if config.workload is not None:
        return config.workload
    if config.tensor_shapes is not None and config.model_parallel == 1:  # a live module's own shapes
        return Workload(config.tensor_shapes)
    return Workload(tuple((f"tensor {i}", (n,)) for i, n in enumerate(model_numels(config))))


def estimate_config(config: EstimateConfig) -> Estimate:
    """Memory, communication and (with an architecture) the peak per GPU of every row the engine
    ``config.engine`` answers (``zeroplan.engines``): one per requested stage (reference) or the one
    sharding its settings select (fsdp2, deepspeed)."""
    workload = workload_of(config)
    numels = tuple(math.prod(s) for _, s in workload.shapes)
    options = config.planner_options
    engine = get_engine(config.engine)
    if engine.own_options:  # the node size, as plan gives it (DeepSpeed qgZ's local group: zeropp_settings.node_keys)
        options = replace(options, own={**options.own, "gpus_per_node": config.gpus_per_node})
    settings = engine.planner_settings(options)
    if config.live_settings:  # read from a live module and optimizer (estimation/live.py)
        settings = settings.model_copy(update=dict(config.live_settings))
    if config.spec is not None and (limit := engine.peak_limits(options, config.spec, config.checkpointing)):
        raise ValueError(limit.reason)  # an architecture: the peak is part of the answer
    policy = engine.policy(settings)  # the byte convention of this engine's model states
    amsgrad = bool(getattr(settings, "amsgrad", False))  # Adam's third state, an engine's Settings.amsgrad
    if config.module_dtype is not None:  # a live module (estimation/live.py)
        check_module_dtype(config.module_dtype, config.engine, policy.param_dtype)
    # "vs DP": plain data parallelism's model states (the reference engine's stage 0, the same byte
    # convention) over this row's
    reference = get_engine("reference")
    (dp,) = reference.estimate(Workload(workload.shapes), config.nd, reference.settings(
        stages=(0,), policy=policy, flat_layout=options.flat_layout, amsgrad=amsgrad))  # fmt: skip
    own = engine.own_estimator(settings, numels, config.nd) if engine.own_estimator is not None else None
    rows = []
    estimated = engine.estimate(workload, config.nd, settings)
    reserved = engine_reserved(engine, workload, config.nd, settings, config.alloc_conf) or (None,) * len(estimated)
    for r, held in zip(estimated, reserved):
        need = fit_bytes(r.model_states_bytes, r.peak, held)
        fits = None if config.gpu_memory_bytes is None else need <= config.gpu_memory_bytes
        name = r.label if engine.one_row else get_stage(r.stage).name
        # none: every model state on the host (FSDP2's CPUOffloadPolicy)
        reduction = dp.model_states_bytes / r.model_states_bytes if r.model_states_bytes else None
        collectives = layered_zero3(engine, workload, r, config.nd)
        rows.append(StageEstimate(r.stage, name, r.memory, reduction, collectives, fits, r.peak, own, r.peak_rank,
                                  held, r.host))
    return Estimate(
        psi=sum(numels),
        total_params=int(config.params) if config.params else sum(config.tensor_numels or numels),
        gpus=config.gpus,
        nd=config.nd,
        nm=config.model_parallel,
        gpu_memory_bytes=config.gpu_memory_bytes,
        policy=policy,
        bytes_per_param=policy.byte_rows(amsgrad),
        k=policy.k_of(amsgrad),
        stages=tuple(rows),
        engine=config.engine,
        model=config.model if config.model is not None else (config.spec.model_type if config.spec else None),
        workload=config.workload,
        block_bytes=engine.block_bytes(settings),
        allocator_overhead_bytes=getattr(settings, "allocator_overhead_bytes", 0),
        own_estimator=engine.own_estimator_name or None,
        alloc_conf=config.alloc_conf,
        tp=getattr(settings, "tp", None) or 1,  # an engine's tensor parallelism (FSDP2 Settings.tp), else 1
        gpus_per_node=config.gpus_per_node,
        reserved_not_replayed=NO_CUDA_ALLOCATOR if engine.alloc_trace is not None and workload.spec is not None
        and not replayed_on(settings) else None,
    )  # fmt: skip


def api_batch(engine: str, settings_file: dict | None, gpus: object, model_parallel: object, micro_batch: object,
              grad_accum: object) -> tuple[object, object]:
    """The Python API's micro-batch and accumulation: the engine's batch rule (``Engine.batch``: a ds_config's
    where it sets them, at N_d = gpus / model_parallel), else as given (1 for None); values of the wrong type
    pass through to the config, which refuses them by name."""
    whole = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (gpus, model_parallel))
    typed = all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (micro_batch, grad_accum))
    if settings_file is None or not (whole and typed):
        return (1 if micro_batch is None else micro_batch), (1 if grad_accum is None else grad_accum)
    nd = gpus // model_parallel if gpus % model_parallel == 0 else None
    return get_engine(engine).batch(settings_file, nd, micro_batch, grad_accum, ("micro_batch", "grad_accum"))


def estimate(
    params: float | None = None,
    gpus: int = 1,
    *,
    model: object = None,
    model_parallel: int = 1,
    stage: int | None = None,
    tensor_numels: tuple[int, ...] | list[int] | None = None,
    gpu_memory_bytes: int | None = None,
    seq_len: int | None = None,
    micro_batch: int | None = None,
    checkpointing: str = "none",
    grad_accum: int | None = None,
    foreach: bool | None = None,
    engine: str = "reference",
    gpu: str | None = None,
    alloc_conf: str = "",
    gpus_per_node: int = 8,
    **options: object,
) -> Estimate:
    """Estimate per-GPU model states, per-step communication and, with an architecture, the peak.

    Give the model as ``params`` (Ψ of the whole model), ``tensor_numels`` (exact padding) or ``model``:
    a preset name, the path of a Hugging Face ``config.json``, or a ``torch.nn.Module`` (its shapes,
    meta device fine; a ``transformers`` model whose config zeroplan reads also gets the peak, any
    other module shapes only; its dtype, and with ``optimizer=<torch.optim.Optimizer>`` the optimizer's
    class, ``foreach`` and state dtypes, are read from the objects: ``live_model``, docs/python-api.md). ``seq_len``, ``micro_batch``, ``checkpointing`` (none, full),
    ``grad_accum`` and ``foreach`` (None: torch's default for the device, off with ``device="cpu"``) describe the
    training step of an architecture, ``alloc_conf`` the
    ``PYTORCH_CUDA_ALLOC_CONF`` its reserved bytes are replayed under (micro-batch and
    accumulation: a ``ds_config``'s batch where it sets one, the engine's ``Engine.batch``;
    else 1). ``gpu``: a GPU preset (its memory for ``fits`` unless ``gpu_memory_bytes`` is given, its compute
    capability for the peak's cuBLAS workspaces, as ``plan``); ``gpus_per_node`` the node size the collectives'
    links are read for. ``gpus`` = N_d x
    ``model_parallel``. Remaining keywords are the engine's options: for ``reference``,
    ``PrecisionPolicy`` fields (``param_dtype``, ``grad_dtype``, ``master_weights``, ``optimizer``,
    ``optimizer_dtype``); for ``fsdp2``, ``reshard_after_forward``, ``param_dtype``, ``reduce_dtype``;
    for ``deepspeed``, ``ds_config`` (a parsed ds_config.json; ``stage`` fills in its stage). Raises
    ``pydantic.ValidationError`` or ValueError on bad input.
    """
    architecture, live, module_dtype, modelled, shapes = None, (), None, model is not None, None
    if isinstance(model, os.PathLike):  # model=Path("config.json"), as the docs say
        model = os.fspath(model)
    if model is not None and not isinstance(model, str):
        if params is not None or tensor_numels is not None:
            raise ValueError("give exactly one of params, tensor_numels and model")
        architecture, shapes, foreach, live, module_dtype = live_model(model, engine, options, foreach)
        tensor_numels = None if shapes is None else tuple(math.prod(s) for _, s in shapes)
        model = None
    elif is_optimizer(options.get("optimizer")):
        raise ValueError(f"optimizer={type(options['optimizer']).__name__}: an optimizer object needs model=<the "
                         "torch.nn.Module it trains>; else name it (optimizer='adamw')")  # fmt: skip
    policy, engine_options = split_keywords(engine, options)
    micro_batch, grad_accum = api_batch(engine, engine_options.ds_config if modelled else None,
                                        gpus, model_parallel, micro_batch, grad_accum)  # fmt: skip
    config = EstimateConfig(
        params=params,
        tensor_numels=tensor_numels,  # the config checks and converts lists (never a str)
        tensor_shapes=shapes,
        model=model,
        architecture=architecture,
        seq_len=seq_len,
        micro_batch=micro_batch,
        checkpointing=checkpointing,
        grad_accum=grad_accum,
        foreach=foreach,  # None: torch's default for the device (estimation/workload.py device_foreach)
        engine=engine,
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        model_parallel=model_parallel,
        stage=stage,
        gpu=gpu,
        gpu_memory_bytes=gpu_memory_bytes,
        **({} if policy is None else {"policy": PrecisionPolicy(**policy)}),
        engine_options=engine_options,
        alloc_conf=alloc_conf,
        live_settings=live,
        module_dtype=module_dtype,
    )
    return estimate_config(config)


def live_model(model: object, engine: str, options: dict, foreach: bool | None) -> tuple:
    """(architecture, else its tensors' shapes, foreach, engine settings, dtype) of a ``torch.nn.Module`` and, as
    ``options["optimizer"]``, its ``torch.optim`` optimizer: shapes from the module, the architecture from a
    ``transformers`` config, dtypes and the optimizer from the objects (``estimation/live.py``). ``options``
    gains the policy keywords the objects give; a keyword or ``foreach`` that contradicts them is refused."""
    from zeroplan.architectures.module_shapes import module_shapes
    from zeroplan.estimation.live import live_settings, read_live
    from zeroplan.estimation.workload import module_architecture

    torch = sys.modules.get("torch")  # a module object means torch is imported; never import it here
    if torch is None or not isinstance(model, torch.nn.Module):
        raise ValueError(f"model={show(model)}: expected a preset name, the path of a config.json or a "
                         "torch.nn.Module")  # fmt: skip
    optimizer = options.pop("optimizer") if is_optimizer(options.get("optimizer")) else None
    run = read_live(model, optimizer)
    if run.foreach is not None and foreach is not None and foreach != run.foreach:
        raise ValueError(f"foreach={foreach} contradicts the optimizer, whose foreach is {run.foreach}: leave it out")
    keywords, settings = live_settings(engine, run, options)
    options.update(keywords)
    shapes = module_shapes(model)
    architecture = module_architecture(model, shapes)
    shapes = tuple((name, shape or (1,)) for name, shape in shapes)  # a 0-d parameter: one element
    foreach = run.foreach if run.foreach is not None else foreach
    live = tuple(sorted(settings.items()))
    return architecture, None if architecture is not None else shapes, foreach, live, run.dtype
