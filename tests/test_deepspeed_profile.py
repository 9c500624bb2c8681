"""The DeepSpeed engine profile without DeepSpeed: strict ds_config reading, DeepSpeed 0.19.8's defaults,
the optimizer class it builds, emitted configs that read back as predicted, and the planning hook.
(Against the real engine: tests/test_deepspeed_engine.py and tests/test_deepspeed_runner.py.)"""

from __future__ import annotations

import math

import pytest

from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines import ENGINES
from zeroplan.engines import deepspeed as D
from zeroplan.engines.base import Workload


def _workload(micro_batch: int = 2, seq: int = 16) -> Workload:
    from zeroplan.architectures.hf_config import spec_from_hf_config

    spec = spec_from_hf_config({"model_type": "gpt2", "activation_function": "gelu", "n_layer": 2, "n_embd": 36,
                                "n_head": 3, "vocab_size": 101, "n_positions": 16}, "gpt-tiny")  # fmt: skip
    return Workload(tuple(transformer_shapes(spec)), spec, seq, micro_batch)


def test_defaults_are_deepspeed_0_19_8s():
    s = D.Settings.from_ds_config({"zero_optimization": {"stage": 2}})
    assert (s.reduce_bucket_size, s.allgather_bucket_size, s.prefetch_bucket_size) == (
        500_000_000,
        500_000_000,
        50_000_000,
    )
    assert (s.param_persistence_threshold, s.max_live_parameters, s.max_reuse_distance) == (
        100_000,
        10**9,
        10**9,
    )
    assert s.contiguous_gradients and s.use_multi_rank_bucket_allreduce and not s.overlaps
    assert D.Settings.from_ds_config({"zero_optimization": {"stage": 3}}).overlaps  # overlap_comm_valid
    assert s.dtype == "fp32" and s.grad_dtype == "fp32" and not s.torch_adam


def test_keys_change_the_settings():
    s = D.Settings.from_ds_config({
        "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
        "optimizer": {"type": "AdamW", "params": {"torch_adam": True, "foreach": False}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e3, "overlap_comm": True},
    })  # fmt: skip
    assert (s.dtype, s.grad_dtype, s.reduce_bucket_size, s.overlaps) == ("bf16", "fp32", 5000, True)
    assert (D.optimizer_class(s), D.inner_optimizer_class(s)) == ("BF16_Optimizer", "AdamW")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "5e8"}}, "reduce_bucket_size='5e8'"),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1.5}}, "whole number"),
        ({"zero_optimization": {"stage": 2, "overlap_comm": "true"}}, "overlap_comm='true'"),
        ({"zero_optimization": {"stage": 0}}, "covers 1-3"),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD"}}, "Adam and AdamW"),
        (
            {"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam", "params": {"torch_adam": 1}}},
            "torch_adam=1",
        ),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "offload"),
    ],
)
def test_bad_keys_are_one_line_naming_the_key(config, message):
    with pytest.raises(ValueError, match="deepspeed config") as err:
        D.Settings.from_ds_config(config)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_stage_option_fills_in_or_contradicts():
    assert D.Settings.from_ds_config({}, stage=3).stage == 3
    with pytest.raises(ValueError, match="contradicts"):
        D.Settings.from_ds_config({"zero_optimization": {"stage": 2}}, stage=3)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_emitted_config_reads_back_as_predicted(stage, dtype):
    s = D.Settings(
        stage=stage, dtype=dtype, reduce_bucket_size=5000, torch_adam=True, foreach=False, overlap_comm=True
    )
    assert D.Settings.from_ds_config(D.to_ds_config(s)) == s
    assert D.Settings.from_ds_config(D.to_ds_config(D.Settings(stage=stage))) == D.Settings(stage=stage)


def test_bucket_is_allocated_at_its_configured_size_whatever_the_model():
    """Issue 11: ZeRO-2 at defaults peaks at the 5e8-element bucket (2 GB in fp32) for a 36k-parameter
    model."""
    w = _workload()
    (big,) = D.estimate(w, 2, D.Settings(stage=2))
    (small,) = D.estimate(w, 2, D.Settings(stage=2, reduce_bucket_size=5000))
    assert big.peak.peak_phase == "backward"
    bucket = next(t for t in big.peak.peak_terms if t.name.startswith("reduce bucket"))
    assert bucket.bytes == 500_000_000 * 4
    assert 0 < big.peak.peak_bytes - bucket.bytes < small.peak.peak_bytes  # the rest: the model and a step
    assert big.model_states_bytes == small.model_states_bytes  # ZeRO-1/2 buckets live in backward only
    assert (
        D.ds_estimate_bytes(D.Settings(stage=2), tuple(n for n in (3636, 576)), 2)
        == 2 * 4212 + 18 * 4212 // 2
    )


def test_registry_and_no_torch():
    """The profile is pure: ``--engine deepspeed`` in ``zeroplan estimate`` must not import torch."""
    import ast
    import inspect

    assert ENGINES["deepspeed"] is D.estimate
    tree = ast.parse(inspect.getsource(D))
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not ({"torch", "deepspeed", "pandas", "matplotlib"} & names)


def test_recommend_lowest_stage_then_largest_bucket_that_fits():
    w = _workload()
    r = D.recommend(w, 4, 30 * 10**6, D.Settings(stage=1))
    assert (r.settings.stage, r.settings.reduce_bucket_size) == (1, 5_000_000)
    assert [t[1] for t in r.tried] == list(D.BUCKET_CHOICES)
    assert r.estimate.peak.peak_bytes <= 30 * 10**6
    assert D.Settings.from_ds_config(r.ds_config) == r.settings  # the JSON is the predicted configuration
    assert D.recommend(w, 4, 10**6, D.Settings(stage=1)) is None  # no bucket choice fits 1 MB


@pytest.mark.parametrize(("stage", "scaled"), [(1, set()), (2, {("all-reduce", "backward")}),
                                               (3, {("all-gather", "forward"), ("reduce-scatter", "backward")})])  # fmt: skip
def test_collectives_per_micro_step_under_accumulation(stage, scaled):
    """gradient_accumulation_steps = G: ZeRO-2 reduces every micro-step, ZeRO-3 gathers and reduce-scatters
    every micro-step, ZeRO-1 reduces at the boundary only (measured at G = 2: tests/test_deepspeed_engine.py)."""
    wl = _workload()
    numels = tuple(math.prod(sh) for _, sh in wl.shapes)
    s = D.Settings.from_ds_config({"zero_optimization": {"stage": stage, "reduce_bucket_size": 5000,
                                                         "stage3_param_persistence_threshold": 100}})  # fmt: skip
    one, two = D.collectives(s, numels, 2), D.collectives(s, numels, 2, grad_accum=2)
    for a, b in zip(one, two):
        k = 2 if (a.op, a.phase) in scaled else 1
        assert (b.calls, b.elements) == (k * a.calls, k * a.elements), (a, b)


def test_accumulation_holds_gradients_between_micro_steps():
    """G = 2 adds to forward what the first micro-step leaves: ZeRO-1 every gradient and its bucket, ZeRO-2
    the largest rank's grads_in_partition, ZeRO-3 nothing; G = 1 is unchanged."""
    import dataclasses

    wl = _workload()
    psi = sum(math.prod(sh) for _, sh in wl.shapes)
    for stage, extra in ((1, psi * 4 + 5000 * 4), (3, 0)):
        s = D.Settings.from_ds_config({"zero_optimization": {"stage": stage, "reduce_bucket_size": 5000}})
        (g1,) = D.estimate(wl, 2, s)
        (g2,) = D.estimate(dataclasses.replace(wl, grad_accum=2), 2, s)
        assert g2.peak.by_phase()["forward"] - g1.peak.by_phase()["forward"] == extra
        assert g2.peak.by_phase()["init"] == g1.peak.by_phase()["init"]


def test_bf16_optimizer_and_overlap_moments():
    """BF16_Optimizer has no initialize_optimizer_states (its init peak is its states) and reduces after
    backward through a 16-bit copy of the flat fp32 gradients; ZeRO-1 with overlap_comm reduces from the
    hooks (no reduce_gradients walk after backward)."""
    wl = _workload()
    bf16 = D.Settings.from_ds_config({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
                                      "zero_optimization": {"stage": 1}})  # fmt: skip
    assert D.optimizer_class(bf16) == "BF16_Optimizer"
    (est,) = D.estimate(wl, 2, bf16)
    numels = tuple(math.prod(sh) for _, sh in wl.shapes)
    states_at_init = D.model_state_bytes(D.terms(bf16, numels, 2), after_step=False)
    assert est.peak.by_phase()["init"] == states_at_init  # measured 290,592 B at N_d = 2 (the cast is smaller)
    run = D.ds_run(bf16, wl, 2)
    names = [m.name for m in D.backward_moments(run)]
    assert "all-reduce of the flat gradients" in names and not any("reduce_gradients" in n for n in names)
    overlap = D.Settings.from_ds_config({"zero_optimization": {"stage": 1, "overlap_comm": True,
                                                               "reduce_bucket_size": 5000}})  # fmt: skip
    plain = overlap.model_copy(update={"overlap_comm": False})
    assert any("reduce_gradients" in m.name for m in D.backward_moments(D.ds_run(plain, wl, 2)))
    assert not any("reduce_gradients" in m.name for m in D.backward_moments(D.ds_run(overlap, wl, 2)))


SMALL3 = {"reduce_bucket_size": 5000, "stage3_prefetch_bucket_size": 5000, "stage3_param_persistence_threshold": 100}


def test_zero3_prefetch_groups_as_measured():
    """gpt-tiny, 5,000-element prefetch: the all-gathers of a steady-state forward as logged from
    partitioned_param_coordinator.py ``__all_gather_params_`` (DeepSpeed 0.19.8, N_d = 2, 2026-11-30): the root
    fetches the tied head (wte) alone, then each fetch prefetches the next >= 5,000 elements not available;
    coalesced buffers are freed at the fetch that pops their last parameter."""
    w = _workload()
    names = [n for n, _ in w.shapes]
    numels = tuple(math.prod(sh) for _, sh in w.shapes)
    fetches = D.forward_fetches(w.shapes, "gpt", True)
    assert [m for m, _ in fetches][:4] == ["", "transformer.wte", "transformer.wpe", "transformer.h.0"]
    assert "transformer" not in dict(fetches) and "transformer.h" not in dict(fetches)
    s = D.Settings.from_ds_config({"zero_optimization": {"stage": 3, **SMALL3}})
    groups = D.prefetch_groups(s, numels, fetches)
    got = [([names[p].removeprefix("transformer.") for p in g.params], fetches[g.issued][0].removeprefix("transformer."),
            fetches[g.freed][0].removeprefix("transformer.")) for g in groups]  # fmt: skip
    assert got == [
        (["wte.weight"], "", ""),
        (["wpe.weight", "h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias", "h.0.attn.c_proj.weight"], "", "h.0.attn.c_proj"),
        (["h.0.mlp.c_fc.weight"], "wte", "h.0.mlp.c_fc"),
        (["h.0.mlp.c_fc.bias", "h.0.mlp.c_proj.weight"], "wpe", "h.0.mlp.c_proj"),
        (["h.1.attn.c_attn.weight", "h.1.attn.c_attn.bias", "h.1.attn.c_proj.weight"], "h.0", "h.1.attn.c_proj"),
        (["h.1.mlp.c_fc.weight"], "h.0.ln_1", "h.1.mlp.c_fc"),
        (["h.1.mlp.c_fc.bias", "h.1.mlp.c_proj.weight"], "h.0.attn", "h.1.mlp.c_proj"),
    ]  # fmt: skip
    # in the last block's MLP (c_fc run, c_proj not yet fetched) the c_fc bias + c_proj weight buffer is open:
    # measured with MemTracker at the checkpointed forward's peak, 21,312 B at N_d = 2 and 4
    c_fc = [m for m, _ in fetches].index("transformer.h.1.mlp.c_fc")
    for nd in (2, 4):
        resident, open_ = D.gather_buffers_numel(groups, numels, nd, c_fc)
        assert open_ * 4 == 21_312
        assert resident == sum(n for n in numels if n > 100)  # everything issued by then (sizes divide by N_d)


def test_checkpointed_forward_peaks_with_the_open_buffer():
    """The checkpointed ZeRO-3 forward: the last block's moment carries the open buffer (measured 605,541 B at
    N_d = 2 against 584,485 predicted without it, +21,056 B); without checkpointing the block's moment comes after
    c_proj, whose fetch freed it."""
    s = D.Settings.from_ds_config({"zero_optimization": {"stage": 3, **SMALL3}}, zero_init=False)
    for checkpointing, buffer in (("full", 21_312), ("none", 0)):
        w = _workload()
        w = Workload(w.shapes, w.spec, w.seq_len, w.micro_batch, checkpointing=checkpointing)
        run = D.ds_run(s, w, 2, stat_bytes=4)
        last = next(m for m in D.forward_moments(run) if m.name == "last block")
        terms = {t.name: t.bytes for t in last.terms}
        assert terms.get("coalesced all-gather buffers awaiting their last module", 0) == buffer
    (est,) = D.estimate(Workload(w.shapes, w.spec, w.seq_len, w.micro_batch, checkpointing="full"), 2, s, stat_bytes=4)
    assert abs(est.peak.by_phase()["forward"] - 605_541) <= 0.001 * 605_541


def test_zero2_partition_lives_into_earlier_blocks():
    """ZeRO-2, 5,000-element buckets, gpt-tiny at N_d = 4, checkpointed: rank 2's grads_in_partition is allocated
    when the last block's c_fc weight bucket is reduced (at ln_2's hook, mid-block), so it is live at block 0's
    c_proj backward; measured there (MemTracker, rank 2's backward peak): 471,152 B, the other ranks below."""
    w = _workload()
    w = Workload(w.shapes, w.spec, w.seq_len, w.micro_batch, checkpointing="full")
    s = D.Settings.from_ds_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5000}})
    run = D.ds_run(s, w, 4, stat_bytes=4)
    # rank 3's at the last block's c_proj (its first op), rank 2's before block 0; rank 1's mid-block 0 (after every
    # block's first op), rank 0's with the embedding's, after the blocks
    assert [(r, j) for r, j, _ in D._partition_allocations(run)] == [(2, 0), (3, 1)]
    (est,) = D.estimate(w, 4, s, stat_bytes=4)
    assert est.peak.peak_phase == "backward"
    assert abs(est.peak.by_phase()["backward"] - 471_152) <= 0.003 * 471_152


def test_zero1_overlap_keeps_large_gradients_outside_the_partition():
    """ZeRO-1 with overlap_comm, checkpointed, N_d = 4: gradients larger than the 5,000-element bucket (the c_fc and
    c_proj weights, 5,184) outside a rank's partition stay to the step (stage 1 clears none); measured backward
    peak 511,888 B (rank 2), 20,736-41,472 B above ZeRO-2's ranks in the same world."""
    w = _workload()
    w = Workload(w.shapes, w.spec, w.seq_len, w.micro_batch, checkpointing="full")
    s = D.Settings.from_ds_config({"zero_optimization": {"stage": 1, "reduce_bucket_size": 5000, "overlap_comm": True}})
    run = D.ds_run(s, w, 4, stat_bytes=4)
    kept = D._stage1_kept_gradients(run)
    assert [kept[r][0].bytes for r in range(4)] == [41_472, 41_472, 20_736, 0]  # at block 0: block 1's weights
    (est,) = D.estimate(w, 4, s, stat_bytes=4)
    assert abs(est.peak.by_phase()["backward"] - 511_888) <= 0.003 * 511_888
