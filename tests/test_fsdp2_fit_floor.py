"""The FSDP2 plan's "does not fit" without the whole estimate (``fit_floor.over_floor``, ``plan.estimate``'s
``over``; a speed-up, no rule): on drawn configurations of every kind the mesh search makes (tp, HSDP meshes,
reshard, checkpointing) and a few it does not (CPU, offload, an int reshard, selective checkpointing), an estimate
given a budget has no row only when its peak is over it (always, but for the TP rank map on CPU) and else the same row, the floor it reads is a lower
bound on the peak, the moments it builds are those the estimate would (``leaders.step_moments``), and the plans
answer what they answer without it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from zeroplan.engines import fsdp2
from zeroplan.engines.base import PlannerOptions
from zeroplan.estimation.workload import model_workload
from zeroplan.presets import resolve_model

CONFIGS = Path(__file__).parent / "data" / "hf_configs"
MODELS = ("llama3-8b", "llama2-7b", "gpt2-xl", str(CONFIGS / "tiny-llama.json"), str(CONFIGS / "qwen2-0.5b.json"),
          str(CONFIGS / "tiny-gpt2.json"), str(CONFIGS / "gemma-3-1b.json"))  # fmt: skip


def _blocks_saved_all(run):
    """The cross-entropy backward's "saved activations of L blocks" (``moments.backward_moments``)."""
    from zeroplan.engines.fsdp2.moments import backward_moments

    (ce,) = (m for m in backward_moments(run) if m.name == "cross-entropy backward")
    return tuple(t for t in ce.terms if t.name.startswith("saved activations of "))


def _floor(run) -> int:
    """The largest init, forward or optimizer-step moment of ``run``, each term rounded as the peak rounds it
    (``formulas.peak.Term``: its tensors' bytes up to whole blocks), the workspaces after init, or without
    checkpointing the activations every layer saves: what ``over_floor`` compares, summed term by term."""
    from zeroplan.engines.fsdp2.leaders import peak_rounding
    from zeroplan.engines.fsdp2.moments import forward_moments, init_moments
    from zeroplan.engines.fsdp2.optimizer_step import optimizer_moments

    block, resident = peak_rounding(run)

    def total(terms) -> int:
        if block == 1:
            return sum(t.bytes for t in terms)
        return sum(t.tensors * -(-(-(-t.bytes // t.tensors)) // block) * block for t in terms if t.tensors)

    extra = total(resident)
    (saved,) = (t for t in _blocks_saved_all(run)) if run.checkpointing == "none" else (None,)
    return max(saved.bytes if saved else 0, *(total(m.terms) for m in init_moments(run)),
               *(total(m.terms) + extra for m in (*forward_moments(run), *optimizer_moments(run))))  # fmt: skip


def _draws(n: int, seed: int = 20261203) -> list:
    """(model, N, seq, micro-batch, checkpointing, FSDP2 options) drawn: TP degrees the model's plan holds."""
    from zeroplan.engines.fsdp2.tp import check_plan

    rng = random.Random(seed)
    out = []
    while len(out) < n:
        model = rng.choice(MODELS)
        spec = resolve_model(model)
        seq = rng.choice([q for q in (16, 512, 2048, 4096) if q <= spec.max_seq_len])
        dp = rng.choice((2, 4, 8, 16, 64, 256))
        tps = []
        for t in (1, 2, 4, 8):
            try:
                check_plan(spec, t, dp * t, seq, True) if t > 1 else None
                tps.append(t)
            except ValueError:
                pass
        tp = rng.choice(tps)
        own = {"param_dtype": rng.choice(("bf16", "fp32")), "foreach": rng.random() < 0.7}
        if tp > 1:
            own["tp"] = tp
        if rng.random() < 0.5 and dp >= 4:
            own["dp_shard"] = rng.choice([s for s in (2, 4, 8, 16) if dp % s == 0 and s < dp])
        own["reshard_after_forward"] = rng.choice((True, False, True, False, 2)) if "dp_shard" not in own \
            and dp > 2 else rng.choice((True, False))
        if rng.random() < 0.15:
            own.update(device="cpu", backend="gloo")
        elif rng.random() < 0.1:
            own["offload_policy"] = "cpu"
        if rng.random() < 0.1:
            own["reduce_dtype"] = "fp32"
        ckpt = rng.choice(("none", "full"))
        if ckpt == "full" and tp == 1 and rng.random() < 0.2:
            own["selective_ac"] = 2
        out.append((model, dp * tp, seq, rng.choice((1, 2)), ckpt, own))
    return out


@pytest.mark.parametrize("model, nd, seq, batch, ckpt, own", _draws(150))
def test_an_estimate_over_a_budget_is_no_row_exactly_when_its_peak_is_over(model, nd, seq, batch, ckpt, own):
    """Budget one byte under the peak: no row (with TP on CPU it may be the row); at the peak: the row itself; the floor of the first rank's run
    (``_floor``) never above the peak and ``over_floor`` true exactly below it. A floor counting a backward
    moment, without the workspaces' rounding, or an estimate that gave up on a rank that fits, fails."""
    from zeroplan.engines.fsdp2.fit_floor import over_floor
    from zeroplan.engines.fsdp2.plan import rank_run
    from zeroplan.engines.fsdp2.mesh import resolve_mesh, shard_groups
    from zeroplan.engines.fsdp2.param import distinct_ranks, distinct_shapes
    from zeroplan.engines.fsdp2.tp_estimate import tp_local

    w = model_workload(resolve_model(model), seq, batch, ckpt, 1, True)
    s = fsdp2.Settings(**own)
    try:
        (row,) = fsdp2.estimate(w, nd, s, collectives=False)
    except ValueError as e:  # a configuration the model refuses (a TP plan, a mesh): nothing to compare
        pytest.skip(str(e))
    peak = row.peak.peak_bytes
    # one byte under: no row (but with TP on CPU, whose rank map ``tp_estimate`` adds after: the row, never wrong)
    under = fsdp2.estimate(w, nd, s, collectives=False, over=peak - 1)
    assert under == () or (under == (row,) and s.device == "cpu" and (s.tp or 1) > 1)
    assert fsdp2.estimate(w, nd, s, collectives=False, over=peak) == (row,)
    lw, ln, ls = tp_local(w, nd, s) if (s.tp or 1) > 1 else (w, nd, s)
    ls = resolve_mesh(ls, ln)
    first = distinct_ranks(distinct_shapes(lw.shapes), shard_groups(ls, ln)[1])[0]
    run, _ = rank_run(lw, ln, ls.model_copy(update={"rank": first}))
    from zeroplan.engines.fsdp2.leaders import sampled_blocks, step_moments
    from zeroplan.engines.fsdp2.moments import moments

    from zeroplan.engines.fsdp2.leaders import SECTIONS, outside_backward
    from zeroplan.engines.fsdp2.param import distinct_ranks as ranks_of

    for blocks in (None, sampled_blocks(run)):  # the moments the floor built, taken by the estimate: the same
        assert step_moments(run, blocks) == moments(rank_run(lw, ln, ls.model_copy(update={"rank": first}))[0], blocks)
    for r in ranks_of(distinct_shapes(lw.shapes), shard_groups(ls, ln)[1])[1:]:  # another rank's: its own
        built = rank_run(lw, ln, ls.model_copy(update={"rank": r}))[0]
        assert all(outside_backward(run.for_rank(r), p) == f(built) for p, f in SECTIONS.items())
    if s.offload_policy == "cpu":
        assert not over_floor(run, 0)
        return
    floor = _floor(run)
    assert 0 < floor <= peak
    assert over_floor(run, floor - 1) and not over_floor(run, floor)


@pytest.mark.parametrize("model, nd, gib, own", [
    ("llama2-70b", 2048, 80, {}),  # the slowest plan: every shard group a bisection passes over that fails
    ("llama2-70b", 64, 80, {}),
    ("llama3-8b", 16, 14, {}),  # tp 4 and 8 tie at the third candidate
    ("llama2-7b", 8, 40, {}),  # one node
    ("llama3-8b", 32, 20, {"tp": 1}),  # the flat group alone: the rows needed, nothing asked for fit alone
    ("llama3-8b", 64, 24, {"tp": 2, "dp_shard": "auto"}),
    ("gpt2-xl", 64, 6, {}),
])  # fmt: skip
def test_the_plans_are_the_plans_without_the_floor(monkeypatch, model, nd, gib, own):
    """``planner_plan`` as it answers, against the same plan with every row built (``_configured`` asked for its
    row each time: no ``over``): the same candidates, rows, fits and search summary. A configuration taken for
    over the budget that fits (a floor too high) changes the search and fails."""
    from zeroplan.engines.fsdp2 import plan as P

    spec = resolve_model(model)
    w = model_workload(spec, min(4096, spec.max_seq_len), 1, "none", 1, True)
    options = PlannerOptions(param_dtype="bf16", own={"gpus_per_node": 8, **own})
    got = P.planner_plan(w, nd, gib * 2**30, options)
    plain = P._configured

    def every_row(*args, **kwargs):
        return plain(*args[:8], need_row=True)

    monkeypatch.setattr(P, "_configured", every_row)
    want = P.planner_plan(w, nd, gib * 2**30, options)
    assert got.order == want.order and got.recommended == want.recommended
    assert [(c.label, c.estimate, c.fits, c.launcher, c.pins) for c in got.candidates] == \
        [(c.label, c.estimate, c.fits, c.launcher, c.pins) for c in want.candidates]
    assert [c.trace_inputs[:3] for c in got.candidates] == [c.trace_inputs[:3] for c in want.candidates]
