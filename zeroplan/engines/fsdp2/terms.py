"""What one FSDP2 rank holds, as terms: the run (units, settings, activations), its model states, and one
function per term, each citing the FSDP2 file and function that allocates it (``SRC``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache

from zeroplan.architectures.spec import BLOCK_PREFIX, block_prefix
from zeroplan.engines.base import Workload
from zeroplan.engines.fsdp2.param import Shape, Unit, padded_shard_numel, units_shard_numel
from zeroplan.engines.fsdp2.hf_buffers import (
    embed_scale_bytes,
    rotary_buffer_bytes,
    router_bias_bytes,
    rotary_recompute_bytes,
    router_weight_copy_bytes,
)
from zeroplan.engines.fsdp2.memo import RANKED, by_identity, memo_term
from zeroplan.engines.fsdp2.units import profile_units, shard_units_of
from zeroplan.engines.fsdp2.wrap import ShardUnit
from zeroplan.engines.fsdp2.selective_ac import SRC as SAC_SRC, checkpointed, checkpointed_blocks, saved_through
from zeroplan.engines.fsdp2.selective_ac import OP_SRC as SAC_OP, op_cache, op_forward_peak, op_limit
from zeroplan.engines.fsdp2.settings import ADAM, SRC, Settings, post_forward_group
from zeroplan.formulas.activation_terms import ModelActivations, model_activations
from zeroplan.formulas.dtypes import dtype_bytes
from zeroplan.formulas.peak import Term
from zeroplan.engines.fsdp2.states import adam_moments, run_states
from zeroplan.engines.fsdp2.states import ModelStates, model_states  # noqa: F401 - re-exported (their home: states.py)


@dataclass(frozen=True)
class Fsdp2Run:
    """One rank of FSDP2 training a model: units (root first), settings, and (with an architecture)
    one micro-batch's activations; ``head_numel`` and ``final_norm_numel`` are the LM head weight and
    the final norm's parameters, whose gradients come first in backward and wait for the root's
    reduce-scatter; ``tied_head``: the head is the token embedding (GPT-2)."""

    units: tuple[Unit, ...]
    nd: int
    settings: Settings
    acts: ModelActivations | None = None
    checkpointing: str = "none"
    foreach: bool = False
    head_numel: int = 0
    final_norm_numel: int = 0
    tied_head: bool = False
    style: str = "gpt"  # the architecture's layout (architectures.spec): gpt (LayerNorm) or llama (RMSNorm)
    biased_linear: bool = True  # a projection has a bias: its GEMM takes cuBLASLt's workspace on CUDA
    param_order: tuple[Shape, ...] = ()  # parameters in model.parameters() order (the optimizer's); () = units'
    transformers: bool = False  # transformers' module tree (Workload.transformers): see zeroplan.engines.fsdp2.hf_tree
    loss_in_forward: bool = False  # transformers: the loss inside the root's forward (forward(labels=...))
    buffer_bytes: int = 0  # module buffers every moment holds (transformers' rotary inv_freq): hf_tree.rotary_buffers
    router_bytes: int = 0  # DeepSeek-V3's fp32 e_score_correction_bias buffers (hf_buffers.router_bias_bytes)
    rotary_init_bytes: int = 0  # a meta init's rotary-table recompute temporaries (hf_buffers.rotary_recompute_bytes)
    router_copy: tuple[int, ...] = ()  # per layer, bytes its router's fp32 weight copy adds to its saved set (hf_buffers)
    scale_bytes: int = 0  # Gemma's fp32 embed_scale buffer, every moment (hf_buffers.embed_scale_bytes)
    position_bytes: int = 0  # transformers llama-style: the int64 position ids in forward (hf_tree.position_ids)
    shard_units: tuple[ShardUnit, ...] = ()  # the fully_shard calls as made (wrap.resolve): collectives, edge_regathers
    replicate: int = 1  # HSDP: replicas R of the 2-D mesh; ``nd`` is then the shard group S (engines/fsdp2/mesh.py)
    ac_every: int = 1  # checkpointing full: only layers k, 2k, ... checkpointed (selective_ac.py, Settings.selective_ac)
    ac_op: bool = False  # checkpointing full under torchtitan's per-op policy: each layer keeps its cache (selective_ac)
    op_cache: int = 0  # ac_op: bytes each layer keeps beyond its input (selective_ac.op_cache)
    op_forward: int = 0  # ac_op: a layer's forward peak beside its input (selective_ac.op_forward_peak)

    def __post_init__(self) -> None:
        if self.nd == 1:
            raise ValueError("N_d = 1: FSDP2 takes its world-size-1 path there (no all-gather or reduce-scatter; "
                             "_fsdp_param_group.py:FSDPParamGroup.unshard), which this profile does not model: "
                             "use N_d >= 2")  # fmt: skip
        if self.nd < 1 or len(self.units) < (2 if self.acts is not None else 1):
            raise ValueError(f"nd={self.nd}, units={len(self.units)}: need nd >= 1 and a root plus blocks")
        if self.checkpointing not in ("none", "full"):
            raise ValueError(f"checkpointing={self.checkpointing!r}: expected none or full")
        post_forward_group(self.settings, self.nd)
        if self.settings.selective_ac != 1 and self.checkpointing != "none" and (self.settings.tp or 1) > 1:
            raise ValueError(f"selective_ac={self.settings.selective_ac}: selective checkpointing with tensor "
                             "parallelism is not modelled (engines/fsdp2/tp.py models none and full)")  # fmt: skip

    def checkpointed(self, block: int) -> bool:
        """Whether decoder layer ``block`` (1-based) is recomputed in backward (``selective_ac.checkpointed``)."""
        return checkpointed(self.checkpointing, self.ac_every, block)

    @property
    def any_checkpointed(self) -> bool:
        """Some layer runs under ``checkpoint_wrapper`` (its call arguments are kept to its backward)."""
        return checkpointed_blocks(self.checkpointing, self.ac_every, len(self.units) - 1) > 0

    # cached per run (a frozen run's fields never change): every moment of every block asks them again
    @cached_property
    def m(self) -> int:
        return dtype_bytes(self.settings.module)

    @cached_property
    def p(self) -> int:
        return dtype_bytes(self.settings.param)

    @cached_property
    def r(self) -> int:
        return dtype_bytes(self.settings.reduce)

    @cached_property
    def shards(self) -> tuple[int, ...]:
        """S_u of every unit (``unit_shard_numel``), root first."""
        return units_shard_numel(self.units, self.nd)

    @cached_property
    def memo(self) -> dict:
        """Terms this run asks for again and again (``memo_term``): the same values, built once."""
        return {}

    def shard(self, u: int) -> int:
        return self.shards[u]

    def for_rank(self, rank: int) -> Fsdp2Run:
        """This run as ``rank`` of the same shard group sees it (what ``fsdp2_run`` would build with that
        ``settings.rank``). The rank enters only through ``local_shard_numel`` (``RANKED`` terms, the Adam
        temporaries, init's re-padding), so the other terms built so far are kept: ``estimate``'s worst rank
        builds them once."""
        out = replace(self, settings=self.settings.model_copy(update={"rank": rank}))
        out.memo.update(self.memo)  # copied in C, the ranked terms dropped after (a speed-up: the same entries)
        list(map(out.memo.pop, [k for k in out.memo if k[0] in RANKED]))
        return out


@lru_cache(maxsize=8192)  # the same term asked at many moments: one object (phase_leaders)
def _fp(name: str, nbytes: int, where: str, tensors: int = 1) -> Term:
    return Term(name, nbytes, SRC + where, tensors)


@lru_cache(maxsize=8192)  # the same term asked at many moments: one object (phase_leaders)
def _act(name: str, nbytes: int, tensors: int = 1) -> Term:
    return Term(name, nbytes, "zeroplan/formulas/activation_terms.py:model_activations", tensors)


@memo_term
def params(run: Fsdp2Run) -> Term:
    """Sharded parameters, padded, in the module dtype (no separate master copy)."""
    return _fp("sharded parameters (module dtype, padded)", sum(run.shards) * run.m,
               "_fsdp_param.py:FSDPParam._init_sharded_param", sum(len(u.shapes) for u in run.units))  # fmt: skip


@memo_term
def grads(run: Fsdp2Run, units) -> Term:
    """Sharded gradients of ``units`` (views into each unit's reduce-scatter output, cast to the module dtype)."""
    units = tuple(units)
    return _fp(f"sharded gradients of {len(units)} unit(s)", sum(map(run.shards.__getitem__, units)) * run.m,
               "_fsdp_collectives.py:foreach_reduce (_to_dtype_if_needed(reduce_output, orig_dtype))", len(units))  # fmt: skip


@memo_term
def adam(run: Fsdp2Run) -> Term:
    """Adam's exp_avg, exp_avg_sq, with amsgrad max_exp_avg_sq (zeros_like of the DTensor: the local shard,
    unpadded: ``states.adam_moments``) and step."""
    st = run_states(run)
    n = sum(len(u.shapes) for u in run.units)
    name = f"Adam exp_avg, exp_avg_sq, {'max_exp_avg_sq, ' if run.settings.amsgrad else ''}step"
    return Term(name, st.optimizer_bytes, f"{ADAM}:Adam._init_group (first step)", (adam_moments(run.settings) + 1) * n)


@memo_term
def unsharded(run: Fsdp2Run, u: int) -> Term:
    """A unit's unsharded parameters: one padded buffer per tensor in the param dtype."""
    what = "root" if u == 0 else f"block {u}"
    return _fp(f"unsharded parameters ({what})", run.nd * run.shard(u) * run.p,
               "_fsdp_param.py:FSDPParam.alloc_all_gather_outputs", len(run.units[u].shapes))  # fmt: skip


@memo_term
def ag_output(run: Fsdp2Run, u: int, why: str) -> Term:
    """A unit's flat all-gather output (kept in forward until the next unit's copy-out)."""
    what = "root" if u == 0 else f"block {u}"
    return _fp(f"all-gather output ({what}, {why})", run.nd * run.shard(u) * run.p,
               "_fsdp_collectives.py:foreach_all_gather; _fsdp_param_group.py:FSDPParamGroup.wait_for_unshard")  # fmt: skip


@memo_term
def copy_in(run: Fsdp2Run, u: int, post_forward: bool = False) -> Term:
    """The all-gather input copied into one flat buffer in the param dtype (none when the dtypes agree:
    ``use_foreach_copy`` needs a ``param_dtype``); from the post-forward state of an int k it is the
    k-sharded data, nd·S_u/k elements, else the shard S_u (_fsdp_collectives.py:_get_param_all_gather_inputs)."""
    cast = run.settings.param != run.settings.module
    numel = run.nd * run.shard(u) // post_forward_group(run.settings, run.nd) if post_forward else run.shard(u)
    return _fp(f"all-gather copy-in (unit {u}{', post-forward' if post_forward else ''}, cast)",
               numel * run.p if cast else 0, "_fsdp_collectives.py:_get_param_all_gather_inputs")  # fmt: skip


@memo_term
def post_forward_shard(run: Fsdp2Run, u: int) -> Term:
    """reshard_after_forward=k: the block kept sharded over k ranks until backward."""
    k = post_forward_group(run.settings, run.nd)
    return _fp(f"post-forward shard (block {u}, k={k})", run.nd * run.shard(u) // k * run.p,
               "_fsdp_param.py:FSDPParam.to_sharded_post_forward")  # fmt: skip


def partial_reshard(run: Fsdp2Run) -> bool:
    """reshard_after_forward=k with 1 < k < nd: blocks kept sharded over k ranks between forward and backward."""
    return 1 < post_forward_group(run.settings, run.nd) < run.nd


def mesh_ranks_bytes(settings: Settings, nd: int) -> int:
    """The post-forward mesh's rank tensor, held from init on beside the model states (0 unless 1 < k < nd):
    ``_get_post_forward_mesh_info`` builds a ``DeviceMesh`` from ``mesh_info.mesh.mesh.view(-1, k)``, a new
    int32 tensor of the nd ranks (``DeviceMesh.mesh``) that the new mesh keeps as its rank map
    (measured with 2 blocks: 16, 32, 256 B at N_d = 4, 8, 64)."""
    return 4 * nd if 1 < post_forward_group(settings, nd) < nd else 0


@memo_term
def mesh_ranks(run: Fsdp2Run) -> tuple[Term, ...]:
    """``mesh_ranks_bytes`` as a term of every moment from the first ``fully_shard`` on."""
    if not partial_reshard(run):
        return ()
    return (_fp("post-forward mesh ranks (int32)", mesh_ranks_bytes(run.settings, run.nd),
                "_fsdp_init.py:_get_post_forward_mesh_info"),)  # fmt: skip


@memo_term
def post_forward_reshard(run: Fsdp2Run, u: int) -> Term:
    """The k-sharded copy made at a block's post-forward, parameter by parameter: each clones its slice
    (nd·c·rest/k) and then frees its unsharded tensor (nd·c·rest), so the most held beyond the unsharded
    block is max over j of clone_j + Σ_{i<j} (clone_i - full_i) (_fsdp_param.py:FSDPParam.to_sharded_post_forward)."""
    k = post_forward_group(run.settings, run.nd)
    held, worst = 0, 0
    for shape in run.units[u].shapes:
        full = run.nd * padded_shard_numel(shape, run.nd)
        worst = max(worst, held + full // k)
        held += full // k - full
    return _fp(f"post-forward reshard (block {u}, k={k}): clones less what is freed", worst * run.p,
               "_fsdp_param.py:FSDPParam.to_sharded_post_forward")  # fmt: skip


def kept_blocks(run: Fsdp2Run, upto: int) -> tuple[Term, ...]:
    """Blocks 1..upto between their forward and their backward: whole (False), k-sharded (int) or freed (True)."""
    return _all_kept_blocks(run)[: max(upto, 0)]


@memo_term
def _all_kept_blocks(run: Fsdp2Run) -> tuple[Term, ...]:
    """``kept_blocks`` of every block, built once per run (each moment takes a prefix)."""
    k, upto = post_forward_group(run.settings, run.nd), len(run.units) - 1
    if k == run.nd:
        return ()
    if k == 1:
        return tuple(unsharded(run, u) for u in range(1, upto + 1))
    return tuple(post_forward_shard(run, u) for u in range(1, upto + 1))


def resharded(run: Fsdp2Run) -> bool:
    """Blocks are gathered again for backward (True, or an int k < nd)."""
    return post_forward_group(run.settings, run.nd) > 1


@memo_term
def batch(run: Fsdp2Run) -> Term:
    return Term("batch (token ids, targets)", run.acts.batch, "validate/engines/fsdp2.py:measure", 2)


@memo_term
def _blocks_saved(run: Fsdp2Run, n: int) -> Term:
    """What layers 1..n keep to their backward (a checkpointed layer its input: selective_ac.saved_through)."""
    if run.ac_op:  # every layer its input and the outputs the per-op policy caches
        return _act(f"checkpointed block inputs and per-op cached outputs of {n} blocks ({SAC_OP})",
                    n * (run.acts.block.ckpt_saved + run.op_cache), n)
    ckpt = checkpointed_blocks(run.checkpointing, run.ac_every, n)
    what = "saved activations" if not ckpt else "checkpointed block inputs" if ckpt == n else "saved activations " \
        f"and checkpointed inputs ({ckpt} layers: {SAC_SRC})"
    copies = sum(c for i, c in enumerate(run.router_copy[:n], 1) if not run.checkpointed(i))  # hf_buffers.router_weight_copy_bytes
    return _act(f"{what} of {n} blocks", saved_through(run.acts, run.checkpointing, run.ac_every, n) + copies, n)


def prefetched(run: Fsdp2Run, u: int) -> tuple[Term, ...]:
    """Block ``u``'s all-gather output, prefetched for its backward (resharded blocks only; never the root)."""
    return (ag_output(run, u, "backward prefetch"),) if resharded(run) and u >= 1 else ()


def gather_input(run: Fsdp2Run, u: int) -> Term:
    """A backward all-gather's copy-in: from the k-sharded data under an int reshard_after_forward."""
    return copy_in(run, u, post_forward=partial_reshard(run))


@memo_term
def unit_grads(run: Fsdp2Run, u: int) -> Term:
    """Block ``u``'s unsharded gradients as autograd made them, until its reduce-scatter copies them in."""
    return Term(f"unsharded gradients (block {u})", run.units[u].numel * run.p,
                "autograd; freed in _fsdp_collectives.py:foreach_reduce (unsharded_grads.clear())",
                len(run.units[u].shapes))  # fmt: skip


@memo_term
def rs_input(run: Fsdp2Run, u: int, why: str) -> Term:
    """Unit ``u``'s flat reduce-scatter input (nd·S_u in the reduce dtype)."""
    return _fp(f"reduce-scatter input (unit {u}, {why})", run.nd * run.shard(u) * run.r,
               "_fsdp_collectives.py:foreach_reduce; _fsdp_param_group.py:FSDPParamGroup.post_backward")  # fmt: skip


def last_grad_held(run: Fsdp2Run, shape, what: str) -> tuple[Term, ...]:
    """The unsharded gradient of a unit's last parameter, alive through its reduce-scatter and cast: before the
    copy-in, ``_fsdp_collectives.py:foreach_reduce`` checks each gradient's shard dim in ``for i, (fsdp_param,
    unsharded_grad) in enumerate(zip(fsdp_params, unsharded_grads))`` (only when the group has more than one rank);
    the loop variable still binds the last gradient after ``unsharded_grads.clear()``, until ``foreach_reduce``
    returns. Traced (MemTracker's live storages at the peak, each gradient named by its parameter's
    post-accumulate hook): ``ln_f.bias`` (d·2 B) at the root's reduce-scatter of the 5.4M GPT in bf16, an untied
    ``lm_head.weight`` (the root's last parameter) on transformers' classes, the tied embedding's (V·h) of a
    group ``[norm, embed_tokens, lm_head]`` (a group's last in ``fully_shard``'s order:
    wrap._fully_shard_order)."""
    if run.nd == 1 or shape is None:
        return ()
    return (Term(f"unsharded gradient of the last parameter ({what}, foreach_reduce's loop variable)",
                 math.prod(shape) * run.p, "_fsdp_collectives.py:foreach_reduce"),)  # fmt: skip


@memo_term
def rs_output(run: Fsdp2Run, u: int) -> Term:
    """Unit ``u``'s reduce-scatter output (S_u in the reduce dtype)."""
    return _fp(f"reduce-scatter output (unit {u})", run.shard(u) * run.r, "_fsdp_collectives.py:foreach_reduce")


@memo_term
def grad_cast(run: Fsdp2Run, u: int) -> Term:
    """The reduce-scatter output cast to the module dtype (nothing when the dtypes agree)."""
    return _fp(f"gradient cast to the module dtype (unit {u})", run.shard(u) * run.m if run.r != run.m else 0,
               "_fsdp_collectives.py:foreach_reduce (_to_dtype_if_needed)")  # fmt: skip


@memo_term
def gloo_copy(run: Fsdp2Run, u: int) -> tuple[Term, ...]:
    """gloo's copy of unit ``u``'s whole reduce-scatter input (nccl and the fake group: nothing)."""
    if run.settings.backend != "gloo":
        return ()
    return (Term(f"gloo reduce-scatter copy of the whole input (unit {u})", run.nd * run.shard(u) * run.r,
                 "measured: ProcessGroupGloo runs reduce-scatter as an allreduce of a copy of the input, "
                 "then copies its chunk out (aten.split, aten.copy_ seen at dispatch)"),)  # fmt: skip


def fsdp2_run(workload: Workload, nd: int, settings: Settings, replicate: int = 1) -> Fsdp2Run:
    """The run of ``workload`` as ``settings.wrap`` wraps it (``units.shard_units_of``; ``units.profile_units``);
    ``replicate``: its HSDP replicas (``Fsdp2Run.replicate``, given here rather than by a ``replace``: a speed-up)."""
    spec = workload.spec
    shard_units = shard_units_of(workload, settings)
    if spec is not None:
        prefix = block_prefix(spec)
    else:  # bare shapes: decoder layers where the names say so (GPT-2 or Llama names), else one unit
        known = [p for p in BLOCK_PREFIX.values() if any(n.startswith(p) for n, _ in workload.shapes)]
        prefix = known[0] if known else "\0"
    units, settings = profile_units(shard_units, prefix, settings, spec is not None, workload.shapes)
    if spec is None:
        return Fsdp2Run(units, nd, settings, foreach=_foreach(workload, settings), shard_units=shard_units,
                        replicate=replicate)
    act_bytes = dtype_bytes(settings.param)
    stat_bytes = 4 if settings.device == "cuda" else act_bytes  # CPU native_layer_norm: stats in the input dtype
    acts = model_activations(spec, workload.micro_batch, workload.seq_len, act_bytes=act_bytes, stat_bytes=stat_bytes)
    final, param_order = _final_and_order(workload.shapes, prefix)  # shapes as lists: built each time
    hf = workload.transformers
    rotary = hf and spec.style == "llama"

    buffers = rotary_buffer_bytes(spec) if rotary else 0  # fp32 inv_freq, original_inv_freq: hf_tree.rotary_buffers
    scale = embed_scale_bytes(spec) if hf else 0
    if scale and act_bytes == scale:  # fp32: the embedding's product saved the buffer itself (embed_scale_bytes)
        acts = replace(acts, embed_saved=acts.embed_saved - scale)
    return Fsdp2Run(units, nd, settings, acts, workload.checkpointing, _foreach(workload, settings),
                    spec.vocab_size * spec.d_model, final, tied_head=spec.tied, style=spec.style,
                    biased_linear=spec.biased_linear, param_order=param_order,
                    transformers=hf, loss_in_forward=hf and settings.loss_in_forward, buffer_bytes=buffers,
                    router_bytes=router_bias_bytes(spec) if hf else 0, router_copy=_router_copies(spec, hf, act_bytes),
                    rotary_init_bytes=rotary_recompute_bytes(spec) if rotary else 0,
                    scale_bytes=scale, position_bytes=workload.seq_len * 8 if rotary else 0,
                    shard_units=shard_units, replicate=replicate,
                    ac_every=settings.selective_ac if settings.selective_ac != "op" else 1,
                    **_op_policy(workload, settings, act_bytes))  # fmt: skip


@by_identity  # one shapes tuple for every candidate and rank of a plan at one T: not hashed (a speed-up)
def _final_and_order(shapes: tuple[tuple[str, Shape], ...], prefix: str) -> tuple[int, tuple[Shape, ...]]:
    """``fsdp2_run``'s final norm outside the decoder layers (numel) and every parameter's shape, in order."""
    norms = (s for n, s in shapes if not n.startswith(prefix) and n.rsplit(".", 2)[-2] in ("ln_f", "norm"))
    return sum(map(math.prod, norms)), tuple(tuple(s) for _, s in shapes)


def _op_policy(workload: Workload, settings: Settings, a: int) -> dict:
    """The per-op selective policy's fields of the run (``selective_ac.op_cache``, ``op_forward_peak``)."""
    if settings.selective_ac != "op" or workload.checkpointing == "none":
        return {}
    spec, s, b = workload.spec, workload.seq_len, workload.micro_batch
    if (why := op_limit(spec)) is not None:
        raise ValueError(why)
    cuda = settings.device == "cuda"
    return {"ac_op": True, "op_cache": op_cache(spec, b * s, b, s, a, cuda),
            "op_forward": op_forward_peak(spec, b * s, b, s, a, cuda)}


def _router_copies(spec, hf: bool, param_bytes: int) -> tuple[int, ...]:
    """Per layer, its router's fp32 weight copy under a 16-bit param_dtype (hf_buffers.router_weight_copy_bytes)."""
    copy = router_weight_copy_bytes(spec, param_bytes) if hf else 0
    return tuple(copy if copy and i in spec.moe.sparse_layers else 0 for i in range(spec.n_layer)) if copy else ()


def _foreach(workload: Workload, settings: Settings) -> bool:
    return workload.foreach if settings.foreach is None else settings.foreach
