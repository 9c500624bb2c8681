"""ZeRO-1/2's and ZeRO-3's block activations at a gradient hook inside a decoder block (``_block_hook_activations``:
what ``reduce.py _in_block_partitions`` and ``zero3.py _in_block_reductions`` add beside a bucket sent or a
partition allocated there), memoised per layout (``_hook_memo``) and across blocks of the same shape
(``_block_shape``). Split from ``reduce.py``."""

from __future__ import annotations

from zeroplan.engines.deepspeed.attention_hooks import attention_input_hook
from zeroplan.engines.deepspeed.block_roles import _attention_after, _llama_roles, _mlp_modules
from zeroplan.engines.deepspeed.run import DSRun, _act, _pbytes
from zeroplan.formulas.peak import Term


_HOOK_MEMO: list = []  # [(layout, {facts: memo})]: the last layout's, a memo per facts


def _hook_memo(run: DSRun) -> dict:
    """The memo of ``_hook_activations`` for ``run``: what it reads is the layout (the very same tuples, as
    ``block_roles._layout_roles`` checks them), the activations, checkpointing, the dtype, the final norm, the
    architecture (q/k norms, head width) and whether the wrapper wraps each module's inputs (ZeRO-3's
    ``PostBackwardFunctionModule``: attention_hooks.py); every candidate of a plan shares them, and ZeRO-3's
    per-bucket hooks are thousands (a 405B plan)."""
    layout = (run.modules, run.grad_ready_order, run.param_blocks, run.numels, run.output_projections)
    facts = (run.acts, run.checkpointing, run.settings.dtype, run.final_norm_numel, run.spec,
             run.wrapper.wraps_module_inputs)
    if not (_HOOK_MEMO and all(a is b for a, b in zip(_HOOK_MEMO[0][0], layout))):
        _HOOK_MEMO[:] = [(layout, {})]
    by_facts = _HOOK_MEMO[0][1]
    if facts not in by_facts:
        by_facts[facts] = {}
    return by_facts[facts]


def _hook_activations(run: DSRun, j: int, hook: int,
                      memo: dict | None = None) -> tuple[str, tuple[Term, ...], tuple[int, ...]] | None:
    """``_block_hook_activations``, once per layout (``_hook_memo``; ``memo``: the run's, asked once by the
    caller of many hooks) and block shape (``_block_shape``: a block whose parameters are another's shifted by
    ``shift`` indices, of the same sizes and roles, has the same activations at the hook ``shift`` further on, its
    module ``shift`` further on; a 405B plan asks ~1,600 hooks of 126 equal blocks; a speed-up, no rule)."""
    memo = _hook_memo(run) if memo is None else memo
    found = memo.get((j, hook), memo)
    if found is memo:
        base, shape = memo.get(("block", j)) or _block_shape(run, j, memo)
        key = ("shape", shape, hook - base)
        relative = memo.get(key, memo)
        if relative is memo:
            found = _block_hook_activations(run, j, hook)
            memo[key] = None if found is None else (found[0], found[1], tuple(i - base for i in found[2]))
        elif relative is not None:
            found = (relative[0], relative[1], tuple(map(base.__add__, relative[2])))
        else:
            found = None
        memo[j, hook] = found
    return found


def _block_shape(run: DSRun, j: int, memo: dict) -> tuple[int, int]:
    """(base, shape) of block j: everything ``_block_hook_activations`` reads of block j, as its parameter indices
    less ``base`` (the least of them), with those parameters' sizes, numbered in ``memo`` (equal blocks, one
    number); once per block. GPT's LayerNorm block: its MLP input projection and the module before it
    (``_mlp_modules``); a Llama-shaped block: its roles (``_llama_roles``: the MLP input projections, the
    post-attention norm, the output projection) and the modules hooked after its output projection
    (``_attention_after``). The rest it reads is the memo's facts (``_hook_memo``)."""
    if not run.acts.block.norm_backward_saved:  # the GPT path of ``_block_hook_activations``
        groups, split = _mlp_modules(run, j), -1
    else:
        roles = _llama_roles(run, j)
        if roles is None:
            groups, split = (), -2
        else:
            groups, split = (*roles[0], roles[1], roles[2], *_attention_after(run, j)), len(roles[0])
    indices = [i for group in groups for i in group]
    base = min(indices, default=0)
    shape = (split, tuple(tuple(i - base for i in group) for group in groups), tuple(run.numels[i] for i in indices))
    shapes = memo.setdefault("shapes", {})
    found = memo["block", j] = (base, shapes.setdefault(shape, len(shapes)))
    return found


def _hook_bytes(run: DSRun, j: int, hook: int, memo: dict) -> int | None:
    """The bytes of ``_hook_activations``' terms and of the hooked module's weight gradients (``sum(numels) * p``),
    or None where it has none; once per layout (``memo``: ``_hook_memo(run)``, whose facts include the dtype) and
    block shape (the module's sizes are the shape's: ``_block_shape``)."""
    key = ("bytes", j, hook)
    found = memo.get(key, memo)
    if found is memo:
        base, shape = memo.get(("block", j)) or _block_shape(run, j, memo)
        relative = ("shape bytes", shape, hook - base)
        found = memo.get(relative, memo)
        if found is memo:
            at_hook = _hook_activations(run, j, hook, memo)
            found = memo[relative] = None if at_hook is None else (
                sum(t.bytes for t in at_hook[1]) + sum(run.numels[i] for i in at_hook[2]) * _pbytes(run))
        memo[key] = found
    return found


def _block_hook_activations(run: DSRun, j: int, hook: int) -> tuple[str, tuple[Term, ...], tuple[int, ...]] | None:
    """(where, block j's activations at ``hook``'s gradient hook: its saved tensors not yet released and the
    gradients in flight, the hooked module's parameters) for a hook of an MLP input projection or of the norm
    before the MLP; None elsewhere (the attention, the input norm: not modelled). GPT (``_mlp_saved``): at c_fc
    the saved tensors less the MLP's, the incoming and the MLP input's gradients; at LN2 also less its input x1,
    the residual's summed gradient. Llama (RMSNorm, SwiGLU; its hooks in ``DSRun.grad_ready_order``: down, up,
    gate, post_attention_layernorm): at up the MLP's saved tensors less gate's output (SiLU's input) released,
    in flight SiLU's output gradient, the norm output's (from up) and the incoming; at gate the norm's output
    released too, in flight the norm output's summed gradient and the incoming; at the norm
    ``norm_backward_saved`` with its normalised tensor's gradient and the incoming; at o_proj the attention's and
    the input norm's saved tensors, in flight o_proj's input gradient and x1's (block j held whole: recomputed
    under checkpointing, beside the input the checkpoint holds). Not modelled: q, k, v and the input norm.
    Measured: tiny-llama ZeRO-2 checkpointed, 5,000-element buckets, N_d = 3, MemTracker in
    ``copy_grads_in_partition``: rank 0 at block 0's gate_proj hook 620,536 B, rank 1 at block 1's o_proj hook
    597,816 B; each moment 504 B over (the token ids, N·8 B, which MemTracker never sees: no op makes them)."""
    blk, nda = run.acts.block, run.acts.embed_out
    if not blk.norm_backward_saved:  # GPT's LayerNorm block
        proj, norm = _mlp_modules(run, j)
        mlp = _mlp_saved(run)
        if mlp is None or hook not in (*proj, *norm):
            return None
        if hook in norm:
            return "LN2", (_act("block's saved activations before its MLP, less LN2's input", blk.saved - mlp - nda),
                           _act("residual gradient", nda)), norm
        return "MLP input projection", (_act("block's saved activations before its MLP", blk.saved - mlp),
                                        _act("incoming and MLP input's gradients", 2 * nda, 2)), proj
    roles = _llama_roles(run, j)
    if roles is None or not roles[2]:
        return None
    (*earlier, last_proj), norm, o_proj = roles
    saved = blk.recomputed + blk.ckpt_saved if run.checkpointing != "none" else blk.saved
    d = run.final_norm_numel
    nfa = nda // d * (sum(run.numels[i] for i in last_proj) // d)
    attention = _attention_after(run, j)
    if any(hook in m for m in attention):  # q, k, v, their norms, the input norm (attention_hooks.py); not derived:
        # bounded by o_proj's saved tensors, in flight every input projection's output gradient, the norm's and x1's
        rms = nda // _pbytes(run) * 4 + nda // (_pbytes(run) * d) * 4 + 2 * nda
        module = next(m for m in attention if hook in m)
        derived = attention_input_hook(run, hook, attention, saved - blk.mlp_saved - rms)
        if derived is not None:
            return "attention input", derived, module
        qkv = nda // d * (sum(run.numels[i] for m in attention for i in m if run.numels[i] > d) // d)
        return "attention input (bounded at o_proj's)", (
            _act("block's saved activations before its post-attention norm", saved - blk.mlp_saved - rms),
            _act("q, k, v's, the input norm output's and x1's gradients", qkv + 2 * nda, 3)), module
    if not any(hook in m for m in (*roles[0], roles[1], roles[2])):
        return None
    if hook in o_proj:  # the MLP's and the post-attention norm's saved tensors gone (an RMSNorm's: N·d·4 + N·4 +
        # 2·N·d·a), in flight o_proj's input gradient (N·q·a) and x1's (N·d·a)
        rms = nda // _pbytes(run) * 4 + nda // (_pbytes(run) * d) * 4 + 2 * nda
        nqa = nda // d * (sum(run.numels[i] for i in o_proj) // d)
        return "attention output projection", (_act("block's saved activations before its post-attention norm",
                                                    saved - blk.mlp_saved - rms),
                                               _act("attention output's and x1's gradients", nqa + nda, 2)), o_proj
    if hook in norm:
        return "post-attention norm", (_act("block's saved activations left at its post-attention norm",
                                            blk.norm_backward_saved + saved - blk.saved),
                                       _act("normalised tensor's and incoming gradients", 2 * nda, 2)), norm
    if hook in last_proj:
        return "MLP input projection", (_act("block's saved activations less the MLP's and the norm's output",
                                             saved - blk.mlp_saved - nda),
                                        _act("incoming and MLP input's gradients", 2 * nda, 2)), last_proj
    module = next(m for m in earlier if hook in m)
    return "MLP input projection", (
        _act("block's saved activations less the MLP's but the activation's input", saved - 3 * nfa),
        _act("incoming, MLP input's and the activation output's gradients", 2 * nda + nfa, 3)), module


def _mlp_saved(run: DSRun) -> int | None:
    """A GPT block's saved tensors its MLP releases before the input projection's backward ends: LN2's output
    (the projection's input, released by the checkpoint's unpack once used, or saved) and the MLP's own
    (``BlockActivations.mlp_saved``: the activation's kept tensors and output, (k + 1)·N·f·a); None for other
    blocks (Llama's RMSNorm: ``BlockActivations.norm_backward_saved`` is set)."""
    blk = run.acts.block
    if blk.norm_backward_saved or not blk.mlp_saved:
        return None
    return run.acts.embed_out + blk.mlp_saved
