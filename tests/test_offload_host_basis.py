"""Which host bytes a plan row's host memory is (issue 21): plan JSON rows carry estimate's
host_steady_bytes_per_gpu / host_init_peak_bytes_per_gpu / host_peak_at, and the table says which one it shows and
which one --host-memory was compared with.

llama2-7b: Ψ = 6,738,415,616. Reference ZeRO-Offload at N_d = 4: a rank's shard is Ψ/4 = 1,684,603,904 elements, its
host bytes 14 per element (fp32 master, m, v and the bf16 gradient: Ren et al. 2021 sec. 4).
"""

from __future__ import annotations

from tests.clicheck import run, run_json

PSI = 6_738_415_616
SHARD = PSI // 4
REFERENCE = ("plan", "--model", "llama2-7b", "--gpu", "a100-40gb", "--gpus", "4", "--offload", "cpu")
FSDP2 = ("--engine", "fsdp2", "--model", "llama2-7b", "--gpus", "8", "--fsdp-offload", "cpu", "--init", "materialized")


def _rows(d: dict) -> dict:
    return {o["label"]: o for o in (*d["stages"], *d["offload"])}


def test_reference_rows_are_the_steady_bytes_and_host_memory_is_compared_with_them():
    """A reference offload row's host bytes are the steady state (init is not modelled on the host: null); a
    --host-memory one byte below 4 x the steady bytes of "1 + optimizer->cpu" makes it not fit, one at it fits."""
    steady = SHARD * 14
    assert steady == 23_584_454_656
    node = 4 * steady
    for memory, fits in ((node, True), (node - 1, False)):
        rows = _rows(run_json(*REFERENCE, "--host-memory", str(memory)))
        z1 = rows["1 + optimizer->cpu"]
        assert (z1["host_bytes_per_gpu"], z1["host_steady_bytes_per_gpu"]) == (steady, steady)
        assert (z1["host_init_peak_bytes_per_gpu"], z1["host_peak_at"], z1["fits"]) == (None, "steady", fits)
        assert {k: rows["0"][k] for k in ("host_steady_bytes_per_gpu", "host_init_peak_bytes_per_gpu", "host_peak_at")} \
            == {"host_steady_bytes_per_gpu": 0, "host_init_peak_bytes_per_gpu": 0, "host_peak_at": "steady"}  # fmt: skip
    table = run(*REFERENCE, "--host-memory", str(node)).output
    assert "Host fit: each option's steady host bytes" in table and "within --host-memory 87.9 GiB." in table
    assert "Host fit:" not in run(*REFERENCE).output  # nothing compared without --host-memory


def test_engine_rows_name_the_init_peak_as_estimate_does():
    """FSDP2 CPUOffloadPolicy with materialized init at N_d = 8: the whole model built on each rank's CPU (4Ψ) and
    the first unit's new shard are above the steady bytes; every plan row's keys are estimate's, and the table's
    host/node cells say "(init)"."""
    (est,) = run_json("estimate", *FSDP2)["stages"]
    plan = run_json("plan", *FSDP2, "--gpu", "h100-80gb")
    rows = list(_rows(plan).values())
    assert len(rows) == 4
    keys = ("host_bytes_per_gpu", "host_steady_bytes_per_gpu", "host_init_peak_bytes_per_gpu", "host_peak_at")
    for row in rows:
        assert {k: row[k] for k in keys} == {k: est[k] for k in keys}
    assert est["host_peak_at"] == "init" and est["host_init_peak_bytes_per_gpu"] == 27_054_854_144
    assert est["host_init_peak_bytes_per_gpu"] - 4 * PSI == 101_191_680  # the first unit's new fp32 shard
    assert est["host_steady_bytes_per_gpu"] == 16_846_040_204 < est["host_bytes_per_gpu"]
    table = run("plan", *FSDP2, "--gpu", "h100-80gb").output
    assert table.count("202 GiB (init)") == 4 and "Host: host/node is one rank's host memory x 8 GPUs" in table
