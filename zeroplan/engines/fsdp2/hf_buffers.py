"""The module buffers transformers' models hold beside the parameters under FSDP2 (``Fsdp2Run.buffer_bytes``,
``scale_bytes``, ``router_bytes``), and the one saved tensor FSDP2's mixed precision adds to a model's own
(``router_weight_copy_bytes``): read by ``terms.fsdp2_run``; their own module because ``hf_tree`` reads ``terms``."""

from __future__ import annotations


def rotary_buffer_bytes(spec) -> int:
    """transformers' rotary buffers of a llama-style ``spec`` (``Fsdp2Run.buffer_bytes``): the fp32 ``inv_freq`` and
    ``original_inv_freq`` (head_dim/2 each) of every rotary table, one per layer type at Gemma 3
    (``modeling_gemma3.py:Gemma3RotaryEmbedding.__init__``: local and global). Measured against the modules'
    buffers (tests/test_fsdp2_hf.py); t-gemma3 (two tables) missed 96 B in every phase with one table
    (tests/test_families.py)."""
    tables = len(set(spec.layer_types)) if spec.model_type == "gemma3_text" and spec.layer_types else 1
    return tables * 2 * (spec.head_dim // 2) * 4


def embed_scale_bytes(spec) -> int:
    """Gemma's 0-dim fp32 ``embed_scale`` buffer (``Gemma2TextScaledWordEmbedding.__init__``; ``Fsdp2Run.scale_bytes``).
    In fp32 the embedding's product saves the buffer itself (``embed_scale.to(weight.dtype)`` returns it), which
    ``gemma_activations.embed_saved`` counts as one activation-dtype scalar: ``fsdp2_run`` takes it out there
    (counted once, here). Without it t-gemma2 missed 4 B at init and the optimizer step (bf16: in every phase)."""
    return 4 if spec.model_type in ("gemma2", "gemma3_text") else 0


def router_bias_bytes(spec) -> int:
    """DeepSeek-V3's router buffer ``e_score_correction_bias``, fp32, one per routed expert, in every sparse layer
    (``modeling_deepseek_v3.py:DeepseekV3TopkRouter.__init__``: ``nn.Buffer(torch.zeros(num_experts, dtype=float32))``);
    not sharded by FSDP2, alive from the build on. Without it every phase of the recorded DeepSeek rows
    (tests/test_deepseek.py) read 32 B under (2 sparse layers x 4 experts x 4 B; MemTracker's Buffer: 64 B with the
    rotary tables' 32)."""
    moe = getattr(spec, "moe", None)
    if spec.model_type != "deepseek_v3" or moe is None:
        return 0
    return len(moe.sparse_layers) * moe.n_experts * 4


def router_weight_copy_bytes(spec, param_bytes: int) -> int:
    """Per sparse layer, the fp32 copy of DeepSeek-V3's router weight that ``F.linear`` saves when FSDP2 runs the
    layer with a 16-bit ``param_dtype``: transformers keeps the router in fp32 (``_keep_in_fp32_modules_strict``,
    so ``self.weight.type(torch.float32)`` returns the weight itself), but ``MixedPrecisionPolicy`` casts every
    unsharded parameter, the router's too, so ``DeepseekV3TopkRouter.forward`` makes E·d·4 B and the linear saves it
    to its backward. Traced (live storages at the forward peak, gloo N_d = 2, bf16: a (4, 128) fp32 tensor from
    ``modeling_deepseek_v3.py:forward`` line 135 per sparse layer): the 4,096 B the DeepSeek bf16 row read under
    (tests/test_deepseek.py). 0 in fp32 or for other families."""
    moe = getattr(spec, "moe", None)
    if spec.model_type != "deepseek_v3" or moe is None or param_bytes == 4:
        return 0
    return moe.n_experts * spec.d_model * 4


def rotary_recompute_bytes(spec) -> int:
    """The temporaries of recomputing one rotary table at a meta init (``init_weights`` after ``to_empty``:
    ``modeling_rope_utils.py:compute_default_rope_parameters``, ``torch.arange(0, dim, 2, dtype=torch.int64)
    .to(dtype=torch.float)``: the int64 arange and its float copy alive at once, head_dim/2 x (8 + 4) B; each later
    step holds two fp32 tensors of head_dim/2). Measured: differential draw 1-198 (qwen2 bf16, meta init, N_d = 2, no
    short shard to re-pad), init 192 B under on both ranks without it (head_dim 32)."""
    return (spec.head_dim // 2) * (8 + 4)
