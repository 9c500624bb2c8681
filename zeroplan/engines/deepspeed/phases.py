"""The moments of a DeepSpeed training step that every optimizer wrapper shares: the model's 16-bit cast,
the forward (blocks, LM head, loss), the start of backward (loss, LM head, last block) and the inner Adam's
update; each wrapper (``zero12.py``, ``bf16.py``, ``zero3.py``) adds its own moments through
``DSRun.wrapper``, so no function here asks which wrapper or stage runs."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from zeroplan.engines.deepspeed.moe import mark_names, sparse_blocks, sparse_forward_moments
from zeroplan.engines.deepspeed.offload import offload_moments
from zeroplan.engines.deepspeed.offload_terms import adam_step_fp32_temporaries, on_device
from zeroplan.engines.deepspeed.run import DSRun, _act, _blocks_saved, _gathered, _pbytes, _schedule, _states
from zeroplan.engines.deepspeed.settings import inner_optimizer_class
from zeroplan.engines.deepspeed.terms import aligned_flat_numel
from zeroplan.formulas.peak import Moment, Term, rounded_total


def cast_moments(run: DSRun) -> tuple[Moment, ...]:
    """The model's 16-bit cast in ``deepspeed.initialize``, tensor by tensor (none in fp32, none when
    ``deepspeed.zero.Init`` built it in the config's dtype), and before it a tied transformers model's build
    (``tied_build``)."""
    s, numels = run.settings, run.numels
    p, psi = _pbytes(run), sum(numels)
    if s.builds_partitioned:  # zero.Init: its build is zero3.py zero_init_moments, in the config's dtype
        return ()
    build = tied_build(run)
    # engine.py _configure_distributed_model -> _cast_module_mixed_precision: zero.Init built the model in the
    # config's dtype already (is_zero_init_model: no cast), else p.data.to(dtype), tensor by tensor
    if s.dtype == "fp32":
        return build
    # nn.Module._apply converts one parameter at a time: the fp32 ones not yet converted plus the 16-bit ones
    done, worst = 0, 0
    for n in numels:
        worst = max(worst, (psi - done) * 4 + (done + n) * p)
        done += n
    return (*build, Moment("init", "16-bit cast of the model", (
        Term("fp32 model as built and its 16-bit copies so far", worst,
             "runtime/engine.py _configure_distributed_model (module.to(dtype)) -> torch nn.Module._apply"),)))  # fmt: skip


def tied_build(run: DSRun) -> tuple[Moment, ...]:
    """A tied transformers model built whole (not under ``zero.Init``), in fp32: its ``lm_head`` is a module of its
    own with a V x h weight (``nn.Linear``, made after ``self.model``), beside every other parameter, until
    ``post_init`` -> ``tie_weights`` points it at the token embedding's (transformers 5.24 modeling_utils.py; zero.Init's
    build of it: ``zero3.py zero_init_moments``). Init's peak where the cast and the optimizer's partitions hold less
    (bf16 ZeRO-3). Found by the differential matrix (seed 6 draw 9, generator 4: Qwen2 6.0M tied, ZeRO-3 bf16, N_d = 3:
    init -16.20 % on every rank; the live storages at init's peak, benchmarks/differential_trace.py: the whole fp32
    model and two 11,530,752-B (15014, 192) weights, ``Embedding`` and ``Linear``, 35,582,336 B = the measurement).
    On the CPU accelerator only: transformers builds on torch's default device, the host, and on a GPU run
    ``deepspeed.initialize`` moves the tied model (``module.to(device)``): the build is host memory there (the
    validator's CUDA runner builds so too)."""
    if not (run.tied_head and run.transformers and run.spec is not None and run.settings.device == "cpu"):
        return ()
    return (Moment("init", "transformers' build, the tied head before tie_weights", (
        Term("fp32 model as built", sum(run.numels) * 4, "transformers PreTrainedModel._from_config (torch's default dtype)"),
        Term("lm_head's own weight, before post_init ties it", run.head_numel * 4,
             "transformers modeling_utils.py post_init -> tie_weights"))),)  # fmt: skip


def flatten_moment(run: DSRun) -> Moment:
    """ZeRO-1/2 and BF16_Optimizer: the 16-bit group copied into one padded flat buffer (the model's tensors
    are repointed into it afterwards)."""
    p, psi, flat = _pbytes(run), sum(run.numels), aligned_flat_numel(run.numels, run.nd)
    src = "runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.__init__"
    return Moment("init", "flatten the 16-bit group", (
        Term("model parameters (before repointing into the flat buffer)", psi * p, "runtime/engine.py _configure_distributed_model"),
        Term("alignment padding", (flat - psi) * p, f"{src} (flatten_dense_tensors_aligned)"),
        Term("16-bit flat parameters", flat * p, f"{src} (bit16_groups_flat)")))  # fmt: skip


def init_moments(run: DSRun) -> tuple[Moment, ...]:
    """``deepspeed.initialize``: the 16-bit cast, the flat copy (ZeRO-1/2), the optimizer's partitions; the
    model's build under ``deepspeed.zero.Init`` (``zero_init_moments``) when the settings say so."""
    return run.wrapper.init_moments(run)


def forward_moments(run: DSRun) -> tuple[Moment, ...]:
    """Each block, the LM head and the loss (validate/transformer.py CausalLM.forward, loss), on top of the
    model states after a step (the peak of a phase is the largest over steps).

    A block's moment, with the blocks before it saved: its output (after its MLP output projection, the block's
    last module, is fetched) or, checkpointed, its MLP's no-grad peak (after the input projection is fetched,
    before the output projection: activation_terms.py, the MLP's term of the working set). At ZeRO-3 what is
    gathered then is read off the replayed coordinator at that fetch (``stage3_schedule``; the trace's marks
    ``block j output projection`` / ``block j MLP input``), the open coalesced buffers apart; below stage 3
    only the last block's moment can be the largest. Without checkpointing a block also peaks while its output
    projection is fetched: its saved activations are all made (the projection's input is the last), its
    output and the projection's not yet, and a coalesced buffer whose last parameter is that projection's is
    still open until the fetch's wait."""
    acts, L, sched = run.acts, run.acts.n_layer, _schedule(run)
    base = (*_states(run), *run.wrapper.held_between_micro_steps(run),
            _act("batch (token ids, targets)", acts.batch, 2), _act("embedding saved (position ids)", acts.embed_saved))  # fmt: skip
    # the coordinator's moment per block where it replays a trace with per-block marks (ZeRO-3)
    staged = sched is not None and f"block {L - 1} output projection" in mark_names(run)
    # the sparse layers' own moments (moe.py), and the dense ones' of a mixed model (DeepSeek's first layers)
    sparse = sparse_blocks(run) if sched is not None else ()
    dense = staged or (sparse and any(m.endswith("output projection") for m, _, _ in run.trace.marks))

    def block(j: int) -> tuple[Moment, ...]:
        name = "last block" if j == L - 1 else f"block {j}"
        blk = acts.layer_blocks[j] if sparse and acts.layer_blocks else acts.block  # a mixed model's dense layer
        if run.checkpointing != "none":
            held = (_blocks_saved(run, j), _act("checkpointed block's working set (no grad)", blk.ckpt_forward_peak))
            return (Moment("forward", name, (*base, *_gathered(run, sched, f"block {j} MLP input" if dense
                                                                else "last block forward"), *held)),)  # fmt: skip
        done = (_blocks_saved(run, j + 1), _act("block output and last op's output", blk.forward_extra, 2))
        if not dense:
            return (Moment("forward", name, (*base, *_gathered(run, sched, "last block forward"), *done)),)
        mark = f"block {j} output projection"
        before = (_blocks_saved(run, j + 1), _act("block input and residual (not saved)", blk.forward_before_output))
        # the projection's post-forward hook (parameter_offload.py -> release_sub_module) runs as it returns, before
        # the block adds its residual: the block output is made after its weight's release (measured: gpt-tiny r0)
        ran = (*before, _act("output projection's output", acts.embed_out))
        return (Moment("forward", f"{name}, output projection fetched", (*base, *_gathered(run, sched, mark, during=True), *before)),
                Moment("forward", f"{name}, output projection run", (*base, *_gathered(run, sched, mark), *ran)),
                Moment("forward", name, (*base, *_gathered(run, sched, f"{mark} released"), *done)))  # fmt: skip

    head = (_blocks_saved(run, L), _act("final norm saved and output", acts.final_saved), _act("logits", acts.logits))
    # CausalLM.loss: ``logits = self(tokens).float()``: nothing saves the model-dtype logits, so the fp32 copy
    # replaces them (in fp32 ``.float()`` returns the same tensor)
    # transformers' forward keeps its model-dtype logits while ForCausalLMLoss upcasts a copy (``logits =
    # logits.float()`` in loss/loss_utils.py; the caller's ``logits`` is returned in the output): both alive at
    # 16 bits. Found by the differential matrix (seed 3 draw 4, generator 4: Llama 5.5M bf16, ZeRO-2, N_d = 2:
    # forward -4.38% on both ranks before, N·V·2 B short)
    kept = (_act("model-dtype logits (transformers' forward holds them)", acts.logits),) if (
        run.transformers and acts.logits != acts.logits_fp32) else ()
    loss = (_blocks_saved(run, L), _act("final norm saved and output", acts.final_saved), *kept,
            _act("fp32 logits (loss upcast)", acts.logits_fp32),
            _act("log-softmax (fp32, saved by cross-entropy)", acts.log_softmax), _act("loss", acts.loss))  # fmt: skip
    # the head a module of its own (transformers' lm_head; stage3_trace ``head_module``): while its fetch runs, a
    # coalesced buffer whose last parameter is the head's is still open (measured: tiny-llama, DeepSpeed's
    # default prefetch, the root's one call held to lm_head's fetch, +12,544 B over the last block's moment)
    fetched = () if sched is None or "LM head fetch" not in mark_names(run) else (
        Moment("forward", "LM head, its weight fetched", (*base, *_gathered(run, sched, "LM head fetch", during=True),
               _blocks_saved(run, L), _act("final norm saved and output", acts.final_saved))),)  # fmt: skip
    # the root's release, the logits made: under hpZ each weight it frees gets its secondary partition first
    # (zeropp.py HpzCoordinator.free; measured: gpt-tiny r0 at H = 2 and 4, the tied head's +7,272 / +3,636 B)
    released = () if sched is None else (
        Moment("forward", "LM head, the root's release", (*base, *_gathered(run, sched, "forward end", during=True), *head)),)
    return (
        *(sparse_forward_moments(run, sched, base) if sparse else ()),
        *(m for j in (range(L) if staged or sparse else (L - 1,)) if j not in sparse for m in block(j)),
        *fetched,
        Moment("forward", "LM head", (*base, *_gathered(run, sched, "LM head forward"), *head)),
        *released,
        Moment("forward", "cross-entropy", (*base, *_gathered(run, sched, "forward end"), *loss)),
    )


def backward_moments(run: DSRun) -> tuple[Moment, ...]:
    """Loss backward, the LM head's, the last block's (with the bucket from the first hook on), then what the
    wrapper adds (``Wrapper.backward_after_last_block``): each earlier block's first op with what a rank still
    holds from the later blocks, and the reduction after backward where the wrapper reduces there."""
    acts, blk, L, p = run.acts, run.acts.block, run.acts.n_layer, _pbytes(run)
    n_d, sched = acts.embed_out, _schedule(run)
    base = (*_states(run), *run.wrapper.held_between_micro_steps(run),
            _act("batch (token ids, targets)", acts.batch, 2),
            _act("embedding saved (position ids)", acts.embed_saved), _act("loss", acts.loss))  # fmt: skip
    saved_all = (_blocks_saved(run, L), _act("final norm saved and output", acts.final_saved))
    out = [
        Moment("backward", "cross-entropy backward", (*base, *_gathered(run, sched, "forward end"), *saved_all,
               _act("log-softmax (fp32, saved by cross-entropy)", acts.log_softmax),
               _act("nll and log-softmax gradients (fp32)", 2 * acts.log_softmax, 2))),
        Moment("backward", "LM head backward", (*base, *_gathered(run, sched, "LM head backward"), *saved_all,
               _act("logits gradient", acts.logits),
               _act("final norm output gradient", n_d),
               Term("head weight gradient", run.head_numel * p, "autograd (mm backward)"))),
    ]  # fmt: skip
    # a wrapper that reduces after backward keeps every gradient autograd makes until then (its
    # ``keeps_gradients``); a tied head's gradient waits in autograd's input buffer whatever the wrapper
    keeps = run.wrapper.keeps_gradients(run)
    held = run.head_numel * (run.tied_head or keeps) + run.final_norm_numel * keeps
    kept_root = Term("root gradients held (head weight, final norm)", held * p,
                     "autograd InputBuffer (tied weight); torch autograd param.grad (ZeRO-1)")  # fmt: skip
    inflight = (_blocks_saved(run, L),)
    if run.checkpointing != "none":
        inflight += (_act("recomputed block's saved activations", blk.recomputed),)
    # the output projection's weight gradient beside the later activation gradients, unless its hook has moved it
    # into the bucket by then (measured: tiny-llama ZeRO-2, N_d = 2, rank 1: at the SwiGLU product's backward
    # only d(product) and its two outputs, down_proj's 16,896 B weight gradient in the bucket; +1.66% before)
    moved = run.wrapper.buckets_at_hooks(run) and all(run.numels[i] <= run.settings.reduce_bucket_size
                                                      for i in run.output_projections)  # fmt: skip
    ws = max(blk.backward_first_op, blk.backward_act_grads + (0 if moved else blk.first_weight_grads))
    last = (*base, *_gathered(run, sched, "last block backward"), *inflight, _act("incoming activation gradient", n_d),
            kept_root, _act("block backward working set", ws), *run.wrapper.last_block_bucket(run))  # fmt: skip
    return (*out, *run.wrapper.backward_after_last_block(run, last, inflight))


def final_norm_backward(run: DSRun, last: tuple[Term, ...], inflight: tuple[Term, ...]) -> tuple[Moment, ...]:
    """The final RMSNorm's backward after its weight's gradient hook, at pow's backward: every block's
    activations saved, the bucket the head's hook allocated alive (``last``'s, from the first hook on), and what
    is left of the norm: its fp32 input and rsqrt (``BlockActivations.pending_at_last_grad`` less d(normalised))
    and five fp32 N·d temporaries less the released rsqrt: RMSNorm's backward working set (``norm_backward_ws``)
    with its two 16-bit N·d (a block norm's summed output gradient and its product with the weight) replaced by
    one fp32 N·d: the head's output gradient and its product with the weight are released by pow's backward, and
    below fp32 the cast's backward (``hidden_states.to(input_dtype)``) makes the chain's first fp32 gradient
    (in fp32 that is the weight product's). Measured (live storages at rank 1's peak, benchmarks/
    ds_head_bucket_rows.py trace llama 2 bf16: five fp32 (64, 48) backward temporaries, no 16-bit one, beside the
    five norms' fp32 inputs): tiny-llama bf16, 4,500-element buckets, ZeRO-1 and 2, N_d 2 and 3, the rank owning
    the head 5,672 B (0.77-0.90 %) under with one 16-bit N·d for the fp32 one; now 472 B over. Above the last
    block's moment by 16,384 B at tiny-llama fp32, and hidden by the cross-entropy until the bucket is large.
    Measured (dsres's probe, MemTracker's categories at the peak, which rises before down_proj's hook):
    tiny-llama hf ZeRO-2, N_d = 2, buckets 20,250 / 20,500 / 39,000: the final norm's input (12,288 B) and
    5 fp32 N·d temporaries (61,440 B) beside both blocks' saved tensors; the last block's moment was 15,912 B
    under (+1.54%), this one 472 B over (the 504-B token ids MemTracker never sees, less the rotary buffers)."""
    blk, n_d = run.acts.block, run.acts.embed_out
    if not (blk.norm_backward_ws and blk.pending_at_last_grad) or not run.param_blocks:
        return ()  # GPT's LayerNorm: one node, its backward is the LM head moment's
    dropped = ("incoming activation gradient", "block backward working set")
    keep = tuple(t for t in last if t not in inflight and t.name not in dropped)
    return (Moment("backward", "final norm backward (pow's), the bucket alive", (
        *keep, _blocks_saved(run, run.acts.n_layer),
        _act("final norm's fp32 input and rsqrt (pow's and rsqrt's saved)", blk.pending_at_last_grad - n_d),
        _act("final RMSNorm backward working set (five fp32 N·d, rsqrt released)",
             blk.norm_backward_ws - 2 * n_d + n_d // _pbytes(run) * 4))),)


def final_norm_at_its_hook(run: DSRun) -> tuple[Term, ...]:
    """What is left of the final norm when its weight's gradient hook runs (reduce.py ``_first_bucket_reduced``:
    the first bucket reduced there). An RMSNorm's weight gradient comes from its last product, whose backward
    runs first: its fp32 input and rsqrt, the normalised tensor's gradient (``BlockActivations.pending_at_last_grad``).
    A LayerNorm is one node (``native_layer_norm_backward``: input, weight and bias gradients together), so by
    the first of its two ``AccumulateGrad`` hooks its saved input, mean and rstd are released (autograd releases a
    node's saved variables once it has run), its output went with the LM head's backward, and what is alive is
    its input gradient and both parameters' gradients (the second's hook not yet run). Measured (live storages,
    benchmarks/ds_head_bucket_rows.py, GPT2LMHeadModel untied, 6,000-element buckets, fp32, N_d = 2, rank 1
    owning the head, at the ``ln_f`` hook's ``grads_in_partition``): 20,664 B (1.84 %) over with the saved
    tensors and the output gradient counted; now 8 B under, as rank 0's cross-entropy."""
    acts = run.acts
    pending = acts.block.pending_at_last_grad  # an RMSNorm's, the final norm being one of the blocks' norms
    if pending:
        return (_act("final norm's saved tensors not yet used, its input gradient in flight (RMSNorm)", pending),)
    return (_act("final norm input gradient (LayerNorm)", acts.embed_out),
            Term("final norm weight and bias gradients", run.final_norm_numel * _pbytes(run),
                 "torch native_layer_norm_backward (one node; each AccumulateGrad's hook after it)",
                 max(1, run.final_norm_numel // run.spec.d_model)))


def final_norm_per_rank(run: DSRun, last: tuple[Term, ...], inflight: tuple[Term, ...],
                        extra: Callable[[int], tuple[Term, ...]], among: tuple[int, ...] | None = None
                        ) -> tuple[Moment, ...]:
    """``final_norm_backward``'s moment with what a rank holds beyond it, ``extra(rank)``, for the ranks holding
    any (``DSRun.first_largest``). Reducing from the hooks with the first bucket reduced at the final norm
    weight's hook (reduce.py ``_first_bucket_reduced``): an untied head larger than the bucket is not copied into
    it but reduced at the next hook (``reduce_independent_p_g_buckets_and_remove_grads``:
    ``extra_large_param_to_reduce``), the norm weight's, before the norm's input path runs backward; the rank
    owning it allocates its ``grads_in_partition`` there, and at stage 1 (no ``clear_grad_attribute``) the other
    ranks keep its gradient to the step. Measured (live storages at the peak, tiny-llama hf, N_d = 2, 4,500-element
    buckets, the 4,944-element head): ZeRO-2 rank 1 at pow's backward beside its 95,616-B partition, 15,912 B
    (1.49 %) under before; ZeRO-1 with overlap_comm rank 0 beside the 19,776-B head gradient and both buckets,
    12,808 B (1.27 %); both now 472 B over (more rows: tests/test_deepspeed_head_bucket.py, issue 17). ``among``: the
    ranks, in order, outside which ``extra`` is empty, where the caller knows them (not every rank asked: a speed-up)."""
    norm = final_norm_backward(run, last, inflight)
    ranks = tuple(r for r in (run.ranks if among is None else among) if extra(r)) if norm else ()
    return tuple(Moment("backward", f"{m.name}, rank {r}'s first bucket reduced", (*m.terms, *extra(r)))
                 for r in run.first_largest(lambda r: sum(t.bytes for t in extra(r)), ranks) for m in norm)


@lru_cache(maxsize=8)  # every ZeRO-1 run of a plan: the same layout (a speed-up, no rule)
def _later_numels(numels: tuple[int, ...], param_blocks: tuple[int, ...], L: int) -> tuple[int, ...]:
    """Per block j of ``L``, the parameter elements of the blocks after j (``later_blocks_held``)."""
    later = [0] * (L + 1)
    for n, b in zip(numels, param_blocks):
        if 0 < b <= L:
            later[b - 1] += n
        elif b > L:
            later[L] += n
    for j in range(L - 1, -1, -1):
        later[j] += later[j + 1]
    return tuple(later)


@lru_cache(maxsize=8)  # every ZeRO-1 run of a plan: the same elements and bytes (a speed-up, no rule)
def _later_terms(later: tuple[int, ...], p: int) -> tuple[Term, ...]:
    """``later_blocks_held``'s term of each block j: the later blocks' gradients, ``later[j]`` elements of ``p`` B."""
    return tuple(Term("gradients of the later blocks (param.grad)", n * p,
                      "torch autograd AccumulateGrad; runtime/zero/stage_1_and_2.py process_gradients (stage 1 "
                      "without overlap_comm reduces in reduce_gradients, after backward)") for n in later)  # fmt: skip


def later_blocks_held(run: DSRun, last: tuple[Term, ...], inflight: tuple[Term, ...],
                      bound: bool = False) -> tuple[Moment, ...]:
    """A wrapper reducing after backward (ZeRO-1 without ``overlap_comm``, BF16_Optimizer): autograd's
    gradients pile up block by block, so block j's first op also holds every later block's (under
    checkpointing its recomputed activations make it nearly as large as the last block's: measured gpt-tiny,
    N_d = 4, every rank at block 0). ``bound``: ZeRO-1's every-rank run (``DSRun.first_largest``), whose moments
    differ by their two terms alone: only the first holding the most, at 1 B and at the peak's block, is listed
    (a speed-up, no rule: ``peak_of`` takes a phase's first largest; tests/test_deepspeed_zero12_speedups.py)."""
    if not run.param_blocks:
        return ()
    L = run.acts.n_layer
    later = _later_terms(_later_numels(run.numels, run.param_blocks, L), _pbytes(run))
    common, blocks = tuple(t for t in last if t not in inflight), range(L - 1)
    if bound and run.settings.rank is None and L > 2:
        own = [on_device((_blocks_saved(run, j + 1), later[j])) if run.settings.offload_optimizer.on
               else (_blocks_saved(run, j + 1), later[j]) for j in blocks]  # fmt: skip
        blocks = sorted({*run.first_largest(lambda j: rounded_total(own[j], 1), tuple(blocks)),
                         *run.first_largest(lambda j: rounded_total(own[j], run.settings.block_bytes), tuple(blocks))})
    return tuple(Moment("backward", f"block {j} backward, the later blocks' gradients held", (
        *common, _blocks_saved(run, j + 1), *inflight[1:], later[j])) for j in blocks)


def optimizer_moments(run: DSRun) -> tuple[Moment, ...]:
    """The inner Adam on the fp32 partition: its fp32 gradient (stage_1_and_2.py ``step``:
    ``single_partition_of_fp32_groups.grad``; stage3.py ``_prepare_fp32_grad_for_sub_group``) and the
    temporaries of torch's Adam (``_single_tensor_adam``: ``v.sqrt()`` and its quotient; foreach: one; one more with
    Adam's L2 weight decay: offload_terms.py ``adam_step_fp32_temporaries``), none for FusedAdam (a fused kernel)."""
    s = run.settings
    part = run.wrapper.partition_numel(s, run.numels, run.nd)
    inner = inner_optimizer_class(s)
    temps = adam_step_fp32_temporaries(s, run.foreach)
    return run.wrapper.optimizer_moments(run, part, inner, temps)


def adam_update(run: DSRun, part: int, inner: str, temps: int) -> Moment:
    """ZeRO-1/2 and ZeRO-3: the inner Adam's update, its fp32 gradient and torch Adam's temporaries alive."""
    return Moment("optimizer_step", f"{inner} update", (*_states(run),
                  Term("fp32 gradient of the master partition", part * 4,
                       "runtime/zero/stage_1_and_2.py step / runtime/zero/stage3.py _prepare_fp32_grad_for_sub_group"),
                  Term(f"{inner} temporaries", temps * part * 4, "torch/optim/adam.py _single_tensor_adam / _multi_tensor_adam",
                       max(temps, 1))))  # fmt: skip


def moments(run: DSRun) -> tuple[Moment, ...]:
    """Every moment of a DeepSpeed training step, on the GPU (offload: ``offload.offload_moments``)."""
    return offload_moments(run, (*init_moments(run), *forward_moments(run), *backward_moments(run),
                                 *optimizer_moments(run)))
