"""Which ``fully_shard`` units a run has: ``settings.wrap`` resolved in the model's names (``wrapping_of``,
``shard_units_of``), and the units the profile's moments walk (``profile_units``: the root side, then one per
decoder layer). Read by ``terms.fsdp2_run`` and the plan."""

from __future__ import annotations

import re

from zeroplan.architectures.spec import BLOCK_PREFIX
from zeroplan.engines.base import Workload
from zeroplan.engines.fsdp2.param import Unit
from zeroplan.engines.fsdp2.settings import Settings
from zeroplan.engines.fsdp2.wrap import ShardUnit, Wrapping, preset, resolve


def wrapping_of(workload: Workload, settings: Settings) -> Wrapping | None:
    """``settings.wrap`` as a ``Wrapping`` in ``workload``'s module names (a preset resolved for its layout);
    None for bare shapes without decoder-layer names under ``blocks`` (everything in the root)."""
    spec = workload.spec
    if spec is not None:
        style = spec.style
    else:  # bare shapes: the style whose decoder-layer prefix the names use (a scan of every name: only here)
        known = [s for s, p in BLOCK_PREFIX.items() if any(n.startswith(p) for n, _ in workload.shapes)]
        style = known[0] if known else None
    if isinstance(settings.wrap, Wrapping):
        return settings.wrap
    if style is None and settings.wrap == "blocks":
        return None
    if style is None:
        raise ValueError(f"--fsdp-wrap {settings.wrap}: the parameters have no decoder-layer names "
                         f"({', '.join(BLOCK_PREFIX.values())})")  # fmt: skip
    tied = spec.tied if spec is not None else not any(n.startswith("lm_head.") for n, _ in workload.shapes)
    return preset(settings.wrap, style, settings.reshard_after_forward, tied)


def shard_units_of(workload: Workload, settings: Settings) -> tuple[ShardUnit, ...]:
    """The ``fully_shard`` calls of ``settings.wrap`` on ``workload``'s parameters (``wrap.resolve``)."""
    wrapping = wrapping_of(workload, settings)
    if wrapping is None:
        return (ShardUnit(("",), tuple((n, tuple(s)) for n, s in workload.shapes), None, True),)
    spec = workload.spec
    tied = (("lm_head", workload.shapes[0][0]),) if spec is not None and spec.tied and workload.transformers else ()
    return resolve(wrapping, workload.shapes, tied)  # transformers' tied lm_head: the embedding's weight


def profile_units(shard_units: tuple[ShardUnit, ...], prefix: str, settings: Settings, peak: bool,
                  named_shapes: tuple):
    """(the profile's units: root first, then one per decoder layer; the settings with the blocks' value).
    Every unit that is not a decoder layer (the root and the units beside it: embeddings, ``[norm, output]``)
    is counted in one root-side unit kept gathered all step, which bounds them from above (its shards are
    exact: padding is per parameter); ``edge_regathers`` adds what gathering one of them again for backward
    holds. ``peak``: the moments need each decoder layer as its own unit, all with one reshard value;
    ``named_shapes``: the model's (name, shape) pairs in ``named_parameters()`` order, of which ``shard_units``
    were resolved."""
    inner, values, units = _profile(shard_units, prefix, named_shapes)
    if peak and (inner or len(values) > 1):
        why = f"{inner[0]!r} is a unit inside a decoder layer" if inner else "the decoder layers differ in reshard_after_forward"
        raise ValueError(f"wrapping: {why}; the FSDP2 peak models one unit per decoder layer with one "
                         "reshard_after_forward value")  # fmt: skip
    if len(values) == 1 and isinstance(settings.wrap, Wrapping):
        (value,) = values
        if "reshard_after_forward" in settings.model_fields_set and settings.reshard_after_forward != value:
            raise ValueError(f"reshard_after_forward={settings.reshard_after_forward} contradicts the wrapping's "
                             f"decoder layers ({value}): give one of them")  # fmt: skip
        settings = settings.model_copy(update={"reshard_after_forward": value})
    return units, settings


_PROFILED: dict[int, tuple] = {}
"""``_profile``'s results by the identity of its arguments (a speed-up, no rule): ``wrap.resolve`` gives one
tuple of units for a model's shapes and wrapping, so the estimates of a plan's search (18 for llama3-405b on 2,048
GPUs), which differ in the mesh, the rank and the checkpointing, share one profile's units, built once; the
units' per-N_d shards (``unit_shard_numel``) are then looked up on the same objects."""


def _profile(shard_units: tuple[ShardUnit, ...], prefix: str, named_shapes: tuple) -> tuple[list, set, tuple]:
    """(the unit names inside a decoder layer, the blocks' reshard values, the profile's units) of
    ``profile_units``: a function of its arguments only, kept by their identity (``_PROFILED``, the arguments
    held there so that no other object takes their ids)."""
    got = _PROFILED.get(id(shard_units))
    if got is not None and got[0] is shard_units and got[1] is named_shapes and got[2] == prefix:
        return got[3]
    pattern = re.compile(re.escape(prefix) + r"[0-9]+")
    blocks = [u for u in shard_units if len(u.modules) == 1 and pattern.fullmatch(u.modules[0])]
    block_ids = {id(u) for u in blocks}  # by identity: comparing units field by field is O(units²) (a speed-up)
    side = [u for u in shard_units if id(u) not in block_ids]
    inner = [m for u in side for m in u.modules if m.startswith(prefix)]
    values = {True if u.reshard_after_forward is None else u.reshard_after_forward for u in blocks}
    order = {n: i for i, (n, _) in enumerate(named_shapes)}  # each parameter's place in named_parameters()
    root = sorted((p for u in side for p in u.params), key=lambda p: order[p[0]])
    units = (Unit("root", tuple(s for _, s in root)),
             *(Unit(u.modules[0], tuple(s for _, s in u.params)) for u in sorted(blocks, key=lambda u: u.first)))
    if type(named_shapes) is tuple:  # kept only for shapes that cannot change (a list could)
        if len(_PROFILED) >= 64:  # a long-lived process (tests, a sweep): bounded
            _PROFILED.clear()
        _PROFILED[id(shard_units)] = (shard_units, named_shapes, prefix, (inner, values, units))
    return inner, values, units
