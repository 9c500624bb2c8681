"""The module buffers transformers' models hold beside the parameters under FSDP2 (``Fsdp2Run.buffer_bytes``,
``scale_bytes``, ``router_bytes``), and the one saved tensor FSDP2's mixed precision adds to a model's own
(``router_weight_copy_bytes``): read by ``terms.fsdp2_run``; their own module because ``hf_tree`` reads ``terms``.
DeepSeek-V3's two router helpers live in formulas/deepseek_activations.py (DeepSpeed counts them too)."""

from __future__ import annotations

from zeroplan.formulas.deepseek_activations import router_bias_bytes, router_weight_copy_bytes

__all__ = ["embed_scale_bytes", "rotary_buffer_bytes", "rotary_recompute_bytes", "router_bias_bytes",
           "router_weight_copy_bytes"]


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


def rotary_recompute_bytes(spec) -> int:
    """The temporaries of recomputing one rotary table at a meta init (``init_weights`` after ``to_empty``:
    ``modeling_rope_utils.py:compute_default_rope_parameters``, ``torch.arange(0, dim, 2, dtype=torch.int64)
    .to(dtype=torch.float)``: the int64 arange and its float copy alive at once, head_dim/2 x (8 + 4) B; each later
    step holds two fp32 tensors of head_dim/2). Measured: differential draw 1-198 (qwen2 bf16, meta init, N_d = 2, no
    short shard to re-pad), init 192 B under on both ranks without it (head_dim 32)."""
    return (spec.head_dim // 2) * (8 + 4)
