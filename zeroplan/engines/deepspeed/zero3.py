"""``DeepSpeedZeroOptimizer_Stage3`` (runtime/zero/stage3.py, DeepSpeed 0.19.8): ZeRO-3.

Its schedule: every tensor partitioned (ceil(n / N_d) per rank; under ``deepspeed.zero.Init`` as each module
is built: ``zero_init_moments``); in forward and again in backward the parameter coordinator all-gathers each
module's parameters at its hook and prefetches the next ones (``coordinator.py``, over the module trace of
``trace.py``); gradients are reduce-scattered bucket by bucket into the gradient partition; the step updates
the fp32 master partition, and the persistent parameters are re-gathered."""

from __future__ import annotations

import itertools
from dataclasses import replace
from functools import lru_cache
from typing import Optional

from zeroplan.engines.deepspeed.collectives import zero3_collectives
from zeroplan.engines.deepspeed.coordinator import Stage3Schedule, stage3_schedule
from zeroplan.engines.deepspeed.estimator import zero3_estimate_bytes
from zeroplan.engines.deepspeed.moe import expert_gradients_held, routed_experts_backward
from zeroplan.engines.deepspeed.offload_terms import PARAM_NORMS
from zeroplan.engines.deepspeed.offload_wrappers import ZERO3_OFFLOAD
from zeroplan.engines.deepspeed.phases import adam_update, cast_moments
from zeroplan.engines.deepspeed.layout_ranks import _hook_layout, _last_in_blocks
from zeroplan.engines.deepspeed.hook_activations import _hook_activations, _hook_bytes, _hook_memo
from zeroplan.engines.deepspeed.run import (ZINIT, DSRun, Wrapper, _act, _blocks_saved, _fp32_buffers, _gathered,
                                           _pbytes, _schedule, _states)
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES, Settings
from zeroplan.engines.deepspeed.terms import PERSISTENT_PARAMS, zero3_partition_numel, zero3_terms
from zeroplan.engines.deepspeed.zero3_epilogue import (S3, backward_fetches, copies_term, epilogue_moments,
                                                      final_norm_hook, gathered_at_hook, reduce_copies)
from zeroplan.engines.deepspeed.zeropp import all_secondaries, hpz_schedule
from zeroplan.engines.deepspeed.zeropp_settings import hpz_group
from zeroplan.formulas.peak import Moment, Term


def zero_init_moments(run: DSRun) -> tuple[Moment, ...]:
    """The model built under ``deepspeed.zero.Init``, module by module (``run.modules``): the worst moment
    of the builds and the worst of the weight initialisation (``Module.apply``).

    Each floating-point tensor is created as asked (fp32) and converted to the config's dtype, both alive
    for a moment (``zero_wrapper_for_fp_tensor_constructor``: ``tensor.data = tensor.data.to(dtype)``).
    After a module's ``__init__`` (``partition_after`` -> ``Init._post_init_method``) each of its parameters
    gets its partition, ceil(n / N_d) elements (``_partition_param``: ``ds_tensor = torch.empty(partition
    _size)``), before its full tensor is freed (``free_param``); the broadcast before it
    (``_zero_init_param``) is in place. The model's weight initialisation through ``Module.apply``
    (``apply_with_gather``) gathers one module's parameters at a time, each into a padded
    ceil(n / N_d)·N_d buffer (``_allgather_params_sequential``: ``flat_tensor``), then re-partitions them
    into the partitions they had. Measured: docs/engines/deepspeed.md "ZeRO-3 built under zero.Init".

    A transformers model with a tied head builds its ``lm_head`` as a module of its own, last (LlamaForCausalLM
    ``__init__``: ``self.lm_head = nn.Linear(...)`` after ``self.model``), which ``post_init`` -> ``init_weights``
    initialises (``initialize_weights``) and only then ties (``tie_weights``; transformers 5.24 modeling_utils.py):
    ``named_parameters`` lists it once, so ``run.modules`` (parameter indices, read by ``block_roles.py``) has no
    such module and the build gets one more of V x h (``head_numel``). Found by the differential matrix (seed 4,
    4-7, generator 4: Llama 10.1M tied, bf16, N_d = 4: the fp32 lm_head and its bf16 copy beside every partition,
    40,678,464 B, the measurement to the byte; init -6.52 % before).

    A transformers model built by transformers under ZeRO-3 (``Settings.hf_zero3_build``: an ``HfDeepSpeedConfig``
    alive, ``from_config`` opens ``zero.Init`` with ``no_init_weights``, then runs ``initialize_weights_zero3``;
    transformers 5.24 modeling_utils.py ``_from_config``, integrations/deepspeed.py) gathers at once each module's own
    parameters and its direct children's (``run.init_gathers``; ``GatheredParameters`` -> ``_all_gather`` ->
    ``_allgather_params_coalesced``: each into its padded ceil(n / N_d)·N_d ``flat_tensor``), the largest such set rather than one
    module's: the base model's call holds the token embedding with the final norm. Found by the differential matrix
    (seed 5, generator 5, draw 3: DeepSeek-V3 14.4M untied, fp32, N_d = 2: build peak 52,029,336 B measured, 1,016 B
    over the embedding alone: the norm's 960 B, and the 56 B of fp32 buffers fp32 rows leave out, ``_sixteen_bit_hf``).
    """
    tied_head = ((run.head_numel,),) if run.tied_head and run.transformers else ()
    gathers = (*run.init_gathers, *tied_head) if run.init_gathers else None
    return _zero_init_moments((*run.modules, *tied_head), run.nd, _pbytes(run), gathers)


@lru_cache(maxsize=16)
def _zero_init_moments(modules: tuple[tuple[int, ...], ...], nd: int, p: int,
                       gathers: Optional[tuple[tuple[int, ...], ...]] = None) -> tuple[Moment, ...]:
    """``zero_init_moments`` of parameter sizes ``modules`` at N_d = ``nd``, ``p`` bytes per element, the weight
    initialisation gathering ``gathers`` at a time (None: ``modules``, ``Module.apply``) (cached: every ZeRO-3
    candidate of a plan builds the same model)."""
    # each moment's terms as numbers (a 405B model has ~900 of them), the largest kept as they come (the first of
    # equal ones, as ``max`` picks it; a speed-up, no rule: tests/test_deepspeed_coordinator_fast.py); its Moment built
    built: Optional[tuple[int, str, int, int, int, int]] = None  # (total, kind, before, done, n / i, ...)
    before = 0
    for params in modules:
        done = 0  # this module's parameters created so far (full, in the config's dtype)
        for n in params:
            copy = n * p if p != 4 else 0
            if built is None or before + done + n * 4 + copy > built[0]:
                built = (before + done + n * 4 + copy, "created", before, done, n, copy)
            done += n * p
        parted, left = 0, sum(params)  # partitioned before it, not yet freed (elements)
        for n in params:
            part = -(-n // nd)  # partition_parameters.py _partition_numel
            if built is None or before + (parted + left + part) * p > built[0]:
                built = (before + (parted + left + part) * p, "partitioned", before, parted * p, left * p, part * p)
            parted += part
            left -= n
        before += parted * p
    applied = [before + sum([-(-n // nd) * nd for n in params]) * p
               for params in (modules if gathers is None else gathers)]  # fmt: skip
    out = [] if built is None else [_zero_init_built(*built[1:])]
    if applied:
        total = max(applied)
        how = ("for Module.apply", f"{ZINIT} apply_with_gather -> _allgather_params_sequential (flat_tensor)") \
            if gathers is None else ("with its direct children's for initialize_weights_zero3",
                                     f"transformers integrations/deepspeed.py initialize_weights_zero3 -> {ZINIT} "
                                     "GatheredParameters -> _allgather_params_coalesced (flat_tensor)")
        out.append(Moment("init", f"zero.Init: a module's parameters gathered {how[0]}", (
            Term("partitions of the whole model", before, f"{ZINIT} _partition_param (ds_tensor)"),
            Term("this module's parameters gathered (padded)", total - before, how[1]))))  # fmt: skip
    return tuple(out)


def _zero_init_built(kind: str, before: int, a: int, b: int, c: int) -> Moment:
    """A moment of a module's build under ``zero.Init``: a parameter ``created`` (``a``: the module's earlier
    parameters in bytes, ``b``: its elements, ``c``: its copy's bytes) or ``partitioned`` (``a``: the module's
    partitions so far, ``b``: its parameters not yet freed, ``c``: the new partition, in bytes)."""
    if kind == "created":
        return Moment("init", "zero.Init: a parameter created, then converted", (
            Term("partitions of the modules built before", before, f"{ZINIT} _partition_param (ds_tensor)"),
            Term("this module's parameters created before it", a, f"{ZINIT} zero_wrapper_for_fp_tensor_constructor"),
            Term("the parameter as created (fp32)", b * 4, f"{ZINIT} zero_wrapper_for_fp_tensor_constructor (fn(*args))"),
            Term("its copy in the config's dtype", c,
                 f"{ZINIT} zero_wrapper_for_fp_tensor_constructor (tensor.data.to(target_fp_dtype))")))  # fmt: skip
    return Moment("init", "zero.Init: a module's parameter partitioned", (
        Term("partitions of the modules built before", before, f"{ZINIT} _partition_param (ds_tensor)"),
        Term("this module's parameters partitioned before it", a, f"{ZINIT} _partition_param (ds_tensor)"),
        Term("this module's parameters not yet freed", b, f"{ZINIT} free_param (after the copy)"),
        Term("the parameter's new partition", c,
             f"{ZINIT} Init._post_init_method -> _zero_init_param -> _partition_param (ds_tensor)")))  # fmt: skip


class ZeroOptimizerStage3(Wrapper):
    name = "DeepSpeedZeroOptimizer_Stage3"
    terms = staticmethod(zero3_terms)
    collectives = staticmethod(zero3_collectives)
    offload = ZERO3_OFFLOAD
    ds_estimate = staticmethod(zero3_estimate_bytes)
    wraps_module_inputs = True

    def partition_numel(self, s: Settings, numels: tuple[int, ...], nd: int) -> int:
        return zero3_partition_numel(numels, nd)

    def schedule(self, run: DSRun) -> Optional[Stage3Schedule]:
        """The coordinator replayed over the run's module trace (``stage3_schedule``; None without one)."""
        s = run.settings
        if run.trace is None:
            return None
        hpz = hpz_group(s.hpz_partition_size, run.nd)
        if hpz:  # zeropp.py: the secondary partitions; a later micro-step starts with them (G > 1)
            return hpz_schedule(run.trace, run.numels, run.nd, hpz, s.param_persistence_threshold,
                                s.prefetch_bucket_size, s.max_live_parameters, s.max_reuse_distance,
                                warm=run.grad_accum > 1)  # fmt: skip
        return stage3_schedule(run.trace, run.numels, run.nd, s.param_persistence_threshold, s.prefetch_bucket_size,
                               s.max_live_parameters, s.max_reuse_distance)  # fmt: skip

    def init_moments(self, run: DSRun) -> tuple[Moment, ...]:
        """The model built under ``zero.Init`` or cast, the fp32 master converted and cloned, the built model
        partitioned (not under ``zero.Init``), every parameter gathered once."""
        s, numels = run.settings, run.numels
        p, psi = _pbytes(run), sum(numels)
        out = [*(zero_init_moments(run) if s.builds_partitioned else ()), *cast_moments(run)]
        st = _states(run, after_step=False)
        if s.dtype != "fp32":  # the 16-bit partition converted to fp32, then cloned: both alive for a moment
            part = zero3_partition_numel(numels, run.nd)
            src = "runtime/zero/stage3.py _create_fp32_partitions (converted = lp.to(fp32); converted.clone())"
            out.append(Moment("init", "fp32 master: converted and cloned", (
                *(t for t in st if t.name in ("16-bit parameter partition", "inf/nan tracker")), *_fp32_buffers(run),
                *all_secondaries(run),
                Term("16-bit partition converted to fp32", part * 4, src),
                Term("fp32 master partition (the clone)", part * 4, src))))  # fmt: skip
        # the built model is partitioned tensor by tensor: the first one's partition is allocated while the
        # whole model is still alive (measured: Llama, N_d = 4, 195,984 B = Ψ·4 + ceil(4,944 / 4)·4); under
        # zero.Init it was partitioned as built (zero_init_moments): _convert_to_zero_parameters skips it
        psrc = "runtime/zero/partition_parameters.py _convert_to_zero_parameters -> _zero_init_param -> _partition_param"
        if not s.builds_partitioned:
            out.append(Moment("init", "the built model partitioned, first tensor", (
                Term("model parameters as built (model dtype)", psi * p, "runtime/engine.py _configure_distributed_model"),
                Term("first parameter's partition", -(-numels[0] // run.nd) * p,
                     f"{psrc} (ds_tensor allocated before param.data is freed)"))))  # fmt: skip
        out.append(Moment("init", "partitioned parameters gathered once", (*st, *all_secondaries(run), Term(
            "largest parameter gathered", max(numels) * p,
            "runtime/zero/partition_parameters.py _allgather_params_sequential")) ))  # fmt: skip
        return tuple(out)

    def buckets_at_hooks(self, run: DSRun) -> bool:
        """With ``contiguous_gradients`` each gradient that fits is copied into the bucket at its hook and
        autograd's tensor repointed there (stage3.py ``__add_grad_to_ipg_bucket``: ``param.grad.data =
        new_grad_tensor``), every micro-step."""
        return run.settings.contiguous_gradients

    def backward_after_last_block(self, run: DSRun, last: tuple[Term, ...],
                                  inflight: tuple[Term, ...]) -> tuple[Moment, ...]:
        """Each gradient moves into the bucket at its hook: nothing piles up after the last block, except a
        head tied to the token embedding, whose gradient waits in autograd's input buffer until the embedding's
        backward, the last op: there the embedding weight is gathered again and its gradient, the head's and
        their sum are alive together (torch autograd InputBuffer::accumulate, then the hook on the sum; as
        ZeRO-2's ``zero12.py _tied_embedding_backward``). Found by the differential matrix (seed 1 draw 7:
        GPT-2 8.6M tied, ZeRO-3, N_d = 3: -10.3% on every rank before)."""
        sched = _schedule(run)
        pending = _root_gradients_pending(run)
        if pending:
            last = (*last, Term("head and final norm gradients pending in the bucket (param.grad)", pending * _pbytes(run),
                                f"{S3} reduce_independent_p_g_buckets_and_remove_grads (contiguous_gradients off: "
                                "params_in_ipg_bucket, param.grad kept until __reduce_and_partition_ipg_grads)"))  # fmt: skip
        split = routed_experts_backward(run, sched, last)  # moe.py: DeepSeek's shared experts done by then
        sent = _in_block_reductions(run, last, inflight)  # the final norm's hook runs before the last block (the trace)
        out = [*(m for m in sent if m.name.startswith("final norm")),
               *(split or (Moment("backward", "last block backward", last),)),
               *(m for m in sent if not m.name.startswith("final norm"))]
        out += expert_gradients_held(run, sched)  # moe.py: a routed expert's gradient larger than the bucket
        if run.tied_head and sched is not None and "embedding backward" in dict((m, f) for m, f, _ in run.trace.marks):
            acts = run.acts
            out.append(Moment("backward", "tied embedding backward", (
                *_states(run), *_gathered(run, sched, "embedding backward"), _act("batch (token ids, targets)", acts.batch, 2),
                _act("loss", acts.loss),
                Term("tied embedding gradients (the head's, the embedding's, their sum)", 3 * run.head_numel * _pbytes(run),
                     "torch autograd InputBuffer::accumulate -> AccumulateGrad; runtime/zero/stage3.py "
                     "reduce_partition_and_remove_grads (the hook fires on the sum)", 3))))  # fmt: skip
        out += epilogue_moments(run, sched)
        return tuple(out)

    def optimizer_moments(self, run: DSRun, part: int, inner: str, temps: int) -> tuple[Moment, ...]:
        """A copy of the 16-bit gradient partition, then its fp32 conversion (none in fp32); the update. Both
        with what ``step`` holds (``_step_terms``)."""
        s = run.settings
        out = []
        if s.grad_dtype != "fp32":
            src = "runtime/zero/stage3.py _prepare_fp32_grad_for_sub_group (gradient partition copied, then .to(fp32))"
            out.append(Moment("optimizer_step", "prepare the fp32 gradient", (*_states(run),
                       Term("gradient partition copy (gradient dtype)", part * DTYPE_BYTES[s.grad_dtype], src),
                       Term("fp32 gradient of the master partition", part * 4, src))))  # fmt: skip
        return tuple(Moment(m.phase, m.name, _step_terms(run, m.terms)) for m in (*out, adam_update(run, part, inner, temps)))


def _root_gradients_pending(run: DSRun) -> int:
    """Elements of the LM head's and the final norm's gradients still in ``param.grad`` at the last block's
    backward without ``contiguous_gradients``: stage3.py ``reduce_independent_p_g_buckets_and_remove_grads`` then
    only lists a gradient in the bucket (``params_in_ipg_bucket``), which keeps autograd's tensor until the bucket
    is reduced, when the next gradient would overflow it (``elements_in_ipg_bucket + param.ds_numel >
    reduce_bucket_size``). Walked in hook order: the head (not tied: a tied head's waits in autograd's input buffer,
    ``kept_root``), the final norm, then the last block's output projection, whose hook may send them (its own
    gradient is the working set's). Measured (live-storage trace at the backward peak, a Llama of vocabulary 32,
    ZeRO-3, 20,000-element buckets, ``contiguous_gradients: false``, gloo N_d = 2): the head's 6,144 B and the
    norm's 192 B beside down_proj's gradient at the SwiGLU product's backward; 6,344 B under before, both ranks."""
    s, L = run.settings, run.acts.n_layer
    if s.contiguous_gradients or not run.param_blocks:
        return 0
    roots = ([] if run.tied_head else [run.head_numel]) + [run.final_norm_numel]
    outputs = [run.numels[i] for i in run.output_projections if run.param_blocks[i] == L - 1]
    elements, pending = 0, []
    for k, n in enumerate([*roots, *outputs]):
        if elements + n > s.reduce_bucket_size and elements > 0:
            elements, pending = 0, []
        elements += n
        pending.append((k < len(roots)) * n)
    return sum(pending)


def _in_block_reductions(run: DSRun, last: tuple[Term, ...], inflight: tuple[Term, ...]) -> tuple[Moment, ...]:
    """A bucket reduced at a gradient hook inside block j (stage3.py ``reduce_independent_p_g_buckets_and_remove_grads``:
    the first gradient that does not fit sends the bucket, ``__reduce_and_partition_ipg_grads``; the buckets as
    ZeRO-1/2's, ``reduce.py _hook_layout``, in gradient-ready order), at a hook whose block activations are
    known (``reduce.py _hook_activations``: GPT's MLP input projection and LN2, Llama's MLP input projections,
    post-attention norm and o_proj). Alive there: the blocks before j saved, block j's saved tensors not yet
    released and the gradients in flight, the hooked module's weight gradients, and the bucket's gradients
    larger than it: ``__add_grad_to_ipg_bucket`` copies a gradient into the bucket only if it fits, so a larger
    one stays autograd's until ``partition_grads`` sets ``param.grad = None``. With ``offload_optimizer``,
    ``partition_grads -> _offload_grad_partition_at_boundary`` takes each partition's norm on an fp64 copy
    (``_constant_buffered_norm2``: ``part.to(get_norm_dtype())``, one parameter at a time; its norm, 8 B, is
    kept beside the earlier ones, ``offload_terms.param_norm_count``). One moment per block, the largest; the
    gathered parameters are the last block's (``last``). Measured (dsres, 2026-12-02: gpt-tiny bf16, ZeRO-3,
    ``offload_optimizer`` cpu, 5,000-element buckets, N_d = 1; MemTracker's live tensors by category at the
    entry of ``_constant_buffered_norm2``): the backward peak is at the last block's c_fc bias hook, which sends
    c_proj's 5,184-element weight gradient (not in the bucket) and takes its norm on a 41,472-B fp64 copy; the
    live tensors there are this moment's terms to 32 B (-1.17% before, 8 B under now). On gloo every bucket sent
    is a moment, with its flattened copy and gloo's copy of it and the parameters gathered at the hook's module
    (``_gathered_at_hook``): the differential matrix's 1-24 (Qwen3-MoE 5.9M tied, N_d = 4, 1,467,296-element
    buckets; rank 0's live storages) peaks at block 2's q_proj hook with 2 x 5,847,040 B of copies beside the
    head's gradient waiting for the tied sum: -5.71 % before, +0.65 % now. The copies are ``zero3_epilogue.py
    bucket_copies``' (gloo's of a single tensor too), at N_d = 1 as well (nvme17: GPT-2 d = 512, 1e6-element
    buckets, N_d = 1, block 0's c_fc hook sending the MLP c_proj's 1,048,576-element gradient: gloo's 2,097,152-B
    copy, 2,097,160 B under before, 8 B now); with ``offload_optimizer`` gloo's copy is freed before
    ``partition_grads`` takes the norms, so the moment holds the larger of it and the fp64 copy (as the last
    bucket's, traced). A bucket sent at a final-norm parameter's hook (after every block's parameters) is the same
    moment with every block's activations saved and what is left of the final norm (``zero3_epilogue.py
    final_norm_hook``: the untied head's gradient larger than the bucket; differential seed 5 draw 6, -4.58 %
    before)."""
    if not run.param_blocks or not run.acts.block.mlp_saved:
        return ()
    base = tuple(t for t in last if t not in inflight and t.name not in ("block backward working set",
                                                                         "incoming activation gradient"))  # fmt: skip
    if run.settings.device == "cpu":  # gloo: a bucket's moment holds the parameters gathered at its hook, of ``base``
        return tuple(Moment("backward", name, terms) for name, terms in _reduction_terms(run, base))
    # less hpZ too: on a GPU no term reads the schedule (a speed-up, no rule: the hpZ rows of a bucket size share it)
    tails = _gpu_terms(replace(run, settings=run.settings.model_copy(update={"prefetch_bucket_size": 0,
                                                                             "hpz_partition_size": 1})), run.spec)
    return tuple(Moment("backward", name, (*base, *tail)) for name, tail in tails)


@lru_cache(maxsize=8)  # on a GPU ``base`` adds to every bucket alike: once per run less its prefetch (a speed-up, no rule)
def _gpu_terms(run: DSRun, spec: object) -> tuple[tuple[str, tuple[Term, ...]], ...]:  # noqa: ARG001 (key only)
    return _reduction_terms(run, ())


def _reduction_terms(run: DSRun, base: tuple[Term, ...]) -> tuple[tuple[str, tuple[Term, ...]], ...]:
    """``_in_block_reductions``' moments (name, terms) beside ``base``."""
    s, p = run.settings, _pbytes(run)
    order, buckets, first_of_bucket, bucket_of = _hook_layout(run.numels, s.reduce_bucket_size, run.grad_ready_order)
    offload = s.offload_optimizer.on
    numels, limit, rank = run.numels, s.reduce_bucket_size, s.rank or 0
    # per position in ``order``: the large gradients' elements before it, and the gradients before it whose
    # partition on this rank is not empty (its norm kept): each bucket's sums from two lookups, not a pass
    sizes = list(map(numels.__getitem__, order))  # lists, not generators, summed (a speed-up, no rule)
    large_before = (0, *itertools.accumulate([n if n > limit else 0 for n in sizes]))
    normed_before = (0, *itertools.accumulate([int(-(-n // run.nd) * rank < n) for n in sizes])) if offload else ()
    # each bucket's bytes as integers (the terms' sum: the same bucket wins), the terms built for the winners only
    base_bytes, memo, saved, saved_bytes = sum(t.bytes for t in base), _hook_memo(run), {}, {}
    best: dict[int, tuple[int, int]] = {}  # block -> (bytes, bucket) of its largest
    blocks, copies, fetched = run.param_blocks, {}, backward_fetches(run) if s.device == "cpu" else {}
    L, roots = run.acts.n_layer, _last_in_blocks(run)  # a hook after the blocks' parameters: a final norm's
    gloo_copies = s.device == "cpu" and (bool(fetched) or run.nd == 1)  # at N_d > 1 with the hooks' gathers known
    nothing = (0, 0, 0, False)  # no copy and no norm: on a GPU without offload, every bucket's
    for b in range(len(buckets) - 1):  # the last bucket is sent after backward (independent_gradient_partition_epilogue)
        start, end = first_of_bucket[b], first_of_bucket[b + 1]
        large = large_before[end] - large_before[start]
        if gloo_copies or offload:
            # on gloo every bucket sent: flattened (one tensor: a view) and gloo's copy of it (1-24; on a GPU not
            # measured); with offload gloo's copy is freed before partition_grads takes the norms on their fp64
            # copies: the larger
            flat, gloo = reduce_copies(run, order[start:end]) if gloo_copies else (0, 0)  # bytes
            norm = -(-max(sizes[start:end]) // run.nd) * 8 + 8 if offload else 0  # max(ceil) = ceil(max)
            keep_gloo = gloo > norm
            copies[b] = (flat, gloo * keep_gloo, norm * (not keep_gloo), bool(flat or gloo))
            held = flat + gloo * keep_gloo + norm * (not keep_gloo)  # the bucket's copies (bytes)
        else:
            flat = gloo = held = 0
            copies[b] = nothing
        if not (large or offload or flat or gloo):
            continue
        hook = order[end]
        # L: the final norm's hook (final_norm_hook), every block saved; measured on gloo, with the hook's gathers
        j = L if hook > roots and gloo_copies else blocks[hook]
        at_hook = _hook_bytes(run, j, hook, memo) if 0 <= j < L else _final_norm_bytes(run, hook) if j == L else None
        if at_hook is None:
            continue
        if j not in saved:
            saved[j] = _blocks_saved(run, j)
            saved_bytes[j] = saved[j].bytes
        total = base_bytes + saved_bytes[j] + at_hook + large * p + held
        if flat or gloo:
            total += sum(t.bytes for t in gathered_at_hook(base, fetched.get(order[end]), run, "")) - base_bytes
        if offload:
            total += normed_before[start] * 8
        if j not in best or total > best[j][0]:
            best[j] = (total, b)
    out = []
    for j, (_, b) in best.items():
        start, end = first_of_bucket[b], first_of_bucket[b + 1]
        where, acts, module = (final_norm_hook(run, order[end]) if j == L else
                               _hook_activations(run, j, order[end], memo))  # type: ignore[misc]
        at = f"{where} backward" if j == L else f"block {j} {where} backward"
        flat, gloo, norm, copied = copies[b]
        terms = (*(gathered_at_hook(base, fetched.get(order[end]), run, at) if copied else base), saved[j], *acts,
                 Term(f"{where}'s weight gradients", sum(run.numels[i] for i in module) * p,
                      "autograd (one node makes every input's gradient)", len(module)),
                 Term("gradients larger than the bucket, in the bucket sent", (large_before[end] - large_before[start]) * p,
                      f"{S3} __add_grad_to_ipg_bucket (copied only if it fits) -> partition_grads (param.grad = None)"),
                 copies_term(run, (flat, gloo), "the bucket's flattened copy and gloo's copy of it",
                             f"{S3} __avg_scatter_grads -> zero3_epilogue.py bucket_copies"))
        if offload:
            norms = normed_before[start]
            terms += (Term("fp64 copy of a gradient partition for its norm (the largest of the bucket)", norm,
                           f"{S3} partition_grads -> _offload_grad_partition_at_boundary -> _constant_buffered_norm2", 2),
                      Term(f"{PARAM_NORMS}, the buckets sent before", norms * 8, f"{S3} norm_for_param_grads", norms))  # fmt: skip
        out.append((f"{at}, a bucket sent", terms))
    return tuple(out)


def _final_norm_bytes(run: DSRun, hook: int) -> int:
    """The bytes of ``final_norm_hook``'s terms and of its parameters' gradients (``_hook_bytes``' for the final norm)."""
    _, acts, module = final_norm_hook(run, hook)
    return sum(t.bytes for t in acts) + sum(run.numels[i] for i in module) * _pbytes(run)


def _step_terms(run: DSRun, terms: tuple[Term, ...]) -> tuple[Term, ...]:
    """ZeRO-3's ``step`` (stage3.py) first partitions every parameter, the persistent ones too
    (``_partition_all_parameters``; ``_post_step`` gathers them again), so they are not alive at the update;
    while it runs, the global norm's fp64 temporaries (``_get_norm_groups``' list, ``combine_grad_norm_groups``'
    result, then ``_global_grad_norm``: three 8-B tensors beside the one kept) and the micro-batch the training
    loop still holds (the validator's, as a user's loop, drops it after ``engine.step()``). Measured (MemTracker
    at the step's peak, gpt-tiny ZeRO-3 fp32 at N_d = 2: two 256-B and four 8-B tensors beside the partitions):
    every recorded gpt-tiny ZeRO-3 row's step was over by the persistent parameters less 536 B = 512 + 24;
    the differential matrix's seed 1 draw 18 (Qwen2 8.9M, persistence threshold 1e5) by 4.57%."""
    return (*(t for t in terms if t.name != PERSISTENT_PARAMS), *all_secondaries(run),
            _act("batch (token ids, targets)", run.acts.batch, 2),
            Term("global-norm temporaries (fp64)", 3 * DTYPE_BYTES["fp64"],
                 "runtime/zero/stage3.py step (_get_norm_groups, combine_grad_norm_groups, _global_grad_norm)", 3))


ZERO3_OPTIMIZER = ZeroOptimizerStage3()
