"""PyTorch FSDP2 (``fully_shard``) as an engine: what it allocates and sends, phase by phase, as data.

Read from torch 2.13.0's ``torch/distributed/fsdp/_fully_shard/`` (``SRC``; every term cites
``<file>.py:<Class.function>``) and measured against the real thing by ``validate/engines/fsdp2.py``
(``tests/test_fsdp2_engine.py``). Pure: no torch; counts elements, converts to bytes once.

Wrapping is data (``wrap.py``, ``Settings.wrap``): the ``fully_shard`` calls in call order, ``blocks`` by
default (FSDP2's documented pattern: one unit per decoder layer, ``architectures.spec.block_prefix``, then the
root: embeddings, final norm, an untied head), ``torchtitan`` or a file. The profile's units are listed in
forward order, root first: every unit beside the decoder layers is counted in unit 0, the root side, with its
own lifetime (``side.py``). The root keeps FSDP2's default ``reshard_after_forward=None``, which does not
reshard it after forward (``_fsdp_state.py:FSDPState._lazy_init``: ``post_forward_mesh_info = None``), unless a
wrapping passes True.

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

Files, as FSDP2's own ``_fully_shard/`` splits them: ``settings`` (``Settings``, the sources), ``wrap`` (the
wrapping as data, resolved into units), ``param`` (the dim-0 padding rule, units), ``collectives``, ``side``
(the root side's units), ``terms`` (the run and one function per term),
``moments`` (the phases), ``launcher`` (the ``fully_shard`` snippet), ``plan`` (``estimate`` and the
planner's side). This module re-exports the names other modules use.
"""

from __future__ import annotations

from zeroplan.engines.base import Engine, EngineOption
from zeroplan.engines.fsdp2.alloc_trace import alloc_traces
from zeroplan.engines.fsdp2.collectives import UnitCollective, unit_collectives
from zeroplan.engines.fsdp2.declared import LAUNCHER, RUN_OPTIONS
from zeroplan.engines.fsdp2.launcher import fsdp2_snippet, settings_snippet
from zeroplan.engines.fsdp2.leaders import predict_peak
from zeroplan.engines.fsdp2.moments import (
    backward_moments,
    forward_moments,
    init_moments,
    moments,
)
from zeroplan.engines.fsdp2.optimizer_step import optimizer_moments
from zeroplan.engines.fsdp2.param import (
    Shape,
    Unit,
    local_shard_numel,
    padded_shard_numel,
    shard_rows,
    unit_shard_numel,
    units_of,
)
from zeroplan.engines.fsdp2.vocabulary import VOCABULARY  # the settings room: each option and its check
from zeroplan.engines.fsdp2.plan import (
    CANDIDATES,
    PLAN_ORDER,
    PLANNER_OPTIONS,
    Fsdp2Option,
    estimate,
    plan_options,
    planner_block_bytes,
    planner_peak_limits,
    planner_plan,
    planner_policy,
    planner_settings,
    recommend,
)
from zeroplan.engines.fsdp2.live import live_settings
from zeroplan.engines.fsdp2.settings import SRC, TORCH_VERSION, Settings, post_forward_group
from zeroplan.engines.fsdp2.terms import Fsdp2Run, ModelStates, fsdp2_run, mesh_ranks_bytes, model_states

__all__ = [
    "CANDIDATES", "VOCABULARY", "PLAN_ORDER", "PLANNER_OPTIONS", "SRC", "TORCH_VERSION", "Fsdp2Option", "Fsdp2Run",
    "ModelStates", "Settings", "Shape", "Unit", "UnitCollective", "backward_moments", "estimate",
    "forward_moments", "fsdp2_run", "fsdp2_snippet", "init_moments", "local_shard_numel", "mesh_ranks_bytes",
    "model_states", "moments", "optimizer_moments", "padded_shard_numel", "plan_options", "planner_block_bytes",
    "planner_plan", "planner_policy", "planner_settings", "post_forward_group", "predict_peak", "recommend",
    "settings_snippet", "shard_rows", "unit_collectives", "unit_shard_numel", "units_of", "ENGINE",
]  # fmt: skip

ENGINE = Engine("fsdp2", estimate, Settings, planner_settings, planner_policy, PLANNER_OPTIONS, planner_plan,
                block_bytes=planner_block_bytes, plan_chooses=("checkpointing",), own_options=VOCABULARY,
                alloc_trace=alloc_traces, own_peak_limits=planner_peak_limits, live_settings=live_settings,
                launcher=LAUNCHER, run_options=RUN_OPTIONS, runner="validate.engines.fsdp2_run")
"""FSDP2 as the registry knows it (``zeroplan.engines``): the command line's batch, its own plan search."""
