"""FSDP2 wrapping as data: which ``fully_shard`` calls a run makes, in call order, and which parameters each
unit manages (issue 17: the user's own wrapping).

A wrapping is a list of entries in the order ``fully_shard`` is called, the root (``""``) last::

    {"units": [{"modules": ["model.embed_tokens"], "reshard_after_forward": true},
               {"modules": ["model.layers.*"]},
               {"modules": ["model.norm", "lm_head"], "group": true, "reshard_after_forward": false},
               {"modules": [""]}]}

A pattern is a qualified module name as in the model's ``named_modules()``, where ``*`` stands for exactly one
name segment (``model.layers.*`` matches ``model.layers.0``, not ``model.layers.0.mlp``). An entry makes one
``fully_shard`` call per module it matches (torchtitan's loop over the blocks), or with ``"group": true`` one
call over all of them (``fully_shard([model.norm, lm_head])``: one unit, one all-gather). ``null`` is
FSDP2's default: True for a non-root unit, False for the root (``_fsdp_state.py:FSDPState._lazy_init``; torch
2.13 reshards the root when True is passed explicitly, ``_auto_reshard_after_forward``). A parameter belongs
to the unit of its nearest wrapped ancestor module, the root at the latest
(``_fully_shard/_fsdp_init.py:_get_managed_states``, which stops at modules already sharded).

Presets: ``blocks`` (each decoder layer, then the root: FSDP2's documented pattern and zeroplan's default)
and ``torchtitan`` (torchtitan 0.2.2 ``models/llama3/infra/parallelize.py:apply_fsdp``: the token
embeddings, each block, ``[norm, output]`` kept gathered, then the root). Pure: no torch.
"""

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator, model_validator

from zeroplan.architectures.spec import BLOCK_PREFIX, Shape
from zeroplan.engines.fsdp2.memo import by_identity

PRESETS = ("blocks", "torchtitan")
Reshard = Optional[Union[StrictBool, StrictInt]]


class WrapEntry(BaseModel):
    """One entry of a wrapping: the modules it matches, one ``fully_shard`` call each or one for all."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    modules: tuple[str, ...] = Field(min_length=1, description="module name patterns (`*`: one name segment)")
    group: StrictBool = Field(False, description="one fully_shard call over every module matched (one unit)")
    reshard_after_forward: Reshard = Field(
        None, description="true, false, an int k (kept sharded over k ranks) or null (FSDP2's default: True, "
        "False for the root)")  # fmt: skip

    @field_validator("reshard_after_forward")
    @classmethod
    def _k(cls, v):
        if v is not None and not isinstance(v, bool) and v < 1:
            raise ValueError(f"reshard_after_forward={v}: an int must be >= 1")
        return v


class Wrapping(BaseModel):
    """The ``fully_shard`` calls of a run, in call order; the root (``""``) last and only last."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    units: tuple[WrapEntry, ...] = Field(min_length=1, description="entries in fully_shard call order")

    @model_validator(mode="after")
    def _root_last(self) -> "Wrapping":
        *rest, last = self.units
        if last.modules != ("",):
            raise ValueError('the last entry must be the root alone, {"modules": [""]}: fully_shard(model) comes last')
        if any("" in e.modules for e in rest):
            raise ValueError('the root "" may only be the last entry')
        return self

    def label(self) -> str:
        return "; ".join(("[" + ", ".join(e.modules) + "]" if e.group else ", ".join(e.modules) or '""')
                         + ("" if e.reshard_after_forward is None else f" reshard={e.reshard_after_forward}")
                         for e in self.units)  # fmt: skip


@lru_cache(maxsize=64, typed=True)  # True and 1 apart: a bool and an int k reshard differently
def preset(name: str, style: str, blocks: bool | int, tied: bool = False) -> Wrapping:
    """The preset ``name`` in transformers' module names for the layout ``style`` (``architectures.spec``),
    ``blocks`` the decoder layers' (and torchtitan's embeddings') ``reshard_after_forward``. Kept by its arguments
    (a frozen model of them alone): every run and candidate of a plan asks it, three validations each (a speed-up,
    no rule)."""
    layers = WrapEntry(modules=(BLOCK_PREFIX[style] + "*",), reshard_after_forward=blocks)
    root = WrapEntry(modules=("",))
    if name == "blocks":
        return Wrapping(units=(layers, root))
    if name != "torchtitan":
        raise ValueError(f"wrapping {name!r}: expected one of {', '.join(PRESETS)} or a JSON file")
    if tied:
        raise ValueError("--fsdp-wrap torchtitan: torchtitan wraps the token embeddings and the output apart, so a "
                         "tied head would read a resharded weight; torchtitan's models are untied (give a FILE)")  # fmt: skip
    embed, norm = ("transformer.wte", "transformer.ln_f") if style == "gpt" else ("model.embed_tokens", "model.norm")
    return Wrapping(units=(WrapEntry(modules=(embed,), reshard_after_forward=blocks), layers,
                           WrapEntry(modules=(norm, "lm_head"), group=True, reshard_after_forward=False), root))  # fmt: skip


def parse_wrapping(data: object, where: str = "wrapping") -> Wrapping:
    """A wrapping from parsed JSON; ValueError in one line naming the first problem."""
    from zeroplan.types import error_line

    try:
        return Wrapping.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{where}: {error_line(exc)}") from None


def read_wrapping(path: str) -> Wrapping:
    """``--fsdp-wrap FILE.json`` (``zeroplan.files.read_json``: size and depth capped)."""
    from zeroplan.files import read_json

    return parse_wrapping(read_json(path, "fsdp wrapping"), f"fsdp wrapping {path!r}")


# ---- resolving a wrapping against a model's parameters ----


@dataclass(frozen=True)
class ShardUnit:
    """One ``fully_shard`` call resolved: its modules, the parameters it manages (name, shape, in
    ``fully_shard``'s order: ``_fully_shard_order``) and its ``reshard_after_forward`` as given (None: FSDP2's
    default)."""

    modules: tuple[str, ...]
    params: tuple[tuple[str, Shape], ...]
    reshard_after_forward: Reshard
    root: bool = False
    first: int = 0  # where its first parameter is in named_parameters() order (forward_order)
    last: int = 0  # where its last parameter is (a group spanning the layers: [norm, embeddings, head])

    @cached_property  # asked ~25,000 times by a searched plan (side units, collectives): joined once (a speed-up)
    def name(self) -> str:
        return "root" if self.root else ("[" + ", ".join(self.modules) + "]" if len(self.modules) > 1 else self.modules[0])

    def post_forward_group(self, nd: int) -> int:
        """Ranks it stays sharded over between forward and backward: nd (resharded), 1 (kept) or k
        (``_fsdp_init.py:_get_post_forward_mesh_info``); None is True, or False for the root."""
        rsf = self.reshard_after_forward
        if rsf is None:
            rsf = not self.root
        if rsf is True:
            return nd
        if rsf is False:
            return 1
        if nd % rsf:
            raise ValueError(f"{self.name}: reshard_after_forward={rsf}: must divide N_d={nd}")
        return rsf


def matches(pattern: str, module: str) -> bool:
    """``pattern`` names ``module``: the same segments, ``*`` standing for exactly one."""
    if pattern == "" or module == "":
        return pattern == module
    if pattern.count(".") != module.count("."):  # not as many segments (a speed-up: most modules, unsplit)
        return False
    return all(w in ("*", h) for w, h in zip(pattern.split("."), module.split(".")))


def module_names(named_shapes: tuple[tuple[str, Shape], ...]) -> tuple[str, ...]:
    """Every module that holds a parameter or a module that does, root first, in first-seen order."""
    out: dict[str, None] = {"": None}
    for name, _ in named_shapes:
        new = []  # the parameter's module and its ancestors not seen yet, innermost first
        module = name.rpartition(".")[0]
        while module and module not in out:  # a module seen has had its ancestors added with it
            new.append(module)
            module = module.rpartition(".")[0]
        if new:
            out.update(dict.fromkeys(reversed(new)))
    return tuple(out)


def _inside(module: str, ancestor: str) -> bool:
    return ancestor == "" or module == ancestor or module.startswith(ancestor + ".")


def _ancestors(module: str) -> tuple[str, ...]:
    """The modules that hold ``module`` (not the root ""), outermost first."""
    parts = module.split(".")
    return tuple(a for i in range(1, len(parts)) if (a := ".".join(parts[:i])))


def _innermost(module: str, seen: dict[str, int]) -> str:
    """The innermost module of ``seen`` that holds ``module`` (itself, an ancestor, or the root ""):
    ``max(m for m in seen if _inside(module, m))`` by depth, found by walking up ``module``'s ancestors."""
    m = module
    while m not in seen and m:
        m = m.rsplit(".", 1)[0] if "." in m else ""
    if m in seen:
        return m
    return max((m for m in seen if _inside(module, m)), key=lambda m: (m != "", m.count(".")))  # none: as before


def resolve(wrapping: Wrapping, named_shapes, tied: tuple[tuple[str, str], ...] = ()) -> tuple[ShardUnit, ...]:
    """``_resolve`` on hashable shapes: rank- and mesh-independent, so cached (a plan asks again for every
    rank and shard group it tries; 126-layer models take ~1 s each). Shapes already tuples are the key as
    given (an equal key: a plan's candidates pass one tuple, not rebuilt for each)."""
    if type(named_shapes) is tuple:
        try:
            return _resolve_kept(named_shapes, wrapping, tuple(tied))
        except TypeError:  # unhashable shapes (lists): as tuples, below
            pass
    return _resolve(wrapping, tuple((n, tuple(s)) for n, s in named_shapes), tuple(tied))


@by_identity  # the one shapes tuple of a plan's candidates, ranks and shard groups: not hashed again (a speed-up)
def _resolve_kept(named_shapes: tuple[tuple[str, Shape], ...], wrapping: Wrapping,
                  tied: tuple[tuple[str, str], ...]) -> tuple[ShardUnit, ...]:
    return _resolve(wrapping, named_shapes, tied)


@lru_cache(maxsize=64)
def _resolve(wrapping: Wrapping, named_shapes: tuple[tuple[str, Shape], ...],
             tied: tuple[tuple[str, str], ...] = ()) -> tuple[ShardUnit, ...]:
    """The units of ``wrapping`` on a model with parameters ``named_shapes``, in ``fully_shard`` call order;
    ``tied``: (module, parameter) pairs of a module that uses another's parameter as its own (transformers'
    tied ``lm_head`` and the token embedding's weight), which ``named_parameters()`` lists once. ValueError
    (one line) for a pattern that matches nothing, a module wrapped twice, a unit inside an earlier one (FSDP2
    shards children first), or a tied parameter seen by two units (torch 2.13 refuses it:
    ``_fsdp_state.py:FSDPState._validate_no_duplicate_params``). The units' modules and parameters do not depend
    on the entries' ``reshard_after_forward`` (``_units``: once for a plan's candidates that differ only there)."""
    units = _units(tuple((entry.modules, entry.group) for entry in wrapping.units), named_shapes, tied)
    return tuple(ShardUnit(mods, ps, wrapping.units[k].reshard_after_forward, root, f, e)
                 for mods, ps, k, root, f, e in units)  # fmt: skip


@lru_cache(maxsize=64)
def _units(entries: tuple[tuple[tuple[str, ...], bool], ...], named_shapes: tuple[tuple[str, Shape], ...],
           tied: tuple[tuple[str, str], ...]) -> tuple[tuple, ...]:
    """``_resolve``'s units less their reshard value, from each entry's (module patterns, group): (modules, their
    parameters in ``fully_shard`` order, the entry's index, the root?, first and last parameter index). The
    layout reads only the names (``_layout``: shared by the TP degrees of a plan, whose shapes differ)."""
    layout = _layout(entries, tuple(name for name, _ in named_shapes), tied)
    return tuple((mods, tuple((named_shapes[i][0], tuple(named_shapes[i][1])) for i in order), k, root, f, e)
                 for mods, order, k, root, f, e in layout)  # fmt: skip


@lru_cache(maxsize=16)
def _layout(entries: tuple[tuple[tuple[str, ...], bool], ...], names: tuple[str, ...],
            tied: tuple[tuple[str, str], ...]) -> tuple[tuple, ...]:
    """``_units`` with each parameter as its index in ``names`` (``named_parameters()`` order); a unit of one
    module keeps ``_owners``' order without ``_fully_shard_order``'s pairs (its answer then: a speed-up, no rule)."""
    known = (*module_names(tuple((n, ()) for n in names)), *(m for m, _ in tied))
    by_depth: dict[int, list[str]] = {}  # the modules by segment count, in order (the root apart): a pattern
    for m in known:  # matches only modules of its own count (``matches``), so only those are compared (a speed-up)
        by_depth.setdefault(m.count(".") if m else -1, []).append(m)
    calls: list[tuple[tuple[str, ...], int]] = []
    for k, (patterns, group) in enumerate(entries):
        found = []
        for pattern in patterns:
            hit = [m for m in by_depth.get(pattern.count(".") if pattern else -1, ()) if matches(pattern, m)]
            if not hit:
                raise ValueError(f"wrapping: {pattern!r} matches no module of the model (modules holding "
                                 f"parameters: {', '.join(m for m in known[1:6])}, ...)")  # fmt: skip
            found += [m for m in hit if m not in found]
        calls += [(tuple(found), k)] if group else [((m,), k) for m in found]
    seen: dict[str, int] = {}
    for i, (mods, _) in enumerate(calls):
        for m in mods:
            if m in seen:
                raise ValueError(f"wrapping: module {m!r} is wrapped twice (fully_shard refuses a module already sharded)")
            # the modules seen that hold m: its ancestors (each looked up, not every module seen compared)
            if m and any(a in seen for a in _ancestors(m)):
                outer = [o for o in seen if o != "" and _inside(m, o)]
                raise ValueError(f"wrapping: {m!r} comes after {outer[0]!r}, which holds it: call fully_shard on the "
                                 "inner module first (FSDP2 assigns each parameter to the first unit that holds it)")  # fmt: skip
            seen[m] = i
    for module, param in tied:  # the unit that owns the module and the one that owns the parameter
        uses, holds = _innermost(module, seen), _innermost(param.rsplit(".", 1)[0], seen)
        if seen[uses] != seen[holds]:
            raise ValueError(f"wrapping: {module!r} uses {param!r} (tied) from another unit; torch 2.13 refuses a "
                             f"parameter seen by two units: group them, fully_shard([..., {module}])")  # fmt: skip
    owner, first, last = _owners(names, seen, len(calls))
    for module, _ in tied:  # a tied head lists no parameter of its own, but runs after every other module: a
        last[seen[_innermost(module, seen)]] = len(names)  # group holding it spans the layers (side.spans_layers)
    return tuple((mods, tuple(ps) if len(mods) == 1 else _fully_shard_order(mods, [(names[i], i) for i in ps], seen),
                  k, mods == ("",), f, e) for (mods, k), ps, f, e in zip(calls, owner, first, last))  # fmt: skip


def _owners(names: tuple[str, ...], seen: dict[str, int], units: int) -> tuple[list[list[int]], list[int], list[int]]:
    """(each unit's parameters as indices in ``names``, its first index (``len(names)`` if none), its last (0 if
    none)): a parameter belongs to the unit of the innermost module of ``seen`` that holds it (``_innermost``). Each
    module is walked up once, its parameters sharing the answer, and the indices ascend, so a unit's first is its
    first met and its last its latest (a speed-up, no rule: the min and max of every parameter, and a walk per
    parameter, before)."""
    owner: list[list[int]] = [[] for _ in range(units)]
    first, last = [len(names)] * units, [0] * units
    unit_of: dict[str, int] = {}
    for i, name in enumerate(names):
        module = name.rsplit(".", 1)[0] if "." in name else ""
        u = unit_of.get(module)
        if u is None:
            u = unit_of[module] = seen[_innermost(module, seen)]
        if not owner[u]:
            first[u] = i
        owner[u].append(i)
        last[u] = i
    return owner, first, last


def _fully_shard_order(mods: tuple[str, ...], params: list[tuple[str, int]], seen: dict[str, int]
                       ) -> tuple[int, ...]:
    """A unit's parameters (name, index) in the order ``fully_shard`` manages them, as their indices: its modules
    in the order given, each
    walked depth-first (_fsdp_init.py:_get_managed_modules, _get_managed_states), a tied parameter where it
    is first met. For one module that is ``named_parameters()`` order; a group ``[norm, embed_tokens,
    lm_head]`` puts the norm's weight first and the tied embedding last (its gradient is the one
    ``foreach_reduce``'s loop variable keeps: terms.last_grad_held; traced, differential draw 3-0 of
    generator 4)."""
    if len(mods) == 1:
        return tuple(p for _, p in params)
    where = {m: i for i, m in enumerate(mods)}
    return tuple(p for _, p in sorted(params, key=lambda p: where[_innermost(p[0].rpartition(".")[0], seen)]))


def forward_order(units: tuple[ShardUnit, ...]) -> tuple[ShardUnit, ...]:
    """The units in the order their forward runs: the root first (its pre-forward gathers it before any
    child runs), then the others by where their first parameter is in ``named_parameters()`` order (the
    module order transformers' forward follows); units without parameters are left out."""
    rest = sorted((u for u in units if u.params and not u.root), key=lambda u: u.first)
    root = [u for u in units if u.root and u.params]
    return (*root, *rest)
