"""ZeRO-3's buckets reduced outside the decoder blocks: the last one after backward (runtime/zero/stage3.py
``independent_gradient_partition_epilogue``) and, at a final-norm parameter's gradient hook, one holding the LM head's
gradient (``final_norm_hook``); the copies every bucket's reduction makes (``bucket_copies``, shared with ``zero3.py
_in_block_reductions``): the interleaved flat tensor of ``reduce_scatter_coalesced`` and gloo's copy of it, and with
``offload_optimizer`` the fp64 copy of each gradient partition for its norm; the parameters gathered at a hook
(``gathered_at_hook``)."""

from __future__ import annotations

from typing import Optional

from zeroplan.engines.deepspeed.coordinator import Stage3Schedule
from zeroplan.engines.deepspeed.layout_ranks import _hook_layout
from zeroplan.engines.deepspeed.nvme import gradient_swap_bytes, swappable
from zeroplan.engines.deepspeed.offload_terms import PARAM_NORMS
from zeroplan.engines.deepspeed.phases import final_norm_at_its_hook
from zeroplan.engines.deepspeed.run import GATHER_SRC, DSRun, _act, _gathered, _pbytes, _schedule, _states
from zeroplan.engines.deepspeed.zeropp import all_secondaries
from zeroplan.engines.deepspeed.zeropp_qgz import QGZ_BUFFERS, QGZ_SRC, qgz_nodes, qgz_reduce_bytes
from zeroplan.formulas.peak import Moment, Term
from zeroplan.formulas.sharding import flat_shard_numel

S3 = "runtime/zero/stage3.py"


def bucket_copies(numels: list[int], nd: int, device: str) -> tuple[int, int]:
    """Elements of the two copies a bucket of gradients ``numels`` makes when it is reduce-scattered
    (stage3.py ``__avg_scatter_grads`` -> runtime/comm/coalesced_collectives.py ``reduce_scatter_coalesced``): the
    interleaved flat tensor of their partitions, each padded to a multiple of N_d (``torch.cat``; none for one
    tensor that divides evenly: ``tensors[0].view(-1)``), and gloo's copy of that input inside
    ``reduce_scatter_tensor`` (ProcessGroupGloo; none on NCCL, ``device`` cuda: not measured there). At N_d = 1
    too: nothing there skips a group of one. Measured (nvme17, live storages, gloo N_d = 1): both for the last
    bucket of every gradient (GPT-2 d = 512, 2 x 7,371,776 B), gloo's alone for a bucket of one 1,048,576-element
    gradient (2,097,152 B)."""
    padded = sum(-(-n // nd) * nd for n in numels)
    flat = 0 if len(numels) == 1 and numels[0] % nd == 0 else padded
    return flat, padded if device == "cpu" else 0


def reduce_copies(run: DSRun, bucket: tuple[int, ...]) -> tuple[int, int]:
    """Bytes of (the flat copy, gloo's copy) the reduction of the gradients ``bucket`` (parameter indices, in the
    bucket's order) makes beside them (``bucket_copies`` in the gradients' bytes); with ZeRO++ qgZ over more than
    one node (``zeropp_qgz.py``), (``qgz_reduce_bytes``, 0): its quantized buffers, and its fallbacks' copies."""
    s, nd = run.settings, run.nd
    if _qgz(run):
        shapes = tuple(run.trace.shapes[i] for i in bucket)  # type: ignore[union-attr]
        return qgz_reduce_bytes(shapes, nd, s.devices_per_node, _pbytes(run), s.device), 0
    flat, gloo = bucket_copies([run.numels[i] for i in bucket], nd, s.device)
    return flat * _pbytes(run), gloo * _pbytes(run)


def _qgz(run: DSRun) -> bool:
    """Whether the run's buckets go through qgZ's all-to-alls (more than one node; the shapes traced)."""
    s = run.settings
    return s.quantized_gradients and qgz_nodes(run.nd, s.devices_per_node) > 1 and run.trace is not None


def copies_term(run: DSRun, copies: tuple[int, int], what: str, src: str) -> Term:
    """``reduce_copies``' bytes as a term: ``what`` and ``src`` name the plain reduce-scatter's copies."""
    if _qgz(run):
        return Term(QGZ_BUFFERS, copies[0], f"{S3} __avg_scatter_grads -> {QGZ_SRC} (zeropp_qgz.py qgz_reduce_bytes)")
    return Term(what, copies[0] + copies[1], src, int(copies[0] > 0) + int(copies[1] > 0))


def final_norm_hook(run: DSRun, hook: int) -> tuple[str, tuple[Term, ...], tuple[int, ...]]:
    """``reduce._hook_activations``' triple at the gradient hook of ``hook``, a final-norm parameter (after the blocks
    in ``named_parameters`` order): where, what is left of the final norm there (``phases.final_norm_at_its_hook``;
    every block's activations are saved, the caller's), and the parameters whose gradients are alive beside it: an
    RMSNorm's weight, whose hook runs (``reduce_independent_p_g_buckets_and_remove_grads`` sends the bucket before
    ``__add_grad_to_ipg_bucket`` copies that gradient in); a LayerNorm's two are ``final_norm_at_its_hook``'s.
    The bucket sent there holds the gradients ready before it, the LM head's: one larger than the bucket is not
    copied into it (``__add_grad_to_ipg_bucket``) and stays ``param.grad`` until ``partition_grads``, beside
    ``reduce_scatter_coalesced``'s flat copy and gloo's copy of it (``bucket_copies``), with every parameter the
    backward prefetch has gathered by the norm's fetch (``gathered_at_hook``). Found by the differential matrix
    (seed 5 draw 6, generator 5: Qwen3 16.3M untied, ZeRO-3, 3,504,592-element buckets (V·h / 2), ``overlap_comm``,
    N_d = 3; live storages at the backward peak, in the final norm weight's hook, at G = 1 as at G = 2: the head's
    28,036,736-B gradient, the 28,036,740-B ``cat`` and gloo's copy, the embedding gathered and every block's weights
    prefetched, every block's activations): 11,390,044 B (-4.58 %) under at the last bucket's moment before. Listed
    where it was measured, on gloo (``zero3.py _in_block_reductions``: with the hooks' gathers known): on a GPU the
    head's gradient is alive there all the same, but unmeasured; there it would not move a planned peak, while the
    allocator replay of a no-prefetch 7B candidate read 2.3 GB more reserved (left for a GPU measurement). The moment
    comes before the last block's in the step (``ZeroOptimizerStage3.backward_after_last_block``: the allocation
    trace's order)."""
    pending = run.acts.block.pending_at_last_grad  # an RMSNorm's (LayerNorm: 0, one node)
    return "final norm", final_norm_at_its_hook(run), ((hook,) if pending else ())


def backward_fetches(run: DSRun) -> dict[int, int]:
    """Parameter -> the backward fetch event of its innermost module (the last in the trace), at N_d > 1 with a
    schedule; else empty."""
    out: dict[int, int] = {}
    if run.nd > 1 and _schedule(run) is not None:
        for i, e in enumerate(run.trace.events):
            if not e.forward and e.op == "fetch":
                out.update(dict.fromkeys(run.trace.modules[e.module], i))
    return out


def gathered_at_hook(base: tuple[Term, ...], event: Optional[int], run: DSRun, where: str) -> tuple[Term, ...]:
    """``base`` with the parameters gathered after ``event`` (a hook's module fetched in backward,
    ``stage3_schedule``'s count, the open all-gather buffers apart) for the last block's. Measured (1-24, live
    storages at block 2's q_proj hook): 17,620,992 B gathered (the tied embedding and blocks 1-3's weights), the
    schedule 17,629,696 B."""
    sched = _schedule(run)
    if event is None or sched is None:
        return base
    p, buffers = _pbytes(run), sched.buffers[event] if sched.buffers else 0
    kept = tuple(t for t in base if not t.source.startswith(GATHER_SRC[:60]) and "all-gather buffers" not in t.name)
    return (*kept, Term(f"gathered parameters ({where})", (sched.gathered[event] - buffers) * p, GATHER_SRC),
            *((Term("coalesced all-gather buffers awaiting their last module", buffers * p,
                    "runtime/zero/partition_parameters.py _all_gather_dtype (flat_tensor)"),) if buffers else ()))


def epilogue_moments(run: DSRun, sched: Optional[Stage3Schedule]) -> tuple[Moment, ...]:
    """The last bucket, reduced after backward (stage3.py ``independent_gradient_partition_epilogue`` ->
    ``__reduce_and_partition_ipg_grads`` -> ``__avg_scatter_grads`` -> runtime/comm/coalesced_collectives.py
    ``reduce_scatter_coalesced``): its gradients, each padded to a multiple of N_d, are interleaved into one
    flat tensor (``torch.cat``; none for a single tensor that divides evenly), and gloo's
    ``reduce_scatter_tensor`` works on a full-size copy of that input (the copy is gloo's: on a GPU, NCCL
    reduces in place, not measured there; moe.py ``_reduction_peak`` measured it too). The activations are gone;
    the token embedding, the last module fetched in backward, is still gathered (no gradient input: its release
    is not traced, ``trace.py backward``); without ``contiguous_gradients`` the bucket's gradients are still
    autograd's (``params_in_ipg_bucket``), with it those larger than the bucket. Found twice this session, by the
    differential matrix (seed 3 draw 13, generator 4: Qwen2 17.4M tied, ZeRO-3, one bucket larger than the model,
    N_d = 2; MemTracker's live storages at the backward peak: the states, the bucket, the gathered embedding, the
    69,685,248-B ``cat`` and the 69,685,248-B copy made inside gloo's ``reduce_scatter_tensor``: -5.0% on both
    ranks before, at the tied embedding's backward) and on the recorded MoE rows at DeepSpeed's default 5e8
    bucket, where the last bucket is every gradient (a live-storage trace, Mixtral wide, gloo N_d = 2: two
    5,734,912-B buffers beside the states; 2.57 MB (0.13 %) under before, Qwen3-MoE 0.15 %, DeepSeek-V3 0.085 %).

    At N_d = 1 too: ``reduce_scatter_coalesced`` neither skips a group of one nor avoids the ``cat`` of several
    tensors, and gloo copies the input all the same. With ``offload_optimizer`` gloo's copy is gone by
    ``partition_grads``, which takes each partition's norm on an fp64 copy (``_epilogue_norms``) while the ``cat``,
    whose views the partitions are, is alive. Measured (nvme17, 2026-12-02: GPT-2 one block, d = 512, vocab 1,024,
    Ψ = 3,685,888, DeepSpeed's default 5e8 bucket, gloo N_d = 1; live storages at the backward peak): the states, the
    7,371,776-B ``cat`` and gloo's 7,371,776-B copy (bf16; fp32 twice that): 10,907,780 B under before, 4 B now; with
    ``offload_optimizer`` cpu the ``cat`` and the 8,388,608-B fp64 copy of c_fc's partition."""
    s = run.settings
    if not run.param_blocks:
        return ()
    order, _, first_of_bucket, _ = _hook_layout(run.numels, s.reduce_bucket_size, run.grad_ready_order)
    last = [run.numels[i] for i in order[first_of_bucket[-1]:]]
    flat, gloo = reduce_copies(run, order[first_of_bucket[-1]:])
    held = sum(last) if not s.contiguous_gradients else sum(n for n in last if n > s.reduce_bucket_size)
    norms = _epilogue_norms(run, order, first_of_bucket[-1]) if s.offload_optimizer.on else ()
    if not (flat or gloo or held or norms):
        return ()  # nothing allocated: a subset of the last block's moment
    p, acts = _pbytes(run), run.acts
    common = (*_states(run), *all_secondaries(run), *run.wrapper.held_between_micro_steps(run),
              *_gathered(run, sched, "embedding backward"), _act("batch (token ids, targets)", acts.batch, 2),
              _act("loss", acts.loss),
              Term("the last bucket's gradients still in param.grad (all without contiguous_gradients; else those "
                   "larger than the bucket)", held * p, f"{S3} params_in_ipg_bucket; __add_grad_to_ipg_bucket "
                   "(copied only if it fits) -> partition_grads"))  # fmt: skip
    cat = "runtime/comm/coalesced_collectives.py reduce_scatter_coalesced (torch.cat)"
    out = [Moment("backward", "last bucket reduce-scattered after backward", (*common, copies_term(
        run, (flat, gloo), "the last bucket's interleaved flat copy and gloo's reduce-scatter copy",
        f"{cat} -> torch.distributed.reduce_scatter_tensor (ProcessGroupGloo: on a copy of the input)")))]  # fmt: skip
    if norms:
        out.append(Moment("backward", "last bucket's partitions normed after backward (offload_optimizer)", (
            *common, Term("the last bucket's interleaved flat copy (the partitions are its views)", flat, cat),
            *norms)))  # fmt: skip
    return tuple(out)


def _epilogue_norms(run: DSRun, order: tuple[int, ...], start: int) -> tuple[Term, ...]:
    """``offload_optimizer``: ``partition_grads`` walks the last bucket (``order[start:]``; sorted by ``ds_id``, the
    parameters' build order, where ``reduce_scatter``: stage3.py ``__reduce_and_partition_ipg_grads``) and for each
    gradient partition with real data on this rank (``offload_terms.param_norm_count``'s rule) keeps the fp64 norm
    of ``_offload_grad_partition_at_boundary -> _constant_buffered_norm2``, made on an fp64 copy of the partition
    (``part.data.to(get_norm_dtype())``; its square, 8 B, beside it). The largest moment over the bucket: its copy
    beside the norms kept before it, the earlier buckets' included. On CPU ``grad_buffer.to(device)`` is the buffer
    itself; on a GPU it is a GPU copy of the host partition (not measured: not counted).

    A swapped sub-group (``offload_optimizer`` nvme, ``_swappable_optimizer_subgroup``) keeps beside them each
    partition's fp32 copy made after its norm (``offload_fp32_gradients[i].append(grad_buffer.to(master dtype))``;
    none when the gradients are fp32: ``.to`` returns the buffer) until ``partition_grads`` ends with
    ``_swap_out_offload_fp32_gradients``, which leaves an earlier bucket's slices below the swap threshold on the
    host (``unswapped_gradients``, nvme.py ``step_terms``). Measured (overpred, 2026-12-02: Mixtral wide bf16,
    ZeRO-3 nvme, N_d = 2, the stand-in; ``ds_moe_opt_rows.py nvme3 --trace``): at the backward peak the copies of
    the 15 partitions normed before a 65,536-element one, 2,475,776 B, and its 524,288-B fp64 copy; every MoE nvme
    row's backward 129,164-132,948 B under before."""
    s, rank, nd, numels = run.settings, run.settings.rank or 0, run.nd, run.numels
    swapped = (s.offload_optimizer.device == "nvme" and s.grad_dtype != "fp32"
               and swappable(flat_shard_numel(numels, nd)))
    last = sorted(order[start:]) if s.reduce_scatter else order[start:]  # __reduce_and_partition_ipg_grads: by ds_id
    best, kept, fp32 = (0, 0, 0), 0, 0
    for k, i in enumerate((*order[:start], *last)):
        part = -(-numels[i] // nd)
        if part * rank >= numels[i]:
            continue  # partition_grads: contains_real_data false, no norm
        if k >= start and part * 8 + kept * 8 + fp32 > best[0] + best[1] * 8 + best[2]:
            best = (part * 8, kept, fp32)
        kept += 1
        if swapped:  # its fp32 copy: kept to this bucket's swap-out, then only what stays on the host
            fp32 += part * 4 if k >= start else part * 4 - gradient_swap_bytes((part,))
    if not best[0]:
        return ()
    src = f"{S3} partition_grads -> _offload_grad_partition_at_boundary -> _constant_buffered_norm2"
    return (Term("fp64 copy of a gradient partition for its norm (the largest moment of the last bucket)",
                 best[0] + 8, src, 2),
            Term(f"{PARAM_NORMS}, the gradients normed before it", best[1] * 8, f"{S3} norm_for_param_grads", best[1]),
            *((Term("fp32 copies of the gradient partitions normed before it, kept for the swap-out "
                    "(offload_fp32_gradients; an earlier bucket's unswapped_gradients)", best[2],
                    f"{S3} _offload_grad_partition_at_boundary -> _swap_out_offload_fp32_gradients"),)
              if best[2] else ()))
