"""ZeRO++'s ds_config keys as the profile reads them (DeepSpeed 0.19.8, ``runtime/zero/config.py``
``DeepSpeedZeroConfig``: ``zero_hpz_partition_size`` 1, ``zero_quantized_weights`` false,
``zero_quantized_gradients`` false) and the combinations it refuses, one line each. What they do to memory and
traffic: ``zeropp.py``. Pure: no torch, no deepspeed; imports nothing of the profile (``settings.py`` imports it)."""

from __future__ import annotations

HPZ_KEY = "zero_optimization.zero_hpz_partition_size"
QWZ_KEY = "zero_optimization.zero_quantized_weights"
QGZ_KEY = "zero_optimization.zero_quantized_gradients"
ZEROPP_KEYS = frozenset({"zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients"})
"""ZeRO++'s ``zero_optimization`` keys."""


def _refuse(stage: int, hpz: int, qwz: bool, qgz: bool, offload: bool, reduce_scatter: bool = True) -> None:
    """ValueError (one line naming the key) for what the profile does not model."""
    if qgz and not reduce_scatter:
        raise ValueError(f"deepspeed config: {QGZ_KEY} with zero_optimization.reduce_scatter=false: DeepSpeed asserts "
                         "(runtime/zero/stage3.py: 'when enable all_to_all_reduce, reduce_scatter should also be "
                         "enabled')")  # fmt: skip
    used = [k for k, on in ((HPZ_KEY, hpz > 1), (QWZ_KEY, qwz), (QGZ_KEY, qgz)) if on]
    if not used:
        return
    if stage != 3:
        raise ValueError(f"deepspeed config: {used[0]} at stage {stage}: ZeRO++ partitions ZeRO-3's parameters "
                         "(runtime/engine.py passes it to DeepSpeedZeroOptimizer_Stage3 only); use stage 3")  # fmt: skip
    if offload:
        raise ValueError(f"deepspeed config: {used[0]} with offload_optimizer/offload_param: not modelled by the "
                         "profile (the secondary partition and the quantized gathers and reduce with offload)")  # fmt: skip


def check_zeropp(s) -> None:
    """``Settings``' ZeRO++ fields: ``_refuse``."""
    _refuse(s.stage, s.hpz_partition_size, s.quantized_weights, s.quantized_gradients,
            s.offload_optimizer.on or s.offload_param.on, s.reduce_scatter)  # fmt: skip


def check_zeropp_keys(stage: int, found: dict, targets: dict) -> None:
    """The same refusals on a ds_config's keys (``Settings.from_ds_config``: ``found`` maps fields to values)."""
    _refuse(stage, found.get("hpz_partition_size", 1), bool(found.get("quantized_weights")),
            bool(found.get("quantized_gradients")), any(t.on for t in targets.values()),
            found.get("reduce_scatter", True) is not False)  # fmt: skip


def zeropp_keys(s) -> dict:
    """The ``zero_optimization`` keys ``to_ds_config`` writes: only those set (absent: DeepSpeed's defaults)."""
    out: dict = {}
    if s.hpz_partition_size > 1:
        out["zero_hpz_partition_size"] = s.hpz_partition_size
    if s.quantized_weights:
        out["zero_quantized_weights"] = True
    if s.quantized_gradients:
        out["zero_quantized_gradients"] = True
    return out


def hpz_group(hpz: int, nd: int) -> int:
    """Ranks in one hpZ secondary group at N_d = ``nd``; 0: off (a size of 0 or 1). DeepSpeed takes
    ``min(size, world)`` and asserts it divides the world (utils/groups.py ``_create_zero_param_parallel_group``:
    ``_ensure_divisibility``); at N_d = 1 the group is the rank itself, and every parameter still gets a secondary
    partition, whole (partition_parameters.py ``_partition_param_sec``: ``tensor_size // 1``)."""
    if hpz <= 1:
        return 0
    size = min(hpz, nd)
    if nd % size:
        raise ValueError(f"{HPZ_KEY}={hpz}: must divide N_d={nd} (DeepSpeed asserts it: utils/groups.py "
                         "_create_zero_param_parallel_group)")  # fmt: skip
    return size


def node_keys(own: dict) -> dict:
    """``plan``'s ``--gpus-per-node`` (``planning/engine_plan.py``: own ``gpus_per_node``) as the accelerator's device
    count, ``Settings.devices_per_node`` (qgZ's groups); {} without it (estimate: the default 8)."""
    return {"devices_per_node": own["gpus_per_node"]} if own.get("gpus_per_node") else {}
