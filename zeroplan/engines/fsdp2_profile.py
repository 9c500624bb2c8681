"""What PyTorch FSDP2 (``fully_shard``) allocates and sends, as data: the FSDP2 engine profile.

Read from torch 2.13.0's ``torch/distributed/fsdp/_fully_shard/`` (files and functions cited per term as
``_file.py:Class.function``) and checked against the real thing by ``validate/engines/fsdp2.py``
(``tests/test_fsdp2_runner.py``: model states and collectives equal, byte for byte and element for element).
Wrapping as FSDP2 documents it: one unit per transformer block, then the root (embeddings, final norm);
units are listed in forward order, root first (its pre-forward all-gather runs before any block's).

Symbols: ``nd`` ranks; a parameter of shape ``(d0, *rest)`` is split on dim 0 into ``c = ceil(d0 / nd)``
rows per rank, every rank storing ``c * prod(rest)`` elements (rank r's real rows are
``clamp(d0 - r * c, 0, c)``, the rest is padding); ``S_u`` = sum over unit u's parameters of
``c * prod(rest)``, the unit's padded shard. Dtypes: ``module`` (the parameters as built; the shards keep
it, so under a bf16 policy they stay fp32 and there is no separate master copy), ``param`` (policy
param_dtype, else module), ``reduce`` (policy reduce_dtype, else param). Pure: no torch; count elements,
convert to bytes once (``zeroplan.formulas.dtypes``).

Mapping onto the peak model's records (``zeroplan.formulas.peak``, issue 8): every ``TermSpec`` below
evaluated for one unit becomes a ``Term(name, bytes, source)``; ``TermSpec.phases`` says in which
phases' moments it is live.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from zeroplan.formulas.dtypes import canonical_dtype, dtype_bytes

TORCH_VERSION = "2.13.0"  # the source read; 2.11 differs in the reduce-scatter buffer retention (see docs)
SRC = "torch/distributed/fsdp/_fully_shard/"

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard`` unit: its name and the shapes of the parameters it manages, in order."""

    name: str
    shapes: tuple[Shape, ...]


@dataclass(frozen=True)
class Policy:
    """FSDP2's knobs that change memory or traffic: module dtype, ``MixedPrecisionPolicy``, resharding."""

    module_dtype: str = "fp32"
    param_dtype: str | None = None  # MixedPrecisionPolicy.param_dtype; None: no cast
    reduce_dtype: str | None = None  # MixedPrecisionPolicy.reduce_dtype; None: the param dtype
    reshard_after_forward: bool | int = True  # on the blocks; the root is never resharded after forward

    @property
    def param(self) -> str:
        """Gathered parameters and autograd's gradients (_fsdp_param.py:FSDPParam.init_dtype_attrs)."""
        return canonical_dtype(self.param_dtype or self.module_dtype)

    @property
    def reduce(self) -> str:
        """Reduce-scatter dtype (_fsdp_collectives.py:foreach_reduce: ``reduce_dtype or grad_dtype``)."""
        return canonical_dtype(self.reduce_dtype or self.param)

    @property
    def module(self) -> str:
        return canonical_dtype(self.module_dtype)


@dataclass(frozen=True)
class TermSpec:
    """One buffer FSDP2 allocates: phases it is live in, its size, dtype and where the source says so."""

    name: str
    phases: tuple[str, ...]
    per: str  # "model", "unit" or "param tensor"
    numel: str  # in the symbols of the module docstring
    dtype: str  # "module", "param", "reduce" or "fp32"
    source: str


ALL = ("init", "forward", "backward", "optimizer_step")
TERMS: tuple[TermSpec, ...] = (
    TermSpec("unsharded model at init", ("init",), "model", "sum numel (as built)", "module",
             "the model as built; each unit's full tensors are dropped when its fully_shard returns "
             f"({SRC}_fsdp_param.py:FSDPParam._init_sharded_param: 'Let param_data be freed')"),
    TermSpec("sharded parameters (padded)", ALL, "param tensor", "c * prod(rest)", "module",
             f"{SRC}_fsdp_param.py:FSDPParam._init_sharded_param (new_zeros(padded_sharded_size)); "
             "padding: _fsdp_common.py:_chunk_with_empty, chunks[0] is the padded size"),
    TermSpec("all-gather copy-in (cast shard)", ("forward", "backward"), "unit", "S_u", "param",
             f"{SRC}_fsdp_collectives.py:_get_param_all_gather_inputs (flat_foreach_copy_input, only when "
             "param dtype != module dtype); freed when foreach_all_gather returns"),
    TermSpec("all-gather output (flat)", ("forward", "backward"), "unit", "nd * S_u", "param",
             f"{SRC}_fsdp_collectives.py:foreach_all_gather (all_gather_output); in forward kept until the "
             "next unit's wait_for_unshard (_fsdp_param_group.py:FSDPParamGroup.wait_for_unshard, "
             "AllGatherState), the last one until the root's post-forward (_fsdp_state.py:_post_forward); "
             "in backward freed after copy-out"),
    TermSpec("unsharded parameters", ("forward", "backward"), "unit", "nd * S_u", "param",
             f"{SRC}_fsdp_param.py:FSDPParam.init_all_gather_outputs / alloc_all_gather_outputs (one padded "
             "buffer per tensor, filled by _fsdp_collectives.py:foreach_all_gather_copy_out); freed by "
             "FSDPParam.free_unsharded_param at reshard (after forward if reshard_after_forward, the root "
             "only after backward: _fsdp_state.py:FSDPState._lazy_init)"),
    TermSpec("post-forward shard (reshard_after_forward=k)", ("forward", "backward"), "unit", "nd * S_u / k",
             "param", f"{SRC}_fsdp_param.py:FSDPParam.to_sharded_post_forward (clone of the gathered data)"),
    TermSpec("backward prefetch (next unit's all-gather output)", ("backward",), "unit", "nd * S_(u-1)",
             "param",
             f"{SRC}_fsdp_param_group.py:FSDPParamGroup._backward_prefetch (unshard of the previous unit in "
             "forward order, issued in pre_backward, copied out at that unit's pre_backward)"),
    TermSpec("unsharded gradients", ("backward",), "param tensor", "d0 * prod(rest)", "param",
             "autograd, on the unsharded parameter; released by "
             f"{SRC}_fsdp_collectives.py:foreach_reduce (unsharded_grads.clear() after copy-in)"),
    TermSpec("reduce-scatter input", ("backward",), "unit", "nd * S_u", "reduce",
             f"{SRC}_fsdp_collectives.py:foreach_reduce (reduce_scatter_input, padded by "
             "_fsdp_common.py:_get_dim0_padded_size); kept in comm_ctx.reduce_scatter_states until the next "
             "unit's post_backward (_fsdp_param_group.py:FSDPParamGroup.post_backward, max_input_buffers=1), "
             "the last until _fsdp_state.py:FSDPState._root_post_backward_final_callback"),
    TermSpec("reduce-scatter output", ("backward",), "unit", "S_u", "reduce",
             f"{SRC}_fsdp_collectives.py:foreach_reduce (reduce_output); becomes the sharded gradient when "
             "reduce dtype == module dtype, else freed after the cast"),
    TermSpec("sharded gradients (padded)", ("backward", "optimizer_step"), "unit", "S_u", "module",
             f"{SRC}_fsdp_collectives.py:foreach_reduce (_to_dtype_if_needed(reduce_output, orig_dtype); "
             "each grad is an as_strided view into it); freed by optimizer.zero_grad(set_to_none=True)"),
    TermSpec("Adam exp_avg, exp_avg_sq", ("optimizer_step", "forward", "backward"), "param tensor",
             "2 * clamp(d0 - r * c, 0, c) * prod(rest)", "module",
             "torch/optim/adam.py:Adam._init_group (zeros_like of the DTensor parameter: the local shard "
             "without padding), created lazily at the first step"),
    TermSpec("Adam step", ("optimizer_step", "forward", "backward"), "param tensor", "1", "fp32",
             "torch/optim/adam.py:Adam._init_group (torch.tensor(0.0, dtype=_get_scalar_dtype()))"),
)


def shard_rows(d0: int, nd: int) -> int:
    """Rows of dim 0 each rank stores, padding included: ceil(d0 / nd) (_fsdp_common.py:_chunk_with_empty)."""
    if d0 < 0 or nd < 1:
        raise ValueError(f"d0={d0}, nd={nd}: need d0 >= 0 and nd >= 1")
    return -(-d0 // nd)


def padded_shard_numel(shape: Shape, nd: int) -> int:
    """Elements a rank stores of one parameter: ceil(d0 / nd) * prod(rest) (FSDPParam._init_sharded_param)."""
    return shard_rows(shape[0], nd) * prod(shape[1:]) if shape else 1


def local_shard_numel(shape: Shape, nd: int, rank: int) -> int:
    """Real (unpadded) elements of rank ``rank``'s shard: what ``zeros_like`` of the DTensor allocates."""
    if not shape:
        return 1 if rank == 0 else 0
    c = shard_rows(shape[0], nd)
    return min(c, max(0, shape[0] - rank * c)) * prod(shape[1:])


def unit_shard_numel(unit: Unit, nd: int) -> int:
    """S_u: the unit's padded shard, the all-gather input and reduce-scatter output per rank."""
    return sum(padded_shard_numel(s, nd) for s in unit.shapes)


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


def model_states(units: tuple[Unit, ...], nd: int, rank: int, policy: Policy) -> ModelStates:
    """Model states of rank ``rank`` under FSDP2 with Adam (terms and sources: ``TERMS``)."""
    shapes = [s for u in units for s in u.shapes]
    module = dtype_bytes(policy.module)
    return ModelStates(
        params_bytes=sum(padded_shard_numel(s, nd) for s in shapes) * module,
        grads_bytes=sum(unit_shard_numel(u, nd) for u in units) * module,
        adam_moments_bytes=2 * sum(local_shard_numel(s, nd, rank) for s in shapes) * module,
        adam_step_bytes=len(shapes) * dtype_bytes("fp32"),
    )


@dataclass(frozen=True)
class Collective:
    """One collective as FSDP2 issues it: full size in elements (all-gather output, reduce-scatter input)."""

    op: str
    phase: str
    unit: str
    elements: int
    dtype: str
    group_size: int


def collectives(units: tuple[Unit, ...], nd: int, policy: Policy) -> tuple[Collective, ...]:
    """The collectives of one training step, in issue order (units in forward order, root first).

    Forward: one all-gather per unit (_fsdp_collectives.py:foreach_all_gather). Backward: the blocks are
    gathered again in reverse order when resharded after forward (over the post-forward group of k ranks
    for an int k; the root never is: _fsdp_state.py:FSDPState._lazy_init), one reduce-scatter per unit in
    reverse order (_fsdp_collectives.py:foreach_reduce). Sizes are nd * S_u.
    """
    full = {u.name: nd * unit_shard_numel(u, nd) for u in units}
    out = [Collective("all-gather", "forward", u.name, full[u.name], policy.param, nd) for u in units]
    rsf = policy.reshard_after_forward
    group = nd if rsf is True else int(rsf)
    for u in reversed(units[1:]):  # blocks, last first
        if rsf is not False and group > 1:
            out.append(Collective("all-gather", "backward", u.name, full[u.name], policy.param, group))
    for u in reversed(units):
        out.append(Collective("reduce-scatter", "backward", u.name, full[u.name], policy.reduce, nd))
    return tuple(out)


def units_of(named_shapes: tuple[tuple[str, Shape], ...], block_prefix: str) -> tuple[Unit, ...]:
    """FSDP2's documented wrapping: one unit per decoder layer (``<block_prefix><i>.``, see
    ``architectures.spec.block_prefix``), the other parameters in the root (first)."""
    root: list[Shape] = []
    blocks: dict[str, list[Shape]] = {}
    for name, shape in named_shapes:
        if name.startswith(block_prefix):
            index = name[len(block_prefix) :].split(".", 1)[0]
            blocks.setdefault(block_prefix + index, []).append(tuple(shape))
        else:
            root.append(tuple(shape))
    return (Unit("root", tuple(root)), *(Unit(n, tuple(s)) for n, s in blocks.items()))



def init_peak_bytes(units: tuple[Unit, ...], nd: int, policy: Policy) -> int:
    """Peak of ``init``: build in the module dtype, ``fully_shard`` each block, then the root, create Adam.

    While a unit is sharded, the units not yet sharded are whole and the padded shards of the units sharded
    so far and of this one exist: FSDPParam._init_sharded_param (_fsdp_param.py) allocates the shard
    before the unit's whole tensors are dropped when fully_shard returns. Adam's constructor allocates
    nothing (its states come at the first step). Wrap order: the blocks (``units[1:]``), then the root.
    """
    whole = [sum(prod(s) for s in u.shapes) for u in units]
    shard = [unit_shard_numel(u, nd) for u in units]
    order = [*range(1, len(units)), 0]
    live, peak = sum(whole), sum(whole)
    for i in order:
        peak = max(peak, live + shard[i])
        live += shard[i] - whole[i]
    return peak * dtype_bytes(policy.module)
