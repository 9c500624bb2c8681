"""DeepSeek-V3 (multi-head latent attention, the sigmoid group-limited router, shared experts, dense first layers)
and mixed dense/sparse layers in general: what autograd keeps in transformers' own classes (saved-tensor hooks, what
is still alive at the loss), one decoder layer's moments against a live-storage trace, both exact, in fp32 and
bf16 (``zeroplan.formulas.deepseek_activations``, ``activation_terms.ModelActivations.layer_blocks``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.hf_saved import check_fsdp2_recorded, hf_saved_bytes, predicted_saved_bytes
from zeroplan.architectures.hf_config import read_hf_config, spec_from_hf_config
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.formulas.activation_terms import activation_limit, model_activations

CONFIGS = Path(__file__).parent / "data" / "hf_configs"
TINY = json.loads((CONFIGS / "tiny-deepseek-v3.json").read_text())
# bf16 grouped_mm needs rows of 16-byte multiples: expert widths divisible by 8
VARIANTS = {
    "lora-q": {"moe_intermediate_size": 16},
    "plain-q-groups": {"q_lora_rank": None, "n_group": 3, "topk_group": 2, "num_experts_per_tok": 3,
                       "moe_intermediate_size": 16},
    "all-sparse-unnormalised": {"first_k_dense_replace": 0, "moe_intermediate_size": 8, "norm_topk_prob": False,
                                "hidden_size": 64, "n_shared_experts": 1},
}  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_saved_activations_match_transformers_class(variant, dtype):
    """DeepseekV3ForCausalLM: every storage still saved at the loss equals ``saved_total`` plus the int64 targets,
    no slack. Without the router's dead-branch rule (its group indices and mask counted) the prediction is
    N·(2G + g)·8 + N·E too high per sparse layer; with Llama's attention instead of ``mla_saved`` it misses the
    fp32 math-SDPA copies (scaled q and kᵀ, the s² probabilities, v)."""
    cfg = {**TINY, **VARIANTS[variant]}
    assert hf_saved_bytes(cfg, 2, 8, dtype)[0] == predicted_saved_bytes(cfg, 2, 8, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny-qwen2-moe", "tiny-qwen3-moe"])
def test_mixed_dense_and_sparse_layers_sum_each_layers_block(name, dtype):
    """Qwen2-MoE's ``decoder_sparse_step`` 2 / ``mlp_only_layers`` [3] and Qwen3-MoE's ``mlp_only_layers`` [0]:
    each layer its own block (refused before); one block for every layer misses by the dense/sparse difference."""
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    if dtype == "bfloat16":
        cfg["moe_intermediate_size"] = 24  # 16-byte grouped_mm rows
    spec = spec_from_hf_config(cfg)
    acts = model_activations(spec, 2, 8, act_bytes=4 if dtype == "float32" else 2)
    kinds = {i in spec.moe.sparse_layers for i in range(spec.n_layer)}
    assert kinds == {True, False} and len(acts.layer_blocks) == spec.n_layer and acts.block == acts.layer_blocks[-1]
    assert len({b.saved for b in acts.layer_blocks}) == 2
    assert hf_saved_bytes(cfg, 2, 8, dtype)[0] == predicted_saved_bytes(cfg, 2, 8, dtype)


MOMENT_ROWS = [("lora-q", 2, 64), ("lora-q", 1, 64), ("lora-q", 16, 8), ("plain-q-groups", 4, 16)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("variant", "b", "s"), MOMENT_ROWS)
def test_layer_moments_match_a_live_storage_trace(variant, b, s, dtype):
    """One dense and one sparse ``DeepseekV3DecoderLayer``: saved, the forward's peak beyond it (``forward_extra``),
    the backward's beyond it and the incoming gradient (the engines' working sets, and the post-attention norm's
    moment), the forward without grad (``ckpt_forward_peak``), storage by storage. Exact; at s = 64 the math SDPA's
    two score tensors are each phase's peak, at b·s = 128 with s = 8 the rest of the layer; b = 1 saves v as a view.
    (b = 1 with s = 16 misses 1,632 B of an fp32 dense layer's backward and 256 B, the (s, s) bool mask, of the bf16
    no-grad forward: not in these rows.)"""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.test_moe_peaks import LiveStorages
    from zeroplan.formulas.deepseek_activations import _mlp_weight_grads

    transformers.logging.set_verbosity_error()
    cfg = {**TINY, "num_hidden_layers": 2, "first_k_dense_replace": 1, "moe_intermediate_size": 16,
           **VARIANTS[variant]}  # fmt: skip
    torch_dtype, a = getattr(torch, dtype), 4 if dtype == "float32" else 2
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**cfg), attn_implementation="sdpa", dtype=torch_dtype).train()
    spec, d = spec_from_hf_config(cfg), cfg["hidden_size"]
    acts = model_activations(spec, b, s, act_bytes=a, stat_bytes=a)
    for i, layer in enumerate(model.model.layers):
        x = torch.randn(b, s, d, dtype=torch_dtype, requires_grad=True)
        pos = torch.arange(s).unsqueeze(0)
        cos_sin, g = model.model.rotary_emb(x, pos), torch.randn(b, s, d, dtype=torch_dtype)
        ignore = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), x, *cos_sin, g, pos)}
        blk, nda = acts.layer_blocks[i], b * s * d * a
        fwd = LiveStorages(ignore)
        with fwd.mode:
            out = layer(x, position_embeddings=cos_sin, attention_mask=None, position_ids=pos)
        assert fwd.live - out.untyped_storage().nbytes() + (nda if a == 4 else 0) == blk.saved, i
        assert fwd.peak + nda - blk.saved == blk.forward_extra, i
        start, fwd.peak = fwd.live, 0
        with fwd.mode:
            out.backward(g)
        layer_spec = spec if i in spec.moe.sparse_layers else dataclasses.replace(spec, moe=None)
        norm = blk.norm_backward_saved + blk.norm_backward_ws + _mlp_weight_grads(layer_spec, a) + d * a - blk.saved
        assert fwd.peak - start == max(blk.backward_first_op, blk.backward_act_grads + blk.first_weight_grads, norm), i
        nograd = LiveStorages(ignore)
        with torch.no_grad(), nograd.mode:
            layer(x, position_embeddings=cos_sin, attention_mask=None, position_ids=pos)
        assert nograd.peak + nda == blk.ckpt_forward_peak, i


def test_groups_and_head_widths_outside_the_terms_refuse_the_peak_not_the_shapes():
    """Groups transformers' router cannot form (here 6 experts in 4 groups) and equal q/k and v head widths (CPU
    SDPA's flash kernel, not measured) refuse the peak in one line; the parameter shapes are still given."""
    base = read_hf_config(CONFIGS / "tiny-deepseek-v3.json")
    assert activation_limit(base) is None
    for extra, missing in [({"n_group": 4}, "routing groups n_group=4, topk_group=1 for 6 experts"),
                           ({"v_head_dim": 12}, "latent attention with q/k and v heads of one width (12")]:  # fmt: skip
        spec = spec_from_hf_config({**TINY, **extra}, "tiny")
        why = activation_limit(spec)
        assert why is not None and missing in why and "\n" not in why
        assert len(transformer_shapes(spec)) == len(transformer_shapes(base))


def test_published_deepseek_v3_reads_its_router_and_layer_kinds():
    """DeepSeek-V3's config.json: 8 groups, 4 per token, 3 dense layers then 58 sparse; the peak is given
    (no refusal) with a dense block for layers 0-2 and a sparse one after."""
    spec = read_hf_config(CONFIGS / "deepseek-v3.json")
    assert (spec.moe.n_group, spec.moe.topk_group, spec.moe.sparse_layers[0], spec.n_layer) == (8, 4, 3, 61)
    acts = model_activations(spec, 1, 8)
    assert acts.layer_blocks[0] == acts.layer_blocks[2] != acts.layer_blocks[3] == acts.block


def test_cli_gives_deepseek_peaks_where_the_engines_were_measured():
    """FSDP2 and DeepSpeed ZeRO-1, ZeRO-2 (every gradient in one bucket: the default 5e8 elements) and ZeRO-3 give
    DeepSeek-V3's peak (the refusals of ``moe_limit``: tests/test_deepspeed_moe12.py)."""
    from tests.clicheck import run_json

    model = str(CONFIGS / "tiny-deepseek-v3.json")
    for engine in (["--engine", "fsdp2"], ["--engine", "deepspeed", "--stage", "1"],
                   ["--engine", "deepspeed", "--stage", "2"], ["--engine", "deepspeed", "--stage", "3"]):  # fmt: skip
        (row,) = run_json("estimate", "--model", model, "--gpus", "2", "--seq-len", "8", *engine)["stages"]
        assert row["peak_bytes"] > 0


#: FSDP2 on transformers' DeepseekV3ForCausalLM (validate.engines.fsdp2_rows.run_world, Fsdp2Settings(model=CONFIG_JSON,
#: hf=True, seq_len=64, steps=2, param_dtype), micro-batch 2, gloo, N_d = 2), recorded 2026-12-01 on this project's CPU
#: machine, torch 2.13.0, transformers 5.24: measured peak bytes [init, forward, backward, optimizer_step] per rank.
#: One dense layer, then two sparse (Qwen3-MoE: ``mlp_only_layers`` [0]); small vocabularies, so that the layers'
#: moments are the phases' peaks.
DEEPSEEK_WIDE = {"model_type": "deepseek_v3", "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                 "num_key_value_heads": 4, "num_hidden_layers": 3, "first_k_dense_replace": 1, "vocab_size": 503,
                 "max_position_embeddings": 64, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                 "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 64, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
                 "tie_word_embeddings": False}  # fmt: skip
QWEN3_MOE_MIXED = {"model_type": "qwen3_moe", "hidden_size": 128, "intermediate_size": 96, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 503, "max_position_embeddings": 64,
                   "tie_word_embeddings": False, "num_experts": 6, "num_experts_per_tok": 3,
                   "moe_intermediate_size": 128, "head_dim": 32, "mlp_only_layers": [0]}  # fmt: skip
FSDP2_RECORDED = {
    "qwen3-moe-mixed": (QWEN3_MOE_MIXED, "fp32",
                        [[4139904, 14101720, 14805704, 8033104], [4139904, 14099672, 14803656, 8031056]]),
    "deepseek-wide": (DEEPSEEK_WIDE, "fp32",
                      [[2441152, 9441428, 9990812, 4670196], [2441152, 9439380, 9988764, 4668148]]),
    "deepseek-wide-bf16": (DEEPSEEK_WIDE, "bf16",
                           [[2441152, 7531292, 7660060, 4670196], [2441152, 7529244, 7658012, 4668148]]),
    # every decoder layer in checkpoint_wrapper (non-reentrant, before fully_shard: Fsdp2Settings(checkpointing=True)),
    # recorded 2026-12-02: the recomputed MLA and MoE layers (activation_terms' ``recomputed``, ``ckpt_forward_peak``)
    # exact on both ranks; 512 B under at block 2's backward before hf_tree.checkpointed_position_ids
    "deepseek-wide-ckpt": (DEEPSEEK_WIDE, "fp32",
                           [[2441152, 5868692, 8068620, 4670196], [2441152, 5866644, 8066572, 4668148]]),
}  # fmt: skip
FSDP2_SETTINGS = {"deepseek-wide-ckpt": {"checkpointing": True}}
#: (row, phase): measured - predicted, where not 0: none. Before (traced from the live storages at the peaks, gloo N_d = 2):
#: every phase of every row 32 B under (the routers' fp32 ``e_score_correction_bias`` buffers: hf_buffers.
#: router_bias_bytes); the bf16 row's forward and backward 4,128 B under (those 32 B and the routers' fp32 weight
#: copies F.linear saves when FSDP2 casts the router to bf16: hf_buffers.router_weight_copy_bytes, 2 x 2,048 B)
FSDP2_RESIDUAL: dict = {}
MARGIN = 0.0005  # as tests/test_fsdp2_hf_recorded.py
EXACT = 1e-6  # the recorded FSDP2 rows: a measurement on disk does not move, so to a few bytes (8 B at 8 MB; the bf16
# residual is rank 0's fraction, rank 1 reads it 1.5e-7 apart): the router bias (32 B, 1.3e-5 of init) and a
# checkpointed layer's position ids (512 B) are caught when dropped


@pytest.mark.parametrize("name", sorted(FSDP2_RECORDED))
def test_fsdp2_peaks_of_deepseek_every_phase_every_rank(name, tmp_path):
    """Every phase of every rank equal to the recorded run (fp32), or at its recorded residual (bf16). With one block for
    every layer (the sparse one, ``layer_blocks`` left out) the saved activations of the dense layer are counted
    as a sparse layer's; with Llama's attention terms the s² math-SDPA tensors are missing: each fails here."""
    cfg, dtype, measured = FSDP2_RECORDED[name]
    check_fsdp2_recorded(name, cfg, dtype, measured, FSDP2_RESIDUAL, EXACT, tmp_path, **FSDP2_SETTINGS.get(name, {}))


def test_checkpointed_layers_keep_their_position_ids_to_their_backward():
    """A checkpointed (non-reentrant) decoder layer keeps its call's ``position_ids`` for the recompute, past the
    body's return, until its backward: transformers' own ``gradient_checkpointing_enable`` as FSDP2's
    ``checkpoint_wrapper`` (``hf_tree.checkpointed_position_ids``; without checkpointing they die with the body)."""
    import weakref

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    alive = {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY)).train()
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        seen = []
        model.model.layers[0].register_forward_pre_hook(lambda m, a, kw: seen.append(weakref.ref(kw["position_ids"])),
                                                        with_kwargs=True)  # fmt: skip
        ids = torch.randint(0, TINY["vocab_size"], (2, 8))
        out = model(input_ids=ids, labels=ids, use_cache=False)
        after_forward = seen[0]() is not None
        out.loss.backward()
        alive[ckpt] = (after_forward, seen[0]() is not None)
    assert alive == {False: (False, False), True: (True, False)}


#: DeepSpeed 0.19.8 on transformers' DeepseekV3ForCausalLM (validate.engines.deepspeed_compare.run_world(configs, 2,
#: model=a 64-position tiny-llama world, steps=2, seq_len=64, runs=[{"model": CONFIG_JSON, "hf": True}] per config),
#: ds_config(stage, micro_batch=1, optimizer_params={"torch_adam": True}), DeepSpeed's default buckets, fp32, gloo,
#: N_d = 2, DS_ACCELERATOR=cpu), recorded 2026-12-01 on this project's CPU machine: the largest rank's peak bytes
#: [init, forward, backward, optimizer_step]. ZeRO-3 with 5,000-element buckets: tests/test_deepspeed_moe.py.
DS_RECORDED = {2: [4389440, 8015856, 2008015864, 8779344], 3: [2003554241, 2010211061, 2012071897, 2008779877]}
#: measured - predicted beyond MARGIN: none. ZeRO-3's backward was 1,699,364 B (0.085 %) under at DeepSpeed's default
#: buckets before ``zero3._epilogue_reduce_scatter`` (the last bucket, every gradient, reduced after backward: its
#: padded flat buffer and gloo's copy); now 68 B (the router's and rotary buffers). ZeRO-2 is within 0.007 % every
#: phase; before math SDPA's b = 1 rule (``deepseek_activations._v_view``: v saved as a view of kv_b_proj's output)
#: its forward was 0.61 % under.
DS_RESIDUAL: dict = {}


@pytest.mark.parametrize("stage", sorted(DS_RECORDED))
def test_deepspeed_peaks_of_deepseek_every_phase(stage, tmp_path):
    pytest.importorskip("torch")
    from validate.engines.deepspeed_compare import ds_config, workload_for
    from zeroplan.engines import deepspeed as D
    from zeroplan.formulas.peak import PHASES

    path = tmp_path / "deepseek-wide.json"
    path.write_text(json.dumps(DEEPSEEK_WIDE))
    config = ds_config(stage, micro_batch=1, optimizer_params={"torch_adam": True})
    workload = workload_for(str(path), 1, 64, 1, "none", hf=True)
    (est,) = D.estimate(workload, 2, D.Settings.from_ds_config(config, zero_init=False), stat_bytes=4)
    predicted = est.peak.by_phase()
    for phase, value in zip(PHASES, DS_RECORDED[stage]):
        err = (value - predicted[phase]) / value
        assert abs(err - DS_RESIDUAL.get((stage, phase), 0.0)) <= MARGIN, (stage, phase, value, predicted[phase])
