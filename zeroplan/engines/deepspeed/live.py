"""DeepSpeed's reading of a live module and optimizer (``Engine.live_settings``)."""

from __future__ import annotations

from zeroplan.engines.live import LiveRun, adam_only


def live_settings(run: LiveRun, given: dict) -> tuple[dict, dict]:
    """The ds_config's dtype wins (DeepSpeed 0.19.8 casts an fp32 module to its fp16/bf16,
    ``engine.py:_configure_distributed_model``); Adam/AdamW only, the class agreeing with the config's
    ``optimizer.type`` where it names one."""
    adam_only("deepspeed", run)
    if run.optimizer is None:
        return {}, {}
    config = given.get("ds_config") or {}
    settings = _deepspeed_optimizer(run.optimizer, config)
    return {}, ({**settings, **_amsgrad(run.optimizer, config)} if run.amsgrad else settings)


def _amsgrad(optimizer: str, config: dict) -> dict:
    """A client ``Adam(amsgrad=True)``: torch's Adam is the inner optimizer (``torch_adam``, the object's class)
    with a third state (``Settings.amsgrad``); measured at fp32 only, so a 16-bit ds_config is refused here
    (``model_copy`` skips ``Settings``' own check)."""
    half = [k for k in ("bf16", "fp16") if isinstance(config.get(k), dict) and config[k].get("enabled")]
    if half:
        raise ValueError(f"amsgrad=True under engine=deepspeed with {half[0]} enabled: measured at fp32 only")
    return {"amsgrad": True, "torch_adam": True, "adam_w_mode": optimizer == "adamw"}


def _deepspeed_optimizer(optimizer: str, config: dict) -> dict:
    """DeepSpeed's ``Settings.optimizer`` from the optimizer object (``deepspeed.initialize(optimizer=...)``
    uses the client's, engine.py ``_configure_optimizer``); a config naming the other class is refused, and so
    is ZeRO-Offload of the optimizer, which DeepSpeed refuses for a client optimizer unless told not to."""
    zero = config.get("zero_optimization")
    offload = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    if isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme") and \
            config.get("zero_force_ds_cpu_optimizer", True) is not False:
        raise ValueError(f"ds_config offload_optimizer device {offload['device']} with a torch optimizer object: "
                         "DeepSpeed 0.19.8 refuses a client optimizer under ZeRO-Offload (engine.py "
                         "_configure_optimizer, zero_force_ds_cpu_optimizer); name it in the ds_config instead")
    section = config.get("optimizer")
    named = section.get("type") if isinstance(section, dict) else None
    if isinstance(named, str) and named.lower() != optimizer:
        raise ValueError(f"ds_config optimizer.type={named!r} contradicts the optimizer object "
                         f"({optimizer}): give one")  # fmt: skip
    return {"optimizer": optimizer}
