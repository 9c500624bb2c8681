"""The FSDP2 speed-ups change no number: ``Fsdp2Run.for_rank`` (terms kept across ranks, ``memo.RANKED``
rebuilt) against a run built for that rank, and ``leaders.phase_leaders`` (and ``sampled_blocks``, ``rank_leaders``) against ``peak_of`` on every moment.
Planner only (no torch): tiny models with an odd hidden size, so the last ranks hold short or empty rows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines.base import Workload, worst_rank
from zeroplan.engines.fsdp2 import Settings, fsdp2_run, local_shard_numel, moments, padded_shard_numel
from zeroplan.engines.fsdp2.leaders import STEP_LEADERS, phase_leaders, predict_peak, sampled_blocks
from zeroplan.engines.fsdp2.mesh import resolve_mesh
from zeroplan.engines.fsdp2.plan import _estimate, estimate
from zeroplan.engines.fsdp2.terms import run_states
from zeroplan.formulas.peak import Moment, Term, peak_of

GPT_ODD = {"model_type": "gpt2", "activation_function": "gelu", "n_layer": 2, "n_embd": 35, "n_head": 5,
           "vocab_size": 101, "n_positions": 16}  # fmt: skip
LLAMA_ODD = {"model_type": "llama", "hidden_size": 35, "intermediate_size": 67, "max_position_embeddings": 16,
             "num_attention_heads": 5, "num_hidden_layers": 2, "num_key_value_heads": 1, "vocab_size": 103}  # fmt: skip


def _workload(config: dict, transformers: bool) -> Workload:
    spec = spec_from_hf_config(config, "test")
    return Workload(transformer_shapes(spec), spec, 16, 2, transformers=transformers)


CASES = [  # (config, transformers tree, N_d, reshard_after_forward)
    *((GPT_ODD, False, nd, rsf) for nd in (3, 5, 7) for rsf in (True, False)),
    *((LLAMA_ODD, True, nd, rsf) for nd in (3, 5, 7) for rsf in (True, False)),
    (GPT_ODD, False, 6, 2), (LLAMA_ODD, True, 6, 3), (GPT_ODD, True, 9, 3),
]  # fmt: skip


@pytest.mark.parametrize("config,hf,nd,rsf", CASES)
def test_for_rank_equals_a_run_built_for_that_rank(config, hf, nd, rsf):
    w = _workload(config, hf)
    s = Settings(reshard_after_forward=rsf, param_dtype="bf16", reduce_dtype="fp32")
    shapes = [sh for _, sh in w.shapes]
    short = [r for r in range(nd) if any(local_shard_numel(sh, nd, r) != padded_shard_numel(sh, nd) for sh in shapes)]
    assert short and short[-1] == nd - 1  # the case has short (padded) shards: the ranks differ
    base = fsdp2_run(w, nd, s)
    predict_peak(base), run_states(base)  # rank 0's terms built first, as estimate's worst-rank search does
    assert (STEP_LEADERS, 512) in base.memo  # the other ranks take its forward and backward leaders
    states = set()
    for r in (0, *short):
        built, derived = fsdp2_run(w, nd, s.model_copy(update={"rank": r})), base.for_rank(r)
        assert derived.settings == built.settings
        assert run_states(derived) == run_states(built)
        assert predict_peak(derived) == predict_peak(built)  # every phase's bytes, moment and terms, peak terms
        states.add(run_states(built).optimizer_bytes)
    assert len(states) > 1  # the ranks' Adam states differ: a for_rank that kept rank 0's would fail


def test_for_rank_on_cpu_and_gloo():
    w = _workload(GPT_ODD, False)
    s = Settings(device="cpu", backend="gloo", init="materialized")
    base = fsdp2_run(w, 5, s)
    predict_peak(base)
    built = fsdp2_run(w, 5, s.model_copy(update={"rank": 4}))
    assert (STEP_LEADERS, 1) in base.memo
    assert predict_peak(base.for_rank(4)) == predict_peak(built) != predict_peak(base)


def _t(name: str, nbytes: int, tensors: int = 1) -> Term:
    return Term(name, nbytes, "test", tensors)


def test_phase_leaders_keeps_peak_of_with_ties():
    shared = _t("shared", 1000, 2)  # one object in many moments, as memo_term makes them
    a, b = _t("a", 600), _t("b", 700)  # 600 and 700 B both round to 1,024 B: a tie at 512-byte blocks
    ms = (
        Moment("init", "i1", (shared,)), Moment("init", "i2", (shared, _t("c", 1))),
        Moment("forward", "f1", (shared, a)), Moment("forward", "f2", (shared, b)),  # tie: peak_of keeps f1
        Moment("forward", "f0", (shared, _t("small", 10))),
        Moment("backward", "b1", (shared, b, a)), Moment("backward", "b2", (a, shared, b)),  # same terms reordered
        Moment("optimizer_step", "o1", (shared,)),
    )  # fmt: skip
    for block in (512, 1):
        leaders = phase_leaders(ms, block)
        assert peak_of(leaders, block) == peak_of(ms, block)
    assert [m.name for m in phase_leaders(ms, 512)] == ["i2", "f1", "b1", "o1"]
    assert [m.name for m in phase_leaders(ms, 1)] == ["i2", "f2", "b1", "o1"]  # unrounded: no tie left
    assert peak_of(ms, 512).phases[1].moment == "f1"


@pytest.mark.parametrize("config,hf,nd,rsf", [(GPT_ODD, False, 5, True), (LLAMA_ODD, True, 6, 3)])
def test_phase_leaders_keeps_peak_of_on_a_run(config, hf, nd, rsf):
    ms = moments(fsdp2_run(_workload(config, hf), nd, Settings(reshard_after_forward=rsf, param_dtype="bf16")))
    leaders = phase_leaders(ms, 512)
    assert len(leaders) == 4 < len(ms)
    assert peak_of(leaders, 512) == peak_of(ms, 512)


@pytest.mark.parametrize("config,hf,nd,update", [
    (LLAMA_ODD, True, 10, {"dp_replicate": 2, "param_dtype": "bf16", "reduce_dtype": "fp32", "device": "cpu"}),  # HSDP
    (GPT_ODD, False, 7, {"reshard_after_forward": False, "init": "materialized"}),
])  # fmt: skip
def test_estimate_worst_rank_equals_each_rank_built_alone(config, hf, nd, update):
    """``estimate`` shares rank 0's forward and backward leaders (``moments.rank_leaders``); each rank's row
    built from scratch (``plan._estimate`` without the shared run) gives the same worst rank, byte for byte."""
    w = _workload(config, hf)
    s = resolve_mesh(Settings(**update), nd)
    (shared,) = estimate(w, nd, s)
    alone = {r: _estimate(w, nd, s.model_copy(update={"rank": r})) for r in range(nd)}
    assert shared == worst_rank(alone)
    assert len({row.peak.phases for row in alone.values()}) > 1  # the ranks differ: a kept Adam term would show


DEEP = {"gpt": {**GPT_ODD, "n_layer": 8}, "llama": {**LLAMA_ODD, "num_hidden_layers": 8}}
SAMPLED = [  # (architecture, transformers tree, N_d, checkpointing, Settings, HSDP replicas)
    ("gpt", False, 5, "none", {}, 1), ("gpt", False, 5, "none", {"reshard_after_forward": False}, 1),
    ("gpt", True, 6, "full", {"reshard_after_forward": 3, "param_dtype": "bf16"}, 1),
    ("llama", True, 7, "none", {"param_dtype": "bf16", "reduce_dtype": "fp32"}, 1),
    ("llama", True, 4, "full", {"reshard_after_forward": False, "device": "cpu", "backend": "gloo"}, 1),
    ("llama", True, 6, "none", {"wrap": "torchtitan", "param_dtype": "bf16"}, 1),
    ("llama", False, 5, "none", {"param_dtype": "bf16", "reduce_dtype": "fp32"}, 2),  # HSDP, fp32 reduce: none held
    ("llama", True, 6, "none", {"param_dtype": "bf16"}, 2),  # HSDP, bf16 reduce: buffers held, growing
    ("gpt-short", True, 2, "none", {"param_dtype": "bf16"}, 3),  # the same, peaking towards block 1
    ("gpt-short", True, 2, "none", {}, 1),  # 4 tokens: each block's gradients outweigh its activations, the
    ("llama-short", False, 3, "none", {}, 1),  # peak falls towards block 1 (block 2 gradients complete)
]  # fmt: skip


@pytest.mark.parametrize("arch,hf,nd,ckpt,update,replicas", SAMPLED)
def test_sampled_blocks_keep_every_phase_leader(arch, hf, nd, ckpt, update, replicas):
    """The backward moments of the edges and of the interior's two ends hold each phase's first largest
    moment: the peak of the sampled moments equals ``peak_of`` on every moment, at 512-byte blocks and exact."""
    w = _workload(DEEP[arch.removesuffix("-short")], hf)
    w = replace(w, seq_len=4, micro_batch=1) if arch.endswith("-short") else w
    run = replace(fsdp2_run(replace(w, checkpointing=ckpt), nd, Settings(**update)), replicate=replicas)
    blocks = sampled_blocks(run)
    assert blocks == (8, 7, 3, 2, 1)
    for block in (512, 1):
        assert peak_of(phase_leaders(moments(run, blocks), block), block) == peak_of(moments(run), block)


@pytest.mark.parametrize("arch,hf,nd,update,replicas", [(a, h, n, u, r) for a, h, n, _, u, r in SAMPLED if r > 1])
def test_sampled_moments_are_the_full_profiles_moments_of_those_blocks(arch, hf, nd, update, replicas):
    """``moments(run, blocks)`` on HSDP (held all-reduce buffers, ``mesh.with_allreduce_held``: the blocks not built
    read for their reduce-scatter outputs, the held term made only where a kept moment holds it) gives each moment
    it keeps exactly as the full profile has it: phase, name and every term's value, in order."""
    w = _workload(DEEP[arch.removesuffix("-short")], hf)
    w = replace(w, seq_len=4, micro_batch=1) if arch.endswith("-short") else w
    run = replace(fsdp2_run(w, nd, Settings(**update)), replicate=replicas)
    blocks = sampled_blocks(run)
    assert blocks is not None and len(blocks) < len(run.units) - 1

    def values(m: Moment) -> tuple:
        return m.phase, m.name, tuple((t.name, t.bytes, t.source, t.tensors) for t in m.terms)

    every = moments(run)
    full = {(m.phase, m.name): values(m) for m in every}
    assert len(full) == len(every)  # a moment is its phase and name
    sampled = moments(run, blocks)
    assert [values(m) for m in sampled] == [full[m.phase, m.name] for m in sampled]
    assert any("HSDP all-reduce buffers held" in t.name for m in sampled for t in m.terms) == (update != {
        "param_dtype": "bf16", "reduce_dtype": "fp32"})  # fmt: skip


def test_sampled_blocks_none_where_blocks_differ():
    """HSDP's held all-reduce buffers with a unit reduced before the blocks (torchtitan's [norm, output]): one
    term of unequal tensors, rounded unlike from block to block, so every block is built."""
    w = _workload(DEEP["llama"], True)
    run = fsdp2_run(w, 4, Settings(param_dtype="bf16", wrap="torchtitan"))  # bf16 reduce
    assert sampled_blocks(run) == sampled_blocks(replace(run, replicate=2, settings=run.settings.model_copy(
        update={"reduce_dtype": "fp32"}))) == (8, 7, 3, 2, 1)  # fmt: skip
    assert sampled_blocks(replace(run, replicate=2)) is None
    assert sampled_blocks(fsdp2_run(_workload(LLAMA_ODD, True), 4, Settings())) is None  # 2 blocks: all edges


@pytest.mark.parametrize("config, hf", [(GPT_ODD, False), (LLAMA_ODD, True)])
@pytest.mark.parametrize("nd, update", [(3, {}), (4, {"dp_shard": 2, "reduce_dtype": "fp32", "param_dtype": "bf16"}),
                                        (3, {"reshard_after_forward": False})])  # fmt: skip
def test_shared_rows_and_units_equal_those_built_per_row_and_per_run(config, hf, nd, update):
    """``run_collectives`` (rows from ``unit_collectives``' row maker, equal rows one object: ``one_row``) equals
    each ``UnitCollective`` made into a ``Collective`` on its own; a second run of the same shapes shares the first
    one's profile units (``units._profile``, by identity) and equals a run built on a copy of the shapes (no
    identity to share): the same units, states and peak."""
    from zeroplan.engines.fsdp2.collectives import micro_steps, run_collectives, unit_collectives
    from zeroplan.formulas.collectives import Collective, ring_bytes_per_rank
    from zeroplan.formulas.dtypes import dtype_bytes

    w = replace(_workload(config, hf), grad_accum=3)
    settings = resolve_mesh(Settings(**update, rank=0), nd)
    run, again = fsdp2_run(w, 2 if update.get("dp_shard") else nd, settings), fsdp2_run(w, nd, settings)
    copy = fsdp2_run(replace(w, shapes=tuple((n, tuple(s)) for n, s in w.shapes)), nd, settings)
    assert run.units is again.units and copy.units is not run.units and copy.units == run.units
    assert run_states(again) == run_states(copy) and predict_peak(again) == predict_peak(copy)
    for r in (run, again):
        want = tuple(Collective(c.op, c.phase, m * c.elements, c.dtype,
                                m * ring_bytes_per_rank(c.op, c.elements, c.group_size, dtype_bytes(c.dtype)), m,
                                c.mesh_dim, c.group_size)
                     for c in unit_collectives(r.shard_units, r.nd, r.settings, r.replicate)
                     for m in (micro_steps(c, 3),))  # fmt: skip
        got = run_collectives(r, 3)
        assert got == want and len({id(c) for c in got}) == len(set(want))


def test_by_identity_keeps_tuples_by_identity_only():
    """``memo.by_identity``: the same tuple object gives the value built for it, an equal tuple (another object)
    or a list is built again (a list is not kept: it could change)."""
    from zeroplan.engines.fsdp2.memo import by_identity

    calls = []
    count = by_identity(lambda xs: calls.append(1) or [len(xs)])
    a = ((1,), (2,))
    assert count(a) is count(a) and len(calls) == 1
    assert count(tuple(a)) is count(a) and len(calls) == 1  # tuple() of a tuple is that object
    b = tuple(x for x in a)
    assert b is not a and count(b) == [2] and len(calls) == 2
    xs = [1, 2, 3]
    assert count(xs) == [3] and count(xs) == [3] and len(calls) == 4


def test_final_norm_kept_by_the_shapes_identity_and_the_prefix():
    """``terms._final_and_order`` (``memo.by_identity`` with a second argument): a tuple of shapes answered by its
    identity and the prefix given, the same as built afresh; a list built each time, alike."""
    from zeroplan.engines.fsdp2.terms import _final_and_order

    shapes = _workload(DEEP["llama"], True).shapes
    assert type(shapes) is tuple
    for prefix in ("model.layers.", "model.", "model.layers.", "\0"):
        got = _final_and_order(shapes, prefix)
        assert got == _final_and_order.__wrapped__(shapes, prefix) == _final_and_order([*shapes], prefix)
    assert _final_and_order(shapes, "model.layers.")[0] > 0 == _final_and_order(shapes, "model.")[0]
