"""Which parameters of a block play which part, from the real hook order (``DSRun.grad_ready_order``) and the
modules' sizes (``DSRun.modules``), no family names: a GPT block's MLP input projection and the module before it
(``_mlp_modules``), a Llama-shaped block's MLP input projections, post-attention norm and attention output
projection (``_llama_roles``) and the modules hooked after that projection (``_attention_after``: q, k, v, the
input norm). Split from ``reduce.py``, whose in-block moments (``_hook_activations``) ask these."""

from __future__ import annotations

from functools import lru_cache

from zeroplan.engines.deepspeed.run import DSRun


def _mlp_modules(run: DSRun, j: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(block j's MLP input projection, the module before it), as parameter indices: the modules before the one
    holding the output projection's weight (``run.modules``: sizes module by module, ``named_parameters``
    order). GPT-2: ``mlp.c_fc`` and ``ln_2``; Llama: ``mlp.up_proj`` and ``mlp.gate_proj``. Empty without one."""
    outs = [i for i in run.output_projections if run.param_blocks[i] == j]
    if not outs:
        return (), ()
    spans, at = [], 0  # each module's parameter indices
    for sizes in run.modules:
        spans.append(tuple(range(at, at + len(sizes))))
        at += len(sizes)
    k = next((m for m, span in enumerate(spans) if min(outs) in span), None)
    if k is None or k < 2 or any(run.param_blocks[i] != j for i in (*spans[k - 1], *spans[k - 2])):
        return (), ()
    return spans[k - 1], spans[k - 2]


def _llama_roles(run: DSRun, j: int) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...], tuple[int, ...]] | None:
    """(block j's MLP input projections in hook order, its post-attention norm, the attention's output projection)
    as parameter indices: the modules whose hooks follow the output projection's in ``DSRun.grad_ready_order``,
    projections while their weight is as large as the output projection's, then the norm (a module of vectors),
    then the next module; None when the block's first hook
    is not its output projection (Gemma's post-feed-forward norm) or the MLP is not this shape."""
    return _layout_roles(run)[0].get(j)


_LAST: list = []  # the last layout asked for: [(its tuples, its final norm's numel, (roles, attention))]


def _layout_roles(run: DSRun) -> tuple[dict[int, tuple | None], dict[int, tuple[tuple[int, ...], ...]]]:
    """(``_roles_by_block``, ``_attention_by_block``) of ``run``'s layout. The last layout's when its
    arguments are the very same objects (an identity check: every hook of a run asks, and hashing the
    layout's tuples for ``lru_cache`` cost ~50 us a call, 0.8 s of a 405B plan), else through the caches."""
    if _LAST:
        (modules, order, blocks, numels, outputs), norm, found = _LAST[0]
        if (modules is run.modules and order is run.grad_ready_order and blocks is run.param_blocks
                and numels is run.numels and outputs is run.output_projections
                and norm == run.final_norm_numel):
            return found
    args = (run.modules, run.grad_ready_order, run.param_blocks, run.numels, run.output_projections)
    norm = run.final_norm_numel
    found = (_roles_by_block(*args, norm), _attention_by_block(*args, norm))
    _LAST[:] = [(args, norm, found)]
    return found


def _owners_and_blocks(modules: tuple[tuple[int, ...], ...], order: tuple[int, ...],
                       param_blocks: tuple[int, ...]) -> tuple[dict[int, int], dict[int, list[int]]]:
    """(each parameter's module index, each block's parameters in ``order``)."""
    owner, at = {}, 0
    for m, sizes in enumerate(modules):
        for i in range(at, at + len(sizes)):
            owner[i] = m
        at += len(sizes)
    by_block: dict[int, list[int]] = {}
    for i in order:
        by_block.setdefault(param_blocks[i], []).append(i)
    return owner, by_block


@lru_cache(maxsize=16)  # every rank's hook and every candidate of a plan ask for the same layout's roles
def _roles_by_block(modules: tuple[tuple[int, ...], ...], order: tuple[int, ...], param_blocks: tuple[int, ...],
                    numels: tuple[int, ...], output_projections: tuple[int, ...],
                    final_norm_numel: int) -> dict[int, tuple | None]:
    """``_llama_roles`` of every block, in one pass over the parameters (was one pass per hook and rank)."""
    owner, by_block = _owners_and_blocks(modules, order, param_blocks)
    outputs = set(output_projections)
    return {j: _block_roles(mine, owner, numels, outputs, final_norm_numel) for j, mine in by_block.items()}


def _block_roles(mine: list[int], owner: dict[int, int], numels: tuple[int, ...], outputs: set[int],
                 final_norm_numel: int) -> tuple | None:
    """``_llama_roles`` of one block whose parameters, in gradient-ready order, are ``mine``."""
    groups: list[list[int]] = []
    for i in mine:
        if groups and owner[groups[-1][0]] == owner[i]:
            groups[-1].append(i)
        else:
            groups.append([i])
    if not groups or not outputs.intersection(groups[0]):
        return None
    width = max(numels[i] for i in groups[0])
    projections = []
    for g in groups[1:]:
        if max(numels[i] for i in g) == width:
            projections.append(tuple(g))
            continue
        if projections and len({numels[i] for i in g}) == 1 and numels[g[0]] == final_norm_numel:
            after = groups[groups.index(g) + 1] if groups.index(g) + 1 < len(groups) else []
            return tuple(projections), tuple(g), tuple(after)
        return None
    return None


def _attention_after(run: DSRun, j: int) -> tuple[tuple[int, ...], ...]:
    """Block j's modules whose gradient hooks follow its attention output projection's in
    ``DSRun.grad_ready_order`` (Llama: v, k, q, the input norm), each as its parameter indices."""
    return _layout_roles(run)[1].get(j, ())


@lru_cache(maxsize=16)  # as ``_roles_by_block``: one pass per layout
def _attention_by_block(modules: tuple[tuple[int, ...], ...], order: tuple[int, ...], param_blocks: tuple[int, ...],
                        numels: tuple[int, ...], output_projections: tuple[int, ...],
                        final_norm_numel: int) -> dict[int, tuple[tuple[int, ...], ...]]:
    """``_attention_after`` of every block whose roles ``_roles_by_block`` finds."""
    roles = _roles_by_block(modules, order, param_blocks, numels, output_projections, final_norm_numel)
    owner, by_block = _owners_and_blocks(modules, order, param_blocks)
    out = {}
    for j, r in roles.items():
        if r is None or not r[2]:
            continue
        mine = by_block[j]
        groups: dict[int, list[int]] = {}
        for i in mine[max(mine.index(i) for i in r[2]) + 1:]:
            groups.setdefault(owner[i], []).append(i)
        out[j] = tuple(tuple(g) for g in groups.values())
    return out
