"""DeepSpeed's own model-state estimators, restated: shown beside the prediction (``zeroplan estimate``'s
"DeepSpeed's estimator" column), never used for it; each wrapper carries its file's (``Wrapper.ds_estimate``,
asked by wrapper.py ``ds_estimate_bytes``)."""

from __future__ import annotations

from zeroplan.engines.deepspeed.settings import Settings

def ds_estimate_zero2_bytes(psi: int, nd: int) -> int:
    """DeepSpeed's own ZeRO-2 estimate per GPU, no offload: 2Ψ + 18Ψ/N_d (runtime/zero/stage_1_and_2.py
    ``estimate_zero2_model_states_mem_needs``); shown beside the prediction, never used for it."""
    return 2 * psi + int(18 * psi / nd)


def ds_estimate_zero3_bytes(psi: int, largest_layer_numel: int, nd: int) -> int:
    """DeepSpeed's own ZeRO-3 estimate per GPU, no offload: 4·largest layer + 18Ψ/N_d
    (runtime/zero/stage3.py ``estimate_zero3_model_states_mem_needs``)."""
    return 4 * largest_layer_numel + int(18 * psi / nd)


def zero12_estimate_bytes(s: Settings, numels: tuple[int, ...], nd: int) -> int:
    """stage_1_and_2.py's estimator (``estimate_zero2_model_states_mem_needs_all_live``), the flat-group wrappers'
    (ZeRO-1 has none: DeepSpeed's ZeRO-2 one is shown); with ``offload_optimizer`` its GPU figure
    (``cpu_offload=True``): 2Ψ."""
    psi = sum(numels)
    return 2 * psi if s.offload_optimizer.on else ds_estimate_zero2_bytes(psi, nd)


def zero3_estimate_bytes(s: Settings, numels: tuple[int, ...], nd: int) -> int:
    """stage3.py's estimator (``estimate_zero3_model_states_mem_needs_all_live``); with ``offload_optimizer`` its
    GPU figure (``cpu_offload=True``): 4·largest layer + 2Ψ/N_d, 4·largest layer with ``offload_param`` too
    (``cpu_offload_params``); it has no case for parameter offload alone (the no-offload figure is shown)."""
    psi = sum(numels)
    if s.offload_optimizer.on:
        return 4 * max(numels) + (0 if s.offload_param.on else int(2 * psi / nd))
    return ds_estimate_zero3_bytes(psi, max(numels), nd)
