"""Real DeepSpeed (gloo, CPU) beyond the matrix of tests/test_deepspeed_engine.py (which has overlap_comm and
BF16_Optimizer at N_d = 2 and 4): gradient accumulation, activation checkpointing and a Llama, against
``zeroplan.engines.deepspeed``.

One torchrun world of N_d = 2 trains every case below for two steps (``run_world(..., runs=...)``: a
model and checkpointing per config, so one world's ~30 s of setup serves them all), each row compared by
the validator's own ``compare_row``: model states within 1%, every phase's peak within 3%, steady-state
collectives equal in elements (the second step: ZeRO-3 records its trace in the first). fp32 and torch's
AdamW (``torch_adam``): the dtype and kernel do not matter here, except in the fp16 rows: DeepSpeed's fp16
path (its loss scaler and overflow checks; ZeRO-3 adds an all-reduce of the overflow flag) on a CPU whose
oneDNN has no fp16, with DeepSpeed's capability check answered yes by the runner (``fp16_on_cpu``,
docs/engines/deepspeed.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip(
    "deepspeed", reason="DeepSpeed is an optional extra: DS_BUILD_OPS=0 pip install '.[deepspeed]'"
)

from zeroplan.engines import deepspeed as D  # noqa: E402
from zeroplan.formulas.peak import PHASES  # noqa: E402

ND, STATES_TOL, PEAK_TOL = 2, 0.01, 0.03
LLAMA = str(Path(__file__).resolve().parent / "data" / "hf_configs" / "tiny-llama.json")
SMALL = {"reduce_bucket_size": 5000, "allgather_bucket_size": 5000, "stage3_prefetch_bucket_size": 5000,
         "stage3_param_persistence_threshold": 100}  # fmt: skip


def _cases() -> dict[str, tuple[dict, dict]]:
    """name -> (ds_config, runner overrides: model, checkpointing)."""
    from validate.engines.deepspeed import ds_config

    adam = {"torch_adam": True}

    def accum(config: dict) -> dict:
        return {**config, "gradient_accumulation_steps": 2}

    return {
        "z1-accum2": (accum(ds_config(1, zero=SMALL, optimizer_params=adam)), {}),
        "z2-accum2": (accum(ds_config(2, zero=SMALL, optimizer_params=adam)), {}),
        "z3-accum2": (accum(ds_config(3, zero=SMALL, optimizer_params=adam)), {}),
        "z2-checkpointing": (ds_config(2, zero=SMALL, optimizer_params=adam), {"checkpointing": "full"}),
        "z2-llama": (ds_config(2, zero=SMALL, optimizer_params=adam), {"model": LLAMA}),
        "z3-llama": (ds_config(3, zero=SMALL, optimizer_params=adam), {"model": LLAMA}),
        # fp16: DeepSpeed's capability check answered yes on this CPU (validate/engines/deepspeed.py fp16_on_cpu)
        **{f"z{s}-fp16": (ds_config(s, "fp16", zero=SMALL, optimizer_params=adam), {}) for s in (1, 2, 3)},
    }  # fmt: skip


NAMES = list(_cases())


@pytest.fixture(scope="module")
def world():
    from validate.engines.deepspeed import compare_row, run_world, workload_for

    cases = _cases()
    configs = [c for c, _ in cases.values()]
    runs = [r for _, r in cases.values()]
    ranks = run_world(configs, ND, steps=2, runs=runs)
    rows = {}
    for i, (name, (config, run)) in enumerate(cases.items()):
        workload = workload_for(run.get("model", "gpt-tiny"), config["train_micro_batch_size_per_gpu"], None,
                                config.get("gradient_accumulation_steps", 1), run.get("checkpointing", "none"))  # fmt: skip
        rows[name] = (config, [r[i] for r in ranks],
                      compare_row(config, ND, [r[i] for r in ranks], workload, name, STATES_TOL, PEAK_TOL))  # fmt: skip
    return rows


@pytest.mark.parametrize("name", NAMES)
def test_row_within_tolerance(world, name):
    config, rank_rows, row = world[name]
    settings = D.Settings.from_ds_config(config)
    assert rank_rows[0]["optimizer_class"] == D.optimizer_class(settings)
    assert abs(row["model_states_rel_error"]) <= STATES_TOL, row["model_states_rel_error"]
    assert row["checks"]["model_states_steady"]
    assert row["checks"]["collectives_match"], (row["predicted_collectives"], row["measured_collectives"])
    assert all(r["gloo_settle"]["unsettled"] == 0 for r in rank_rows)
    for phase in PHASES:
        measured = row["measured_peak_bytes_by_phase"][phase]
        predicted = row["predicted_peak_bytes_by_phase"][phase]
        assert abs(measured - predicted) <= PEAK_TOL * measured, (phase, measured, predicted)


def test_what_accumulation_changes_is_measured(world):
    """The rows are not the plain ones in disguise: accumulation doubled the ZeRO-2/3 backward reductions,
    while ZeRO-1 reduced once, at the boundary, in parameter order."""
    import math

    from validate.engines.deepspeed import workload_for
    from validate.report import _key

    numels = tuple(math.prod(sh) for _, sh in workload_for("gpt-tiny", 2, None).shapes)
    for name, op in (("z2-accum2", "all-reduce"), ("z3-accum2", "reduce-scatter")):
        _, _, row = world[name]
        measured = row["measured_collectives"][_key(op, "backward", "float32")]
        assert measured["elements"] == 2 * sum(numels), measured
    _, ranks, _ = world["z1-accum2"]
    sizes = [c[3] for c in ranks[0]["calls_by_step"][-1] if c[:2] == ["all-reduce", "backward"]]
    assert tuple(sizes) == D.greedy_buckets(numels, SMALL["reduce_bucket_size"]), sizes


def test_fp16_runs_deepspeeds_fp16_path(world):
    """The fp16 rows ran DeepSpeed's fp16 optimizer (dtype float16 parameters, its loss scaler), not a
    bf16 or fp32 run renamed: the override is reported where DeepSpeed would have refused, and only there."""
    import torch

    for name, (config, rank_rows, row) in world.items():
        fp16 = name.endswith("-fp16")
        assert all(r["fp16_capability_overridden"] is (fp16 and not _cpu_has_fp16(torch)) for r in rank_rows), name
        if fp16:
            assert row["measured_collectives"].get("all-reduce|optimizer_step|int8"), row["measured_collectives"]


def _cpu_has_fp16(torch) -> bool:
    """What DeepSpeed's CPU accelerator asks (accelerator/cpu_accelerator.py is_fp16_supported)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # as DeepSpeed: an op this torch lacks means no
        return False
