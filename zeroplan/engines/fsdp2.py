"""PyTorch FSDP2 (``fully_shard``) as an engine: what it allocates and sends, phase by phase, as data.

Read from torch 2.13.0's ``torch/distributed/fsdp/_fully_shard/`` (``SRC``; every term cites
``<file>.py:<Class.function>``) and measured against the real thing by ``validate/engines/fsdp2.py``
(``tests/test_fsdp2_engine.py``). Pure: no torch; counts elements, converts to bytes once.

Wrapping is FSDP2's documented pattern: one unit per decoder layer (``architectures.spec.block_prefix``),
then the root (embeddings, final norm, an untied head); units are listed in forward order, root first.
The root keeps FSDP2's default ``reshard_after_forward=None``, which does not reshard it after forward
(``_fsdp_state.py:FSDPState._lazy_init``: ``post_forward_mesh_info = None``).

Symbols: ``nd`` ranks; a parameter of shape ``(d0, *rest)`` is split on dim 0 into ``c = ceil(d0/nd)``
rows per rank, every rank storing ``c·prod(rest)`` elements (rank r's real rows are
``clamp(d0 - r·c, 0, c)``, the rest is padding); ``S_u`` = Σ over unit u's parameters of
``c·prod(rest)``, the unit's padded shard. Dtypes: ``module`` (the parameters as built; the shards keep
it, so under a bf16 policy they stay fp32 and there is no separate master copy), ``param`` (policy
``param_dtype``, else module: gathered parameters, activations and autograd's gradients), ``reduce``
(policy ``reduce_dtype``, else param).

Phases (``zeroplan.formulas.peak``): ``init`` (build in the module dtype, ``fully_shard`` each block,
then the root, construct Adam), ``forward`` (batch in, loss), ``backward``, ``optimizer_step`` (Adam,
``zero_grad(set_to_none=True)``). Forward and backward moments hold Adam's m and v (created at the
first step; a phase's peak is the largest over steps). Activations come from
``zeroplan.formulas.activation_terms.model_activations``.

torch 2.11: the all-gather and reduce-scatter schedule is the same; 2.11 has no
``reduce_scatter_max_input_buffers`` and keeps each reduce-scatter input until the next
``post_backward`` waits on it (one retained, as here with the default of 1); re-read before claiming a
2.11 row exact (docs/engines/fsdp2.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from zeroplan.architectures.spec import block_prefix
from zeroplan.engines.base import Candidate, EngineEstimate, EnginePlan, PlannerOptions, Workload
from zeroplan.formulas.activation_terms import ModelActivations, model_activations
from zeroplan.formulas.collectives import Collective, ring_bytes_per_rank
from zeroplan.formulas.dtypes import canonical_dtype, dtype_bytes
from zeroplan.formulas.memory import MemoryBreakdown
from zeroplan.formulas.offload import NO_OFFLOAD, Offload, check_offload
from zeroplan.formulas.cuda_workspaces import library_workspaces
from zeroplan.formulas.peak import CUDA_BLOCK_BYTES, Moment, PeakEstimate, Term, peak_of
from zeroplan.policy import BF16_MIXED, PrecisionPolicy

TORCH_VERSION = "2.13.0"  # the source the terms were read from
SRC = "torch/distributed/fsdp/_fully_shard/"
ADAM = "torch/optim/adam.py"
STEP_BYTES = 4  # Adam's ``step`` (torch.tensor(0.0, dtype=_get_scalar_dtype()): fp32), one per tensor

Shape = tuple[int, ...]


# ---- the dim-0 padding rule (_fsdp_common.py:_chunk_with_empty, _get_dim0_padded_size) ----


def shard_rows(d0: int, nd: int) -> int:
    """Rows of dim 0 each rank stores, padding included: ceil(d0 / nd) (_fsdp_common.py:_chunk_with_empty)."""
    if d0 < 0 or nd < 1:
        raise ValueError(f"d0={d0}, nd={nd}: need d0 >= 0 and nd >= 1")
    return -(-d0 // nd)


def padded_shard_numel(shape: Shape, nd: int) -> int:
    """Elements a rank stores of one parameter: ceil(d0 / nd)·prod(rest) (FSDPParam._init_sharded_param)."""
    return shard_rows(shape[0], nd) * math.prod(shape[1:]) if shape else 1


def local_shard_numel(shape: Shape, nd: int, rank: int) -> int:
    """Real (unpadded) elements of rank ``rank``'s shard: what ``zeros_like`` of the DTensor allocates."""
    if not shape:
        return 1 if rank == 0 else 0
    c = shard_rows(shape[0], nd)
    return min(c, max(0, shape[0] - rank * c)) * math.prod(shape[1:])


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard`` unit: its name and the shapes of the parameters it manages, in order."""

    name: str
    shapes: tuple[Shape, ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def unit_shard_numel(unit: Unit, nd: int) -> int:
    """S_u: the unit's padded shard, the all-gather input and reduce-scatter output per rank."""
    return sum(padded_shard_numel(s, nd) for s in unit.shapes)


def units_of(named_shapes: tuple[tuple[str, Shape], ...], prefix: str) -> tuple[Unit, ...]:
    """FSDP2's documented wrapping: one unit per decoder layer (``<prefix><i>.``), the rest in the root (first)."""
    root: list[Shape] = []
    blocks: dict[str, list[Shape]] = {}
    for name, shape in named_shapes:
        if name.startswith(prefix):
            index = name[len(prefix) :].split(".", 1)[0]
            blocks.setdefault(prefix + index, []).append(tuple(shape))
        else:
            root.append(tuple(shape))
    return (Unit("root", tuple(root)), *(Unit(n, tuple(s)) for n, s in blocks.items()))


# ---- settings, in FSDP2's vocabulary ----

Dtype = Literal["fp32", "bf16", "fp16"]


class Settings(BaseModel):
    """One FSDP2 configuration: ``fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype,
    reduce_dtype), reshard_after_forward=...)`` per decoder layer, then ``fully_shard(model, mp_policy)``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reshard_after_forward: StrictBool | StrictInt = Field(
        True, description="True: blocks gathered again in backward (ZeRO-3); False: kept (ZeRO-2); an int k: "
        "kept sharded over k ranks between forward and backward (FSDP2's int option)",
    )  # fmt: skip
    module_dtype: Dtype = Field("fp32", description="dtype the model is built in; the shards keep it")
    param_dtype: Dtype | None = Field(None, description="MixedPrecisionPolicy.param_dtype; None: module dtype")
    reduce_dtype: Dtype | None = Field(None, description="MixedPrecisionPolicy.reduce_dtype; None: param dtype")
    foreach: bool | None = Field(None, description="Adam's foreach path; None: Workload.foreach")
    device: Literal["cuda", "cpu"] = Field(
        "cuda", description="cuda: 512-byte allocator blocks and fp32 LayerNorm statistics; cpu: neither"
    )
    backend: Literal["nccl", "gloo", "fake"] = Field(
        "nccl", description="process group backend: gloo's reduce-scatter copies its whole input (a term); "
        "nccl and the fake group (simulation) add nothing",
    )  # fmt: skip
    rank: StrictInt = Field(0, ge=0, description="the rank described (rank 0 holds the most: padding is at the end)")
    init: Literal["meta", "materialized"] = Field(
        "meta", description="meta: built on the meta device, fully_shard, to_empty, initialised shard by shard "
        "(FSDP2's pattern for models larger than one GPU; the planner's default); materialized: built whole "
        "on the device, then fully_shard (init holds the whole model)",
    )  # fmt: skip
    cuda_capability: tuple[StrictInt, StrictInt] = Field(
        (9, 0), description="device cuda: the GPU's compute capability, which sizes the cuBLAS workspaces "
        "(formulas.cuda_workspaces); (9, 0) is H100/H200",
    )  # fmt: skip

    @field_validator("reshard_after_forward")
    @classmethod
    def _k(cls, v: bool | int) -> bool | int:
        if not isinstance(v, bool) and v < 1:
            raise ValueError(f"reshard_after_forward={v}: an int must be >= 1")
        return v

    @property
    def module(self) -> str:
        return canonical_dtype(self.module_dtype)

    @property
    def param(self) -> str:
        """Gathered parameters and autograd's gradients (_fsdp_param.py:FSDPParam.init_dtype_attrs)."""
        return canonical_dtype(self.param_dtype or self.module_dtype)

    @property
    def reduce(self) -> str:
        """Reduce-scatter dtype (_fsdp_collectives.py:foreach_reduce: ``reduce_dtype or grad_dtype``)."""
        return canonical_dtype(self.reduce_dtype or self.param)

    def label(self) -> str:
        mp = f", param {self.param}, reduce {self.reduce}" if self.param != self.module else ""
        return f"fully_shard reshard_after_forward={self.reshard_after_forward}{mp}"


def post_forward_group(settings: Settings, nd: int) -> int:
    """Ranks a block stays sharded over between its forward and backward: nd (True), 1 (False, kept
    whole) or k (_fsdp_init.py:_get_post_forward_mesh_info; k must divide nd)."""
    rsf = settings.reshard_after_forward
    if rsf is True:
        return nd
    if rsf is False:
        return 1
    if nd % rsf:
        raise ValueError(f"reshard_after_forward={rsf}: must divide N_d={nd}")
    return rsf


# ---- model states ----


@dataclass(frozen=True)
class ModelStates:
    """Persistent bytes of one rank, per term, and what the step boundaries hold."""

    params_bytes: int
    grads_bytes: int
    adam_moments_bytes: int  # exp_avg + exp_avg_sq
    adam_step_bytes: int

    @property
    def after_init_bytes(self) -> int:
        """After fully_shard and the optimizer's construction: the sharded parameters alone."""
        return self.params_bytes

    def after_backward_bytes(self, step: int) -> int:
        """After backward of step ``step`` (0-based): parameters, gradients, and Adam's states from step 1."""
        return self.params_bytes + self.grads_bytes + (self.optimizer_bytes if step >= 1 else 0)

    @property
    def optimizer_bytes(self) -> int:
        return self.adam_moments_bytes + self.adam_step_bytes

    @property
    def boundary_bytes(self) -> int:
        """After optimizer.step() and zero_grad(set_to_none=True): parameters and Adam's states."""
        return self.params_bytes + self.optimizer_bytes


def model_states(units: tuple[Unit, ...], nd: int, settings: Settings) -> ModelStates:
    """Model states of ``settings.rank`` under FSDP2 with Adam (terms: ``params``, ``grads``, ``adam``)."""
    shapes = [s for u in units for s in u.shapes]
    module = dtype_bytes(settings.module)
    return ModelStates(
        params_bytes=sum(padded_shard_numel(s, nd) for s in shapes) * module,
        grads_bytes=sum(unit_shard_numel(u, nd) for u in units) * module,
        adam_moments_bytes=2 * sum(local_shard_numel(s, nd, settings.rank) for s in shapes) * module,
        adam_step_bytes=len(shapes) * STEP_BYTES,
    )


# ---- collectives ----


@dataclass(frozen=True)
class UnitCollective:
    """One collective as FSDP2 issues it: full size in elements (all-gather output, reduce-scatter input)."""

    op: str
    phase: str
    unit: str
    elements: int
    dtype: str
    group_size: int


def unit_collectives(units: tuple[Unit, ...], nd: int, settings: Settings) -> tuple[UnitCollective, ...]:
    """The collectives of one training step, in issue order (units in forward order, root first).

    Forward: one all-gather per unit (_fsdp_collectives.py:foreach_all_gather). Backward: the blocks are
    gathered again in reverse order when resharded after forward (over the post-forward group of k ranks
    for an int k; never the root: _fsdp_state.py:FSDPState._lazy_init), one reduce-scatter per unit in
    reverse order (_fsdp_collectives.py:foreach_reduce). Sizes are nd·S_u (dim-0 padded).
    """
    full = {u.name: nd * unit_shard_numel(u, nd) for u in units}
    out = [UnitCollective("all-gather", "forward", u.name, full[u.name], settings.param, nd) for u in units]
    group = post_forward_group(settings, nd)
    for u in reversed(units[1:]):  # blocks, last first
        if group > 1:
            out.append(UnitCollective("all-gather", "backward", u.name, full[u.name], settings.param, group))
    for u in reversed(units):
        out.append(UnitCollective("reduce-scatter", "backward", u.name, full[u.name], settings.reduce, nd))
    return tuple(out)


# ---- the run: what one rank trains ----


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

    @property
    def m(self) -> int:
        return dtype_bytes(self.settings.module)

    @property
    def p(self) -> int:
        return dtype_bytes(self.settings.param)

    @property
    def r(self) -> int:
        return dtype_bytes(self.settings.reduce)

    def shard(self, u: int) -> int:
        return unit_shard_numel(self.units[u], self.nd)


def _fp(name: str, nbytes: int, where: str, tensors: int = 1) -> Term:
    return Term(name, nbytes, SRC + where, tensors)


def _act(name: str, nbytes: int, tensors: int = 1) -> Term:
    return Term(name, nbytes, "zeroplan/formulas/activation_terms.py:model_activations", tensors)


def params(run: Fsdp2Run) -> Term:
    """Sharded parameters, padded, in the module dtype (no separate master copy)."""
    return _fp("sharded parameters (module dtype, padded)", sum(run.shard(u) for u in range(len(run.units))) * run.m,
               "_fsdp_param.py:FSDPParam._init_sharded_param", sum(len(u.shapes) for u in run.units))  # fmt: skip


def grads(run: Fsdp2Run, units) -> Term:
    """Sharded gradients of ``units`` (views into each unit's reduce-scatter output, cast to the module dtype)."""
    units = tuple(units)
    return _fp(f"sharded gradients of {len(units)} unit(s)", sum(run.shard(u) for u in units) * run.m,
               "_fsdp_collectives.py:foreach_reduce (_to_dtype_if_needed(reduce_output, orig_dtype))", len(units))  # fmt: skip


def adam(run: Fsdp2Run) -> Term:
    """Adam's exp_avg, exp_avg_sq (zeros_like of the DTensor: the local shard, unpadded) and step."""
    st = model_states(run.units, run.nd, run.settings)
    n = sum(len(u.shapes) for u in run.units)
    return Term("Adam exp_avg, exp_avg_sq, step", st.optimizer_bytes, f"{ADAM}:Adam._init_group (first step)", 3 * n)


def unsharded(run: Fsdp2Run, u: int) -> Term:
    """A unit's unsharded parameters: one padded buffer per tensor in the param dtype."""
    what = "root" if u == 0 else f"block {u}"
    return _fp(f"unsharded parameters ({what})", run.nd * run.shard(u) * run.p,
               "_fsdp_param.py:FSDPParam.alloc_all_gather_outputs", len(run.units[u].shapes))  # fmt: skip


def ag_output(run: Fsdp2Run, u: int, why: str) -> Term:
    """A unit's flat all-gather output (kept in forward until the next unit's copy-out)."""
    what = "root" if u == 0 else f"block {u}"
    return _fp(f"all-gather output ({what}, {why})", run.nd * run.shard(u) * run.p,
               "_fsdp_collectives.py:foreach_all_gather; _fsdp_param_group.py:FSDPParamGroup.wait_for_unshard")  # fmt: skip


def copy_in(run: Fsdp2Run, u: int, post_forward: bool = False) -> Term:
    """The all-gather input copied into one flat buffer in the param dtype (none when the dtypes agree:
    ``use_foreach_copy`` needs a ``param_dtype``); from the post-forward state of an int k it is the
    k-sharded data, nd·S_u/k elements, else the shard S_u (_fsdp_collectives.py:_get_param_all_gather_inputs)."""
    cast = run.settings.param != run.settings.module
    numel = run.nd * run.shard(u) // post_forward_group(run.settings, run.nd) if post_forward else run.shard(u)
    return _fp(f"all-gather copy-in (unit {u}{', post-forward' if post_forward else ''}, cast)",
               numel * run.p if cast else 0, "_fsdp_collectives.py:_get_param_all_gather_inputs")  # fmt: skip


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


def mesh_ranks(run: Fsdp2Run) -> tuple[Term, ...]:
    """``mesh_ranks_bytes`` as a term of every moment from the first ``fully_shard`` on."""
    if not partial_reshard(run):
        return ()
    return (_fp("post-forward mesh ranks (int32)", mesh_ranks_bytes(run.settings, run.nd),
                "_fsdp_init.py:_get_post_forward_mesh_info"),)  # fmt: skip


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
    k = post_forward_group(run.settings, run.nd)
    if k == run.nd:
        return ()
    if k == 1:
        return tuple(unsharded(run, u) for u in range(1, upto + 1))
    return tuple(post_forward_shard(run, u) for u in range(1, upto + 1))


def resharded(run: Fsdp2Run) -> bool:
    """Blocks are gathered again for backward (True, or an int k < nd)."""
    return post_forward_group(run.settings, run.nd) > 1


def batch(run: Fsdp2Run) -> Term:
    return Term("batch (token ids, targets)", run.acts.batch, "validate/engines/fsdp2.py:measure", 2)


def _blocks_saved(run: Fsdp2Run, n: int) -> Term:
    per = run.acts.block.saved if run.checkpointing == "none" else run.acts.block.ckpt_saved
    what = "saved activations" if run.checkpointing == "none" else "checkpointed block inputs"
    return _act(f"{what} of {n} blocks", n * per, n)


# ---- moments ----


def init_moments(run: Fsdp2Run) -> tuple[Moment, ...]:
    """``fully_shard`` of each block, then the root: the units not yet sharded are whole, and the shard
    of this unit is allocated before its whole tensors are dropped (_fsdp_param.py:
    FSDPParam._init_sharded_param). Adam's constructor allocates nothing (its states come at step 1).

    ``init="meta"``: nothing is allocated until ``to_empty`` gives each shard device memory
    (torch/nn/modules/module.py:Module.to_empty, then _fully_shard/_fully_shard.py:FSDPModule._apply:
    FSDPParam.reset_sharded_param), and the in-place initialisation adds nothing (measured: the init
    peak is the padded shards, gpt-tiny N_d = 2 and tiny-llama N_d = 8, MemTracker less the meta device)."""
    if run.settings.init == "meta":
        rank, src = run.settings.rank, "_fsdp_param.py:FSDPParam.reset_sharded_param"
        shapes = run.param_order or tuple(s for u in run.units for s in u.shapes)
        repad = [local_shard_numel(s, run.nd, rank) for s in shapes
                 if local_shard_numel(s, run.nd, rank) != padded_shard_numel(s, run.nd)]  # fmt: skip
        return (
            Moment("init", "to_empty: the shards get device memory", (*mesh_ranks(run), params(run))),
            # a shard shorter than its padded size (ranks at the end) is copied into a new padded tensor
            # while its unpadded one is alive: the largest such copy on top of all shards bounds the peak
            Moment("init", "to_empty: re-padding a short shard", (*mesh_ranks(run), params(run),
                   _fp("the unpadded shard being re-padded", max(repad, default=0) * run.m, src))),
        )  # fmt: skip
    order = [*range(1, len(run.units)), 0]
    out = []
    for i, u in enumerate(order):
        whole = sum(run.units[v].numel for v in order[i:]) * run.m
        done = sum(run.shard(v) for v in order[:i]) * run.m
        out.append(Moment("init", f"fully_shard({run.units[u].name})", (
            *mesh_ranks(run), Term("unsharded units as built", whole, "validate/models.py:build"),
            _fp("shards of the units sharded before", done, "_fsdp_param.py:FSDPParam._init_sharded_param"),
            _fp("this unit's new shard", run.shard(u) * run.m, "_fsdp_param.py:FSDPParam._init_sharded_param"))))  # fmt: skip
    return tuple(out)


def forward_moments(run: Fsdp2Run) -> tuple[Moment, ...]:
    """The last block's all-gather and forward, the LM head, the loss (_fsdp_state.py:FSDPState._pre_forward,
    _post_forward: the last all-gather output is freed when the root's forward returns)."""
    acts, blk, L = run.acts, run.acts.block, len(run.units) - 1
    base = (*mesh_ranks(run), params(run), adam(run), batch(run),
            _act("embedding saved (position ids)", acts.embed_saved), unsharded(run, 0))  # fmt: skip
    prev = ag_output(run, L - 1 if L > 1 else 0, "previous unit, freed when this copy-out returns")
    gather = Moment("forward", f"block {L} all-gather", (
        *base, *kept_blocks(run, L - 1), _blocks_saved(run, L - 1), _act("block input", acts.embed_out),
        prev, copy_in(run, L), ag_output(run, L, "this unit")))  # fmt: skip
    # wait_for_unshard binds the previous all-gather state to a local (``if prev_all_gather_state := ...``),
    # so the previous output is freed only when it returns, after this block's copy-out (measured)
    copy_out = Moment("forward", f"block {L} copy-out", (
        *base, *kept_blocks(run, L - 1), _blocks_saved(run, L - 1), _act("block input", acts.embed_out),
        prev, ag_output(run, L, "this unit"), unsharded(run, L)))  # fmt: skip
    if run.checkpointing == "none":
        work = (_blocks_saved(run, L), _act("block output and last op's output", blk.forward_extra, 2))
    else:
        work = (_blocks_saved(run, L - 1), _act("checkpointed block's working set (no grad)", blk.ckpt_forward_peak))
    last = Moment("forward", f"block {L} forward", (
        *base, *kept_blocks(run, L - 1), *work, ag_output(run, L, "kept until the root's post-forward"),
        unsharded(run, L)))  # fmt: skip
    # reshard_after_forward=k: the block's post-forward copies its k-sharded slices while it is whole
    # (the block output is alive, its last op's output is gone: traced, gpt-tiny N_d = 8, k = 2)
    reshard = (Moment("forward", f"block {L} post-forward reshard", (
        *base, *kept_blocks(run, L - 1), _blocks_saved(run, L), _act("block output", acts.embed_out),
        ag_output(run, L, "kept until the root's post-forward"), unsharded(run, L), post_forward_reshard(run, L))),
    ) if partial_reshard(run) else ()  # fmt: skip
    head_acts = (_blocks_saved(run, L), _act("final norm saved and output", acts.final_saved),
                 _act("logits", acts.logits))  # fmt: skip
    head = Moment("forward", "LM head", (*base, *kept_blocks(run, L), *head_acts,
                                         ag_output(run, L, "kept until the root's post-forward")))  # fmt: skip
    # ``logits.float()`` (validate/transformer.py:CausalLM.loss): a copy beside the 16-bit logits, which
    # nothing keeps once it exists (the head saves its input); in fp32 it is the logits themselves
    fp32_logits = _act("fp32 logits (loss upcast)", acts.logits_fp32 if run.p != 4 else acts.logits)
    upcast = Moment("forward", "logits upcast", (*base, *kept_blocks(run, L), *head_acts, fp32_logits))
    loss = Moment("forward", "cross-entropy", (*base, *kept_blocks(run, L), *head_acts[:2], fp32_logits,
                  _act("log-softmax (fp32, saved by cross-entropy)", acts.log_softmax), _act("loss", acts.loss)))  # fmt: skip
    return (gather, copy_out, last, *reshard, head, *((upcast,) if run.p != 4 else ()), loss)


def input_norm_backward(run: Fsdp2Run) -> Term:
    """A block's input norm when it runs backward (the block's last backward op): what it saved plus its
    working set. Derived from the ops (to move into ``activation_terms``, which does not split them out):
    - llama (transformers LlamaRMSNorm): saved h32 = x.to(fp32) (N·d·4), rsqrt (N·4), the normalised
      16-bit h (N·d·a) and its output (N·d·a, saved by q/k/v); the backward of ``h32.pow(2)`` and of
      ``h32 * rsqrt`` holds three fp32 N·d temporaries beside the accumulating fp32 input gradient (4·N·d·4),
      as traced at dispatch (llama-2-7b at N_d = 64: 6·N·d·4 above the rest, 2 KiB under);
    - gpt (nn.LayerNorm): saved input (N·d·a), mean and rstd (2·N·st), its output (N·d·a); the fused
      ``native_layer_norm_backward`` allocates the input gradient (N·d·a).
    """
    acts, a = run.acts, run.p
    nd_elems = acts.embed_out // a  # N·d
    n = acts.batch // 16  # tokens: ids and targets are int64
    if run.style == "llama":
        nbytes = nd_elems * 4 + n * 4 + 2 * nd_elems * a + 4 * nd_elems * 4
    else:
        st = (acts.final_saved - 2 * nd_elems * a) // (2 * n)
        nbytes = 3 * nd_elems * a + 2 * n * st
    return Term("input norm saved and backward working set", nbytes,
                "derived from LlamaRMSNorm / nn.LayerNorm backward (see input_norm_backward)")


def reduce_scatter_moments(what: str, common, rs_in: Term, rs_out: Term, cast: Term, gloo) -> tuple[Moment, ...]:
    """A unit's reduce-scatter, then the cast of its output to the module dtype: two moments, since gloo's
    copy of the input is gone before the cast (_fsdp_collectives.py:foreach_reduce runs
    ``_to_dtype_if_needed(reduce_output, orig_dtype)`` after the collective; traced at dispatch, gpt-tiny
    bf16/bf16 at N_d = 2: the copy drops as the fp32 cast is made, so both are never live together)."""
    return (Moment("backward", f"{what} reduce-scatter", (*common, rs_in, rs_out, *gloo)),
            Moment("backward", f"{what} cast to the module dtype", (*common, rs_in, rs_out, cast)))  # fmt: skip


def final_norm_backward(run: Fsdp2Run) -> Term:
    """The final norm running backward, after the LM head (its output, saved by the head, and the logits
    gradient are gone): what it saved plus its working set.
    - llama: the fp32 copy h32 and five fp32 N·d temporaries at ``pow``'s backward (the gradient through
      h·rsqrt, through the mean, pow's h^1, its scaled copy, their product), 6·N·d·4; rsqrt, the 16-bit
      normalised copy and the output gradient are released by then (traced at dispatch: tiny-llama with 4
      layers, N_d = 8, bf16 and fp32, reshard_after_forward=2: the backward peak, exact);
    - gpt: the saved input, mean and rstd, the output gradient and ``native_layer_norm_backward``'s input
      gradient: ``final_saved`` (input, stats, output) + N·d·a.
    """
    acts, a = run.acts, run.p
    nd_elems = acts.embed_out // a  # N·d
    nbytes = 6 * nd_elems * 4 if run.style == "llama" else acts.final_saved + nd_elems * a
    return Term("final norm saved and backward working set", nbytes,
                "derived from LlamaRMSNorm / nn.LayerNorm backward (see final_norm_backward)")


def backward_moments(run: Fsdp2Run) -> tuple[Moment, ...]:
    """Loss and head backward (the root's pre-backward prefetches the last block), each block's backward
    and reduce-scatter (_fsdp_param_group.py:FSDPParamGroup.pre_backward, _backward_prefetch, post_backward;
    _fsdp_collectives.py:foreach_reduce), the embeddings, the root's reduce-scatter (_fsdp_state.py:
    FSDPState._root_post_backward_final_callback)."""
    acts, blk, L, p = run.acts, run.acts.block, len(run.units) - 1, run.p
    n_d = acts.embed_out  # one N·d activation (or its gradient)
    base = (*mesh_ranks(run), params(run), adam(run), batch(run),
            _act("embedding saved (position ids)", acts.embed_saved), _act("loss", acts.loss), unsharded(run, 0))  # fmt: skip
    saved_all = (_blocks_saved(run, L), _act("final norm saved and output", acts.final_saved))
    prefetch = (lambda u: (ag_output(run, u, "backward prefetch"),) if resharded(run) and u >= 1 else ())
    out = [Moment("backward", "cross-entropy backward", (*base, *kept_blocks(run, L), *saved_all,
                  _act("log-softmax (fp32, saved by cross-entropy)", acts.log_softmax),
                  _act("nll and log-softmax gradients (fp32)", 2 * acts.log_softmax, 2)))]  # fmt: skip
    # a backward all-gather copies its input (the shard, or the k-sharded data) into a flat param-dtype
    # buffer first, freed once the collective returns: the root's pre_backward prefetches the last block
    gather_in = lambda u: copy_in(run, u, post_forward=partial_reshard(run))
    if resharded(run):
        out.append(Moment("backward", f"block {L} backward all-gather (root's prefetch)", (
            *base, *kept_blocks(run, L), *saved_all, _act("logits gradient", acts.logits), gather_in(L),
            ag_output(run, L, "backward prefetch"))))  # fmt: skip
    root_held = Term("root gradients held (head weight, final norm)", (run.head_numel + run.final_norm_numel) * p,
                     "autograd (unsharded root .grad until the root's post_backward)", 2)  # fmt: skip
    out.append(Moment("backward", "LM head backward", (*base, *kept_blocks(run, L), *saved_all,
                      _act("logits gradient", acts.logits), _act("final norm output gradient", n_d),
                      Term("head weight gradient", run.head_numel * p, "autograd (mm backward)"), *prefetch(L))))  # fmt: skip
    out.append(Moment("backward", "final norm backward", (*base, *kept_blocks(run, L), _blocks_saved(run, L),
                      root_held, final_norm_backward(run), *prefetch(L))))  # fmt: skip
    ws = max(blk.backward_first_op, blk.backward_act_grads + blk.first_weight_grads)
    grad_of = lambda u: Term(f"unsharded gradients (block {u})", run.units[u].numel * p,
                             "autograd; freed in _fsdp_collectives.py:foreach_reduce (unsharded_grads.clear())",
                             len(run.units[u].shapes))  # fmt: skip
    rs_in = lambda u, why: _fp(f"reduce-scatter input (unit {u}, {why})", run.nd * run.shard(u) * run.r,
                               "_fsdp_collectives.py:foreach_reduce; _fsdp_param_group.py:FSDPParamGroup.post_backward")  # fmt: skip
    rs_out = lambda u: _fp(f"reduce-scatter output (unit {u})", run.shard(u) * run.r, "_fsdp_collectives.py:foreach_reduce")
    cast = lambda u: _fp(f"gradient cast to the module dtype (unit {u})",
                         run.shard(u) * run.m if run.r != run.m else 0,
                         "_fsdp_collectives.py:foreach_reduce (_to_dtype_if_needed)")  # fmt: skip
    gloo = lambda u: (Term(f"gloo reduce-scatter copy of the whole input (unit {u})", run.nd * run.shard(u) * run.r,
                           "measured: ProcessGroupGloo runs reduce-scatter as an allreduce of a copy of the input, "
                           "then copies its chunk out (aten.split, aten.copy_ seen at dispatch)"),)  # fmt: skip
    gloo = gloo if run.settings.backend == "gloo" else (lambda u: ())
    for i in range(L, 0, -1):
        done = grads(run, range(i + 1, L + 1))
        held = (rs_in(i + 1, "held until the next post_backward"),) if i < L else ()
        if resharded(run):  # pre_backward: the prefetched all-gather output is copied out, then freed (with
            # the block's k-sharded data: FSDPParam.to_unsharded), then the next block is prefetched
            out.append(Moment("backward", f"block {i} copy-out", (
                *base, *kept_blocks(run, i), _blocks_saved(run, i), _act("incoming activation gradient", n_d),
                root_held, ag_output(run, i, "prefetched, freed after copy-out"), unsharded(run, i), *held, done)))  # fmt: skip
            if i > 1:
                out.append(Moment("backward", f"block {i - 1} backward all-gather (prefetch)", (
                    *base, *kept_blocks(run, i - 1), _blocks_saved(run, i), _act("incoming activation gradient", n_d),
                    root_held, unsharded(run, i), gather_in(i - 1), *prefetch(i - 1), *held, done)))  # fmt: skip
        inflight = (_blocks_saved(run, i),)
        if run.checkpointing != "none":
            inflight += (_act("recomputed block's saved activations", blk.recomputed),)
        out.append(Moment("backward", f"block {i} backward", (
            *base, *kept_blocks(run, i - 1), *inflight, _act("incoming activation gradient", n_d), root_held,
            _act("block backward working set", ws), unsharded(run, i), *prefetch(i - 1), *held, done)))  # fmt: skip
        # the block's first op (its input norm) runs backward last: every weight gradient of the block exists
        out.append(Moment("backward", f"block {i} gradients complete", (
            *base, *kept_blocks(run, i - 1), _blocks_saved(run, i - 1), _act("incoming activation gradient", n_d),
            input_norm_backward(run), root_held, unsharded(run, i), grad_of(i), *prefetch(i - 1), *held, done)))  # fmt: skip
        common = (*base, *kept_blocks(run, i - 1), _blocks_saved(run, i - 1),
                  _act("block input gradient", n_d), root_held, *prefetch(i - 1), done)  # fmt: skip
        out.append(Moment("backward", f"block {i} reduce-scatter copy-in",
                          (*common, grad_of(i), rs_in(i, "this unit"))))  # fmt: skip
        out.extend(reduce_scatter_moments(f"block {i}", common, rs_in(i, "this unit"), rs_out(i), cast(i), gloo(i)))
    blocks_done = grads(run, range(1, L + 1))
    others = (run.units[0].numel - run.head_numel) * p
    if run.tied_head:  # torch/csrc/autograd/input_buffer.cpp: the two gradients are summed out of place
        emb = (Term("head weight gradient (input buffer)", run.head_numel * p, "autograd InputBuffer"),
               Term("embedding weight gradient", run.head_numel * p, "aten embedding_dense_backward"),
               Term("their sum", run.head_numel * p, "autograd InputBuffer::add"))  # fmt: skip
    else:
        emb = (Term("head weight gradient", run.head_numel * p, "autograd (mm backward)"),)
    out.append(Moment("backward", "embedding backward", (
        *base, _act("incoming activation gradient", n_d), *emb,
        Term("other root gradients", others, "autograd (embedding, final norm)"),
        rs_in(1, "held until the root's post_backward"), blocks_done)))  # fmt: skip
    root_base = base[:-1]  # the root is resharded before its reduce-scatter
    out.append(Moment("backward", "root reduce-scatter copy-in", (
        *root_base, Term("unsharded gradients (root)", run.units[0].numel * p, "autograd", len(run.units[0].shapes)),
        rs_in(0, "this unit"), blocks_done)))  # fmt: skip
    out.extend(reduce_scatter_moments("root", (*root_base, blocks_done), rs_in(0, "this unit"), rs_out(0), cast(0),
                                      gloo(0)))  # fmt: skip
    return tuple(out)


def optimizer_moments(run: Fsdp2Run) -> tuple[Moment, ...]:
    """Adam on the sharded DTensor parameters. ``_multi_tensor_adam`` (foreach) makes ``sqrt(v)`` for every
    tensor at once (one local shard's worth); ``_single_tensor_adam`` computes ``v.sqrt() /
    bias_correction2_sqrt`` per tensor, two temporaries of the largest local shard alive at once."""
    shapes = run.param_order or tuple(s for u in run.units for s in u.shapes)
    local = [local_shard_numel(s, run.nd, run.settings.rank) for s in shapes]
    if run.foreach:
        temps = Term("Adam temporaries (foreach sqrt(v))", sum(local) * run.m, f"{ADAM}:_multi_tensor_adam", len(local))
    else:
        # ``denom`` stays bound to the previous tensor's quotient until this tensor's is assigned (measured)
        worst = max(2 * n + (local[i - 1] if i else 0) for i, n in enumerate(local))
        temps = Term("Adam temporaries (sqrt(v), its quotient, the previous tensor's denom)", worst * run.m,
                     f"{ADAM}:_single_tensor_adam", 3)  # fmt: skip
    return (Moment("optimizer_step", "Adam update", (*mesh_ranks(run), params(run), adam(run), grads(run, range(len(run.units))), temps)),)


def moments(run: Fsdp2Run) -> tuple[Moment, ...]:
    """Every moment of a training step of FSDP2 (needs activations: an architecture)."""
    if run.acts is None:
        raise ValueError("the peak needs an architecture (activations); this run has only tensor shapes")
    return (*init_moments(run), *forward_moments(run), *backward_moments(run), *optimizer_moments(run))


def predict_peak(run: Fsdp2Run) -> PeakEstimate:
    """The peak of ``run`` per phase; CUDA rounds every block to 512 bytes (``peak.CUDA_BLOCK_BYTES``) and
    keeps the cuBLAS / cuBLASLt workspaces from the first backward on (``formulas.cuda_workspaces``)."""
    if run.settings.device != "cuda":
        return peak_of(moments(run))
    resident = (library_workspaces(run.settings.cuda_capability, run.biased_linear),)
    return peak_of(moments(run), CUDA_BLOCK_BYTES, resident=resident)


def fsdp2_run(workload: Workload, nd: int, settings: Settings) -> Fsdp2Run:
    """The run of ``workload`` as FSDP2 wraps it (units per decoder layer + root)."""
    spec = workload.spec
    if spec is not None:
        prefix = block_prefix(spec)
    else:  # bare shapes: decoder layers where the names say so (GPT-2 or Llama names), else one unit
        known = [p for p in ("transformer.h.", "model.layers.") if any(n.startswith(p) for n, _ in workload.shapes)]
        prefix = known[0] if known else "\0"
    units = units_of(workload.shapes, prefix)
    if spec is None:
        return Fsdp2Run(units, nd, settings, foreach=_foreach(workload, settings))
    act_bytes = dtype_bytes(settings.param)
    stat_bytes = 4 if settings.device == "cuda" else act_bytes  # CPU native_layer_norm: stats in the input dtype
    acts = model_activations(spec, workload.micro_batch, workload.seq_len, act_bytes=act_bytes, stat_bytes=stat_bytes)
    final = sum(math.prod(s) for n, s in workload.shapes if n.rsplit(".", 2)[-2] in ("ln_f", "norm")
                and not n.startswith(prefix))  # fmt: skip
    return Fsdp2Run(units, nd, settings, acts, workload.checkpointing, _foreach(workload, settings),
                    spec.vocab_size * spec.d_model, final, tied_head=spec.tied, style=spec.style,
                    biased_linear=spec.biased_linear, param_order=tuple(tuple(s) for _, s in workload.shapes))  # fmt: skip


def _foreach(workload: Workload, settings: Settings) -> bool:
    return workload.foreach if settings.foreach is None else settings.foreach


def estimate(workload: Workload, nd: int, settings: Settings) -> tuple[EngineEstimate, ...]:
    """The one FSDP2 configuration ``settings`` describes, on ``settings.rank`` of ``nd`` ranks."""
    run = fsdp2_run(workload, nd, settings)
    st = model_states(run.units, nd, settings)
    coll = tuple(
        Collective(
            c.op, c.phase, c.elements, c.dtype, ring_bytes_per_rank(c.op, c.elements, c.group_size, dtype_bytes(c.dtype))
        )
        for c in unit_collectives(run.units, nd, settings)
    )
    memory = MemoryBreakdown(st.params_bytes, st.grads_bytes, st.optimizer_bytes)
    peak = predict_peak(run) if run.acts is not None else None
    return (EngineEstimate("fsdp2", settings.label(), 3 if resharded(run) else 2, memory, peak, coll),)


# ---- planning: the cheapest configuration whose predicted peak fits ----

# Cheapest first: keeping blocks gathered (False) sends no backward all-gather; resharding adds one
# all-gather per block (1.5x the traffic); checkpointing adds one forward per block (~1/3 more compute,
# Korthikanti et al. 2022, section 4). Traffic is cheaper to add than compute on one node, so resharding
# is tried before checkpointing.
CANDIDATES: tuple[tuple[bool, str], ...] = ((False, "none"), (True, "none"), (False, "full"), (True, "full"))


@dataclass(frozen=True)
class Fsdp2Option:
    """One candidate: its settings, checkpointing, the estimate and whether its peak fits."""

    settings: Settings
    checkpointing: str
    estimate: EngineEstimate
    fits: bool

    @property
    def snippet(self) -> str:
        return settings_snippet(self.settings, self.checkpointing)


def plan_options(workload: Workload, nd: int, capacity_bytes: int, settings: Settings) -> tuple[Fsdp2Option, ...]:
    """Every candidate of ``CANDIDATES`` (``settings`` gives the policy), cheapest first, with its peak."""
    if workload.spec is None:
        raise ValueError("planning FSDP2 needs an architecture (its peak): give a model")
    out = []
    for reshard, ckpt in CANDIDATES:
        s = settings.model_copy(update={"reshard_after_forward": reshard})
        w = Workload(workload.shapes, workload.spec, workload.seq_len, workload.micro_batch, ckpt,
                     workload.grad_accum, workload.foreach)  # fmt: skip
        (row,) = estimate(w, nd, s)
        out.append(Fsdp2Option(s, ckpt, row, row.peak.peak_bytes <= capacity_bytes))
    return tuple(out)


def recommend(workload: Workload, nd: int, capacity_bytes: int, settings: Settings) -> Fsdp2Option | None:
    """The cheapest candidate whose predicted peak fits in ``capacity_bytes``; None if none does."""
    return next((o for o in plan_options(workload, nd, capacity_bytes, settings) if o.fits), None)


# ---- the launcher snippet: the code a user copies ----

_TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


def settings_snippet(settings: Settings, checkpointing: str = "none") -> str:
    """``fully_shard`` code for exactly ``settings`` and ``checkpointing`` (what ``estimate`` predicted),
    as ``validate/engines/fsdp2.py:shard`` runs it; ``model.layers`` stands for the decoder layers."""
    dtype = _TORCH_DTYPE[settings.param]
    reduce = _TORCH_DTYPE[settings.reduce]
    ckpt = (
        "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper\n"
        "for i, block in enumerate(model.layers):  # activation checkpointing: recompute each block in backward\n"
        "    model.layers[i] = checkpoint_wrapper(block)\n"
        if checkpointing == "full" else ""
    )  # fmt: skip
    meta = settings.init == "meta"
    init_note = (
        "# built on the meta device: `with torch.device(\"meta\"): model = ...` (no memory until to_empty)\n"
        if meta else "# the model was built whole on the device (init holds all of it before sharding)\n"
    )  # fmt: skip
    materialize = (
        f"model.to_empty(device={settings.device!r})  # each rank allocates its shards only\n"
        "model.init_weights()  # your in-place initialisation, run on the shards (DTensor)\n"
        if meta else ""
    )  # fmt: skip
    return (
        "import torch\n"
        "from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy\n\n"
        f"# {settings.label()}, checkpointing {checkpointing}; shards stay {settings.module} (no master copy)\n"
        f"{init_note}"
        f"{ckpt}"
        f"policy = MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype={reduce})\n"
        "for block in model.layers:  # one unit per decoder layer: one all-gather and reduce-scatter each\n"
        f"    fully_shard(block, mp_policy=policy, reshard_after_forward={settings.reshard_after_forward!r})\n"
        "fully_shard(model, mp_policy=policy)  # the root: FSDP2 does not reshard it after forward\n"
        f"{materialize}"
        f"optimizer = torch.optim.Adam(model.parameters(), foreach={settings.foreach!r})\n"
    )




def fsdp2_snippet(stage: int, offload: Offload = NO_OFFLOAD, policy: PrecisionPolicy = BF16_MIXED) -> str:
    """FSDP2 ``fully_shard`` code for ``stage`` and ``offload``, or a comment saying it has no equivalent."""
    check_offload(stage, offload)
    if stage == 0:
        return (
            "# ZeRO stage 0 is plain data parallelism: no FSDP needed.\n"
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "model = DDP(model)  # gradients all-reduced in buckets during backward\n"
        )
    if stage == 1:
        return "# FSDP2 has no stage-1 equivalent (sharded optimizer states only); use DeepSpeed stage 1.\n"
    full_offload = offload == Offload("cpu", "cpu")
    if offload.any and not full_offload:
        return (
            f"# FSDP2 has no equivalent of stage {stage} + {offload.label}: its CPUOffloadPolicy offloads\n"
            "# parameters, gradients and the optimizer step together\n"
            "# (stage 3 + optimizer->cpu, params->cpu).\n"
        )
    dtype = _TORCH_DTYPE.get(policy.param_dtype, "torch.bfloat16")
    reduce = _TORCH_DTYPE.get(policy.resolved_grad_dtype, dtype)
    reshard = "True" if stage == 3 else "False"
    why = (
        "parameters gathered again for backward" if stage == 3 else "parameters kept unsharded until backward"
    )
    imports = "fully_shard, MixedPrecisionPolicy" + (", CPUOffloadPolicy" if full_offload else "")
    offload_arg = "\n    offload_policy=CPUOffloadPolicy(pin_memory=True)," if full_offload else ""
    return (
        "import torch\n"
        f"from torch.distributed.fsdp import {imports}\n\n"
        f"# ZeRO stage {stage}: reshard_after_forward={reshard} "
        f"({why}).\n"
        "# FSDP2 keeps sharded parameters in their original dtype (fp32) and casts them for compute, so the\n"
        "# optimizer needs no master copy: fp32 params + fp32 grads + Adam m, v = 16 bytes/param per shard.\n"
        "kwargs = dict(\n"
        f"    mp_policy=MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype={reduce}),\n"
        f"    reshard_after_forward={reshard},{offload_arg}\n"
        ")\n"
        "for block in model.layers:  # one FSDP unit per block: one all-gather and reduce-scatter each\n"
        "    fully_shard(block, **kwargs)\n"
        "fully_shard(model, **kwargs)\n"
        "# Gradient accumulation: model.set_requires_gradient_sync(False) on all but the last micro-step\n"
        "# skips the reduce-scatter but keeps unsharded gradients (more memory than the plan assumes).\n"
    )


# ---- the planner's side (estimate, plan, sweep): options -> Settings, the byte convention, the plan ----

PLANNER_OPTIONS: tuple[str, ...] = ("reshard_after_forward", "param_dtype", "reduce_dtype")
"""The ``PlannerOptions`` fields in FSDP2's vocabulary (``fully_shard`` and ``MixedPrecisionPolicy``)."""
PLAN_ORDER = ("keep blocks gathered (no backward all-gather), then reshard (one more all-gather per block), "
              "then checkpointing (one more forward per block), then both")  # fmt: skip


def planner_settings(options: PlannerOptions) -> Settings:
    """FSDP2's ``Settings`` from the planner's options, as ``fully_shard`` runs on CUDA with NCCL and a
    model built in fp32; an option not given keeps FSDP2's default (reshard after forward, no mixed
    precision)."""
    given: dict = {}
    if options.reshard_after_forward is not None:
        given["reshard_after_forward"] = options.reshard_after_forward
    for key in ("param_dtype", "reduce_dtype"):
        if getattr(options, key) is not None:
            given[key] = canonical_dtype(getattr(options, key))
    return Settings(**given)


def planner_policy(settings: Settings) -> PrecisionPolicy:
    """The byte convention of FSDP2's model states (``model_states``): parameters and gradients in the module
    dtype, no master copy, Adam's m and v in the module dtype."""
    return PrecisionPolicy(param_dtype=settings.module, master_weights=False, optimizer="adam",
                           optimizer_dtype=settings.module)  # fmt: skip


def planner_plan(workload: Workload, nd: int, capacity_bytes: int, options: PlannerOptions) -> EnginePlan:
    """``zeroplan plan --engine fsdp2``: every candidate of ``plan_options`` (cheapest first) with the
    snippet of exactly the configuration predicted; the recommendation is ``recommend``'s."""
    settings = planner_settings(options)
    if settings.foreach is None:  # the snippet names the foreach path the prediction used
        settings = settings.model_copy(update={"foreach": workload.foreach})
    options_ = plan_options(workload, nd, capacity_bytes, settings)
    chosen = recommend(workload, nd, capacity_bytes, settings)
    candidates = tuple(
        Candidate(f"reshard_after_forward={o.settings.reshard_after_forward}, checkpointing {o.checkpointing}",
                  o.estimate, o.fits, o.snippet)
        for o in options_
    )  # fmt: skip
    index = None if chosen is None else options_.index(chosen)
    return EnginePlan(candidates, index, "fsdp2", PLAN_ORDER, settings)


def planner_block_bytes(settings: Settings) -> int:
    """The allocator block every peak term is rounded to (``predict_peak``): 512 on CUDA, none on CPU."""
    return CUDA_BLOCK_BYTES if settings.device == "cuda" else 1
