"""Real DeepSpeed with ``offload_optimizer: cpu`` (gloo, CPU, N_d = 2) against the profile's offload
(issue 21): one ds_config in the session's shared N_d = 2 world (tests/deepspeed_world.py: ~2 s there), so that
the recorded rows of ``tests/test_engine_offload.py`` stay what DeepSpeed does. It needs DeepSpeed's ``cpu_adam``
JIT op (``DeepSpeedCPUAdam``): built in the background from collection on (``DEEPSPEED_JIT_OPS``; 31 min of wall
time on this loaded 2-core machine the first time, cached after). On CPU the GPU and the host are one memory: the
validator compares their sum (docs/engines/deepspeed.md "Offload")."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "deepspeed", reason="DeepSpeed is an optional extra: DS_BUILD_OPS=0 pip install '.[deepspeed]'"
)

from tests.test_engine_offload import MEASURED, _offload_config  # noqa: E402

CASE = ("z2", 2, 1)
DEEPSPEED_JIT_OPS = ("CPUAdamBuilder",)
DEEPSPEED_WORLD = {2: lambda: [(_offload_config("z2"), {})]}


def test_zero2_offload_row_is_the_recorded_one(request, deepspeed_world):
    from validate.engines.deepspeed import compare_row, workload_for

    ranks = deepspeed_world.ranks(request.module, 2)
    (config,) = [c for c, _ in DEEPSPEED_WORLD[2]()]
    assert [r[0]["inner_optimizer_class"] for r in ranks] == ["DeepSpeedCPUAdam"] * 2
    row = compare_row(config, 2, [r[0] for r in ranks], workload_for("gpt-tiny", 2, None), "gpt-tiny", 0.01, 0.03)
    assert row["measured_model_states_bytes"] == row["predicted_model_states_bytes"] == 420_304
    assert row["checks"]["collectives_match"]
    assert row["measured_peak_bytes_by_phase"] == MEASURED[CASE]
    assert row["ok"], row["peak_rel_error_by_phase"]
