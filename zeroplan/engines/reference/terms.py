"""What one rank of the reference runtime holds, as terms: the run (units, stage, activations) and one
function per term, each naming the ``validate/<file>.py:<function>`` that allocates it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from zeroplan.architectures.spec import Shape, TransformerSpec, block_prefix, transformer_shapes
from zeroplan.engines.reference.settings import ADAM_STEP_BYTES, MASTER_BYTES
from zeroplan.formulas.activation_terms import ModelActivations, model_activations
from zeroplan.formulas.optimizers import optimizer_states
from zeroplan.formulas.peak import Term
from zeroplan.formulas.sharding import flat_padded_numel, flat_shard_numel
from zeroplan.formulas.stages import get_stage

#: the final norm's parameter names (transformers' GPT2Model.ln_f, LlamaModel.norm)
FINAL_NORM_PREFIX = {"gpt": "transformer.ln_f.", "llama": "model.norm."}


@dataclass(frozen=True)
class ReferenceRun:
    """One rank of the reference runtime training a transformer.

    ``units``: element counts of each unit's tensors, root first then one tuple per block (in
    ``validate/runtime.py:split_units`` order); ``head_numel`` and ``final_norm_numel``: the LM head
    weight (V·d, tied or not) and the final norm's parameters, whose gradients come first in backward.
    """

    units: tuple[tuple[int, ...], ...]
    head_numel: int
    final_norm_numel: int
    nd: int
    stage: int
    acts: ModelActivations
    checkpointing: str = "none"
    foreach: bool = False
    param_bytes: int = 2
    tied_head: bool = True  # the head is the token embedding (GPT): its two gradients meet in backward
    late_grads_numel: int = 0  # a block's parameters whose gradients come before its post-attention norm's input's
    grad_accum: int = 1  # micro-steps per optimizer step (validate/runtime.py:Runtime.grad_accum)
    gloo: bool = False  # the process group is gloo, whose reduce-scatter copies its input (``gloo_copy``)
    amsgrad: bool = False  # Adam(amsgrad=True): a third fp32 state, max_exp_avg_sq (``adam_states``)

    def __post_init__(self) -> None:
        get_stage(self.stage)
        if self.nd < 1 or len(self.units) < 2:
            raise ValueError(f"nd={self.nd}, units={len(self.units)}: need nd >= 1 and a root plus blocks")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum={self.grad_accum}: must be >= 1")
        if self.checkpointing not in ("none", "full"):
            raise ValueError(f"checkpointing={self.checkpointing!r}: expected none or full")


def _psi(run: ReferenceRun) -> int:
    return sum(sum(u) for u in run.units)


def _align(run: ReferenceRun) -> int:
    """Stage 0 keeps whole unpadded tensors (DDP); sharded stages pad every tensor to N_d (flat.py)."""
    return run.nd if get_stage(run.stage).shards_optimizer else 1


@lru_cache(maxsize=64)  # every moment asks, for every stage of a plan: the layout is the same
def unit_shards(units: tuple[tuple[int, ...], ...], nd: int) -> tuple[int, ...]:
    """Elements of each unit's shard on one of ``nd`` ranks (``flat_shard_numel``), in unit order."""
    return tuple(flat_shard_numel(u, nd) for u in units)


@lru_cache(maxsize=4096)  # the blocks' units are alike: one entry serves them all
def _padded(unit: tuple[int, ...], align: int) -> int:
    return flat_padded_numel(unit, align)


def _shard(run: ReferenceRun) -> int:
    """Elements of this rank's master shard (validate/runtime.py:Runtime.__init__, local_slices)."""
    if not get_stage(run.stage).shards_optimizer:
        return _psi(run)
    return sum(unit_shards(run.units, run.nd))


def _full(run: ReferenceRun, unit: tuple[int, ...]) -> int:
    """Elements of a unit's full flat buffer (validate/flat.py:FlatLayout.full_numel)."""
    return _padded(unit, _align(run))


def params16(run: ReferenceRun) -> Term:
    """16-bit parameters kept between steps: full (stages 0-2, padded from 1) or the shard (3)."""
    st, a = get_stage(run.stage), run.param_bytes
    if st.shards_parameters:
        return Term("16-bit parameter shard", _shard(run) * a, "validate/stage3.py:Stage3.setup")
    src = "validate/stage1.py:Stage1.setup" if st.shards_optimizer else "validate/stage0.py:Stage0.setup"
    return Term("16-bit parameters", sum(_full(run, u) for u in run.units) * a, src)


def grads16(run: ReferenceRun) -> Term:
    """Persistent 16-bit gradients: the full flat buffer (stages 0-1) or the reduced shard (2-3)."""
    st, a = get_stage(run.stage), run.param_bytes
    if st.shards_gradients:
        return Term("16-bit gradient shard", _shard(run) * a, "validate/stage2.py:Stage2.setup_grads")
    src = "validate/stage1.py:Stage1.setup_grads" if st.shards_optimizer else "validate/stage0.py:Stage0.setup"
    return Term("16-bit gradient buffer", sum(_full(run, u) for u in run.units) * a, src)


def master(run: ReferenceRun) -> Term:
    """fp32 master copy of this rank's shard (validate/runtime.py:Runtime.__init__)."""
    return Term("fp32 master", _shard(run) * MASTER_BYTES, "validate/runtime.py:Runtime.__init__")


def adam_states(run: ReferenceRun) -> Term:
    """Adam's m and v (with amsgrad max v; fp32, like the master: ``optimizer_states``) and its step scalar,
    created lazily at the first step."""
    states = optimizer_states("adam", "fp32", run.amsgrad)
    name = f"Adam {', '.join(s.name.removeprefix('Adam ') for s in states)}, step"
    return Term(name, sum(s.bytes(_shard(run)) for s in states) + ADAM_STEP_BYTES,
                "torch/optim/adam.py:Adam._init_group via validate/runtime.py:Runtime.step",
                tensors=len(states) + 1)  # fmt: skip


def batch(run: ReferenceRun) -> Term:
    """The micro-batch's int64 tokens and targets, copied to the device (validate/worker.py:measure_stage)."""
    return Term("batch (token ids, targets)", run.acts.batch, "validate/worker.py:measure_stage", tensors=2)


def _states(run: ReferenceRun) -> tuple[Term, ...]:
    return (params16(run), grads16(run), master(run), adam_states(run))


def _gathered(run: ReferenceRun, *units: int) -> tuple[Term, ...]:
    """Stage 3: units whose full 16-bit parameters are gathered (validate/stage3.py:Stage3._gather)."""
    if not get_stage(run.stage).shards_parameters:
        return ()
    names = {0: "gathered root unit"}
    return tuple(
        Term(names.get(u, "gathered block unit"), _full(run, run.units[u]) * run.param_bytes,
             "validate/stage3.py:Stage3._gather")  # fmt: skip
        for u in units
    )


def _kept_grads(run: ReferenceRun) -> bool:
    """Stages 2-3 let autograd allocate each gradient and keep it until its unit is reduced
    (validate/stage2.py:Stage2.unit_grads_ready); stages 0-1 accumulate into the persistent buffer."""
    return get_stage(run.stage).shards_gradients


def gloo_copy(run: ReferenceRun, u: int) -> tuple[Term, ...]:
    """gloo's copy of unit ``u``'s whole reduce-scatter input, alive while the collective runs
    (validate/collectives.py:reduce_scatter_mean); nccl and the fake group: nothing."""
    if not run.gloo or run.nd == 1:  # N_d = 1: reduce_scatter_mean copies into the output, no collective
        return ()
    return (Term(f"gloo reduce-scatter copy of the whole input ({'root' if u == 0 else 'block'} unit)",
                 _full(run, run.units[u]) * run.param_bytes,
                 "measured: ProcessGroupGloo runs reduce-scatter as an allreduce of a copy of the input"),)


def _act(name: str, nbytes: int, tensors: int = 1) -> Term:
    return Term(name, nbytes, "zeroplan/formulas/activation_terms.py", tensors)


def _blocks_saved(run: ReferenceRun, n: int) -> Term:
    """Saved activations of ``n`` blocks (their inputs only under full checkpointing)."""
    what = "saved activations" if run.checkpointing == "none" else "checkpointed block inputs"
    return _act(f"{what} of {n} blocks", run.acts.saved_through(n, run.checkpointing), n)


def reference_run(
    spec: TransformerSpec,
    nd: int,
    stage: int,
    micro_batch: int,
    seq_len: int,
    checkpointing: str = "none",
    foreach: bool = False,
    stat_bytes: int = 2,
    grad_accum: int = 1,
    shapes: Optional[tuple[tuple[str, Shape], ...]] = None,
) -> ReferenceRun:
    """The run of ``spec`` as ``validate/transformer.py:CausalLM`` builds it: units (root, then each decoder
    layer by ``block_prefix``) sized from ``shapes``, the parameters as built (``Workload.shapes``: the
    model's ``named_parameters()``); None: the architecture's own (``transformer_shapes``)."""
    units, final_norm, late = _layout(spec, shapes)
    acts = model_activations(spec, micro_batch, seq_len, stat_bytes=stat_bytes)
    return ReferenceRun(units, spec.vocab_size * spec.d_model, final_norm, nd, stage, acts,
                        checkpointing, foreach, tied_head=spec.tied, late_grads_numel=late,
                        grad_accum=grad_accum)  # fmt: skip


@lru_cache(maxsize=16)  # every stage of a plan, and its trace, build the same units
def _layout(spec: TransformerSpec, shapes: Optional[tuple[tuple[str, Shape], ...]]
            ) -> tuple[tuple[tuple[int, ...], ...], int, int]:
    """(units, final norm elements, the last block's late gradients) of ``reference_run``, in one pass over
    the parameter names: a parameter named ``{prefix}{i}.`` with i < L is block i's (``block_prefix``)."""
    shapes, prefix = (transformer_shapes(spec) if shapes is None else shapes), block_prefix(spec)
    root: list[int] = []
    blocks: list[list[int]] = [[] for _ in range(spec.n_layer)]
    for n, s in shapes:
        if not n.startswith(prefix):
            root.append(math.prod(s))
            continue
        index, dot, _ = n[len(prefix):].partition(".")
        if dot and index.isascii() and index.isdigit() and str(int(index)) == index and int(index) < spec.n_layer:
            blocks[int(index)].append(math.prod(s))
    final_norm = sum(math.prod(s) for n, s in shapes if n.startswith(FINAL_NORM_PREFIX[spec.style]))
    last = f"{prefix}{spec.n_layer - 1}."
    late = sum(math.prod(s) for n, s in shapes
               if n.startswith(last) and (".mlp." in n or "post_attention_layernorm" in n))  # fmt: skip
    return (tuple(root), *(tuple(b) for b in blocks)), final_norm, late
