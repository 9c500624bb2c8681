"""A Llama-shaped block's activations at the gradient hooks of its attention inputs (q, k, v and their norms, the
input norm), which come after the output projection's in ``DSRun.grad_ready_order``; split from ``reduce.py``
(``_block_hook_activations`` asks it).

torch's autograd runs the attention's backward as ``o_proj``, SDPA, RoPE (k's, then q's), then each projection's
chain from the one called last: ``v_proj``; ``k_norm``, ``k_proj``; ``q_norm``, ``q_proj`` (modeling_qwen3.py
``Qwen3Attention.forward``; Llama the same without the norms). So by the first input projection's hook SDPA's
backward has released its saved tensors (``BlockActivations.sdpa_saved``) and o_proj's input gradient, and in
flight are the gradients of the projections' outputs not yet through their backward, the input norm output's
gradient (from the projections done: summed) and x1's. A q/k norm's saved tensors (``_qk_norm_saved``: its fp32
input, rsqrt, normalised copy) go with its projection's backward; the input norm's output (every projection's
saved input) with the last projection's. ZeRO-3 wraps each module's inputs in ``PostBackwardFunctionModule``
(runtime/zero/parameter_offload.py ``_post_backward_module_hook``): a projection's input gradient waits in that
function's node while the projection's ``AccumulateGrad`` (and its hook) runs first, beside the sum of the
earlier ones: one N·d·a more at every projection's hook after the first. A norm's weight gradient comes from its
last product, the first node of its backward: its hook is bounded by the previous projection's.

Measured with post-accumulate-grad hooks on transformers' Qwen3 (d 384, 8 heads, 2 kv heads, head_dim 64, 32
tokens, fp32; each layer; with and without ZeRO-3's wrapper functions applied to every module's inputs): every
step of the live bytes between o_proj's hook and q_proj's as derived (o -> v -99,328 B, v -> k -49,408 B, k -> q
-246,784 B; with the wrappers k and q +49,152 B each), and the differential draw 1-24 (Qwen3-MoE, ZeRO-3, N_d = 4)
at q_proj's hook: rank 0's backward peak 264 B above this moment (was 493,560 B below the bound at o_proj's
saved tensors that this replaces)."""

from __future__ import annotations

from zeroplan.engines.deepspeed.run import DSRun, _act, _pbytes
from zeroplan.formulas.peak import Term


def attention_input_hook(run: DSRun, hook: int, attention: tuple[tuple[int, ...], ...],
                         saved_before_post_norm: int) -> tuple[Term, ...] | None:
    """Block activations at ``hook`` (a parameter of one of ``attention``, the modules hooked after the output
    projection, in hook order), as terms: the block's saved tensors left and the gradients in flight (module
    docstring); ``saved_before_post_norm``: the block's saved tensors at the output projection's hook. None where
    the attention is not derived (``sdpa_saved`` 0: DeepSeek-V3's latent attention) or no projection has run."""
    blk, spec, nda = run.acts.block, run.spec, run.acts.embed_out
    d = run.final_norm_numel
    at = next(k for k, m in enumerate(attention) if hook in m)
    projections = [k for k, m in enumerate(attention) if max(run.numels[i] for i in m) > d]
    done = [k for k in projections if k <= at]
    if not blk.sdpa_saved or spec is None or not done:
        return None
    n_a = nda // d  # N·a: a width's tensor per token
    widths = {k: sum(run.numels[i] for i in attention[k]) // d for k in projections}
    released = blk.sdpa_saved + (0 if len(done) < len(projections) else nda)  # + the input norm's output
    for k in done:  # the q/k norm just before a projection in hook order goes with it (module docstring)
        if spec.qk_norm and k > 0 and max(run.numels[i] for i in attention[k - 1]) < d:
            w = widths[k]
            released += n_a * w // _pbytes(run) * 4 + n_a * w + n_a // _pbytes(run) * (w // spec.head_dim) * 4
    pending = sum(widths[k] for k in projections if k > at) * n_a
    waiting = nda if run.wrapper.wraps_module_inputs and at in projections and len(done) > 1 else 0  # the wrapper's node
    return (_act("block's saved activations left at its attention inputs' backward", saved_before_post_norm - released),
            _act("pending projections' output, the input norm output's and x1's gradients",
                 pending + 2 * nda + waiting, len(projections) - len(done) + 2 + bool(waiting)))
