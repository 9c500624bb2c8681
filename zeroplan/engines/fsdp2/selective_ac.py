"""torchtitan's selective activation checkpointing as data: which decoder layers are checkpointed (its layer
policy), and what each layer keeps under its per-op policy.

torchtitan 0.2.2 (github:pytorch/torchtitan tag v0.2.2, ``torchtitan/distributed/activation_checkpoint.py``
``_apply_layer_sac``; the TOML ``[activation_checkpoint] mode = "selective"``, ``selective_ac_option = "k"``) wraps
the layers in order, counting them from 1 with a module-level counter (``_layer_sac_count += 1``), and puts a
layer in ``ptd_checkpoint_wrapper`` (torch ``distributed/algorithms/_checkpoint/checkpoint_wrapper.py``,
non-reentrant ``torch.utils.checkpoint``) when ``_layer_sac_count % k == 0``: layers k, 2k, 3k, ... (1-based) are
checkpointed, the others run as they are. k = 1 is full checkpointing. The FSDP2 engine's setting is
``Settings.selective_ac`` (k) with ``Workload.checkpointing`` "full"; its blocks are numbered 1..L as here.

A checkpointed layer keeps its input (``BlockActivations.ckpt_saved``) to its backward, runs its forward without
saving (``ckpt_forward_peak``) and recomputes its saved set in its backward (``recomputed``); a layer not wrapped
keeps its whole saved set (``saved``) and runs forward and backward as without checkpointing: each term of a block
is the one of its own mode (``zeroplan/formulas/activation_terms.py``).

torchtitan's per-op policy (``selective_ac_option = "op"``; 0.3.0 ``SelectiveAC._wrap_block``, 0.2.2
``_apply_op_sac``) wraps every layer in ``ptd_checkpoint_wrapper(context_fn=create_selective_checkpoint_contexts(
policy))``: under torch 2.13 ``utils/checkpoint.py`` ``_CachingTorchDispatchMode`` the outputs of the ops the policy
marks ``MUST_SAVE`` are kept (``out.detach()``, the same storages) until the layer's recompute pops them; autograd
keeps nothing else of the layer's forward (the checkpoint's pack hook). The policy saves the ops of
``_get_default_save_ops()`` (functorch's ``compute_intensive_ops``: ``aten.mm``, ``addmm``, ``bmm``, the CUDA SDPA
kernels flash / efficient / cudnn; ``aten.linear``, ``max``, ``topk``, reduce-scatter, all-to-all) but every second
``aten.mm`` / ``aten.linear`` of the layer (its counter, ``meta["forward_mm_count"]``, is new per layer and call).
A bias-free llama layer dispatches seven ``aten.mm`` (``F.linear`` of a 3-D input folds it: q, k, v, o, gate, up,
down, in transformers' order), so it keeps the outputs of q, v, gate and down (``op_cache``). On the CPU, SDPA
dispatches ``aten._scaled_dot_product_flash_attention_for_cpu``, which is not in the set (seen at dispatch,
torch 2.13): recomputed. On CUDA the flash / efficient / cudnn kernel is: its output and fp32 logsumexp are kept
too (not measured here: no GPU run). The recompute in backward (``early_stop=False``) rebuilds the layer's whole
saved set as full checkpointing does, the cached outputs among it or freed when their op has been replayed.
"""

from __future__ import annotations

SRC = "torchtitan 0.2.2 distributed/activation_checkpoint.py:_apply_layer_sac"
OP_SRC = "torchtitan 0.3.0 distributed/activation_checkpoint.py:SelectiveAC"


def checkpointed(checkpointing: str, every: int, block: int) -> bool:
    """Whether decoder layer ``block`` (1-based) runs under ``checkpoint_wrapper`` (``_apply_layer_sac``)."""
    return checkpointing != "none" and block % every == 0


def checkpointed_blocks(checkpointing: str, every: int, n: int) -> int:
    """How many of layers 1..n are checkpointed."""
    return 0 if checkpointing == "none" else max(n, 0) // every


def saved_through(acts, checkpointing: str, every: int, n: int) -> int:
    """What layers 1..n keep to their backward: a checkpointed layer its input, the others their saved set
    (``ModelActivations.saved_through`` per mode, each layer its own block's)."""
    if every == 1 or checkpointing == "none":
        return acts.saved_through(n, checkpointing)
    blocks = acts.layer_blocks[:n] if acts.layer_blocks else (acts.block,) * max(n, 0)
    return sum(b.ckpt_saved if checkpointed(checkpointing, every, i) else b.saved for i, b in enumerate(blocks, 1))


def label(checkpointing: str, every: int) -> str:
    """The mode in the engine's words: ``none``, ``full`` or ``every 2nd layer (torchtitan layer SAC)``."""
    if checkpointing == "none" or every == 1:
        return checkpointing
    nth = {2: "2nd", 3: "3rd"}.get(every, f"{every}th")
    return f"every {nth} layer (torchtitan selective_ac_option={every})"


def op_limit(spec) -> str | None:
    """None where ``op_cache`` derives the layer (a bias-free llama layout with separate projections, dense, no
    q/k norms or masks); else why not."""
    odd = [what for what, on in (
        ("GPT-2's layout", spec.style != "llama"), ("projection biases (addmm: saved, not counted)", spec.biased_linear),
        ("q/k norms", spec.qk_norm), ("fused projections", spec.fused_projections), ("a sparse MLP", spec.moe),
        ("latent attention", spec.mla), ("Gemma's layer", spec.sandwich_norms or spec.attn_logit_softcap),
        ("a sliding-window mask", spec.sliding_window)) if on]  # fmt: skip
    if not odd:
        return None
    return (f"selective_ac=op: torchtitan's per-op policy is modelled for a bias-free Llama layer, not {odd[0]} "
            "(engines/fsdp2/selective_ac.py)")


def op_cache(spec, n: int, b: int, s: int, a: int, cuda: bool) -> int:
    """Bytes one layer keeps to its backward beyond its input under the per-op policy: the outputs of the 1st, 3rd,
    5th and 7th ``aten.mm`` (q, v, gate, down: N·(q + kv + f + d)·a); on CUDA SDPA's output and logsumexp too."""
    return n * a * (spec.q_dim + spec.kv_dim + spec.ffn + spec.d_model) + (_sdpa_cache(spec, n, b, s, a) if cuda else 0)


def _sdpa_cache(spec, n: int, b: int, s: int, a: int) -> int:
    return n * a * spec.q_dim + b * spec.n_head * s * 4


def op_forward_peak(spec, n: int, b: int, s: int, a: int, cuda: bool) -> int:
    """Bytes a layer holds beside its input at its forward peak under the per-op policy: its no-grad moments
    (``llama_nograd_moments``) with the cached outputs their op would have freed by then: q's from SDPA on (the
    rotated q replaces it), v's from the residual sum on, gate's once SiLU has run (the MLP then holds SiLU's
    output, up's and their product (4f with gate's), then the product and down's output (2f + d), then the block's
    sum beside x1 and down's output (3d + f)); on CUDA SDPA's output and logsumexp once o_proj has run."""
    from zeroplan.formulas.llama_nograd import ACT_NOGRAD_PEAK, llama_nograd_moments

    d, f, q, kv = spec.d_model, spec.ffn, spec.q_dim, spec.kv_dim
    m = llama_nograd_moments(spec, n, s, a)
    cq, cqv = n * a * q, n * a * (q + kv)
    attn = _sdpa_cache(spec, n, b, s, a) if cuda else 0
    lse = b * spec.n_head * s * 4 if cuda else 0
    act = ACT_NOGRAD_PEAK[spec.hidden_act] * f
    mlp = n * a * (2 * d + max(act, 4 * f, 2 * f + d))
    return max(m["norm"], m["rope_q"], m["rope_k"], m["sdpa"] + cq, m["o_proj"] + cq + lse,
               m["residual"] + cqv + attn, m["post_norm"] + cqv + attn, mlp + cqv + attn,
               n * a * (3 * d + f) + cqv + attn)  # fmt: skip
