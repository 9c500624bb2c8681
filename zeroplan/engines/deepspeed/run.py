"""One rank of DeepSpeed training a transformer (``DSRun``, built by ``wrapper.py ds_run``), what an optimizer
wrapper answers (``Wrapper``, the base of ``zero12.py``, ``bf16.py``, ``zero3.py``) and the terms every
phase's moments share: the model states alive, the reduce bucket, saved activations, and ZeRO-3's gathered
parameters read off the replayed coordinator."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Callable, Optional

from zeroplan.architectures.spec import TransformerSpec
from zeroplan.engines.base import Workload
from zeroplan.engines.deepspeed.coordinator import Stage3Schedule
from zeroplan.engines.deepspeed.estimator import zero12_estimate_bytes
from zeroplan.engines.deepspeed.hook_order import grad_ready_order, sparse_calls
from zeroplan.engines.deepspeed.offload_terms import NO_OFFLOAD, WrapperOffload, on_gpu
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES, Settings
from zeroplan.engines.deepspeed.terms import DSTerm, FlatGroup, aligned_flat_numel, flat_group
from zeroplan.engines.deepspeed.trace import _MLP_PROJECTIONS, ATTENTION_FORWARD, Stage3Trace, stage3_trace
from zeroplan.engines.deepspeed.zeropp import qwz_buffer_terms, secondary_terms
from zeroplan.formulas.activation_terms import ModelActivations
from zeroplan.formulas.deepseek_activations import router_bias_bytes, router_weight_copy_bytes
from zeroplan.formulas.peak import Moment, Term

ACT_SRC = "zeroplan/formulas/activation_terms.py"


class Wrapper:
    """One DeepSpeed optimizer wrapper: the defaults are those of the flat-group wrappers (ZeRO-1/2 and
    BF16_Optimizer), which gather nothing and partition one padded flat group."""

    name: str
    """DeepSpeed's class name."""
    terms: Callable
    """``(settings, numels, nd) -> tuple[DSTerm, ...]``: its model states and buckets (terms.py)."""
    collectives: Callable
    """``(settings, numels, nd, grad_accum, trace) -> tuple[DSCollective, ...]`` (collectives.py)."""
    offload: WrapperOffload = NO_OFFLOAD
    """what its offload keeps on the host and moves (offload_terms.py; ZeRO-1/2's and ZeRO-3's: offload_wrappers.py)."""
    ds_estimate: Callable = staticmethod(zero12_estimate_bytes)
    """``(settings, numels, nd) -> bytes``: DeepSpeed's own estimator of the wrapper's file (estimator.py)."""
    wraps_module_inputs: bool = False
    """Whether each module's inputs pass through ``PostBackwardFunctionModule`` (ZeRO-3's module hooks,
    runtime/zero/parameter_offload.py ``_post_backward_module_hook``): an input gradient waits in its node while the
    module's ``AccumulateGrad`` hooks run (attention_hooks.py)."""

    def partition_numel(self, s: Settings, numels: tuple[int, ...], nd: int) -> int:
        """Elements of one rank's fp32 master partition."""
        return aligned_flat_numel(numels, nd) // nd

    def schedule(self, run: DSRun) -> Optional[Stage3Schedule]:
        """The replayed parameter coordinator; None: every parameter is always there."""
        return None

    def init_moments(self, run: DSRun) -> tuple[Moment, ...]:
        raise NotImplementedError

    def held_between_micro_steps(self, run: DSRun) -> tuple[Term, ...]:
        """With ``gradient_accumulation_steps`` > 1, what an earlier micro-step leaves for the next one."""
        return ()

    def keeps_gradients(self, run: DSRun) -> bool:
        """Whether autograd's gradients stay in ``param.grad`` to the end of backward (reduced after it)."""
        return False

    def buckets_at_hooks(self, run: DSRun) -> bool:
        """Whether a gradient's hook copies it into the reduce bucket and frees autograd's tensor in this
        backward, so that a block's first weight gradient is gone by its next op."""
        return False

    def last_block_bucket(self, run: DSRun) -> tuple[Term, ...]:
        """The reduce bucket(s) alive at the last block's backward."""
        return ()

    def backward_after_last_block(self, run: DSRun, last: tuple[Term, ...],
                                  inflight: tuple[Term, ...]) -> tuple[Moment, ...]:
        """The last block's backward moment (``last``: its terms) and the wrapper's moments after it."""
        raise NotImplementedError

    def optimizer_moments(self, run: DSRun, part: int, inner: str, temps: int) -> tuple[Moment, ...]:
        raise NotImplementedError

    def uses_reduction_stream(self, s: Settings) -> bool:
        """Whether ``grads_in_partition`` comes from the wrapper's ``reduction_stream`` (alloc_trace.py)."""
        return False


@dataclass(frozen=True)
class DSRun:
    """One rank of DeepSpeed training a transformer: settings, parameter sizes (``named_parameters``
    order), N_d, one micro-batch's activations, and the model's head and final norm sizes."""

    settings: Settings
    numels: tuple[int, ...]
    nd: int
    acts: ModelActivations
    head_numel: int
    final_norm_numel: int
    tied_head: bool
    """the head's weight is the token embedding's (``head_tied``: any transformers family tied, the validator's
    GPT); read from the architecture."""
    wrapper: Wrapper = field(compare=False, repr=False)
    """the optimizer wrapper DeepSpeed builds for ``settings`` (``wrapper.py wrapper_for``), chosen once per run."""
    checkpointing: str = "none"
    foreach: bool = False
    grad_accum: int = 1
    modules: tuple[tuple[int, ...], ...] = ()
    """parameter sizes module by module, in build order (``named_parameters`` grouped by owning module):
    what ``deepspeed.zero.Init`` partitions after each module's ``__init__``."""
    trace: Optional[Stage3Trace] = None
    """ZeRO-3's module trace (``stage3_trace``): what the coordinator fetches and releases, in order."""
    param_blocks: tuple[int, ...] = ()
    """per parameter (``named_parameters`` order), the index of its decoder block; -1 outside the blocks."""
    output_projections: tuple[int, ...] = ()
    """the parameters of the blocks' MLP output projections (GPT-2 ``mlp.c_proj``, Llama ``mlp.down_proj``)."""
    spec: Optional[TransformerSpec] = field(default=None, compare=False, repr=False)
    """the architecture (a sparse MLP's sizes: engines/deepspeed/moe.py)."""
    transformers: bool = False
    """the transformers model of the architecture (``Workload.transformers``), not the validator's causal LM."""
    init_gathers: tuple[tuple[int, ...], ...] = ()
    """a transformers model's parameter sizes gathered together by ``initialize_weights_zero3``, module by module
    (``_init_gathers``) where it builds the model (``Settings.hf_zero3_build``); else empty (``Module.apply``)."""
    memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    """results a run's moment functions ask for more than once, by name (``memo_of``); never copied by
    ``dataclasses.replace`` (not an ``__init__`` field), so a changed run starts empty."""

    @property
    def ranks(self) -> tuple[int, ...] | range:
        """The ranks whose own terms (a flat group's ``grads_in_partition``, the gradients kept outside a
        partition) the moments describe: ``settings.rank``, or every rank (each moment of one rank: the
        phase's peak is then the largest over ranks; a family of per-rank moments lists only the rank whose
        moment is largest, ``first_largest``)."""
        return range(self.nd) if self.settings.rank is None else (self.settings.rank,)

    def first_largest(self, extra_bytes: Callable[[int], int], ranks: Optional[tuple[int, ...]] = None) -> tuple[int, ...]:
        """The ranks (of ``ranks``, default ``self.ranks``) whose moment of one per-rank family to list: the rank
        described, or where every rank is (the bound ``profile.estimate`` tries the ranks against), only the first
        whose moment holds the most, ``extra_bytes(rank)`` being its bytes beyond what every rank's holds alike.
        ``peak_of`` takes a phase's first largest moment, so no other rank's moment of the family can be it: the
        phase's peak (and its moment) is the same as with every rank's listed, for a fraction of the terms."""
        ranks = tuple(self.ranks) if ranks is None else ranks
        if self.settings.rank is not None or len(ranks) <= 1:
            return ranks
        return (max(ranks, key=extra_bytes),)  # max keeps the first of equals

    @cached_property
    def flat(self) -> FlatGroup:
        """The flat group's layout (ZeRO-1/2, BF16_Optimizer): which parameters each rank's partition holds."""
        return flat_group(self.numels, self.nd)

    @cached_property
    def grad_ready_order(self) -> tuple[int, ...]:
        """The parameters in the order their gradient hooks fire (``grad_ready_order``)."""
        return grad_ready_order(self.trace, self.numels, sparse_calls(self.spec) if self.spec is not None else ())

    @cached_property
    def model_terms(self) -> tuple[DSTerm, ...]:
        """Every buffer of model states and buckets (``terms``), computed once per run."""
        return on_gpu(self.wrapper, self.settings, self.numels, self.nd)

    @cached_property
    def live_terms(self) -> dict[tuple[str, ...], tuple[Term, ...]]:
        """``model_terms`` as ``Term``s by the lives asked (``_states``, ``_bucket``), each built once per run:
        every moment holds them, and a rank's moments are many (one per block, per rank)."""
        out: dict[tuple[str, ...], tuple[Term, ...]] = {}
        for lives in (("persistent", "lazy"), ("persistent",), ("backward",)):
            out[lives] = tuple(t.term() for t in self.model_terms if t.live in lives and t.bytes)
        buffers = _fp32_buffers(self)
        for lives in (("persistent", "lazy"), ("persistent",)):
            out[lives] = (*out[lives], *buffers)
        return out


def memo_of(run: DSRun, name: str, make: Callable[[DSRun], object]) -> object:
    """``make(run)``, computed once per run under ``name`` (``DSRun.memo``)."""
    if name not in run.memo:
        run.memo[name] = make(run)
    return run.memo[name]


_SHARED: dict = {}  # (name, id of each key object, the rest of the key) -> (the key objects, the value)


def shared_memo(name: str, objects: tuple, rest: tuple, make: Callable[[], object]) -> object:
    """``make()`` once per ``name``, ``objects`` (by identity, kept alive here: the layout's tuples every run of a
    plan shares, ``DSRun.numels``, ``param_blocks``, ``grad_ready_order``) and ``rest`` (small values: a bucket
    size), for what a run derives from its layout alone; at most 256 values kept. A speed-up, no rule: each run of
    a 405B plan derived them again (37 runs, a pass over 1,137 parameters each)."""
    key = (name, *map(id, objects), *rest)
    hit = _SHARED.get(key)
    if hit is None or any(a is not b for a, b in zip(hit[0], objects)):
        if len(_SHARED) >= 256:
            _SHARED.clear()
        hit = _SHARED[key] = (objects, make())
    return hit[1]


@lru_cache(maxsize=1024, typed=True)  # one term per value, every run asks the same few (a speed-up, no rule)
def _act(name: str, nbytes: int, tensors: int = 1) -> Term:
    return Term(name, nbytes, ACT_SRC, tensors)


def _sixteen_bit_hf(run: DSRun) -> bool:
    """A 16-bit run of a transformers model (its fp32 router weight copies and buffers: ``_fp32_buffers``,
    ``router_copies``); fp32 runs leave them out (their rows: the buffers within the residual, docs/engines/deepspeed.md
    "ZeRO-3 and mixture-of-experts")."""
    return run.spec is not None and run.transformers and _pbytes(run) != 4


def _fp32_buffers(run: DSRun) -> tuple[Term, ...]:
    """The fp32 module buffers a 16-bit transformers run keeps beside its states, from the build on: DeepSeek-V3's
    ``e_score_correction_bias`` (``router_bias_bytes``; DeepSpeed casts the model, the buffer stays fp32: traced,
    tests/test_deepspeed_moe.py ``BF16``, every phase 32 B under without it)."""
    nbytes = router_bias_bytes(run.spec) if _sixteen_bit_hf(run) else 0
    src = "transformers models/deepseek_v3/modeling_deepseek_v3.py DeepseekV3TopkRouter.__init__ (a Buffer)"
    return (Term("routers' fp32 e_score_correction_bias buffers", nbytes, src, len(run.spec.moe.sparse_layers)),) \
        if nbytes else ()


def router_copies(run: DSRun, n: int) -> int:
    """Bytes of the fp32 router weight copies the first ``n`` blocks' routers saved to their backward: DeepSeek-V3 in
    a 16-bit run (``router_weight_copy_bytes`` per sparse layer: DeepSpeed casts the router to bf16 and
    ``DeepseekV3TopkRouter.forward`` copies it back to fp32 for F.linear); none under checkpointing (the no-grad
    forward saves nothing)."""
    if not _sixteen_bit_hf(run) or run.checkpointing != "none":
        return 0
    copy = router_weight_copy_bytes(run.spec, _pbytes(run))
    return copy * sum(1 for i in run.spec.moe.sparse_layers if i < n) if copy else 0


def _states(run: DSRun, after_step: bool = True) -> tuple[Term, ...]:
    """The model states alive (``run.model_terms``): persistent ones, and lazy ones after the first step; with the
    fp32 buffers of a 16-bit transformers run (``_fp32_buffers``)."""
    return run.live_terms[("persistent", "lazy") if after_step else ("persistent",)]


def _bucket(run: DSRun) -> tuple[Term, ...]:
    """ZeRO-1/2: the reduce bucket(s), allocated at the first gradient hook of each backward."""
    return run.live_terms[("backward",)]


def _pbytes(run: DSRun) -> int:
    return DTYPE_BYTES[run.settings.dtype]


def _schedule(run: DSRun) -> Optional[Stage3Schedule]:
    """ZeRO-3's replayed coordinator for ``run`` (``stage3_schedule``); None for the wrappers that gather nothing."""
    return run.wrapper.schedule(run)


GATHER_SRC = ("runtime/zero/partitioned_param_coordinator.py fetch_sub_module (prefetch), release_sub_module "
              "(__params_to_release); partition_parameters.py all_gather_coalesced")  # fmt: skip


def _gathered(run: DSRun, sched: Optional[Stage3Schedule], mark: str, during: bool = False) -> tuple[Term, ...]:
    """ZeRO-3 after the first step: the non-persistent parameters gathered at the peak moment ``mark`` of the
    trace (``stage3_schedule``: fetched or prefetched and not yet released) and, apart, the flat buffers of
    coalesced all-gathers still open there (measured: gpt-tiny checkpointed, N_d = 2 and 4, 21,312 B in the last
    block's MLP: its c_fc bias and c_proj weight, prefetched together). ``during``: the most while the mark's
    event runs (its wait frees a buffer only after its own all-gather), one term. ``sched``: ``_schedule(run)``
    (asked once per phase: hashing a 70B trace for the cache costs milliseconds). None at N_d = 1: each fetch is
    partition_parameters.py ``_no_gather_coalesced``, ``param.data`` a view of its partition (``NoGatherHandle``;
    measured: gpt-tiny ZeRO-3 bf16 at world size 1, no gathered bytes at the forward and backward peaks; with
    ``offload_param`` on a GPU the view is a copy, counted by offload.py's fetched partitions)."""
    if sched is None or run.nd == 1:
        return ()
    # the same terms for every run replaying this schedule at this dtype (a plan's ZeRO-3 candidates of one prefetch
    # setting: 126 blocks' marks each), made once per schedule object, as ``Stage3Trace.span`` keeps its spans
    memo = sched.__dict__.get("_gathered_terms")
    if memo is None:
        memo = {}
        object.__setattr__(sched, "_gathered_terms", memo)
    key = (mark, during, _pbytes(run), run.settings.quantized_weights)
    if key not in memo:
        memo[key] = _gathered_terms(run, sched, mark, during)
    return memo[key]


def _gathered_terms(run: DSRun, sched: Stage3Schedule, mark: str, during: bool) -> tuple[Term, ...]:
    """``_gathered``'s terms, from ``sched``, the trace's marks, the dtype and qwZ."""
    p, i = _pbytes(run), sched.event(run.trace, mark)
    sec = secondary_terms(sched, i, p)  # ZeRO++ hpZ (zeropp.py); () without
    if during:
        return (Term(f"gathered parameters and open all-gather buffers (during {mark})", sched.high[i] * p, GATHER_SRC),
                *sec)
    buffers = sched.buffers[i] if sched.buffers else 0
    open_buffers = (Term("coalesced all-gather buffers awaiting their last module", buffers * p,
                         "runtime/zero/partition_parameters.py _all_gather_dtype (flat_tensor) held by "
                         "AllGatherCoalescedHandle until partitioned_param_coordinator.py fetch_sub_module pops the "
                         "call's last parameter"),)  # fmt: skip
    if run.settings.quantized_weights:  # ZeRO++ qwZ: the buffer is int8 and its fp16 dequantization (zeropp.py)
        open_buffers = qwz_buffer_terms(buffers)
    return (Term(f"gathered parameters ({mark})", (sched.gathered[i] - buffers) * p, GATHER_SRC),
            *(open_buffers if buffers else ()), *sec)  # fmt: skip


def _blocks_saved(run: DSRun, n: int) -> Term:
    """The saved activations of the first ``n`` blocks, with their routers' fp32 weight copies (``router_copies``),
    each ``n``'s term made once per run (``DSRun.memo``: every block's moments ask, in each phase)."""
    saved = run.memo.get("blocks saved")
    if saved is None:  # not setdefault's: a new dict at each of a run's thousands of calls
        saved = run.memo["blocks saved"] = _saved_memo(run)
    if n not in saved:
        copies = router_copies(run, n)
        what = f"saved activations of {n} blocks" + (" (with the routers' fp32 weight copies)" if copies else "")
        saved[n] = _act(what, run.acts.saved_through(n, run.checkpointing) + copies, max(n, 1))
    return saved[n]


_SAVED_MEMO: list = []  # [(facts, {n: _blocks_saved term})]: the last run's


def _saved_memo(run: DSRun) -> dict:
    """The terms of ``_blocks_saved`` for ``run``, shared with the runs before while what they read is the same:
    the activations (``_activations``' record, the very same object), checkpointing and ``router_copies``' facts
    (the architecture, the same object; a transformers model; the dtype). Every candidate of a plan and each of its
    ranks' runs ask for the same ~130 terms (a 405B plan: ~4,000 calls)."""
    facts = (run.acts, run.spec, run.checkpointing, run.transformers, _pbytes(run))
    if _SAVED_MEMO:
        old, memo = _SAVED_MEMO[0]
        if old[0] is facts[0] and old[1] is facts[1] and old[2:] == facts[2:]:
            return memo
    _SAVED_MEMO[:] = [(facts, {})]
    return _SAVED_MEMO[0][1]


ZINIT = "runtime/zero/partition_parameters.py"


@lru_cache(maxsize=32)  # the same for every candidate of a plan (a workload hashes once: ``Workload.__hash__``)
def _layout(workload: Workload) -> tuple[tuple[int, ...], int, tuple[tuple[int, ...], ...], tuple[int, ...], tuple[int, ...]]:
    """(parameter sizes, final norm elements, sizes module by module, block of each parameter, output
    projections) of ``workload``, from its parameter names (``DSRun``'s fields); once per workload."""
    from zeroplan.architectures.spec import block_prefix

    spec = workload.spec
    numels = tuple(math.prod(shape) for _, shape in workload.shapes)
    prefix = block_prefix(spec)
    # the final norm: the root's norm parameters (GPT-2 ln_f, Llama model.norm)
    final = sum(math.prod(sh) for n, sh in workload.shapes
                if not n.startswith(prefix) and (".ln_f." in n or n.startswith("model.norm.")))  # fmt: skip
    owners: dict[str, list[int]] = {}  # insertion order: the order the modules were built
    for name, shape in workload.shapes:
        owners.setdefault(name.rpartition(".")[0], []).append(math.prod(shape))
    blocks = tuple(int(n[len(prefix):].split(".")[0]) if n.startswith(prefix) else -1 for n, _ in workload.shapes)
    output = f".mlp.{_MLP_PROJECTIONS[spec.style][1]}."
    outputs = tuple(i for i, (n, _) in enumerate(workload.shapes) if blocks[i] >= 0 and output in n)
    return numels, final, tuple(tuple(v) for v in owners.values()), blocks, outputs


@lru_cache(maxsize=32)
def _init_gathers(workload: Workload) -> tuple[tuple[int, ...], ...]:
    """The parameter sizes transformers' ZeRO-3 weight initialisation gathers at once, module by module
    (transformers 5.24 integrations/deepspeed.py ``initialize_weights_zero3``: each module's own parameters and its
    direct children's, one ``deepspeed.zero.GatheredParameters``; a child that is a ``PreTrainedModel``, the base
    model holding the blocks, is left to its own call), from the parameter names; modules with none left out."""
    from zeroplan.architectures.spec import block_prefix

    base = block_prefix(workload.spec).split(".")[0]  # "model" (model.layers.), "transformer" (transformer.h.)
    sets: dict[str, list[int]] = {}
    for name, shape in workload.shapes:
        owner = name.rpartition(".")[0]
        sets.setdefault(owner, []).append(math.prod(shape))
        if owner and owner != base:  # the parent's call gathers its direct children's parameters too
            sets.setdefault(owner.rpartition(".")[0], []).append(math.prod(shape))
    return tuple(tuple(v) for v in sets.values())


@lru_cache(maxsize=32)  # every candidate of a plan, and ds_run and collectives of one estimate, ask for it
def _trace(workload: Workload) -> tuple[Optional[Stage3Trace]]:
    """(ZeRO-3's module trace of ``workload``,) for ``collectives``: ``stage3_trace`` of its parameter names,
    the validator's causal LM where there is an architecture, the transformers one with ``Workload.transformers``."""
    spec = workload.spec
    style = spec.style if spec is not None else None
    hf = workload.transformers and spec is not None
    calls = ATTENTION_FORWARD.get(spec.model_type, ()) if hf else ()  # transformers' attention modules' call order
    return (stage3_trace(workload.shapes, style, head_tied(workload), hf, calls),)


def head_tied(workload: Workload) -> bool:
    """Whether the head's weight is the token embedding's (``DSRun.tied_head``): in transformers' model of any
    family whose config ties them (``tie_word_embeddings``: ``lm_head.weight`` is ``embed_tokens.weight``), in the
    validator's CausalLM at GPT only (validate/transformer.py ``head_weight``; its Llama layout keeps a head)."""
    spec = workload.spec
    return spec is not None and spec.tie_word_embeddings and (spec.style == "gpt" or workload.transformers)
