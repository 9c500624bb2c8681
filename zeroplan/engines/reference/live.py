"""The reference engine's reading of a live module and optimizer (``Engine.live_settings``)."""

from __future__ import annotations

from zeroplan.engines.live import LiveRun, agree


def live_settings(run: LiveRun, given: dict) -> tuple[dict, dict]:
    """(policy keywords, Settings fields) of the paper's mixed precision, as its runtime runs it: a 16-bit
    module's dtype is ``param_dtype``; with an optimizer, an fp32 module's too (a plain fp32 run), and the class
    is ``optimizer``. The optimizer steps the fp32 master copy (on for a 16-bit module), so its states are fp32
    whatever the object's; without a master copy (an fp32 module, or ``master_weights=False``: a plain torch
    run) they are the states' dtype read. Adam's ``amsgrad`` is ``Settings.amsgrad`` (the third state). An fp32
    module alone keeps the policy given (a module does not say
    how it is trained: autocast or a mixed-precision wrapper may cast it)."""
    if run.optimizer is None:
        return ({"param_dtype": run.dtype} if run.dtype != "fp32" and "param_dtype" not in given else {}), {}
    master = given.get("master_weights")
    plain = master is False or (master is None and run.dtype == "fp32")  # PrecisionPolicy.master_dtype
    read = {"param_dtype": run.dtype, "optimizer": run.optimizer,
            "optimizer_dtype": run.state_dtype if plain else "fp32"}  # fmt: skip
    agree(given, read)
    return read, ({"amsgrad": True} if run.amsgrad else {})
