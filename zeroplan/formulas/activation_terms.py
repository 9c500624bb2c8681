"""Activation bytes of one micro-batch, derived per op for decoder-only transformers (no dropout, SDPA).

Each block's forward is a short list of ops; what an op saves for backward is what its autograd
formula (``tools/autograd/derivatives.yaml`` in PyTorch) keeps: a linear its input, LayerNorm its
input, mean and rstd, GELU its input, SDPA q, k, v, its output and the fp32 logsumexp, an elementwise
product both factors. Tensors are counted once per storage (q, k, v are views of one qkv output at
GPT). Korthikanti et al. 2022 (arXiv:2205.05198, eq. 1: 34·sbh + 5·a·s²·b per layer) counts the
same tensors plus dropout masks and the s×s attention scores; without dropout and with SDPA the
constant for a fused-GELU GPT block is 32·sbh (56·sbh with gelu_new), and nothing grows
with s² (Mistral's mask aside).

Symbols: N = b·s tokens, d = d_model, kv = key/value width (n_kv_head·head_dim), f = FFN width,
h = heads, V = vocabulary; ``a`` = bytes of an activation (the 16-bit dtype) and ``st`` = bytes of
LayerNorm's mean/rstd (``a`` on CPU, where ``native_layer_norm`` returns them in the input dtype;
4 on CUDA, which keeps them in fp32).

Two layouts, as ``validate/transformer.py:CausalLM`` computes them (and transformers 5.24 with
``attn_implementation="sdpa"`` and dropout 0); checked against MemTracker and saved-tensor hooks for
every config in tests/data/hf_configs (tests/test_peak.py):
- ``gpt`` (GPT-2): x → ln_1 → c_attn (Conv1D: addmm; q, k, v are views of its output) → SDPA →
  c_proj → +x → ln_2 → c_fc → activation → c_proj → +; learned positions (the arange is saved), tied
  head unless the config unties it. Per block N·a·(8d + (k+1)·f) + 4·N·st + 4·b·h·s, where k is what
  the configured activation keeps besides its output (``ACT_KEPT``: 1 for a fused op such as ``gelu``,
  4 for ``gelu_new``, transformers' Python tanh GELU and GPT-2's default, 0 for ``relu``).
- ``llama`` (Llama, Mistral, Qwen2; biases change no activation): RMSNorm as transformers writes it
  (fp32 copy, pow, mean, rsqrt, two products), separate q/k/v of q = n_head·head_dim and kv widths,
  RoPE (cos and sin (1, s, head_dim), once per model), SDPA with grouped-query heads (``enable_gqa``:
  k, v stay kv wide; with Mistral's sliding-window mask they are repeated to q wide, a copy from 2 kv heads on
  and a view with one (``llama_nograd.kv_copied``), and the mask is saved in the activation dtype), SwiGLU MLP
  (gate, up, activation, product). Per block
  2·(4Nd + 4N + 2Nd·a) + N·a·(2q + 2kv') + 4·b·h·s [+ s²·a] + (k+3)·N·f·a.
The newer llama-layout families add to that block what their own modeling file computes (measured on
transformers' classes, tests/test_families.py): Qwen3's q/k norms (``_qk_norm_saved``) and Phi-3's fused
qkv and gate-up projections (``_fused_attention_extra``, the MLP's one gate_up storage); Mixtral, Qwen2-MoE
and Qwen3-MoE replace the MLP's terms with the sparse block's (``moe_block.sparse_block``: router, routed and
shared experts, measured in tests/test_moe_peaks.py); Gemma 2 and 3 have their own layer
(``gemma_activations``); the others are refused (``unmodelled_features``).
The loss upcasts the logits to fp32 (the 16-bit logits are freed at once) and cross-entropy saves the
fp32 log-softmax output (N·V·4). Under full checkpointing each block keeps its input (N·d·a), and
the checkpoints hold RoPE's tables and the bool mask as inputs too.

Working sets (what is alive beside the saved tensors at a block's forward or backward peak, and a
checkpointed block's no-grad forward) are derived op by op from the same Python, with the lifetime of
its locals and call arguments, and were checked byte for byte with MemTracker (docs/peak.md).
"""

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal, Optional

from zeroplan.architectures.spec import TransformerSpec, layout_features
from zeroplan.formulas import deepseek_activations as DS
from zeroplan.formulas import gemma_activations as G
from zeroplan.formulas.llama_nograd import (ACT_NOGRAD_PEAK, kv_copied, llama_nograd_moments, llama_nograd_peak,
                                            sdpa_masked)
from zeroplan.formulas.moe_block import SPARSE_BLOCK_FAMILIES, sparse_block, sparse_block_limits, sparse_mlp_saved

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
    Checkpointed forward (no grad): ``ckpt_forward_peak`` is derived op by op from the block's Python
    (validate/transformer.py): which locals and call arguments are alive at each op.
    """

    saved: int
    forward_extra: int
    ckpt_forward_peak: int
    ckpt_saved: int
    backward_first_op: int
    first_weight_grads: int
    backward_act_grads: int
    forward_before_output: int = 0
    """alive beside ``saved`` when the block's MLP output projection is called (its input, the last tensor the
    block saves, is made): ``forward_extra`` less the projection's output and the block output."""
    backward_first_op_recomputed: int = 0
    """``backward_first_op`` of a recomputed block (full checkpointing)."""
    recomputed: int = 0
    """under full checkpointing, what the recompute adds in backward beside the held input."""
    pending_at_last_grad: int = 0
    """alive in the block's first op when its last weight gradient is ready (its unit is then packed):
    RMSNorm's weight gradient comes from its last product, before pow and rsqrt give back their saved
    fp32 copy and rsqrt, with d(normalised) in flight; LayerNorm's backward is one node (0)."""
    norm_backward_saved: int = 0
    """saved tensors of the block still alive when its post-attention RMSNorm runs backward: the MLP's
    and that norm's output and normalised copy are released (0: no such moment, GPT's LayerNorm)."""
    norm_backward_ws: int = 0
    """RMSNorm's backward working set there (at pow's backward, seen with MemTracker): four fp32 N·d
    (the gradients through h·rsqrt and through the mean, pow's h^1 and its scaled copy), two 16-bit N·d
    (the gradient of the norm's output, summed from gate's and up's, and its product with the weight),
    less the fp32 rsqrt its two nodes have released."""
    held_input_pending: int = 0
    """under full checkpointing, the block input the checkpoint still holds at that moment (its frame
    lives while a recomputed tensor is unpacked: Llama's pending RMSNorm nodes; GPT's LN1 has run)."""
    mlp_saved: int = 0
    """the MLP's own part of ``saved``: what its projections and activation keep beyond its input (the
    norm's output, counted with the norm): GPT (k + 1)·N·f·a, Llama (k + 3)·N·f·a, the sparse block's
    router and experts (``moe_block.sparse_mlp_saved``)."""
    sdpa_saved: int = 0
    """the attention's part of ``saved`` that SDPA's backward releases, before any q/k/v projection's backward:
    q and k after RoPE, v (repeated where copied), SDPA's output, logsumexp, the mask where one is used, Phi-3's
    fused qkv storage and output copy (``_llama_attention_saved`` + ``_fused_attention_extra``; 0: not derived)."""


@dataclass(frozen=True)
class ModelActivations:
    """A whole micro-batch: blocks, embeddings, final norm, head and loss (bytes)."""

    block: BlockActivations
    n_layer: int
    embed_saved: int  # saved by the embeddings (position ids; the token ids are the batch's)
    embed_out: int  # the embedding sum: block 0's input
    mask: int  # the bool sliding-window mask (Mistral, s > window; Gemma 2: its two additive masks): live through
    # forward, and under full checkpointing through backward too (every checkpointed block holds it as an input)
    final_saved: int  # final norm's saved tensors and its output (the head's input)
    logits: int  # the head's output, activation dtype, N·V·a
    logits_fp32: int  # the loss's fp32 upcast, N·V·4 (freed after cross-entropy)
    log_softmax: int  # saved by cross-entropy: fp32 log-probabilities, N·V·4
    batch: int  # token ids and targets, int64
    loss: int
    body_masks: int = 0  # transformers' body's masks kept by no node (Gemma 2's: gemma_activations.eager_masks)
    layer_blocks: tuple[BlockActivations, ...] = ()
    """each layer's block where the layers differ (dense and sparse MLPs: Qwen-MoE's ``mlp_only_layers`` /
    ``decoder_sparse_step``, DeepSeek-V3's ``first_k_dense_replace``); empty: every layer is ``block``, which is
    always the last layer's (the block the engines' forward-end and backward-start moments take)."""

    @property
    def blocks_saved(self) -> int:
        """Every block's saved activations (checkpointing none)."""
        return self.saved_through(self.n_layer, "none")

    def saved_through(self, n_blocks: int, checkpointing: str) -> int:
        """What the first ``n_blocks`` blocks keep to their backward: their saved activations, or their inputs under
        full checkpointing; each layer its own block's (``layer_blocks``)."""
        if not self.layer_blocks:  # every layer alike: n copies of one block's (asked per rank and hook by a plan)
            return max(n_blocks, 0) * (self.block.saved if checkpointing == "none" else self.block.ckpt_saved)
        blocks = self.layer_blocks[:n_blocks]
        return sum(b.saved if checkpointing == "none" else b.ckpt_saved for b in blocks)

    def saved_total(self, checkpointing: str) -> int:
        """What autograd holds when forward ends, before the loss is reduced (derivation above)."""
        held = self.mask if checkpointing == "full" else 0
        return (
            self.embed_saved + held + self.saved_through(self.n_layer, checkpointing) + self.final_saved
            + self.log_softmax + SAVED_LOSS_BYTES
        )  # fmt: skip


#: N·f tensors an activation function keeps for its own backward besides its output (which the next op,
#: GPT-2's c_proj or Llama's gate product, saves anyway): derivatives.yaml per op.
#: ``gelu`` / ``gelu_pytorch_tanh`` / ``silu`` / ``swish``: one fused op, saves its input.
#: ``relu``: saves its result, which is the output: nothing more.
#: ``gelu_new`` (transformers' NewGELUActivation, 0.5·x·(1 + tanh(c·(x + 0.044715·x³)))): pow saves x,
#: tanh its result, the last product both factors 0.5·x and 1 + tanh: four.
ACT_KEPT: dict[str, int] = {"gelu": 1, "gelu_pytorch_tanh": 1, "silu": 1, "swish": 1, "relu": 0, "gelu_new": 4}
#: N·f bytes the activation's backward adds to the saved set at its peak (its output, saved by the next
#: op, is freed once that op has run backward): a fused op computes d(input) beside d(output) (+1); relu
#: keeps its output until its own backward runs (+2); gelu_new's last product returns the gradients of
#: both factors beside d(output) (+2, measured with saved_tensors and MemTracker).
ACT_BACKWARD_NET: dict[str, int] = {"gelu": 1, "gelu_pytorch_tanh": 1, "silu": 1, "swish": 1, "relu": 2, "gelu_new": 2}


def _gpt_block(spec: TransformerSpec, n: int, b: int, s: int, a: int, st: int) -> BlockActivations:
    """GPT2Block as validate/transformer.py (and transformers, dropout 0, SDPA) computes it."""
    d, f, h = spec.d_model, spec.ffn, spec.n_head
    lse = b * h * s * 4  # SDPA (flash, CPU or CUDA) keeps the fp32 logsumexp per query and head
    act = ACT_KEPT[spec.hidden_act]
    # x, LN1 out, c_attn out (q, k, v are views: N·3d), SDPA out (c_proj's input), x1, LN2 out (N·d
    # each), the activation's kept tensors and its output (c_proj's input) (N·f each), LN stats
    saved = n * a * (8 * d + (act + 1) * f) + 4 * n * st + lse
    # checkpointed (no-grad) forward, beside the block input: GPT2Attention holds LN1 out (its argument),
    # c_attn out (q, k, v views) and SDPA out while c_proj runs; the MLP holds x1 and LN2 out with the
    # activation's own peak, then its output and c_proj out; the residual sum holds x1, mlp out, sum
    ng = max(6 * d, 2 * d + ACT_NOGRAD_PEAK[spec.hidden_act] * f, 3 * d + f)
    ckpt_peak = n * a * (d + ng)
    return BlockActivations(
        saved=saved,
        mlp_saved=n * a * (act + 1) * f,
        forward_extra=2 * n * d * a,  # the MLP's projection and the block output x + mlp(x)
        forward_before_output=0,  # the block input and x1 are saved (LN1, LN2)
        ckpt_forward_peak=ckpt_peak,
        ckpt_saved=n * d * a,
        # mlp.c_proj's addmm backward: d(act out), dW (mm), then the bias gradient (a sum); a recomputed
        # input is dropped by the checkpoint's unpack once dW has used it, so the bias comes after it
        backward_first_op=n * f * a + (d * f + d) * a,
        backward_first_op_recomputed=n * f * a + d * f * a,
        first_weight_grads=(d * f + d) * a,
        backward_act_grads=ACT_BACKWARD_NET[spec.hidden_act] * n * f * a,
        recomputed=saved - n * d * a,  # LN1 saves the block input itself: the held input is one of them
    )


def _llama_attention_saved(spec: TransformerSpec, n: int, b: int, s: int, a: int) -> int:
    """q and k after RoPE, v, SDPA's output (o_proj's input) and logsumexp; the mask where one is used.

    ``validate/transformer.py:_attend`` (transformers' sdpa_attention_forward): with grouped-query heads
    and no mask SDPA gets ``enable_gqa`` (k, v stay kv wide); with a mask (Mistral's sliding window,
    sequences longer than the window) or head_dim > 256, k and v are repeated to the query heads (``repeat_kv``:
    copies from 2 kv heads on, a view with one, ``llama_nograd.kv_copied``), and SDPA saves them and the
    (b, 1, s, s) mask converted to the activation dtype (b·s²·a per layer; measured against MistralForCausalLM,
    tests/test_activations.py).
    """
    q, kv, h = spec.q_dim, spec.kv_dim, spec.n_head
    masked = sdpa_masked(spec, s)
    k_v = q if kv_copied(spec, s) else kv
    return n * a * (2 * q + 2 * k_v) + b * h * s * 4 + (b * s * s * a if masked else 0)


def _qk_norm_saved(spec: TransformerSpec, n: int, a: int) -> int:
    """Qwen3's and Gemma 3's ``q_norm`` and ``k_norm`` (``Qwen3RMSNorm`` over head_dim, applied to the
    projection's output before RoPE: ``modeling_qwen3.py:Qwen3Attention.forward``): each saves the fp32 copy of
    its input (pow's and the product's; in fp32 the projection's output itself), the fp32 rsqrt per head and
    the normalised 16-bit copy (the weight product's); its output is not saved (RoPE's products save cos and
    sin). Measured: FSDP2 on Qwen3ForCausalLM, fp32, exact (tests/test_families.py)."""
    if not spec.qk_norm:
        return 0
    return sum(n * width * (4 + a) + n * heads * 4 for width, heads in ((spec.q_dim, spec.n_head),
                                                                        (spec.kv_dim, spec.n_kv_head)))


def _fused_attention_extra(spec: TransformerSpec, n: int, s: int, a: int) -> int:
    """Phi-3's fused ``qkv_proj`` (``modeling_phi3.py:Phi3Attention.forward``) beside the q/k/v layout: v is a
    view of the qkv output, so SDPA's saved value keeps that whole storage (N·(q + 2kv), where k and v are
    not repeated); and ``apply_rotary_pos_emb`` concatenates the rotated and pass-through halves
    (``torch.cat``, partial rotary), so q is contiguous (b, h, s, hd), SDPA's output is too, and
    ``transpose(1, 2).contiguous()`` in ``sdpa_attention_forward`` copies it: o_proj saves that copy (N·q)
    beside SDPA's own output. Seen on the autograd graph's saved tensors (tests/test_families.py)."""
    if not spec.fused_projections:
        return 0
    return n * a * (spec.q_dim + (0 if kv_copied(spec, s) else spec.q_dim + spec.kv_dim))


def _llama_block(spec: TransformerSpec, n: int, b: int, s: int, a: int) -> BlockActivations:
    """LlamaDecoderLayer as validate/transformer.py (and transformers) computes it: RMSNorm, RoPE, SDPA
    (GQA), SwiGLU; Mistral and Qwen2 alike (biases change no activation)."""
    d, f = spec.d_model, spec.ffn
    # RMSNorm: fp32 copy (saved by pow and by the product), rsqrt (N fp32), normalised 16-bit (saved
    # by the weight product) and its output (saved by the next linears). In fp32 (a = 4) the copy is
    # the norm's input itself (``x.to(torch.float32)`` returns x): the block input and x1 are saved.
    rms = n * d * 4 + n * 4 + 2 * n * d * a
    own_input = a == 4  # the two norms save the block input and x1 themselves
    sdpa = _llama_attention_saved(spec, n, b, s, a) + _fused_attention_extra(spec, n, s, a)
    attn = sdpa + _qk_norm_saved(spec, n, a)
    if spec.mla is not None:  # DeepSeek-V3's latent attention (deepseek_activations.py)
        attn, sdpa = DS.mla_saved(spec, n, b, s, a), 0
    # gate out's kept tensors (SiLU: its input), act out and up out (the product's factors), the product;
    # Phi-3's gate_up_proj output (N·2f) is one storage, kept by the product (its up half) whatever the
    # activation keeps: 4·N·f for an activation that keeps nothing more (relu), as many as Llama's otherwise
    kept = ACT_KEPT[spec.hidden_act]
    mlp = (kept + 3 + (spec.fused_projections and kept == 0)) * n * f * a
    if spec.moe is not None:  # router, routed and shared experts (moe_block.py; a dense layer: spec.moe None)
        mlp = sparse_mlp_saved(spec.moe, spec.model_type, n, d, a)
    saved = 2 * rms + attn + mlp
    block = BlockActivations(
        saved=saved,
        mlp_saved=mlp,
        sdpa_saved=sdpa,
        # 16-bit: nothing saves the block input or x1: both live beside the last product, down's out and
        # the sum; fp32: they are in ``saved`` (measured: tiny-llama fp32 at N_d = 2, forward exact)
        forward_extra=(2 if own_input else 4) * n * d * a,
        forward_before_output=(0 if own_input else 2) * n * d * a,  # the block input and x1, 16-bit
        ckpt_forward_peak=n * d * a + llama_nograd_peak(spec, n, s, a),
        ckpt_saved=n * d * a,
        # 16-bit: nothing in the block saves its input, the held input comes on top; fp32: the input
        # norm saves the held input itself (one storage)
        recomputed=saved - (n * d * a if own_input else 0),
        pending_at_last_grad=n * d * 4 + n * 4 + n * d * a,
        held_input_pending=n * d * a,
        norm_backward_saved=saved - mlp - 2 * n * d * a,
        norm_backward_ws=4 * n * d * 4 + 2 * n * d * a - n * 4,
        # down_proj backward: d(product), dW (and its bias, where the config has one, as at GPT-2)
        backward_first_op=n * f * a + (d * f + d * spec.mlp_bias) * a,
        backward_first_op_recomputed=n * f * a + d * f * a,
        first_weight_grads=d * f * a,
        backward_act_grads=2 * n * f * a,  # product backward: dSiLU-out, dup-out beside d(product)
    )
    block = block if spec.moe is None else sparse_block(block, spec, n, a, own_input)
    return block if spec.mla is None else DS.mla_block(block, spec, n, b, s, a)  # the latent attention's moments


#: the families whose activations are derived above op by op and measured (tests/test_peak.py; Qwen3 and
#: Phi-3: tests/test_families.py, FSDP2 on transformers' classes); the others (docs/models.md, "What the peak
#: models") are refused rather than given a Llama number.
MODELLED_FAMILIES: tuple[str, ...] = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")


def unmodelled_features(spec: TransformerSpec) -> tuple[str, ...]:
    """What in ``spec`` the activation terms do not derive yet (empty: the peak is modelled)."""
    if spec.model_type in MODELLED_FAMILIES:
        return ()
    if spec.model_type in SPARSE_BLOCK_FAMILIES:  # Mixtral, Qwen2-MoE, Qwen3-MoE: moe_block.py
        return sparse_block_limits(spec)
    return layout_features(spec) or (f"the {spec.model_type} family",)


def activation_limit(spec: TransformerSpec) -> Optional[str]:
    """None when the activation terms derive ``spec``'s family; else the one-line reason (every engine's peak
    needs them: ``zeroplan.engines.base.Engine.peak_limits``)."""
    missing = unmodelled_features(spec)
    if not missing:
        return None
    return (f"model_type {spec.model_type!r}: its activation peak is not modelled yet ({', '.join(missing)}; "
            "docs/models.md); for model states alone give its parameter shapes (--shapes)")


def unused_sliding_mask(spec: TransformerSpec, s: int) -> int:
    """Qwen2-MoE's sliding-window mask, built and never used where the config has no sliding window: transformers
    5.24 sets ``sliding_window = 0`` without ``use_sliding_window`` (configuration_qwen2_moe.py), and
    ``Qwen2MoeModel.forward`` builds both masks of ``causal_mask_mapping`` whatever the layer types, so
    masking_utils.py ``create_sliding_window_causal_mask`` cannot skip it (``_ignore_causal_mask_sdpa``: the window 0
    is not above the sequence): a bool (1, 1, s, s) tensor expanded over the batch, s² B, alive to the body's end.
    Traced (live storages at DeepSpeed ZeRO-3's forward peak, Qwen2-MoE wide, gloo N_d = 2: ``and_mask``'s 4,096 B at
    s = 64); the 4,096 B the FSDP2 and DeepSpeed rows of that config read under (tests/test_moe_peaks.py,
    tests/test_deepspeed_moe.py)."""
    return s * s if spec.model_type == "qwen2_moe" and spec.sliding_window is None else 0


@lru_cache(maxsize=32)  # a plan's every candidate and rank asks (a frozen record; Gemma 3's: ~7 ms each)
def model_activations(
    spec: TransformerSpec,
    micro_batch: int,
    seq_len: int,
    act_bytes: int = 2,
    stat_bytes: int = 2,
) -> ModelActivations:
    """Activations of one micro-batch of ``spec`` (derivation in the module docstring), once per arguments."""
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"micro_batch={micro_batch}, seq_len={seq_len}: each must be >= 1")
    if seq_len > spec.max_seq_len:
        raise ValueError(f"seq_len={seq_len}: the model has only {spec.max_seq_len} positions")
    if (why := activation_limit(spec)) is not None:
        raise ValueError(why)
    b, s, a = micro_batch, seq_len, act_bytes
    n, d, v = b * s, spec.d_model, spec.vocab_size
    layers: tuple[BlockActivations, ...] = ()  # one block for every layer, but where they differ
    if spec.style == "gpt":
        block = _gpt_block(spec, n, b, s, a, stat_bytes)
        embed_saved = s * TOKEN_BYTES  # the position ids (arange), saved by the position embedding
        final_saved = n * d * a + 2 * n * stat_bytes + n * d * a  # ln_f input, mean, rstd; ln_f out
    elif spec.model_type in G.GEMMA_FAMILIES:  # Gemma's norms, attention, scaled embedding, soft-capped logits
        def gemma(kind: Optional[str]) -> BlockActivations:  # a full layer's attention gets no mask (is_causal)
            at = spec if kind != "full_attention" else replace(spec, sliding_window=None)
            nograd = max(llama_nograd_moments(replace(at, qk_norm=False), n, s, a).values())
            llama = _llama_attention_saved(at, n, b, s, a), nograd
            return BlockActivations(**G.gemma_block(at, n, b, s, a, llama[0], ACT_KEPT, llama[1], ACT_NOGRAD_PEAK))

        kinds = spec.layer_types if G.sliding_masked(spec, s) else None  # Gemma 3 from its window on
        made = {kind: gemma(kind) for kind in dict.fromkeys(kinds)} if kinds and len(set(kinds)) > 1 else {}
        layers = tuple(map(made.__getitem__, kinds)) if made else ()  # each kind's block once, not each layer's
        block = layers[-1] if layers else gemma(kinds[-1] if kinds else None)
        embed_saved, final_saved = G.embed_saved(spec, s, a), G.final_saved(spec, n, a)
    else:
        block = _llama_block(spec, n, b, s, a)
        if spec.moe is not None and len(spec.moe.sparse_layers) != spec.n_layer:  # dense and sparse layers
            dense = _llama_block(replace(spec, moe=None), n, b, s, a)
            layers = tuple(block if i in spec.moe.sparse_layers else dense for i in range(spec.n_layer))
            block = layers[-1]
        # RoPE's cos and sin, (1, s, head_dim) in the activation dtype, saved once for every block's
        # q·cos and rotate_half(q)·sin (positions are (1, s) as transformers' cache_position makes them)
        embed_saved = 2 * s * spec.head_dim * a
        final_saved = n * d * 4 + n * 4 + 2 * n * d * a  # final RMSNorm, its output saved by lm_head
    return ModelActivations(
        block=block,
        n_layer=spec.n_layer,
        embed_saved=embed_saved,
        embed_out=n * d * a,
        mask=G.eager_masks(spec, b, s, a) or (s * s if spec.style == "llama" and sdpa_masked(spec, s) else 0),
        final_saved=final_saved,
        logits=n * v * a,
        logits_fp32=n * v * 4,
        log_softmax=n * v * 4,
        batch=2 * n * TOKEN_BYTES,
        loss=LOSS_BYTES,
        body_masks=G.eager_masks(spec, b, s, a) + unused_sliding_mask(spec, s),
        layer_blocks=layers,
    )
