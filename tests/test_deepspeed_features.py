"""Real DeepSpeed (gloo, CPU) beyond the matrix of tests/test_deepspeed_engine.py (which has overlap_comm and
BF16_Optimizer at N_d = 2 and 4): gradient accumulation, activation checkpointing (ZeRO-2 and 3) and a Llama, against
``zeroplan.engines.deepspeed``.

The session's one torchrun world of N_d = 2 (``tests/deepspeed_world.py``: a model and checkpointing per
config, so one world's ~30 s of setup serves these and the other DeepSpeed modules) trains every case below
for three steps, each row compared by
the validator's own ``compare_row``: model states within 1%, every phase's peak within its recorded error + max(64 B, 0.05%)
(``tests/data/measured/deepspeed.json``; 3% before issue 16), steady-state
collectives equal in elements (the second step: ZeRO-3 records its trace in the first). One row trains
transformers' ``LlamaForCausalLM`` of the same config (``"hf": true``, ``hf_builder``). fp32 and torch's
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
from tests.test_measured_rows import live_peak_misses  # noqa: E402

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
        # ZeRO-1 reducing from its hooks at the boundary micro-step only (engines/deepspeed/boundary.py): rank 1's
        # grads_in_partition beside the earlier micro-step's gradients not yet moved into the bucket
        "z1-overlap-accum2": (accum(ds_config(1, zero={**SMALL, "overlap_comm": True}, optimizer_params=adam)), {}),
        "z2-checkpointing": (ds_config(2, zero=SMALL, optimizer_params=adam), {"checkpointing": "full"}),
        "z3-checkpointing": (ds_config(3, zero=SMALL, optimizer_params=adam), {"checkpointing": "full"}),
        "z2-llama": (ds_config(2, zero=SMALL, optimizer_params=adam), {"model": LLAMA}),
        "z3-llama": (ds_config(3, zero=SMALL, optimizer_params=adam), {"model": LLAMA}),
        # fp16: DeepSpeed's capability check answered yes on this CPU (validate/engines/deepspeed.py fp16_on_cpu)
        **{f"z{s}-fp16": (ds_config(s, "fp16", zero=SMALL, optimizer_params=adam), {}) for s in (1, 2, 3)},
        # ZeRO-3 with prefetch and a reuse distance below the model (stage3_schedule): distance 0 releases
        # what the prefetch scan has not marked; 1e4 keeps the root's head weight for backward; DeepSpeed's
        # default prefetch gathers the whole model in one coalesced all-gather at the root's fetch
        "z3-llama-prefetch-r0": (ds_config(3, zero={**SMALL, "stage3_max_reuse_distance": 0}, optimizer_params=adam),
                                 {"model": LLAMA}),
        "z3-llama-prefetch-r1e4": (ds_config(3, zero={**SMALL, "stage3_max_reuse_distance": 10_000},
                                             optimizer_params=adam), {"model": LLAMA}),
        "z3-default-prefetch-r0": (ds_config(3, zero={**SMALL, "stage3_prefetch_bucket_size": 50_000_000,
                                                      "stage3_max_reuse_distance": 0}, optimizer_params=adam), {}),
        # transformers' LlamaForCausalLM of the same config (hf_builder): body and lm_head called as modules
        # (stage3_trace head_module); the root's one prefetch call is held open to lm_head's fetch
        "z3-llama-hf-default-prefetch-r0": (ds_config(3, zero={**SMALL, "stage3_prefetch_bucket_size": 50_000_000,
                                                               "stage3_max_reuse_distance": 0}, optimizer_params=adam),
                                            {"model": LLAMA, "hf": True}),
    }  # fmt: skip


NAMES = list(_cases())


# the session's shared world of N_d = 2 (tests/deepspeed_world.py), 3 steps
DEEPSPEED_WORLD = {ND: lambda: list(_cases().values())}


@pytest.fixture(scope="module")
def world(request, deepspeed_world):
    from validate.engines.deepspeed import compare_row, workload_for

    cases = _cases()
    ranks = deepspeed_world.ranks(request.module, ND)
    rows = {}
    for i, (name, (config, run)) in enumerate(cases.items()):
        workload = workload_for(run.get("model", "gpt-tiny"), config["train_micro_batch_size_per_gpu"], None,
                                config.get("gradient_accumulation_steps", 1), run.get("checkpointing", "none"),
                                hf=run.get("hf", False))  # fmt: skip
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
    # every phase at this row's recorded error + max(64 B, 0.05%) (tests/test_measured_rows.py), not 3%
    misses = live_peak_misses(f"deepspeed-{name}-nd{ND}", row["measured_peak_bytes_by_phase"],
                              row["predicted_peak_bytes_by_phase"])  # fmt: skip
    assert misses == []


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


def test_prefetch_rows_follow_the_coordinator(world):
    """The prefetch rows are the coordinator's schedule, not everything gathered: at distance 0 the root's
    head weight is released after forward and gathered again in backward (one call), at 1e4 it is kept; the
    forward all-gathers are the prefetch's coalesced calls (7 for tiny-llama at 5,000 elements, not one per
    parameter), and forward ends with the flat buffer (9,168 elements) of the coalesced all-gather of layer 1's
    down_proj and the embedding's backward use still waited on: the measured forward peak is 16,896 B above
    "everything gathered" (the profile before) at distance 0, where the head is released, 36,672 B at 1e4."""
    from validate.engines.deepspeed import workload_for
    from validate.report import _key

    for name, backward in (("z3-llama-prefetch-r0", (1, 4_944)), ("z3-llama-prefetch-r1e4", None)):
        config, ranks, row = world[name]
        calls = [c for c in ranks[0]["calls_by_step"][-1] if c[0] == "all-gather"]
        assert [c[3] for c in calls if c[1] == "forward"] == [4_944, 7_248, 8_064, 8_448, 6_144, 8_448, 9_168]
        regathered = [c[3] for c in calls if c[1] == "backward"]
        assert (len(regathered), sum(regathered)) == (backward or (0, 0)), regathered
        run = D.ds_run(D.Settings.from_ds_config(config), workload_for(LLAMA, 2, None), ND, stat_bytes=4)
        s = run.settings
        sched = D.stage3_schedule(run.trace, run.numels, ND, s.param_persistence_threshold, s.prefetch_bucket_size,
                                  s.max_live_parameters, s.max_reuse_distance)  # fmt: skip
        assert sched.at(run.trace, "forward end") == 47_520 + 9_168 - (4_944 if backward else 0)
        assert row["measured_peak_bytes_by_phase"]["forward"] == row["predicted_peak_bytes_by_phase"]["forward"]
        assert row["measured_collectives"][_key("all-gather", "forward", "float32")]["elements"] == 52_464
@pytest.mark.parametrize("name", ["z3-checkpointing", "z3-llama"])
def test_zero3_forward_gathers_are_the_replayed_prefetches(world, name):
    """ZeRO-3's forward all-gathers, call by call, are ``stage3_schedule``'s: which parameters each fetch and
    prefetch takes (each call's elements: its buffer, Σ ceil(n / N_d)·N_d), in order, on every rank and step
    from the second. The profile's open coalesced buffers (the checkpointed block's forward peak) rest on it."""
    import math

    from validate.engines.deepspeed import workload_for

    config, ranks, _ = world[name]
    workload = workload_for(_cases()[name][1].get("model", "gpt-tiny"), 2, None)
    numels = tuple(math.prod(sh) for _, sh in workload.shapes)
    s = D.Settings.from_ds_config(config)
    trace = D.stage3_trace(workload.shapes, workload.spec.style,
                           workload.spec.style == "gpt" and workload.spec.tie_word_embeddings)  # fmt: skip
    sched = D.stage3_schedule(trace, numels, ND, s.param_persistence_threshold, s.prefetch_bucket_size,
                              s.max_live_parameters, s.max_reuse_distance)  # fmt: skip
    forward = [g for g in sched.gathers if not trace.events[g.issued].backward_phase]
    want = [g.elements for g in forward]
    assert want == [sum(-(-numels[p] // ND) * ND for p in g.params) for g in forward]
    assert len(want) > 3 and any(len(g.params) > 1 for g in forward)
    for rank in ranks:
        for calls in rank["calls_by_step"][2:]:
            got = [c[3] for c in calls if c[:2] == ["all-gather", "forward"]]
            assert got == want, (got, want)


def test_the_transformers_model_is_what_ran(world):
    """The hf row trained transformers' model, not the validator's in disguise: its head is gathered with the
    root's prefetch and kept to backward (one forward call, nothing in backward), where the validator's model
    of the same config, at the same settings, gathers the head again in backward (stage3_trace)."""
    from validate.report import _key

    _, _, hf = world["z3-llama-hf-default-prefetch-r0"]
    assert _key("all-gather", "backward", "float32") not in hf["measured_collectives"]
    assert hf["measured_collectives"][_key("all-gather", "forward", "float32")]["elements"] == 47520
    _, ranks, _ = world["z3-llama-hf-default-prefetch-r0"]
    assert [c[3] for c in ranks[0]["calls_by_step"][-1] if c[:2] == ["all-gather", "forward"]] == [47520]
    import math

    from validate.engines.deepspeed import workload_for

    config, _, _ = world["z3-llama-hf-default-prefetch-r0"]
    validator = workload_for(LLAMA, 2, None)
    numels = tuple(math.prod(sh) for _, sh in validator.shapes)
    predicted = D.collectives(D.Settings.from_ds_config(config, zero_init=False), numels, ND, 1, *D._trace(validator))
    assert [c.elements for c in predicted if c.op == "all-gather" and c.phase == "backward"] == [4944]
