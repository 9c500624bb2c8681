"""Generator 5 of the differential matrix (issue 19): the newer families, drawn as generator 1 draws the first four.

``draw(seed, index, engine, generator=5)`` (``validate.engines.differential.draw``) lands in ``family_draw``:
one of ``FAMILIES`` (Qwen3, Gemma 2, Gemma 3 text, Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) with its own
sizes drawn (heads, KV heads, a decoupled head_dim, experts, top-k, shared experts, DeepSeek's dense first layers,
latent ranks and routing groups, Gemma's sliding windows and soft-caps, tied or not where the class ties), 5-30M
parameters, N_d 2-4, and the engine's settings as generator 1 draws them (``differential._ds_config``,
``differential._fsdp2``), from a stream of its own (``...-generator-5``), so generators 1-4 are unchanged.

What is drawn stays inside what zeroplan models, by rule, not by asking the profile (a later profile must draw
the same): DeepSpeed on a sparse model draws ZeRO-3, or ZeRO-2 with a reduce bucket at least one expert tensor
(``engines/deepspeed/plan.py moe_limit``); Gemma 3's window is drawn on both sides of the sequence, DeepSeek's
routing groups as its router can form them. A draw zeroplan still refuses is not run: ``refusal`` gives the
profile's one line (``benchmarks/differential.py`` skips it), ``refusals`` counts them by reason.

Widths are multiples of 8: transformers' ``grouped_mm`` experts need 16-byte rows in bf16 (docs/models.md).
"""

from __future__ import annotations

import json
import random
import re
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Optional

FAMILIES = ("qwen3", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
SPARSE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
PSI_RANGE = (5_000_000, 30_000_000)
"""parameters of a drawn model: ~1 CPU-minute a draw at fp32 on gloo."""
SEQUENCES = (32, 64, 128)
GENERATOR = 5


def _width(rng: random.Random, low: int, high: int) -> int:
    """A multiple of 8 in [low, high] (``grouped_mm``'s 16-byte rows in bf16)."""
    return 8 * rng.randint(low // 8, high // 8)


def _hidden(rng: random.Random, heads: int) -> int:
    """A width of 96-384 apart from head_dim: whole heads (the spec reader's check), a multiple of 8."""
    return heads * 8 * rng.randint(max(1, 96 // (8 * heads)), 384 // (8 * heads))


def _attention(rng: random.Random, decoupled: bool) -> dict:
    """Heads, KV heads (a divisor) and the width; ``decoupled``: head_dim drawn apart from hidden / heads."""
    heads = rng.choice((2, 4, 6, 8))
    kv = rng.choice([k for k in range(1, heads + 1) if heads % k == 0])
    head_dim = rng.choice((16, 32, 48, 64))
    hidden = _hidden(rng, heads) if decoupled else head_dim * heads
    out = {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv}
    return out | ({"head_dim": head_dim} if decoupled else {})


def _dense(rng: random.Random, family: str, seq: int) -> dict:
    """Qwen3, Gemma 2, Gemma 3 text, Phi-3: a config.json beyond the generic keys."""
    c = _attention(rng, decoupled=family != "phi3")
    c["intermediate_size"] = _width(rng, c["hidden_size"], 4 * c["hidden_size"])
    c["tie_word_embeddings"] = rng.random() < 0.5
    if family == "qwen3":
        c["attention_bias"] = rng.random() < 0.5
    elif family == "phi3":  # Phi3Config's pad_token_id 32000 is outside a drawn vocabulary (nn.Embedding refuses it)
        c |= {"pad_token_id": 0, "eos_token_id": 2}
    elif family.startswith("gemma"):
        c["query_pre_attn_scalar"] = c["head_dim"]
        c["pad_token_id"] = 0
        if family == "gemma2":  # eager at any length: a window shorter or longer than the sequence
            c["sliding_window"] = rng.choice((seq // 2, 4 * seq))
            c["attn_logit_softcapping"] = rng.choice((None, 50.0))
            c["final_logit_softcapping"] = rng.choice((None, 30.0))
        else:  # Gemma 3's window drawn on both sides of the sequence (sliding and full layers differ above it)
            c["sliding_window"] = rng.choice((seq + 8, 4 * seq, seq // 2))
            c["sliding_window_pattern"] = rng.randint(2, 6)
            c["attention_bias"] = rng.random() < 0.5
    return c


def _sparse(rng: random.Random, family: str, layers: int) -> dict:
    """Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3: experts, top-k, shared experts, dense layers."""
    experts = rng.randint(2, 8)
    top_k = rng.randint(1, min(3, experts))
    expert_ffn = _width(rng, 32, 256)
    if family == "mixtral":
        c = _attention(rng, decoupled=False)
        return c | {"num_local_experts": experts, "num_experts_per_tok": top_k, "intermediate_size": expert_ffn,
                    "tie_word_embeddings": False, "sliding_window": None}  # fmt: skip
    if family == "deepseek_v3":
        return _deepseek(rng, experts, top_k, expert_ffn, layers)
    c = _attention(rng, decoupled=family == "qwen3_moe")
    dense = [i for i in range(layers) if rng.random() < 0.25]
    c |= {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": expert_ffn,
          "intermediate_size": _width(rng, c["hidden_size"], 3 * c["hidden_size"]), "mlp_only_layers": dense,
          "decoder_sparse_step": rng.choice((1, 1, 2)), "norm_topk_prob": rng.random() < 0.5,
          "tie_word_embeddings": rng.random() < 0.5}  # fmt: skip
    if family == "qwen2_moe":
        c["shared_expert_intermediate_size"] = _width(rng, 32, 2 * c["hidden_size"])
    return c


def _deepseek(rng: random.Random, experts: int, top_k: int, expert_ffn: int, layers: int) -> dict:
    """Latent attention (q/k and v heads of different widths: ``deepseek_limits``), routing groups its router forms."""
    groups = rng.choice([g for g in range(1, experts // 2 + 1) if experts % g == 0])
    topk_group = rng.randint(1, groups)
    top_k = min(top_k, topk_group * (experts // groups))
    heads = rng.choice((2, 4, 6, 8))
    nope, rope = rng.choice((16, 32)), rng.choice((8, 16))
    v = rng.choice([w for w in (16, 24, 32) if w != nope + rope])
    return {"hidden_size": _hidden(rng, heads), "num_attention_heads": heads, "num_key_value_heads": heads,
            "q_lora_rank": rng.choice((None, 48, 96)), "kv_lora_rank": rng.choice((32, 64)),
            "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v,
            "n_routed_experts": experts, "num_experts_per_tok": top_k, "n_group": groups, "topk_group": topk_group,
            "n_shared_experts": rng.randint(1, 2), "moe_intermediate_size": expert_ffn,
            "first_k_dense_replace": rng.randint(0, min(2, layers - 1)), "norm_topk_prob": rng.random() < 0.5,
            "intermediate_size": _width(rng, 128, 512), "tie_word_embeddings": False}  # fmt: skip


def _model(rng: random.Random, family: str, seq: int) -> dict:
    layers = rng.randint(2, 5)
    c = _sparse(rng, family, layers) if family in SPARSE else _dense(rng, family, seq)
    return {"model_type": family, "num_hidden_layers": layers, "vocab_size": rng.randint(5_000, 32_000),
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "attention_dropout": 0.0, **c}  # fmt: skip


def expert_tensor(config: dict) -> int:
    """Elements of one layer's ``experts.gate_up_proj`` (E, 2f, d): DeepSpeed ZeRO-2's bucket floor (``moe_limit``)."""
    from zeroplan.architectures.hf_config import spec_from_hf_config

    spec = spec_from_hf_config(config)
    return spec.moe.n_experts * 2 * spec.moe.expert_ffn * spec.d_model


def _ds_config(rng: random.Random, config: dict, numels: tuple[int, ...], micro: int) -> tuple[dict, bool]:
    """Generator 1's ds_config; a sparse model's stage redrawn as ZeRO-2 or 3 and a ZeRO-2 reduce bucket raised
    to one expert tensor where it is smaller (``moe_limit``: what DeepSpeed's MoE peak is measured on)."""
    from validate.engines.differential import _ds_config as dense_ds_config

    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    block = (sum(numels) - numels[0] * (1 if config["tie_word_embeddings"] else 2)) // layers
    ds, zero_init = dense_ds_config(rng, numels, hidden, block, micro)
    zero = ds["zero_optimization"]
    if config["model_type"] in SPARSE and zero["stage"] == 1:  # ZeRO-1 of a sparse model: not measured
        zero["stage"] = rng.choice((2, 3))
        if zero["stage"] == 3:  # the stage-3 keys generator 1 draws
            zero |= {"stage3_param_persistence_threshold": rng.choice((0, hidden, 3 * hidden * hidden // 2)),
                     "stage3_prefetch_bucket_size": rng.choice((0, block // 2, 50_000_000)),
                     "stage3_max_live_parameters": rng.choice((1_000_000_000, block))}  # fmt: skip
            zero_init = rng.random() < 0.5
    if config["model_type"] in SPARSE and zero["stage"] == 2:
        zero["reduce_bucket_size"] = max(zero["reduce_bucket_size"], expert_tensor(config))
    return ds, zero_init


def family_draw(seed: int, index: int, engine: Optional[str] = None):
    """The ``index``-th draw of generator 5 of ``seed`` (``differential.draw(..., generator=5)``)."""
    from validate.engines.differential import Draw, _fsdp2, _numels

    rng = random.Random(f"zeroplan-differential-{seed}-{index}-generator-{GENERATOR}")
    drawn = rng.choice(("fsdp2", "deepspeed"))  # drawn whatever ``engine`` says: the rest is the same
    engine = engine or drawn
    family = rng.choice(FAMILIES)
    nd, seq, micro = rng.choice((2, 3, 4)), rng.choice(SEQUENCES), rng.choice((1, 2))
    while True:
        config = _model(rng, family, seq)
        numels = _numels(config)
        if PSI_RANGE[0] <= sum(numels) <= PSI_RANGE[1]:
            break
    base = Draw(seed, index, engine, config, nd, seq, micro, psi=sum(numels), generator=GENERATOR)
    if engine == "deepspeed":
        ds, zero_init = _ds_config(rng, config, numels, micro)
        if zero_init and "pad_token_id" in config:  # transformers' _init_weights zeroes the padding row of the
            # embedding, which zero.Init has partitioned to 0 elements (IndexError): no padding row (memory alike)
            config = {**config, "pad_token_id": None}
        return replace(base, config=config, ds_config=ds, zero_init=zero_init)
    return replace(base, fsdp2=_fsdp2(rng, nd))


def refusal(d) -> Optional[str]:
    """The profile's one line where it refuses ``d`` (a ``differential.Draw``), else None: such a draw is not run."""
    from validate.engines.differential import predict_draw
    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.engines import get_engine
    from zeroplan.engines.base import PlannerOptions

    # the engine's limits first (as estimate asks them: DeepSpeed's moe_limit reads the ds_config), then the profile's
    own = {"ds_config": d.ds_config} if d.engine == "deepspeed" else {}
    checkpointing = "full" if (d.fsdp2 or {}).get("checkpointing") else "none"
    limit = get_engine(d.engine).peak_limits(PlannerOptions(own=own), spec_from_hf_config(d.config), checkpointing)
    if limit is not None:
        return limit.reason.splitlines()[0]
    with tempfile.TemporaryDirectory(prefix="zeroplan-families-") as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(d.config))
        try:
            predict_draw(d, str(path), 0)
        except ValueError as e:
            return str(e).splitlines()[0]
    return None


def rule(why: str) -> str:
    """A refusal's line with its numbers as N (the draw's own sizes): one key per rule of the profile."""
    return re.sub(r"(?<![\w.\-])\d(?:[\d,.]*\d)?", "N", why)


def refusals(seed: int, indices, engine: Optional[str] = None) -> Counter:
    """How many of generator 5's draws ``indices`` of ``seed`` the profile refuses, by ``rule``."""
    from validate.engines.differential import draw

    out: Counter = Counter()
    for i in indices:
        why = refusal(draw(seed, i, engine, GENERATOR))
        if why is not None:
            out[rule(why)] += 1
    return out
