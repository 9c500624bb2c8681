"""FSDP2's reading of a live module and optimizer (``Engine.live_settings``)."""

from __future__ import annotations

from zeroplan.engines.live import LiveRun, adam_only


def live_settings(run: LiveRun, given: dict) -> tuple[dict, dict]:
    """``Settings.module_dtype`` is the module's (the shards keep it); Adam/AdamW only, with states in the
    module's dtype (torch creates them like the parameter); ``amsgrad`` (``Settings.amsgrad``: the third state)
    and ``fused`` (``Settings.fused``: no step temporaries)."""
    adam_only("fsdp2", run)
    if run.state_dtype not in (None, run.dtype):
        raise ValueError(f"optimizer states in {run.state_dtype}, parameters in {run.dtype}: FSDP2's Adam "
                         "states are modelled in the module's dtype")  # fmt: skip
    return {}, {"module_dtype": run.dtype, **{k: True for k in ("amsgrad", "fused") if getattr(run, k)}}
