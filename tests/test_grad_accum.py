"""Gradient accumulation: G micro-steps per optimizer step, predicted (peak per phase, collectives per
optimizer step) and measured on the reference runtime (issue 8, ``--grad-accum``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from background import cli_job, key, zeroplan
from zeroplan.architectures.hf_config import read_hf_config
from zeroplan.engines.reference import moments, predict_peak, reference_run
from zeroplan.formulas.commtime import calls_per_optimizer_step
from zeroplan.formulas.peak import PHASES

HF_CONFIGS = Path(__file__).parent / "data" / "hf_configs"
G = 2


# The module's two runs, each one of the session's background jobs (tests/background.py: started at collection,
# niced, while the other tests run; this module runs last): ``zeroplan validate ARGS --json FILE``, in-process
# (a child process per run imported torch and the validator again: issue 16, the suite's time budget).
BACKGROUND_CLI = {
    # real gloo, N_d = 2, stages 0 and 2 (reduce at the boundary vs every micro-step)
    "real": ["--model", str(HF_CONFIGS / "tiny-gpt2.json"), "--world-size", "2", "--stage", "0", "--stage", "2",
             "--seq-len", "16", "--steps", "2", "--grad-accum", str(G)],
    # simulated N_d = 8, stages 1 and 3 (Llama family, full checkpointing)
    "simulated": ["--model", str(HF_CONFIGS / "tiny-llama.json"), "--simulated", "--world-size", "8", "--stage", "1",
                  "--stage", "3", "--seq-len", "16", "--steps", "2", "--checkpointing", "full", "--grad-accum", str(G)],
}  # fmt: skip


def validate(background, module, name: str) -> SimpleNamespace:
    """The run ``name``: exit code, stdout, stderr and ``report`` (the JSON, or None when it wrote none)."""
    return SimpleNamespace(**background.result(key(module, name), cli_job(module.BACKGROUND_CLI[name])))


@pytest.fixture(scope="module")
def real(request, background):
    """Real gloo, N_d = 2, stages 0 and 2 (reduce at the boundary vs every micro-step)."""
    return validate(background, request.module, "real")


@pytest.fixture(scope="module")
def simulated(request, background):
    """Simulated N_d = 8, stages 1 and 3 (Llama family, full checkpointing)."""
    return validate(background, request.module, "simulated")


def check_row(row: dict) -> None:
    pred, meas = row["predicted_peak_bytes_by_phase"], row["measured_peak_bytes_by_phase"]
    assert set(pred) == set(meas) == set(PHASES)
    for phase in PHASES:  # the bound, both sides
        assert abs(meas[phase] - pred[phase]) <= 0.02 * meas[phase], (row["stage"], phase, pred, meas)
    assert pred == meas, row["stage"]  # derived op by op: equal to the byte
    assert abs(row["model_states_rel_error"]) <= 0.01 and row["checks"]["collectives_match"] is True
    assert row["grad_accum"] == G and row["ok"]
    # collectives per optimizer step: G calls' elements where commtime says every micro-step, else one
    for key, c in row["measured_collectives"].items():
        op = key.split("|")[0]
        assert c["elements"] == row["predicted_collectives"][key]["elements"]
        n = calls_per_optimizer_step(row["stage"], op, G)
        assert n == (G if (op == "all-gather" and row["stage"] == 3) or (op == "reduce-scatter" and row["stage"] >= 2) else 1)


@pytest.mark.distributed
def test_real_gloo_stages_0_and_2(real):
    assert real.returncode == 0, real.stdout + real.stderr
    rows = {r["stage"]: r for r in real.report["rows"]}
    assert set(rows) == {0, 2}
    for row in rows.values():
        check_row(row)
        assert row["checks"]["parity"] is True  # the mean over N_d x G micro-batches, as the reference
    psi = rows[0]["psi"]
    # stage 0 all-reduces once per optimizer step (no_sync); stage 2 reduce-scatters every micro-step
    assert rows[0]["measured_collectives"]["all-reduce|backward|bf16"]["elements"] == psi
    rs = rows[2]["measured_collectives"]["reduce-scatter|backward|bf16"]
    ag = rows[2]["measured_collectives"]["all-gather|optimizer step|bf16"]
    assert rs["elements"] == G * ag["elements"] and ag["elements"] >= psi


def test_simulated_nd8_stages_1_and_3(simulated):
    assert simulated.returncode == 0, simulated.stdout + simulated.stderr
    rows = {r["stage"]: r for r in simulated.report["rows"]}
    assert set(rows) == {1, 3}
    for row in rows.values():
        check_row(row)
    s1, s3 = rows[1]["measured_collectives"], rows[3]["measured_collectives"]
    assert s1["reduce-scatter|backward|bf16"]["elements"] == s1["all-gather|optimizer step|bf16"]["elements"]
    full = s1["all-gather|optimizer step|bf16"]["elements"]
    assert [s3[k]["elements"] for k in ("all-gather|forward|bf16", "all-gather|backward|bf16",
                                        "reduce-scatter|backward|bf16")] == [G * full] * 3  # fmt: skip


def test_accumulated_reduce_scatter_is_a_moment_at_stages_2_3_only():
    spec = read_hf_config(HF_CONFIGS / "tiny-gpt2.json")
    for stage in range(4):
        one, acc = reference_run(spec, 2, stage, 2, 16), reference_run(spec, 2, stage, 2, 16, grad_accum=G)
        new = [m for m in moments(acc) if m not in moments(one)]
        assert [m.phase for m in new] == (["backward"] * 2 if stage >= 2 else []), stage
        # the temporary replaces the unit's freed autograd gradients, so no phase's peak grows at N_d = 2
        # (nccl; gloo's copy of the input grows it: test_gloo_copies_each_reduce_scatter_input)
        assert predict_peak(acc).by_phase() == predict_peak(one).by_phase()


def test_gloo_copies_each_reduce_scatter_input():
    """gloo's reduce-scatter holds a copy of its whole input (terms.gloo_copy): at stages 2-3, where every
    micro-step reduce-scatters a unit's pack buffer, the accumulated moment then outgrows the packing one
    by the unit's shard (tests/data/measured/reference.json: gpt-tiny accum2, 16,020 B at ZeRO-3)."""
    spec = read_hf_config(HF_CONFIGS / "tiny-gpt2.json")
    for stage in range(4):
        run = reference_run(spec, 2, stage, 2, 16, grad_accum=G)
        gloo = replace(run, gloo=True)
        copies = {m.name: [t.bytes for t in m.terms if t.name.startswith("gloo")] for m in moments(gloo)}
        assert not any("gloo" in t.name for m in moments(run) for t in m.terms)  # nccl, fake group
        if stage < 2:  # stages 0-1 keep a gradient buffer: no moment is taken inside a reduce-scatter
            assert not any(copies.values()), stage
            continue
        block = 2 * sum(-(-n // 2) * 2 for n in run.units[-1])  # padded to N_d, 16-bit
        for name in ("last block's reduce-scatter", "last block's accumulated reduce-scatter"):
            assert copies[name] == [block], (stage, name)
        by = {m.name: m.total() for m in moments(gloo)}
        shard = block // 2
        grads = 2 * sum(run.units[-1])
        assert by["last block's accumulated reduce-scatter"] - by["last block's gradients packed"] == block + shard - grads
        assert not any("gloo" in t.name for m in moments(replace(gloo, nd=1)) for t in m.terms)


@pytest.mark.parametrize("value", ["0", "65", "x"])
def test_grad_accum_out_of_range_is_one_line(value):
    proc = zeroplan("validate", "--grad-accum", value)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zeroplan: error:") and "grad" in lines[0], proc.stderr
