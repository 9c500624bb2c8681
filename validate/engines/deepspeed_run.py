"""The validator's runner of real DeepSpeed (``Engine.runner`` of ``zeroplan/engines/deepspeed``): what its ranks
run (``validate/engines/deepspeed.py``), its report (``deepspeed_compare.py``), its defaults and what it refuses
before any rank starts."""

from __future__ import annotations

from zeroplan.engines import get_engine

PEAK_TOLERANCE = 0.03
"""--engine deepspeed without --peak-tolerance: issue 11's target for every phase of real DeepSpeed."""
MISSING = '--engine deepspeed needs DeepSpeed: DS_BUILD_OPS=0 pip install ".[deepspeed]"'
"""What ``zeroplan validate`` says, before any work, where the package it trains is not installed."""


def installed() -> bool:
    """Whether DeepSpeed can be imported (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def worker_module(config) -> str:
    """The module each rank runs (``validate.harness.launch_command``)."""
    return "validate.engines.deepspeed"


def run(config) -> dict:
    """Train every ds_config of the matrix and compare with the DeepSpeed engine's prediction."""
    from validate.engines.deepspeed_compare import run_validation

    return run_validation(config)


def run_defaults(data: dict) -> dict:
    """DeepSpeed has stages 1-3: no stages given -> 1, 2, 3, or the stage of the given config; its peak tolerance."""
    if data.get("stages") is None:
        ds = data.get("deepspeed_config")
        zero = ds.get("zero_optimization") if isinstance(ds, dict) else None
        data = {**data, "stages": (zero.get("stage", 0),) if isinstance(zero, dict) else (1, 2, 3)}
    if data.get("peak_tolerance") is None:
        data = {**data, "peak_tolerance": PEAK_TOLERANCE}
    return data


def check_run(config) -> None:
    """ValueError (one line) for what the DeepSpeed runner does not run: real gloo ranks on one node, stages 1-3,
    the ds_config's stage and batch rule (``Engine.read_settings_file``, ``Engine.batch``) at every world size."""
    if config.zero_init and config.stages != (3,):
        raise ValueError(f"--zero-init: deepspeed.zero.Init partitions parameters for ZeRO-3 only (stages "
                         f"{list(config.stages)}); give --stage 3 or a ds_config of stage 3")  # fmt: skip
    if config.simulated or config.wire or config.nnodes > 1 or config.params is not None:
        raise ValueError("--engine deepspeed runs real gloo ranks on one node: no --simulated, --wire, --nnodes "
                         "or --params")  # fmt: skip
    if 0 in config.stages:
        raise ValueError("--engine deepspeed: stages 1-3 (DeepSpeed's stage 0 is plain data parallelism)")
    if config.deepspeed_config is not None:
        engine = get_engine(config.engine)
        settings = engine.read_settings_file(config.deepspeed_config)  # one line naming a bad key
        if config.stages != (settings.stage,):
            raise ValueError(f"--stage {list(config.stages)} contradicts zero_optimization.stage={settings.stage}")
        for nd in config.world_sizes:  # DeepSpeed's batch rule, refused here rather than in a rank
            engine.batch(config.deepspeed_config, nd, None, None, ("micro_batch", "grad_accum"))
