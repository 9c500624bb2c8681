"""ZeRO-2 (and ZeRO-1 with ``overlap_comm``) reducing from the hooks on a mixture-of-experts decoder (transformers
5.24: one (E, 2f, d) ``experts.gate_up_proj`` and one (E, d, f) ``experts.down_proj`` per sparse layer): a rank's
``grads_in_partition`` allocated at a gradient hook inside a sparse MLP's backward (runtime/zero/stage_1_and_2.py,
DeepSpeed 0.19.8).

The mechanism (live storages at each rank's backward peak, benchmarks/ds_moe12_rows.py ``trace``): a hook first
reduces the bucket when its own gradient does not fit (``reduce_independent_p_g_buckets_and_remove_grads`` ->
``reduce_ipg_grads`` -> ``average_tensor``), with that gradient waiting in ``param.grad`` beside the bucket's; an
expert tensor larger than the bucket is not copied into it but reduced on its own at the next hook
(``extra_large_param_to_reduce``), so it is alive there too; the first reduction holding one of the rank's own
parameters allocates its ``grads_in_partition`` (``copy_grads_in_partition``), before the expert gradient is
copied into it and released. The block's activations are then partly released: autograd runs the sparse MLP
backward from its last call (experts' ``down_proj``, ``gate_up_proj``, then the router and the post-attention
norm; DeepSeek-V3's shared experts before the routed ones, called after them; Qwen2-MoE's shared expert after the
router, called first).

Per hook of sparse block j reducing a bucket (``_at_hook``), beside the states, the buckets and the first j blocks'
saved tensors:

- ``experts.gate_up_proj``'s: the block's saved tensors less the routed experts' (the gate-up grouped matmul, the
  experts' first call, has run backward) and DeepSeek-V3's shared experts' (run backward before), the router's
  kept; in flight the incoming gradient, d(gathered rows) (S·d·a) and DeepSeek-V3's shared experts' input gradient
  (N·d·a); Qwen2-MoE's shared SwiGLU tensors and d(shared output) still waiting, with its gate's input gradient; alive ``down_proj``'s gradient where it is larger than the bucket (reduced at this hook) and
  ``gate_up_proj``'s own (waiting for its hook to return);
- the experts' ``down_proj``'s (its grouped matmul's backward has run; transformers integrations/moe.py
  ``grouped_mm_experts_forward`` read backward): the block's saved tensors less the routing
  product's (the down output, the sorted weights, the inverse permutation) and the down matmul's input (SiLU·up),
  the gathered rows, the gate-up output and SiLU's output kept; in flight the incoming gradient, d(SiLU·up) (S·f·a)
  and the sorted routing weights' gradient; Qwen2-MoE's shared terms as at ``gate_up_proj``'s (measured: Qwen2-MoE
  at 1,000,000-element buckets, both ranks' first bucket reduced at layer 0's ``down_proj`` hook, its flattened copy
  beside the bucket: 594,584 / 497,048 B (2.5 %) under before, now 376 B over; not DeepSeek-V3, not measured);
- Qwen2-MoE's shared SwiGLU's (``_at_shared_hook``);
- the router's (``mlp.gate.weight``) or the post-attention norm's: the block's saved tensors less the MLP's and the
  norm's output (the router's linear, its last reader, has run); in flight the incoming gradient, the experts'
  input gradient and the router's (3·N·d·a), at the router's Qwen2-MoE's shared expert's as above; alive
  ``gate_up_proj``'s gradient where larger than the bucket and the router weight's own.

After a ``gate_up_proj`` hook whose gradient is larger than the bucket (left in ``param.grad`` for the next hook:
``extra_large_param_to_reduce``), the gathered rows' gradient scattered back to the tokens (``IndexBackward``: a zeros
tensor and ``index_put``, 2·N·d·a) beside it, the bucket reduced gone and the partition kept (measured: Qwen2-MoE's
rank 0 at 100,000-element buckets, 66,696 B under before, now 1,160 B).
With ``offload_optimizer`` (moe_offload.py ``norms_at_hooks``) no rank has a ``grads_in_partition``: the reduction
holds the flattened copy or the fp64 norm copy of the rank's largest slice (``norm_copy``), the larger
(``_rank_holding_most``); also at a hook of the block's attention or input norm (role "attention": bounded at
``o_proj``'s, the first, each op after it releasing more; measured: Mixtral bf16 at 300,000, the bucket holding a
whole ``gate_up_proj`` reduced at ``q_proj``'s hook, up to 0.44 % over) and at DeepSeek-V3's routed ``down_proj``
(its shared experts' input gradient in flight; measured at 100,000, fp32 and bf16).
Also the gate-up backward before its hook with a partition allocated at ``down_proj``'s (``_gate_up_backward``)
and the head's hook allocating the bucket (``head_hook_bucket``); the blocks' working set without the weight
gradients gone at the hooks: moe12_ws.py. At ZeRO-1's boundary (G > 1) each moment holds the earlier micro-steps'
gradients of the parameters whose hook has not run (boundary.py ``held_at``).

Measured (gloo, N_d = 2, fp32 and bf16, tests/test_deepspeed_moe12.py): see ``moe12.py``.
"""

from __future__ import annotations

from bisect import bisect_left
from functools import lru_cache

from zeroplan.architectures.spec import transformer_shapes
import zeroplan.engines.deepspeed.boundary as B
from zeroplan.engines.deepspeed.layout_ranks import _hook_buckets, _rank_first_buckets
from zeroplan.engines.deepspeed.moe12_hook_facts import LARGE, SRC, sparse_hooks
from zeroplan.engines.deepspeed.moe12_winners import _kept_bytes_of, _partitions_by_first, _winner_without_kept
from zeroplan.engines.deepspeed.moe_offload import norm_copy, norms_at_hooks
from zeroplan.engines.deepspeed.reduce import GIP_SRC
from zeroplan.engines.deepspeed.run import DSRun, _act, _blocks_saved, _pbytes, memo_of, shared_memo
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES
from zeroplan.formulas import deepseek_activations as DS
from zeroplan.formulas.moe_activations import INDEX_BYTES, OFFSET_BYTES, ROUTING_WEIGHT_BYTES
from zeroplan.formulas.moe_block import router_saved
from zeroplan.formulas.peak import Moment, Term

ROLES = {".mlp.experts.gate_up_proj": "gate_up", ".mlp.experts.down_proj": "down", ".mlp.gate.weight": "router",
         ".post_attention_layernorm.weight": "norm", ".mlp.shared_expert.down_proj.weight": "shared_down",
         ".mlp.shared_expert.up_proj.weight": "shared_up",
         ".mlp.shared_expert.gate_proj.weight": "shared_gate"}  # fmt: skip
"""A sparse MLP's parameter (its ``named_parameters`` name's ending) -> its role in the hooks' order."""
ATTENTION = (".self_attn.", ".input_layernorm.")
"""A sparse block's parameters before its MLP (role "attention"): their hooks come after the post-attention norm's."""


@lru_cache(maxsize=16)
def _names(spec) -> tuple[str, ...]:
    return tuple(n for n, _ in transformer_shapes(spec))


def _roles(run: DSRun) -> dict[int, str]:
    """Parameter index -> its role (``ROLES``) in a sparse MLP, for the sparse layers' parameters; once per
    architecture (every candidate of a plan shares it; read, never changed)."""
    return _roles_of(run.spec)


@lru_cache(maxsize=16)
def _roles_of(spec) -> dict[int, str]:
    names, moe = _names(spec), spec.moe
    sparse = {str(j) for j in moe.sparse_layers}
    out = {}
    for i, name in enumerate(names):
        role = next((v for k, v in ROLES.items() if name.endswith(k)), None)
        if role is None and any(a in name for a in ATTENTION):
            role = "attention"
        if role is not None and _in_layers(name, sparse):
            out[i] = role
    return out


def _in_layers(name: str, layers: set[str]) -> bool:
    """Whether ``name`` holds ``.layers.{j}.`` for a j of ``layers`` (its indices as text): the index after each
    ``.layers.`` looked up, not every layer's text searched for (a speed-up, no rule; tests/test_deepspeed_moe12_winner.py)."""
    at = name.find(".layers.")
    while at >= 0:
        end = name.find(".", at + 8)
        if end >= 0 and name[at + 8:end] in layers:
            return True
        at = name.find(".layers.", at + 1)
    return False


def _tokens(run: DSRun) -> int:
    return run.acts.embed_out // (run.spec.d_model * DTYPE_BYTES[run.settings.dtype])


def _router_saved(run: DSRun) -> int:
    spec, n, a = run.spec, _tokens(run), DTYPE_BYTES[run.settings.dtype]
    if spec.model_type == "deepseek_v3":
        return DS.router_saved(spec.moe, n, spec.d_model, a)
    return router_saved(spec.moe, spec.model_type, n)


def _at_hook(run: DSRun, j: int, role: str) -> tuple[Term, ...]:
    """``_hook_terms``, once per (j, role) for every run of the same activations, architecture, parameter sizes (the
    very objects), checkpointing and dtype: what it reads. A speed-up, no rule: every ZeRO-1/2 run asked each hook's
    anew (tests/test_deepspeed_moe12_winner.py ``test_at_hook_memo_equals_each_built``). Read, never changed."""
    memo = run.memo.get("sparse hook activations")
    if memo is None:
        memo = run.memo["sparse hook activations"] = shared_memo(
            "sparse hook activations", (run.acts, run.spec, run.numels), (run.checkpointing, run.settings.dtype), dict)
    found = memo.get((j, role))
    if found is None:
        found = memo[j, role] = _hook_terms(run, j, role)
    return found


def _hook_terms(run: DSRun, j: int, role: str) -> tuple[Term, ...]:
    """Block j's activations at the hook of its sparse MLP's parameter of ``role`` (module docstring)."""
    spec, n, a, nda = run.spec, _tokens(run), DTYPE_BYTES[run.settings.dtype], run.acts.embed_out
    blk = run.acts.layer_blocks[j] if run.acts.layer_blocks else run.acts.block
    # under checkpointing the block's recomputed tensors (not measured here: the rows are without checkpointing)
    saved = blk.recomputed + blk.ckpt_saved if run.checkpointing != "none" else blk.saved
    before_mlp = saved - blk.mlp_saved
    # Qwen2-MoE's shared expert runs first, so its backward runs last: its SwiGLU's saved tensors (4·N·f_s·a) and
    # d(shared output) wait beside the routed experts', with the input gradient its sigmoid gate's linear made
    # (its product's and sigmoid's saved tensors, N·d·a + N·a, released: they ran backward first)
    if role.startswith("shared_"):
        return _at_shared_hook(run, role, before_mlp)
    qwen2 = spec.model_type == "qwen2_moe" and role != "norm"
    shared = (_act("the shared expert's SwiGLU saved tensors", 4 * n * spec.moe.shared_ffn * a),
              _act("d(shared output) and the shared gate's input gradient", 2 * nda, 2)) if qwen2 else ()
    if role == "down":  # the routing product's and the down matmul's saved tensors released (expert_activations)
        rows, f, w = n * spec.moe.top_k, spec.moe.expert_ffn, ROUTING_WEIGHT_BYTES[spec.model_type] or a
        deepseek = spec.model_type == "deepseek_v3"  # its shared experts ran backward first: their input gradient
        return (_act("block's saved activations less the routing product's and down matmul's (the router's kept)",
                     before_mlp + _router_saved(run) + rows * (a * (spec.d_model + 3 * f) + 2 * INDEX_BYTES)
                     + spec.moe.n_experts * OFFSET_BYTES),
                _act("incoming, d(SiLU·up) and the sorted routing weights' gradients (DeepSeek-V3: and the shared "
                     "experts' input's)", nda + rows * (f * a + w) + (nda if deepseek else 0), 4 if deepseek else 3),
                *shared)
    if role == "gate_up":  # DeepSeek-V3's shared experts ran backward first: their input gradient in flight
        rows, deepseek = n * spec.moe.top_k * spec.d_model * a, spec.model_type == "deepseek_v3"
        return (_act("block's saved activations less its experts' (the router's kept)",
                     before_mlp + _router_saved(run)),
                _act("incoming and d(gathered rows) gradients (DeepSeek-V3: and the shared experts' input's)",
                     nda + rows + (nda if deepseek else 0), 3 if deepseek else 2), *shared)  # fmt: skip
    if role == "attention":  # bounded at the attention output projection's hook, the first (reduce.py's Llama
        # rule): the MLP's and the post-attention RMSNorm's saved tensors released (its fp32 input, rsqrt and the two
        # N·d·a), in flight o_proj's input gradient (N·q·a) and x1's
        rms = nda // a * 4 + n * 4 + 2 * nda
        o_proj = next(i for i, name in enumerate(_names(spec)) if name.endswith(f".layers.{j}.self_attn.o_proj.weight"))
        nqa = n * (run.numels[o_proj] // spec.d_model) * a
        return (_act("block's saved activations before its post-attention norm", before_mlp - rms),
                _act("attention output's and x1's gradients", nqa + nda, 2))
    return (_act("block's saved activations less its MLP's and the norm's output", before_mlp - nda),
            _act("incoming, the experts' and the router's input gradients", 3 * nda, 3), *shared)


def _at_shared_hook(run: DSRun, role: str, before_mlp: int) -> tuple[Term, ...]:
    """Qwen2-MoE, block's activations at a hook of its shared SwiGLU (transformers 5.24 modeling_qwen2_moe.py
    ``Qwen2MoeSparseMoeBlock.forward`` calls ``shared_expert`` first, so autograd runs it last; ``Qwen2MoeMLP.forward``:
    g = gate_proj(x), s = SiLU(g), u = up_proj(x), h = s·u, down_proj(h)) where the hook reduces a bucket
    (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads`` -> ``reduce_ipg_grads`` -> ``average_tensor``,
    ``copy_grads_in_partition``): the routed experts', the router's and the sigmoid gate's saved tensors released,
    in flight the incoming gradient and the MLP input's summed gradient (2·N·d·a): at ``down_proj``'s g, s and u kept
    (h, down's saved input, released) and d(h) (N·f_s·a); at ``up_proj``'s g kept (SiLU's saved input; s and u, the
    product's, released) and d(s) (N·f_s·a, waiting for SiLU's backward); at ``gate_proj``'s the norm output x (its
    last reader ran) released too. Measured (live storages at Qwen2-MoE's rank 1 peak, 300,000-element buckets: its
    partition allocated at layer 2's shared ``down_proj`` hook; 674,184 B (3.0 %) under before)."""
    nfa = _tokens(run) * run.spec.moe.shared_ffn * DTYPE_BYTES[run.settings.dtype]
    nda = run.acts.embed_out
    if role == "shared_gate":
        return (_act("block's saved activations less its MLP's and the norm's output", before_mlp - nda),
                _act("incoming and MLP input's gradients", 2 * nda, 2))
    kept, grad = (("g, SiLU(g), u", 3), "d(h)") if role == "shared_down" else (("g", 1), "d(SiLU(g))")
    return (_act("block's saved activations less its MLP's", before_mlp),
            _act(f"the shared SwiGLU's saved tensors left ({kept[0]})", kept[1] * nfa, kept[1]),
            _act(f"incoming and MLP input's gradients, the shared {grad}", 2 * nda + nfa, 3))


def sparse_hook_partitions(run: DSRun, last: tuple[Term, ...], inflight: tuple[Term, ...],
                           kept: dict[int, tuple[Term, ...]]) -> tuple[Moment, ...]:
    """Reducing from the hooks, each bucket reduced at the hook of a sparse MLP's ``gate_up_proj``, ``down_proj``,
    router, post-attention norm or (Qwen2-MoE) shared SwiGLU weight (module docstring), the rank holding the most:
    ``allreduce_bucket``'s flattened copy of the bucket (``_hook_bucket_copy``) beside the ``grads_in_partition``
    of a rank whose first bucket went earlier; or, the rank's first, its partition allocated once the copy is freed
    (the larger of the two). At ZeRO-1 (``overlap_comm``) also the gradients larger than the bucket outside the
    rank's partition, reduced before and kept to the step (``kept``: zero12.py ``_stage1_kept_gradients``, the later blocks'; and block j's own)."""
    if run.spec is None or run.spec.moe is None or not run.param_blocks:
        return ()
    base = tuple(t for t in last if t not in inflight and t.name not in ("block backward working set",
                                                                         "incoming activation gradient"))  # fmt: skip
    firsts = _sparse_firsts(run)
    out = []
    for b, hook, role, j, at, hooked, copy, name, waits in sparse_hooks(run, _roles(run)):
        common = (*B.held_at(run, base, at), _blocks_saved(run, j), *_at_hook(run, j, role), *hooked)
        best = _rank_holding_most(run, kept, copy, firsts, j, b)
        out.append(Moment("backward", name, (*common, *best)))
        if waits:  # gate_up_proj's gradient larger than the bucket waits past the hook (module docstring)
            out.append(Moment("backward", f"block {j} gathered rows' backward after the gate-up hook, bucket {b} gone", (
                *(t for t in common if t.name != LARGE), *(t for t in best if t is not copy),
                _act("the gathered rows' gradient scattered back (IndexBackward: zeros, index_put)",
                     2 * run.acts.embed_out, 2))))
    return (*out, *_gate_up_backward(run, base, kept, firsts))


def _sparse_firsts(run: DSRun) -> dict[int, int]:
    """Rank -> its first hook bucket (the least bucket of its parameters), for the ranks described with a parameter,
    in rank order: ``layout_ranks._rank_first_buckets`` (the same least over each rank's range), every rank's dict
    once per layout and bucket size (``shared_memo``). A speed-up, no rule: it was a generator's ``min`` per rank and
    run (tests/test_deepspeed_moe12_winner.py ``test_sparse_firsts_equal_the_per_rank_min``). Read, never changed."""
    firsts = _rank_first_buckets(run)
    if run.settings.rank is not None:
        r = run.settings.rank
        return {r: firsts[r]} if firsts[r] >= 0 else {}
    return shared_memo("sparse firsts", (firsts,), (), lambda: {r: f for r, f in enumerate(firsts) if f >= 0})  # type: ignore[return-value]


def _gate_up_backward(run: DSRun, base: tuple[Term, ...], kept: dict[int, tuple[Term, ...]],
                      firsts: dict[int, int]) -> tuple[Moment, ...]:
    """The gate-up grouped matmul's backward making ``gate_up_proj``'s gradient, before its hook, for a rank whose
    ``grads_in_partition`` a bucket reduced at an earlier hook allocated (``down_proj``'s: its gradient did not fit
    beside the bucket's): the partition, the bucket, ``down_proj``'s gradient where larger than the bucket, the
    block's activations at the gate-up hook (``_at_hook``) and, not yet released, the grouped matmul's saved input
    (the gathered rows, S·d·a) and its output's gradient (S·2f·a). Measured (live storages at Qwen3-MoE's rank 1
    peak, 150,000-element buckets: its partition allocated at layer 2's ``down_proj`` hook)."""
    roles, order, (_, _, first_of_bucket, bucket_of) = _roles(run), run.grad_ready_order, _hook_buckets(run)
    p, a, spec, limit = _pbytes(run), DTYPE_BYTES[run.settings.dtype], run.spec, run.settings.reduce_bucket_size
    s_rows, last_first = _tokens(run) * spec.moe.top_k, len(first_of_bucket) - 1
    out = []  # the gate-up parameters once per architecture, their places from the layout's (a speed-up, no rule)
    for gu in shared_memo("gate-up parameters", (roles,), (), lambda: [i for i, role in roles.items() if role == "gate_up"]):  # type: ignore[union-attr]
        j, at = run.param_blocks[gu], B.position(run, gu)
        b = bucket_of[order[at - 1]]  # the bucket filling when the gate-up backward runs
        if kept:  # a speed-up, no rule: ``_stage1_kept``'s bytes summed from integers
            held = [r for r, first in firsts.items() if first < last_first and first_of_bucket[first + 1] < at]
            if not held:
                continue
            kept_bytes = _kept_bytes_of(run, kept, j, b, order, first_of_bucket)
            r = max(held, key=lambda r: run.flat.params_numel(r) + kept_bytes(r))
        else:  # a speed-up, no rule: held = the ranks whose first bucket is before the last one starting before
            # ``at`` (``first_of_bucket`` increases), their largest partition the first on a tie (``_by_first_bucket``)
            before = _partitions_by_first(run, firsts)[1]
            largest = before[min(max(bisect_left(first_of_bucket, at) - 1, 0), len(before) - 1)]
            if largest is None:
                continue
            r = largest[2]
        down = sum(run.numels[i] for i in order[first_of_bucket[b]:at]
                   if roles.get(i) == "down" and run.numels[i] > limit)
        out.append(Moment("backward", f"block {j} gate-up backward, rank {r}'s grads_in_partition held", (
            *B.held_at(run, base, at), _blocks_saved(run, j), *_at_hook(run, j, "gate_up"),
            _act("the gate-up matmul's saved input and its output's gradient",
                 s_rows * spec.d_model * a + s_rows * 2 * spec.moe.expert_ffn * a, 2),
            Term("down_proj's gradient larger than the bucket (waiting)", down * p,
                 f"{SRC} reduce_ipg_grads (extra_large_param_to_reduce)"),
            Term("gate_up_proj's gradient", run.numels[gu] * p, "autograd (grouped_mm backward)"),
            *_stage1_kept(run, kept, r, j, b, order, first_of_bucket),
            Term("grads_in_partition", run.flat.params_numel(r) * p, GIP_SRC))))
    return tuple(out)


def _rank_holding_most(run: DSRun, kept: dict[int, tuple[Term, ...]], copy: Term, firsts: dict[int, int], j: int,
                       b: int) -> tuple[Term, ...]:
    """At bucket b's reduction in block j, the rank-dependent terms of the rank holding the most (with its hook):
    ``allreduce_bucket``'s flattened copy of the bucket beside the ``grads_in_partition`` of a rank whose first bucket
    went earlier; or, the rank's first, its partition allocated once the copy is freed (the larger of the two). With
    ``offload_optimizer`` (moe_offload.py ``norms_at_hooks``) no partition: the copy, or once it is freed the fp64
    norm copy of the rank's largest slice in the bucket (``norm_copy``), the larger."""
    order, _, first_of_bucket, _ = _hook_buckets(run)
    if norms_at_hooks(run):
        params = order[first_of_bucket[b]:first_of_bucket[b + 1]]
        options = [(max(copy, norm_copy(run, r, params), key=lambda t: t.bytes),) for r in run.ranks]
        return max(options, key=lambda terms: sum(t.bytes for t in terms))
    # A speed-up, no rule: each rank's option summed from integers, the first largest kept (``max``'s choice over
    # [(copy,), each rank's terms]), and only the winner's terms built (tests/test_deepspeed_moe12_winner.py
    # against every option built).
    p, c, numel_of = _pbytes(run), copy.bytes, run.flat.params_numel
    if kept:
        kept_bytes, best, winner = _kept_bytes_of(run, kept, j, b, order, first_of_bucket), c, None
        for r, first in firsts.items():
            if first <= b:
                gip = numel_of(r) * p
                total = kept_bytes(r) + (gip + c if first < b else (gip if gip > c else c))
                if total > best:
                    best, winner = total, r
    else:
        winner = _winner_without_kept(run, firsts, c, b)
    if winner is None:
        return (copy,)  # a rank with no grads_in_partition yet
    gip = Term("grads_in_partition", numel_of(winner) * p, GIP_SRC)
    own = (gip, copy) if firsts[winner] < b else (max(gip, copy, key=lambda t: t.bytes),)
    return (*_stage1_kept(run, kept, winner, j, b, order, first_of_bucket), *own)


def _stage1_kept(run: DSRun, kept: dict[int, tuple[Term, ...]], rank: int, j: int, b: int, order: tuple[int, ...],
                 first_of_bucket: list[int]) -> tuple[Term, ...]:
    """ZeRO-1 (``kept`` not empty): ``rank``'s gradients larger than the bucket outside its partition, reduced before
    bucket b and kept to the step: the later blocks' (``kept[rank][j]``) and block j's own."""
    if not kept:
        return ()
    lo, hi = run.flat.range(rank)
    mine = sum(run.numels[i] for i in order[:first_of_bucket[b]] if run.param_blocks[i] == j
               and run.numels[i] > run.settings.reduce_bucket_size and not lo <= i < hi)  # fmt: skip
    return (Term("gradients larger than the bucket, outside the partition, reduced before (kept)",
                 mine * _pbytes(run) + kept[rank][j].bytes, kept[rank][j].source),)


def head_hook_bucket(run: DSRun, last: tuple[Term, ...], inflight: tuple[Term, ...]) -> tuple[Moment, ...]:
    """Reducing from the hooks, the head weight's hook (the first): ``reduce_independent_p_g_buckets_and_remove_grads``
    -> ``process_gradients`` -> ``setup_buckets`` allocates the reduce bucket(s) with the head's gradient alive, every
    activation still saved; the logits' gradient and the final norm output's are gone by then (the head's
    backward node has run). Measured (live storages at DeepSeek-V3's rank 0 peak, 300,000-element buckets: the
    1,200,000-B bucket beside the 257,536-B head gradient; 159,048 B under before, now 440 B over).

    Then the final RMSNorm's weight product (``weight * x̂``) runs backward, its weight's gradient made before its
    hook: where the head's gradient is larger than the bucket it was not copied into it but left in ``param.grad``
    for the next hook to reduce (``reduce_independent_p_g_buckets_and_remove_grads``: ``extra_large_param_to_
    reduce``), so it is alive beside the bucket, the norm's saved tensors less its output (the head's input,
    released by the head's backward), the norm output's gradient and the product's two (d·w and d·x̂, N·d·a each)
    and the weight's gradient. Measured (live storages at DeepSeek-V3's rank 0 peak, 50,000-element buckets, the
    257,536-B head gradient over 200,000 B: the peak at the norm weight gradient's ``sum``; 61,800 B (0.75 %)
    under before, now 440 B over)."""
    if run.spec is None or run.spec.moe is None or run.tied_head or not run.param_blocks:
        return ()
    keep = tuple(t for t in last if t not in inflight and t.name not in (
        "block backward working set", "incoming activation gradient", "root gradients held (head weight, final norm)"))
    saved, nd, p = _blocks_saved(run, run.acts.n_layer), run.acts.embed_out, _pbytes(run)
    head = Term("head weight gradient", run.head_numel * p, "autograd (mm backward)")
    out = [Moment("backward", "head's hook, the reduce bucket allocated", (
        *keep, saved, _act("final norm saved and output", run.acts.final_saved), head))]
    if run.head_numel > run.settings.reduce_bucket_size and run.acts.block.pending_at_last_grad:  # an RMSNorm
        out.append(Moment("backward", "final norm's weight product backward, the head's gradient waiting", (
            *keep, saved, _act("final norm saved less its output", run.acts.final_saved - nd),
            _act("norm output gradient and the product's two (d·w, d·x̂)", 3 * nd, 3),
            Term("final norm weight gradient", run.spec.d_model * p, "autograd (mul backward, sum)"),
            Term("head weight gradient (larger than the bucket, waiting)", run.head_numel * p,
                 f"{SRC} reduce_independent_p_g_buckets_and_remove_grads (extra_large_param_to_reduce)"))))
    return tuple(out)


def sparse_moments(run: DSRun, last: tuple[Term, ...], inflight: tuple[Term, ...],
                   kept: dict[int, tuple[Term, ...]]) -> tuple[Moment, ...]:
    """ZeRO-1/2 reducing from the hooks, no accumulation, a sparse model: ``sparse_hook_partitions`` and
    ``head_hook_bucket`` (zero12.py ``ZeroOptimizer.backward_after_last_block`` asks)."""
    return (*sparse_hook_partitions(run, last, inflight, kept), *head_hook_bucket(run, last, inflight))
