"""The runner's synchronous collectives against DeepSpeed's own asynchronous handles, on gloo CPU.

The DeepSpeed runner makes every collective synchronous (``validate.engines.deepspeed_changes.GlooSettled``:
a call returns once gloo has let go of its tensors) so that a buffer freed after a collective is freed at
the same moment on every rank. Here one ``overlap_comm`` row (ZeRO-2, DeepSpeed's reduction stream and
double ``ipg_buffer``) trains twice in the session's one torchrun world of N_d = 2 (tests/deepspeed_world.py),
gpt-tiny, three steps: once through the runner's synchronous collectives and once with ``"settle": false``,
DeepSpeed's own asynchronous handles. Measured 2026-12-01 (N_d = 2, 3 steps, and a ZeRO-3 pair beside it): the same model states
(363,248 B), the same step-boundary bytes on both ranks and the same peak in every phase, to the byte;
both rows within tolerance of the profile. So the synchronous reading is representative of the engine
as it runs; its cost is time only.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "deepspeed", reason="DeepSpeed is an optional extra: pip install '.[deepspeed]' (with DS_BUILD_OPS=0)"
)

ND = 2
# tests/test_deepspeed_engine.py's small buckets (the ZeRO-3 keys do nothing at ZeRO-2): the synchronous row
# is that module's z2-fp32-small+overlap, run once for both in the session's shared world
SMALL = {"reduce_bucket_size": 5000, "allgather_bucket_size": 5000, "stage3_prefetch_bucket_size": 5000,
         "stage3_param_persistence_threshold": 100}  # fmt: skip
# gloo holding one bucket a moment longer in one of the two runs would add up to 5,000 x 4 B = 20 kB to a
# phase; none was seen (0 B). 1 KiB of slack leaves room for DeepSpeed's scalar temporaries only.
PEAK_SLACK_BYTES = 1024


def _config() -> dict:
    from validate.engines.deepspeed import ds_config

    return ds_config(2, zero={**SMALL, "overlap_comm": True}, optimizer_params={"torch_adam": True})


# the session's shared world of N_d = 2 (tests/deepspeed_world.py), 3 steps
DEEPSPEED_WORLD = {ND: lambda: [(_config(), {}), (_config(), {"settle": False})]}


@pytest.fixture(scope="module")
def rows(request, deepspeed_world):
    from validate.engines.deepspeed import compare_row, workload_for

    config = _config()
    ranks = deepspeed_world.ranks(request.module, ND)
    workload = workload_for("gpt-tiny", 2, None)
    return [(compare_row(config, ND, [r[i] for r in ranks], workload, "gpt-tiny", 0.01, 0.03), [r[i] for r in ranks])
            for i in range(2)]  # fmt: skip


@pytest.mark.distributed
def test_asynchronous_handles_measure_what_the_synchronous_runner_measures(rows):
    (sync, sync_ranks), (free, free_ranks) = rows
    assert all(r["gloo_settle"] is not None for r in sync_ranks) and all(r["gloo_settle"] is None for r in free_ranks)
    assert any("GlooSettled" in c for c in sync["runner_changes"])
    assert any("left asynchronous" in c for c in free["runner_changes"])
    assert sync["engine_label"] == free["engine_label"] == "ZeRO-2 DeepSpeedZeroOptimizer + AdamW"
    for row in (sync, free):
        assert row["ok"], row["checks"]
        assert row["model_states_rel_error"] == 0  # exact, both ways
    # every step boundary of every rank: the same bytes
    assert [r["boundary_bytes"] for r in free_ranks] == [r["boundary_bytes"] for r in sync_ranks]
    for phase, got in free["measured_peak_bytes_by_phase"].items():
        assert abs(got - sync["measured_peak_bytes_by_phase"][phase]) <= PEAK_SLACK_BYTES, phase
    assert free["measured_collectives"] == sync["measured_collectives"]
