"""FSDP2 + TP without loss parallel (``Settings.loss_parallel`` false, ``--no-loss-parallel``: torchtitan's
``disable_loss_parallel``; engines/fsdp2/tp_loss.py): the head's output Replicate, one all-gather of the N x V
logits per micro-step over ``tp``, the whole-vocabulary loss on every TP rank. The recorded gloo runs (the
``-no-lp`` rows of tests/data/measured/fsdp2_tp.json, asserted phase by phase and call by call with the others in
tests/test_fsdp2_tp.py) are re-made with ``torchrun --nproc-per-node 4 -m validate.engines.fsdp2_tp --tp 2
--no-loss-parallel [--param-dtype bf16 --batch 4] [--no-sp] --out F``."""

from __future__ import annotations

import pytest

from test_fsdp2_tp import RECORDED, _predict
from zeroplan.engines.fsdp2 import tp
from zeroplan.engines.fsdp2.tp import tp_collectives
from zeroplan.engines.fsdp2.tp_loss import logits_all_gather

N, V, T, D = 64, 130, 2, 48  # bf16 runs: 4 x 16 tokens, llama-tiny's vocabulary and width, dp_shard 2 x tp 2


def _run(sp: bool, dtype: str = "bf16") -> dict:
    (run,) = [r for r in RECORDED["runs"] if r["meta"].get("loss_parallel") is False and "tp_plan" not in r["meta"]
              and r["meta"]["sequence_parallel"] == sp and r["meta"]["param_dtype"] == dtype]  # fmt: skip
    return run


def _phase(run: dict, phase: str, rank: int = 0):
    return next(p for p in _predict(run, rank).peak.phases if p.phase == phase)


def test_the_logits_all_gather_is_the_measured_forward_peak():
    """bf16, SP, 4 x 16 tokens: the forward peak is the join of the logits' all-gather (``aten.cat`` in
    ``funcol.all_gather_single``, traced with MemTracker): the head's N·V/T output, the gathered T x N x V/T buffer,
    the whole N x V logits and the head's N/T-row argument, all bf16; its terms are 3,072 B over the forward's
    other moments, so each of them is in the measured peak (every rank: test_every_phase_of_every_rank)."""
    run = _run(True)
    peak = _phase(run, "forward")
    assert peak.moment == "logits all-gather (no loss parallel)"
    assert peak.bytes == run["rows"][0]["peak_bytes_by_phase"]["forward"]
    gather = sum(t.bytes for t in peak.terms if t.name.startswith("no loss parallel"))
    assert gather == N * V // T * 2 + N * V * 2 + N * D // T * 2
    assert any(t.name == "logits" and t.bytes == N * V * 2 for t in peak.terms)  # the cat's output, whole


def test_the_whole_vocabulary_loss_is_the_measured_peak():
    """bf16 without SP: the forward peak is the plain cross-entropy on the whole N x V logits (fp32 copy and
    log-softmax, N·V·4 each) and the backward peak its gradient (2·N·V·4), measured; with loss parallel's V/T
    there (``tp_loss.whole_logits`` dropped) the backward falls below the measurement (test_dropping_a_term_fails)."""
    run = _run(False)
    row = run["rows"][0]["peak_bytes_by_phase"]
    fwd, bwd = _phase(run, "forward"), _phase(run, "backward")
    assert (fwd.moment, bwd.moment) == ("cross-entropy", "cross-entropy backward")
    assert (fwd.bytes, bwd.bytes) == (row["forward"], row["backward"])
    assert sum(t.bytes for t in fwd.terms if "fp32" in t.name) == 2 * N * V * 4
    assert sum(t.bytes for t in bwd.terms if t.name.startswith("nll")) == 2 * N * V * 4


def test_dropping_a_term_fails(monkeypatch):
    """Each new term moves a measured peak: the whole logits (``whole_logits``) and the all-gather's buffers
    (``logits_all_gather``)."""
    from zeroplan.engines.fsdp2.plan import _kept_tp_acts

    sp, nosp = _run(True), _run(False)
    monkeypatch.setattr(tp, "whole_logits", lambda acts, t: acts)
    _kept_tp_acts.cache_clear()  # a run's TP activations are kept by value (plan._tp_acts): built again, patched
    assert _phase(nosp, "backward").bytes != nosp["rows"][0]["peak_bytes_by_phase"]["backward"]
    monkeypatch.undo()
    _kept_tp_acts.cache_clear()  # and not left patched for the next test
    import zeroplan.engines.fsdp2.tp_loss as tp_loss

    monkeypatch.setattr(tp_loss, "logits_all_gather", lambda run: ())
    assert _phase(sp, "forward").bytes != sp["rows"][0]["peak_bytes_by_phase"]["forward"]


def test_collectives():
    """One all-gather of N·V elements (the activation dtype) in forward over tp in place of loss parallel's three
    fp32 all-reduces of N; nothing in backward (``Redistribute.backward``: Replicate -> Shard(-1) is a local
    split). Measured call by call in the recorded runs (test_collectives_call_by_call)."""
    with_lp = tp_collectives(2, N, D, "bf16", T, True, False)
    without = tp_collectives(2, N, D, "bf16", T, True, False, vocab=V)
    gone = [c for c in with_lp if c not in without]
    new = [c for c in without if c not in with_lp]
    assert [(c.op, c.phase, c.elements, c.dtype) for c in gone] == [("all-reduce", "forward", N, "fp32")] * 3
    assert [(c.op, c.phase, c.unit, c.elements, c.dtype, c.group_size, c.mesh_dim) for c in new] == [
        ("all-gather", "forward", "root (logits)", N * V, "bf16", T, "tp")]
    run = _run(True, "fp32")
    calls = [c for c in run["rows"][0]["calls"] if c["op"] == "all-gather" and c["elements"] == 32 * V]
    assert [(c["phase"], c["dtype"], len(c["group"])) for c in calls] == [("forward", "float32", T)]


def test_refused_without_tp():
    """``loss_parallel`` false is a setting of the TP plan's head: refused at T = 1 / no ``--tp`` in one line,
    by estimate, plan at ``--tp 1`` and validate; plan's mesh search (``--tp auto``, and its default without a
    mesh option) takes it for its TP degrees and drops it at T = 1."""
    from typer.testing import CliRunner

    from tests.clicheck import assert_one_line_error
    from zeroplan.cli import app

    base = ["--engine", "fsdp2", "--model", "llama3-8b", "--gpus", "16", "--no-loss-parallel"]
    for args in (["estimate", *base], ["estimate", *base, "--tp", "1"],
                 ["plan", "--gpu", "h100-80gb", *base, "--tp", "1"]):
        assert_one_line_error(CliRunner().invoke(app, args), "loss_parallel=false: a tensor-parallel option")
    assert_one_line_error(CliRunner().invoke(app, ["validate", "--engine", "fsdp2", "--no-loss-parallel"]),
                          "--loss-parallel/--no-loss-parallel: with --tp only")
    for search in (["--tp", "auto"], []):
        ok = CliRunner().invoke(app, ["plan", "--gpu", "h100-80gb", *base, *search])
        assert ok.exit_code == 0, ok.output


@pytest.mark.parametrize("lp", [True, False])
def test_the_snippet_says_the_run(lp):
    """``plan --tp 2``: the head's layouts and the loss exactly as predicted, with and without loss parallel."""
    from typer.testing import CliRunner

    from zeroplan.cli import app

    flag = "--loss-parallel" if lp else "--no-loss-parallel"
    out = CliRunner().invoke(app, ["plan", "--engine", "fsdp2", "--model", "llama3-8b", "--gpus", "8", "--tp", "2",
                                   "--gpu-memory", "80GB", "--param-dtype", "bf16", "--seq-len", "4096", flag])
    assert out.exit_code == 0, out.output
    head = ("output_layouts=Shard(-1), use_local_output=False)" if lp
            else "output_layouts=Replicate(), use_local_output=True)")  # fmt: skip
    assert head in out.output and ("with loss_parallel():" in out.output) == lp
    assert ("tp 2 (no loss parallel)" in out.output) == (not lp)


def test_logits_all_gather_absent_with_loss_parallel():
    from types import SimpleNamespace

    for t, lp in ((None, False), (1, False), (2, True)):
        run = SimpleNamespace(settings=SimpleNamespace(tp=t, loss_parallel=lp, sequence_parallel=True))
        assert logits_all_gather(run) == ()
