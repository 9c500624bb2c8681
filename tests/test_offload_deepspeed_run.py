"""Real DeepSpeed with ``offload_optimizer: cpu`` (gloo, CPU, N_d = 2) against the profile's offload
(issue 21): one ds_config in the session's shared N_d = 2 world (tests/deepspeed_world.py: ~2 s there), so that
the recorded rows of ``tests/test_engine_offload.py`` stay what DeepSpeed does. It needs DeepSpeed's ``cpu_adam``
JIT op (``DeepSpeedCPUAdam``): built in the background from collection on (``DEEPSPEED_JIT_OPS``; 31 min of wall
time on this loaded 2-core machine the first time, cached after). On CPU the GPU and the host are one memory: the
validator compares their sum (docs/engines/deepspeed.md "Offload").

Not in CI's slice (tests/suite_slices.py): the op's first build costs minutes of the suite's budget, and a build that
failed would fail the whole shared world; the recorded row stays checked by ``tests/test_engine_offload.py`` with
no run, and ``benchmarks/full_matrices.py`` runs this live."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "deepspeed", reason="DeepSpeed is an optional extra: DS_BUILD_OPS=0 pip install '.[deepspeed]'"
)

from tests.suite_slices import ci_slice  # noqa: E402
from tests.test_engine_offload import MEASURED, _offload_config  # noqa: E402

CASE = ("z2", 2, 1)
LIVE = ci_slice(["z2"], [])  # the full matrices only (module docstring)
DEEPSPEED_JIT_OPS = ("CPUAdamBuilder",) if LIVE else ()
DEEPSPEED_WORLD = {2: lambda: [(_offload_config(case), {}) for case in LIVE]}


@pytest.mark.skipif(not LIVE, reason="full matrices only (ZEROPLAN_FULL_MATRICES=1): cpu_adam's JIT build")
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
