"""Real DeepSpeed (gloo, CPU) beyond the matrix of tests/test_deepspeed_engine.py (which has overlap_comm and
BF16_Optimizer at N_d = 2 and 4): gradient accumulation, activation checkpointing (ZeRO-2 and 3) and a Llama, against
``zeroplan.engines.deepspeed``.

One torchrun world of N_d = 2 trains every case below for two steps (``run_world(..., runs=...)``: a
model and checkpointing per config, so one world's ~30 s of setup serves them all), each row compared by
the validator's own ``compare_row``: model states within 1%, every phase's peak within 3%, steady-state
collectives equal in elements (the second step: ZeRO-3 records its trace in the first). fp32 and torch's
AdamW (``torch_adam``): the dtype and kernel do not matter here. fp16 is not here: DeepSpeed refuses it on
this CPU (docs/engines/deepspeed.md).
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
        "z3-checkpointing": (ds_config(3, zero=SMALL, optimizer_params=adam), {"checkpointing": "full"}),
        "z2-llama": (ds_config(2, zero=SMALL, optimizer_params=adam), {"model": LLAMA}),
        "z3-llama": (ds_config(3, zero=SMALL, optimizer_params=adam), {"model": LLAMA}),
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
        if phase == "optimizer_step" and settings.stage in (1, 2):
            # the one phase not settled yet (tests/test_deepspeed_engine.py _unsettled_step_bytes): one rank of
            # some runs reads up to a bucket's flat copy more; bounded by two
            high = predicted + 2 * SMALL["reduce_bucket_size"] * 4
            assert predicted * (1 - PEAK_TOL) <= measured <= high, (measured, predicted)
        else:
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


@pytest.mark.parametrize("name", ["z3-checkpointing", "z3-llama"])
def test_zero3_forward_gathers_are_the_simulated_prefetches(world, name):
    """ZeRO-3's forward all-gathers, call by call, are ``prefetch_groups``'s: which parameters each fetch and
    prefetch takes (each call's elements: its buffer, Σ ceil(n / N_d)·N_d), in order, on every rank and step
    from the second. The profile's open coalesced buffers (the checkpointed block's forward peak) rest on it."""
    import math

    from validate.engines.deepspeed import workload_for

    config, ranks, _ = world[name]
    workload = workload_for(_cases()[name][1].get("model", "gpt-tiny"), 2, None)
    numels = tuple(math.prod(sh) for _, sh in workload.shapes)
    settings = D.Settings.from_ds_config(config)
    fetches = D.forward_fetches(workload.shapes, workload.spec.style, workload.spec.tied)
    want = [sum(-(-numels[p] // ND) * ND for p in g.params) for g in D.prefetch_groups(settings, numels, fetches)]
    assert len(want) > 3 and any(len(g.params) > 1 for g in D.prefetch_groups(settings, numels, fetches))
    for rank in ranks:
        for calls in rank["calls_by_step"][2:]:
            got = [c[3] for c in calls if c[:2] == ["all-gather", "forward"]]
            assert got == want, (got, want)
