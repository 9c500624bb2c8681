"""The validator's runner of real FSDP2 (``Engine.runner`` of ``zeroplan/engines/fsdp2``; its run options are declared
in ``zeroplan/engines/fsdp2/declared.py``): what its ranks run (``validate/engines/fsdp2.py``, with ``tp``
``fsdp2_tp.py``), its report, its defaults and what it refuses before any rank starts."""

from __future__ import annotations

from typing import Optional

STATES = "parameters, gradients and Adam's states live after the last backward (fsdp2 frees gradients at zero_grad)"
"""When the report's states column is read (``validate.report.to_table``; others: at the step boundary)."""
TP_MODEL = "llama-tiny"
"""The default model with ``tp``: torchtitan's llama plan holds llama module names only (validate/models.py)."""


def worker_module(config) -> str:
    """The module each rank runs (``validate.harness.launch_command``): the TP runner with ``tp``."""
    return "validate.engines.fsdp2_tp" if config.tp else "validate.engines.fsdp2"


def run(config) -> dict:
    """Train the matrix and compare with the FSDP2 engine's prediction (with ``tp``: the TP runner's comparison)."""
    from validate.harness import run_matrix

    if config.tp is not None:
        from validate.engines.fsdp2_tp_compare import build_report
    else:
        from validate.engines.fsdp2_compare import build_report
    return build_report(config, run_matrix(config))


def default_model(config) -> Optional[str]:
    """The preset run when neither ``model`` nor ``params`` is given: ``TP_MODEL`` with ``tp``, else the validator's."""
    return TP_MODEL if config.tp is not None else None


def run_defaults(data: dict) -> dict:
    """No world sizes given, real, with ``tp``: 2·T·R (dp_shard 2)."""
    if data.get("world_sizes") is None and not data.get("simulated") and isinstance(data.get("tp"), int) and \
            isinstance(data.get("dp_replicate") or 1, int):  # fmt: skip
        data = {**data, "world_sizes": (2 * data["tp"] * (data.get("dp_replicate") or 1),)}
    return data


def check_run(config) -> None:
    """ValueError (one line) for what the FSDP2 runner does not run; with ``tp``, ``check_tp``."""
    if config.stages != type(config).model_fields["stages"].default:
        raise ValueError("--stage: FSDP2 has no stages; use --reshard-after-forward true|false|K")
    if config.wire:
        raise ValueError("--wire: --engine reference only")
    from validate.models import spec_for
    from zeroplan.architectures.spec import TransformerSpec

    if not isinstance(spec_for(config.model_name, config.params), TransformerSpec):
        raise ValueError(f"model {config.model_name}: --engine fsdp2 validates transformers only")
    if config.param_dtype == "fp16" or config.reduce_dtype == "fp16":
        raise ValueError("fp16: FSDP2 needs a gradient scaler for fp16 (not run); use bf16 or fp32")
    if 1 in config.world_sizes:
        raise ValueError("world-size=1: FSDP2 takes its world-size-1 path there (no collectives), which "
                         "zeroplan does not model; use 2 or more")  # fmt: skip
    if config.labels is not None and not config.hf:
        raise ValueError("--labels/--no-labels: with --hf only (the validator's CausalLM takes its loss outside)")
    if config.hf and config.params is not None:  # meta init and checkpointing run (validate/engines/fsdp2.py)
        raise ValueError("--hf: a config.json --model, not --params (hf_builder)")
    rsf = config.reshard_after_forward
    bad = [n for n in config.world_sizes if not isinstance(rsf, bool) and rsf is not None and n % rsf]
    if bad:
        raise ValueError(f"reshard-after-forward={rsf}: must divide every world size (got {bad})")
    r = config.dp_replicate or 1
    if config.tp is None and any(n % r or n // r < 2 for n in config.world_sizes):
        raise ValueError(f"dp-replicate={r}: must divide every world size and leave dp_shard >= 2 "
                         f"(got {list(config.world_sizes)})")  # fmt: skip
    check_tp(config)


def check_tp(config) -> None:
    """``tp``: what the TP runner (validate/engines/fsdp2_tp.py) runs, refused here before any rank starts."""
    if config.tp is None:
        for flag, value in (("--sp/--no-sp", config.sequence_parallel),
                            ("--loss-parallel/--no-loss-parallel", config.loss_parallel), ("--tp-plan", config.tp_plan)):  # fmt: skip
            if value is not None:
                raise ValueError(f"{flag}: with --tp only")
        return
    given = [flag for flag, on in (("--simulated", config.simulated), ("--params", config.params is not None),
                                   ("--hf", bool(config.hf)), ("--fsdp-wrap", config.fsdp_wrap is not None),
                                   ("--init materialized", config.fsdp2_init == "materialized"),
                                   ("--reshard-after-forward", config.reshard_after_forward not in (None, True)),
                                   ("--device cuda", config.device == "cuda"), ("--foreach", config.foreach is True),
                                   ("--nnodes", config.nnodes > 1),
                                   ("--reduce-dtype", config.reduce_dtype not in (None, config.param_dtype)))
             if on]  # fmt: skip
    if config.tp_plan == "transformers" and (config.sequence_parallel or config.loss_parallel):
        raise ValueError("--tp-plan transformers: its plan has no sequence parallelism and gathers the logits "
                         "(no --sp, no --loss-parallel)")  # fmt: skip
    if given:
        raise ValueError(f"tp={config.tp}: the TP runner is real gloo ranks on CPU, meta init, blocks and root "
                         f"resharded, Adam for-loop, reduce dtype = param dtype: no {', '.join(given)}")
    from validate.engines.fsdp2_tp_check import check_tp_plan

    r = config.dp_replicate or 1
    for n in config.world_sizes:
        if n % (config.tp * r) or n // (config.tp * r) < 2:
            raise ValueError(f"tp={config.tp}, dp-replicate={r}: world size {n} must be R x S x T with dp_shard "
                             f"S >= 2 (got {list(config.world_sizes)})")  # fmt: skip
    check_tp_plan(config.model_name, config.tp, config.world_sizes, config.seq_len,
                  config.sequence_parallel is not False and config.tp_plan != "transformers")
