"""Activation bytes of one micro-batch, derived per op for decoder-only transformers (no dropout, SDPA).

Each block's forward is a short list of ops; what an op saves for backward is what its autograd
formula (``tools/autograd/derivatives.yaml`` in PyTorch) keeps: a linear its input, LayerNorm its
input, mean and rstd, GELU its input, SDPA q, k, v, its output and the fp32 logsumexp, an elementwise
product both factors. Tensors are counted once per storage (q, k, v are views of one qkv output at
GPT). Korthikanti et al. 2022 (arXiv:2205.05198, eq. 1: 34·sbh + 5·a·s²·b per layer) counts the
same tensors plus dropout masks and the s×s attention scores; without dropout and with SDPA the
constant for a fused-GELU GPT block is 32·sbh, and nothing grows with s².

Symbols: N = b·s tokens, d = d_model, kv = key/value width (n_kv_head·head_dim), f = FFN width,
h = heads, V = vocabulary; ``a`` = bytes of an activation (the 16-bit dtype) and ``st`` = bytes of
LayerNorm's mean/rstd (``a`` on CPU, where ``native_layer_norm`` returns them in the input dtype;
4 on CUDA, which keeps them in fp32).

Two families, as ``validate/models.py`` and ``transformers`` build them:
- ``gpt``: x → LN → qkv linear → SDPA → proj → +x → LN → fc → GELU → proj → +; learned positions,
  tied head. GELU is ``fused`` (``F.gelu``: saves its input) or ``tanh_python`` (transformers'
  ``NewGELUActivation``: 0.5·x, tanh(...) and 1 + tanh(...) are saved too, three more N·f).
- ``llama`` (Mistral, Qwen2 alike; q/k/v biases change no activation): RMSNorm as transformers
  writes it (fp32 upcast, pow, mean, rsqrt, two products), separate q/k/v, RoPE (the cos/sin tables
  once per model), SDPA with grouped-query heads (``enable_gqa``: k, v stay kv wide), SwiGLU MLP
  (gate, up, SiLU, product), untied head.
The loss upcasts the logits to fp32 and cross-entropy saves the fp32 log-softmax output (N·V·4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from zeroplan.architectures.spec import TransformerSpec

TOKEN_BYTES = 8  # int64 token ids and targets, as the embedding and nll_loss take them
LOSS_BYTES = 8  # nll_loss returns the fp32 loss and its total_weight (saved for backward), both live
SAVED_LOSS_BYTES = 4  # of which cross-entropy saves total_weight
Checkpointing = Literal["none", "full"]
CHECKPOINTING_MODES: tuple[str, ...] = ("none", "full")


@dataclass(frozen=True)
class BlockActivations:
    """One transformer block of one micro-batch, in bytes.

    ``saved``: what autograd keeps for the block's backward (checkpointing none), its input included
    where an op saves it. ``forward_extra``: tensors alive beside ``saved`` at the block's forward peak
    (its output and the last op's output, plus the input where nothing saves it). ``ckpt_forward_peak``:
    everything the block holds at its peak when it runs without saving (checkpointed forward).
    ``ckpt_saved``: what the checkpoint keeps (the block input). ``backward_first_op``: activation
    gradients and the first op's weight gradients alive when the block's last linear runs backward
    (beyond ``saved`` and the incoming gradient); ``first_weight_grads``: those weight gradients alone;
    ``backward_act_grads``: the largest activation-gradient working set later in the block's backward.
    """

    saved: int
    forward_extra: int
    ckpt_forward_peak: int
    ckpt_saved: int
    backward_first_op: int
    first_weight_grads: int
    backward_act_grads: int


@dataclass(frozen=True)
class ModelActivations:
    """A whole micro-batch: blocks, embeddings, final norm, head and loss (bytes)."""

    block: BlockActivations
    n_layer: int
    embed_saved: int  # saved by the embeddings (position ids; the token ids are the batch's)
    embed_out: int  # the embedding sum: block 0's input
    final_saved: int  # final norm's saved tensors and its output (the head's input)
    logits: int  # the head's output, activation dtype, N·V·a
    logits_fp32: int  # the loss's fp32 upcast, N·V·4 (freed after cross-entropy)
    log_softmax: int  # saved by cross-entropy: fp32 log-probabilities, N·V·4
    batch: int  # token ids and targets, int64
    loss: int

    @property
    def blocks_saved(self) -> int:
        """Every block's saved activations (checkpointing none)."""
        return self.n_layer * self.block.saved

    def saved_total(self, checkpointing: str) -> int:
        """What autograd holds when forward ends, before the loss is reduced (derivation above)."""
        per_block = self.block.saved if checkpointing == "none" else self.block.ckpt_saved
        return (
            self.embed_saved + self.n_layer * per_block + self.final_saved + self.log_softmax + SAVED_LOSS_BYTES
        )


def _gpt_block(spec: TransformerSpec, n: int, b: int, s: int, a: int, st: int, gelu: str) -> BlockActivations:
    """GPT block (validate/models.py:Block.forward; transformers GPT2Block with dropout 0)."""
    d, kv, f, h = spec.d_model, spec.kv_dim, spec.ffn, spec.n_head
    lse = b * h * s * 4  # SDPA (flash, CPU or CUDA) keeps the fp32 logsumexp per query and head
    gelu_extra = 3 * n * f * a if gelu == "tanh_python" else 0  # 0.5x, tanh(u), 1 + tanh(u)
    # x, LN1 out, qkv, SDPA out, x1, LN2 out (N·d each; qkv N·(d+2kv)) + fc out, GELU out (N·f)
    saved = n * a * (6 * d + 2 * kv + 2 * f) + 4 * n * st + lse + gelu_extra
    # in the checkpointed (no-grad) forward, Block.forward's locals q, k, v (one qkv storage) and y live
    # to the end; at the GELU: x, qkv, y, x1, fc out, GELU out (LN outputs are freed after their linear)
    ckpt_peak = n * a * (3 * d + 2 * kv + 2 * f) + n * a * d
    return BlockActivations(
        saved=saved,
        forward_extra=2 * n * d * a,  # the MLP's projection and the block output x + mlp(x)
        ckpt_forward_peak=ckpt_peak,
        ckpt_saved=n * d * a,
        backward_first_op=n * f * a + (d * f + d) * a,  # mlp.proj backward: dGELU-out, dW, db
        first_weight_grads=(d * f + d) * a,
        backward_act_grads=n * f * a,  # GELU backward: dGELU-out and dfc-out live, GELU out freed
    )


def _llama_block(spec: TransformerSpec, n: int, b: int, s: int, a: int) -> BlockActivations:
    """Llama block as transformers writes it (LlamaDecoderLayer, RMSNorm, RoPE, SDPA with GQA, SwiGLU)."""
    d, kv, f, h = spec.d_model, spec.kv_dim, spec.ffn, spec.n_head
    lse = b * h * s * 4
    # RMSNorm: fp32 copy (saved by pow and by the product), rsqrt (N fp32), normalised 16-bit (saved
    # by the weight product) and its output (saved by the next linears)
    rms = n * d * 4 + n * 4 + 2 * n * d * a
    attn = n * a * (d + 2 * kv) + n * d * a + lse  # q, k after RoPE, v, SDPA out, logsumexp
    mlp = 4 * n * f * a  # gate out (SiLU's input), up out, SiLU out, their product (down's input)
    return BlockActivations(
        saved=2 * rms + attn + mlp,
        # nothing saves the block input or x1: both live beside the last product, down's out, the sum
        forward_extra=4 * n * d * a,
        ckpt_forward_peak=2 * rms + attn + mlp + 4 * n * d * a,  # derived as upper bound (see docs)
        ckpt_saved=n * d * a,
        backward_first_op=n * f * a + d * f * a,  # down_proj backward: d(product), dW
        first_weight_grads=d * f * a,
        backward_act_grads=2 * n * f * a,  # product backward: dSiLU-out, dup-out beside d(product)
    )


def model_activations(
    spec: TransformerSpec,
    micro_batch: int,
    seq_len: int,
    act_bytes: int = 2,
    stat_bytes: int = 2,
    gelu: Literal["fused", "tanh_python"] = "fused",
) -> ModelActivations:
    """Activations of one micro-batch of ``spec`` (derivation in the module docstring)."""
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"micro_batch={micro_batch}, seq_len={seq_len}: each must be >= 1")
    if seq_len > spec.max_seq_len:
        raise ValueError(f"seq_len={seq_len}: the model has only {spec.max_seq_len} positions")
    b, s, a = micro_batch, seq_len, act_bytes
    n, d, v = b * s, spec.d_model, spec.vocab_size
    if spec.style == "gpt":
        block = _gpt_block(spec, n, b, s, a, stat_bytes, gelu)
        embed_saved = s * TOKEN_BYTES  # the position ids (arange), saved by the position embedding
        final_saved = n * d * a + 2 * n * stat_bytes + n * d * a  # ln_f input, mean, rstd; ln_f out
    else:
        block = _llama_block(spec, n, b, s, a)
        head_dim = d // spec.n_head
        # position ids, and RoPE's cos and sin (b, s, head_dim) in the activation dtype, shared by blocks
        embed_saved = s * TOKEN_BYTES + 2 * b * s * head_dim * a
        final_saved = n * d * 4 + n * 4 + 2 * n * d * a  # final RMSNorm, its output saved by lm_head
    return ModelActivations(
        block=block,
        n_layer=spec.n_layer,
        embed_saved=embed_saved,
        embed_out=n * d * a,
        final_saved=final_saved,
        logits=n * v * a,
        logits_fp32=n * v * 4,
        log_softmax=n * v * 4,
        batch=2 * n * TOKEN_BYTES,
        loss=LOSS_BYTES,
    )
