"""The working set of a sparse block's backward where ZeRO-1/2 reduce from the hooks (``_hooks_ws``: the weight
gradients gone at the hooks), per block and per rank (``block_ws``), and where ZeRO-1's boundary micro-step holds
the earlier micro-steps' gradients beside it (``sparse_block_start``, boundary.py ``held_at``); DeepSpeed 0.19.8
runtime/zero/stage_1_and_2.py, transformers 5.24's sparse MLPs (moe12_hooks.py).

Measured (gloo, fp32, ZeRO-1 with ``overlap_comm``, G = 2 and 3, N_d = 2 and 3; Mixtral, Qwen3-MoE, Qwen2-MoE,
DeepSeek-V3; tests/data/measured/deepspeed_moe12_accum.json): every phase of every rank within 3,464 B under / 888 B
over, but Qwen2-MoE's rank 0 at N_d = 3, G = 3 (166,504 B, 0.77 %, over: ``sparse_block_start``)."""

from __future__ import annotations

import math

from zeroplan.architectures.moe import moe_shapes
import zeroplan.engines.deepspeed.boundary as B
from zeroplan.engines.deepspeed.moe12_hooks import _roles, _tokens
from zeroplan.engines.deepspeed.run import DSRun, _act, memo_of, shared_memo
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES
from zeroplan.formulas.moe_block import deepseek_backward_ws, sparse_backward_ws
from zeroplan.formulas.peak import Term


def _hooks_ws(run: DSRun) -> int:
    """The last (sparse) block's backward working set where ZeRO-2 reduces at the hooks: the block's moments
    (``moe_block.sparse_backward_ws``, ``shared_expert_ws``, ``deepseek_backward_ws``) without the weight gradients
    that have left by then. A gradient no larger than the bucket is copied into it at its own hook; a larger one is
    reduced at the next hook (``extra_large_param_to_reduce``) and then copied into ``grads_in_partition`` or cleared
    (``reduce_ipg_grads``: ``clear_grad_attribute``): ``down_proj``'s is alive through the gate-up backward only
    where it is larger than the bucket; the shared experts' (DeepSeek-V3, run backward first) by the routed experts',
    the experts' and router's by Qwen2-MoE's shared SwiGLU (run backward last) and every MLP weight gradient by the
    post-attention norm's backward (``moe_block.sparse_block``'s ``later``)."""
    spec, blk, a = run.spec, run.acts.block, DTYPE_BYTES[run.settings.dtype]
    moe, mt, d, n = spec.moe, spec.model_type, spec.d_model, _tokens(run)
    down_held = moe.n_experts * d * moe.expert_ffn > run.settings.reduce_bucket_size
    if mt == "deepseek_v3":
        return deepseek_backward_ws(moe, n, d, a, a == 4, down_held, grads_held=False)
    mlp_grads = sum(math.prod(shape) for _, shape in moe_shapes(moe, mt, d, "")) * a + d * a
    later = blk.backward_act_grads + blk.first_weight_grads - mlp_grads if blk.backward_act_grads else 0
    return max(sparse_backward_ws(moe, mt, n, d, a, down_held, grads_held=False), later)


def last_block_from_hooks(run: DSRun, last: tuple[Term, ...]) -> tuple[Term, ...]:
    """``last`` (the last block's backward terms, ``phases.backward_moments``) as ``block_ws`` of the last block."""
    return block_ws(run, last, run.acts.n_layer - 1, run.settings.rank)


def block_ws(run: DSRun, terms: tuple[Term, ...], j: int, rank: int | None) -> tuple[Term, ...]:
    """``terms`` (a block's backward moment) with the working set ``_hooks_ws`` where sparse block ``j``'s weight
    gradients leave at the hooks for ``rank`` (``_hooks_ws_for``); else ``terms``."""
    if not _hooks_ws_for(run, j, rank):
        return terms
    ws = "block backward working set"
    return tuple(_act(ws, _hooks_ws(run)) if t.name == ws else t for t in terms)  # the name other moments drop


def _hooks_ws_for(run: DSRun, j: int, rank: int | None) -> bool:
    """Sparse block ``j``'s weight gradients leave at the hooks: ZeRO-2 without accumulation; ZeRO-1 with
    ``overlap_comm`` (at G = 1 or at its boundary) for a rank holding every MLP gradient of block ``j`` larger than
    the bucket in its partition (stage 1 clears none outside it: ``reduce_ipg_grads``; they stay in the formulas'
    working set; the attention's, outside it or not, stay in the set's later moment). Per block, not the last
    block's for all: measured (Qwen2-MoE, gloo, N_d = 3, 5,000-element buckets: rank 1 owning block 1 whole, not
    block 2's, its block-1 moment 227,688 B (1.2 %) over with the last block's set; rank 2 owning block 2's MLP,
    not its q_proj, the same 227,688 B over; at G = 1 and G = 3)."""
    spec, s = run.spec, run.settings
    if spec is None or spec.moe is None or (run.grad_accum > 1 and not B.at_boundary(run)) or (
            j not in spec.moe.sparse_layers):
        return False
    if not s.partition_gradients:
        if rank is None or not s.overlaps:
            return False
        lo, hi, roles = *run.flat.range(rank), _roles(run)
        return not any(b == j and n > s.reduce_bucket_size and not lo <= i < hi and roles.get(i) != "attention"
                       for i, (n, b) in enumerate(zip(run.numels, run.param_blocks)))  # fmt: skip
    return True


def block_held(run: DSRun, common: tuple[Term, ...], j: int, hook: int | None) -> tuple[Term, ...]:
    """Block ``j``'s first-op moment (zero12.py ``_blocks_from_hooks``): ``common`` with the block's working set for
    the rank estimated (``block_ws``; every rank at once: the set with the gradients held, the larger) and, at
    ZeRO-1's boundary, the earlier gradients held there (boundary.py ``block_position``: ``hook`` the reduction that
    allocated the rank's partition)."""
    at = B.block_position(run, j, hook, sparse_block_start(run, j))
    return block_ws(run, B.held_at(run, common, at), j, run.settings.rank)


def sparse_block_start(run: DSRun, j: int) -> int:
    """ZeRO-1's boundary (boundary.py ``held_at``): where block ``j``'s moments with a working set stand in the
    gradient-ready order: the block's first hook (``B.block_start``), or, a sparse block, its experts'
    ``gate_up_proj`` hook: the gate-up backward, the set's peak (``_hooks_ws``, ``sparse_backward_ws``). The hooks
    before it have run (``down_proj``'s; DeepSeek-V3's shared experts', Qwen2-MoE's shared gate's): their earlier
    micro-steps' gradients, summed into in place (``AccumulateGrad``), were moved into the bucket, or, larger than
    the bucket, wait in ``param.grad`` as the set's ``down_held`` (one tensor, counted there). Measured (gloo,
    N_d = 2, G = 2, 5,000-element buckets, rank 1, the last block with its partition): 524,288 B (Mixtral's
    ``down_proj``), 393,216 (Qwen3-MoE's), 263,168 (Qwen2-MoE's and its shared gate's) over before, held from the
    block's first hook; Mixtral N_d = 3 every rank 524,288 B over."""
    if run.spec is None or run.spec.moe is None or j not in run.spec.moe.sparse_layers:
        return B.block_start(run, j)
    first = _first_gate_up(run).get(j)
    return B.position(run, first) if first is not None else B.block_start(run, j)


def _first_gate_up(run: DSRun) -> dict[int, int]:
    """Block -> its first ``gate_up_proj`` parameter (in the roles' order), once per architecture and layout (the
    roles and blocks, by identity: ``shared_memo``), looked up once per run: a speed-up, no rule (it scanned every
    role per block and per moment, then per run). Read, never changed."""
    def make(r: DSRun) -> dict[int, int]:
        roles, blocks = _roles(r), r.param_blocks

        def scan() -> dict[int, int]:
            out: dict[int, int] = {}
            for i, role in roles.items():
                if role == "gate_up":
                    out.setdefault(blocks[i], i)
            return out
        return shared_memo("first gate-up per block", (roles, blocks), (), scan)  # type: ignore[return-value]
    return memo_of(run, "first gate-up per block", make)  # type: ignore[return-value]


def last_block_start(run: DSRun) -> int:
    """``sparse_block_start`` of the last block (its head's and final norm's hooks have run)."""
    return sparse_block_start(run, run.acts.n_layer - 1)
