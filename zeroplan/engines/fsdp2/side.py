"""A split root: the ``fully_shard`` units beside the decoder layers (the root, torchtitan's embeddings and
``[norm, output]``: a wrapping's own, ``wrap.py``) with their own lifetimes, as terms. The profile counts them
in unit 0 (``units.profile_units``); these say which of them is gathered, or reduced, when, each citing the
FSDP2 function (``SRC``) or the measurement it comes from (docs/engines/fsdp2.md, "Wrapping as data")."""

from __future__ import annotations

import math

from zeroplan.engines.fsdp2.memo import memo_term
from zeroplan.engines.fsdp2.param import padded_shard_numel
from zeroplan.engines.fsdp2.terms import Fsdp2Run, _fp, ag_output, unsharded
from zeroplan.engines.fsdp2.wrap import ShardUnit
from zeroplan.formulas.peak import Moment, Term


@memo_term  # the same for every rank of a run, asked ~100 times a run: found once (a speed-up)
def _side_units(run: Fsdp2Run) -> tuple[ShardUnit, ...]:
    blocks = {u.name for u in run.units[1:]}
    return tuple(u for u in run.shard_units if u.params and u.name not in blocks)


def _before_blocks(run: Fsdp2Run, u: ShardUnit) -> bool:
    """A unit that runs before the decoder layers (the embeddings), by its first parameter's place."""
    blocks = {v.name for v in run.units[1:]}
    return not u.root and u.first < min((v.first for v in run.shard_units if v.name in blocks), default=0)


def spans_layers(run: Fsdp2Run, u: ShardUnit) -> bool:
    """A group with modules before and after the decoder layers (a tied ``[norm, embeddings, head]``): FSDP2's
    group post-forward runs once every module of the group has run (``_fsdp_state.py``, ``_modules_to_run_forward``),
    after the head, so the group stays gathered through the layers' forward whatever its reshard_after_forward
    (measured: differential draw 1-9 of generator 2, llama tied, the group True, forward -33% without)."""
    names = {b.name for b in run.units[1:]}  # once, not once per unit (a speed-up)
    blocks = [v for v in run.shard_units if v.name in names]
    return bool(blocks) and not u.root and u.first < min(v.first for v in blocks) and u.last > max(v.last for v in blocks)


def spanning_resharded(run: Fsdp2Run) -> list[ShardUnit]:
    """A group spanning the layers resharded after forward (a tied ``[embed_tokens, lm_head]``, or with the
    norm): its post-forward (after the head) is the last but the root's, so the root's pre-backward prefetches it
    (``_backward_prefetch`` follows ``post_forward_order``; the last block waits for the group's own pre-backward,
    on the logits' gradient, which copies it out); its post-backward hook is registered on its first module's
    inputs (token ids, no gradient), so it stays unsharded until the root's final callback, never gathered again
    by block 1 (``root_side`` counts it in backward). Traced (MemTracker at FSDPParamGroup's calls, the case 0-3
    of tests/data/measured/fsdp2_embedding_unit.json): the root's prefetch adds N_d·S (6,144,000 B), the group's
    copy-out adds nothing, its reshard in the final callback frees 6,144,000 B; backward -5.14% without."""
    return [u for u in _side_units(run) if spans_layers(run, u) and u.post_forward_group(run.nd) > 1]


def gathered_numel(run: Fsdp2Run, u: ShardUnit) -> int:
    """N_d·S_u of a resolved unit: its all-gather output and reduce-scatter input, in elements."""
    return run.nd * sum(padded_shard_numel(s, run.nd) for _, s in u.params)


def split_root(run: Fsdp2Run) -> bool:
    """Whether units beside the root hold parameters outside the decoder layers (torchtitan's embeddings and
    ``[norm, output]``): then unit 0 is several ``fully_shard`` units with their own lifetimes, the root
    resharded after forward (True passed explicitly) or not (``resharded_after_head``,
    ``embedding_copy_outs``; moments.split_root_regathers)."""
    return any(not u.root for u in _side_units(run))


def resharded_after_head(run: Fsdp2Run) -> list[ShardUnit]:
    """The units after the decoder layers resharded by their own post-forward (``[norm, output]`` left at
    FSDP2's default True): freed once the head's forward returns, so not held at the loss; the root's
    pre-backward (on the loss) prefetches them again, their own pre-backward (on the logits' gradient) copies
    them out (_fsdp_state.py:FSDPState._pre_backward; _fsdp_param_group.py:FSDPParamGroup._backward_prefetch,
    which follows the post-forward order). Measured: qwen2 under a FILE wrapping with the root True, exact."""
    return [u for u in head_units(run) if u.post_forward_group(run.nd) > 1]


def root_side(run: Fsdp2Run, stage: str) -> Term:
    """The unsharded parameters of unit 0 at ``stage``: the root alone (``unsharded(run, 0)``), or with a split
    root the units gathered then: ``"blocks"`` (the decoder layers' forward): the root and the units before the
    layers kept gathered (False; resharded ones were freed by their post-forward); ``"head"`` and
    ``"backward"``: and every unit after the layers (gathered at their forward; kept through backward here,
    an upper bound: _fsdp_param_group.py:FSDPParamGroup.post_backward reshards them after theirs); ``"loss"``
    (the loss, and backward until the head's pre-backward copies it out): as ``"head"`` less the units after
    the layers resharded by their post-forward (``resharded_after_head``)."""
    if not split_root(run):
        return unsharded(run, 0)
    freed = resharded_after_head(run) if stage == "loss" else []
    if stage == "loss" and not run.loss_in_forward:  # the root's post-forward ran before the loss: a root True is freed
        freed += [u for u in _side_units(run) if u.root and u.post_forward_group(run.nd) > 1]
    if stage == "loss":  # a group spanning the layers is resharded after the head, as the units after them
        freed += [u for u in _side_units(run) if spans_layers(run, u) and u.post_forward_group(run.nd) > 1]
    units = [u for u in _side_units(run) if (u.root or (_before_blocks(run, u) and u.post_forward_group(run.nd) == 1)
             or (stage != "blocks" and not _before_blocks(run, u)) or spans_layers(run, u)) and u not in freed]  # fmt: skip
    kept = k_sharded(run, stage)
    return _fp(f"unsharded parameters ({', '.join(u.name for u in units) or 'none'})"
               + "".join(f", {u.name} k-sharded after forward" for u in kept),
               (sum(gathered_numel(run, u) for u in units) + sum(gathered_numel(run, u) // u.post_forward_group(run.nd)
                for u in kept)) * run.p, "_fsdp_param.py:FSDPParam.alloc_all_gather_outputs; "
               "FSDPParam.to_sharded_post_forward", sum(len(u.params) for u in (*units, *kept)))  # fmt: skip


def k_sharded(run: Fsdp2Run, stage: str) -> list[ShardUnit]:
    """Units beside the layers resharded after forward to an int k < N_d (torchtitan's embeddings under
    ``reshard_after_forward=k``): from their post-forward to their backward copy-out each rank keeps N_d·S/k
    of them (_fsdp_param.py:FSDPParam.to_sharded_post_forward; freed by to_unsharded). Kept here until the
    backward's end (the embeddings' copy-out is backward's last: a bound after it). Measured: differential
    draw 1-16 of generator 2 (mistral, torchtitan, k = 2 at N_d = 4), forward and backward -8.4% without."""
    partial = [u for u in _side_units(run) if not u.root and 1 < u.post_forward_group(run.nd) < run.nd
               and not spans_layers(run, u)]  # fmt: skip
    return [u for u in partial if _before_blocks(run, u) or stage == "loss"]


def side_prev(run: Fsdp2Run) -> tuple[Term, ...]:
    """The all-gather output still bound when the first block is copied out: the root's, or with a split root
    the last unit gathered before the layers (the embeddings' after the root's), none if none has parameters."""
    if not split_root(run):
        return (ag_output(run, 0, "the root's, freed when this copy-out returns"),)
    before = sorted((u for u in _side_units(run) if u.root or _before_blocks(run, u)), key=lambda u: (not u.root, u.first))
    if not before:
        return ()
    u = before[-1]
    return (_fp(f"all-gather output ({u.name}, freed when this copy-out returns)", gathered_numel(run, u) * run.p,
                "_fsdp_collectives.py:foreach_all_gather; _fsdp_param_group.py:FSDPParamGroup.wait_for_unshard"),)  # fmt: skip


def embedding_copy_outs(run: Fsdp2Run, states: tuple[Term, ...]) -> tuple[Moment, ...]:
    """Forward, before the layers: each unit gathered after the root (the embeddings) copied out while the
    previous all-gather output (the root's) is still bound (``wait_for_unshard`` frees it on return) and
    before any activation exists; ``states``: the terms every moment holds (shards, Adam, batch). Measured:
    the forward peak of validate/transformer.py's CausalLM with its embeddings apart and a root (head, norm)
    True, exact (the root's output, its parameters, the embeddings' output and parameters)."""
    if not split_root(run):
        return ()
    before = sorted((u for u in _side_units(run) if u.root or _before_blocks(run, u)), key=lambda u: (not u.root, u.first))
    out = []
    for prev, u in zip(before, before[1:]):
        in_root_side = u.post_forward_group(run.nd) == 1 or spans_layers(run, u)  # root_side counts it
        own = () if in_root_side else (_fp(f"unsharded parameters ({u.name})", gathered_numel(run, u) * run.p,
                                           "_fsdp_param.py:FSDPParam.alloc_all_gather_outputs", len(u.params)),)  # fmt: skip
        out.append(Moment("forward", f"{u.name} copy-out", (*states, root_side(run, "blocks"), *own, *(_fp(
            f"all-gather output ({v.name}, {why})", gathered_numel(run, v) * run.p,
            "_fsdp_collectives.py:foreach_all_gather; _fsdp_param_group.py:FSDPParamGroup.wait_for_unshard")
            for v, why in ((prev, "previous unit, freed when this copy-out returns"), (u, "this unit"))))))  # fmt: skip
    return tuple(out)


def head_units(run: Fsdp2Run) -> list[ShardUnit]:
    """Units after the decoder layers (``[norm, output]``), in forward order."""
    if not split_root(run):
        return []
    return sorted((u for u in _side_units(run) if not u.root and not _before_blocks(run, u)), key=lambda u: u.first)


def head_output(run: Fsdp2Run, why: str) -> Term:
    """The all-gather output of the last unit after the layers, kept until the root's post-forward (it frees
    the last block's at its own copy-out)."""
    u = head_units(run)[-1]
    return _fp(f"all-gather output ({u.name}, {why})", gathered_numel(run, u) * run.p,
               "_fsdp_collectives.py:foreach_all_gather; _fsdp_state.py:FSDPState._post_forward")  # fmt: skip


def embedding_units(run: Fsdp2Run) -> list[ShardUnit]:
    """Units before the layers resharded after forward (gathered again for backward by block 1's prefetch)."""
    if not split_root(run):
        return []
    return [u for u in _side_units(run) if _before_blocks(run, u) and u.post_forward_group(run.nd) > 1
            and not spans_layers(run, u)]  # fmt: skip


def embedding_regather(run: Fsdp2Run) -> tuple[Term, ...]:
    """Units before the layers resharded after forward, gathered again from the first block's backward on:
    their unsharded parameters (``root_side`` leaves them out then)."""
    if not split_root(run):
        return ()
    return tuple(_fp(f"unsharded parameters ({u.name}, gathered again for backward)", gathered_numel(run, u) * run.p,
                     "_fsdp_param.py:FSDPParam.alloc_all_gather_outputs", len(u.params)) for u in embedding_units(run))  # fmt: skip


def embedding_prefetch_copy_in(run: Fsdp2Run) -> tuple[Term, ...]:
    """The copy-in of the embeddings' backward all-gather (block 1's prefetch), as ``terms.copy_in`` for a block:
    their shard (or their k-sharded data) in the param dtype, none when the dtypes agree
    (_fsdp_collectives.py:_get_param_all_gather_inputs)."""
    if run.settings.param == run.settings.module:
        return ()
    return tuple(_fp(f"all-gather copy-in ({u.name}, cast)", gathered_numel(run, u) // (
        k if 1 < (k := u.post_forward_group(run.nd)) < run.nd else run.nd) * run.p,
        "_fsdp_collectives.py:_get_param_all_gather_inputs") for u in embedding_units(run))  # fmt: skip


def side_reduce(run: Fsdp2Run, u: ShardUnit) -> tuple[Term, Term, Term, Term, tuple[Term, ...]]:
    """A side unit's own reduce-scatter: (its unsharded gradients, input, output, cast to the module dtype,
    gloo's copy), as ``unit_grads``, ``rs_input``, ``rs_output``, ``grad_cast`` and ``gloo_copy`` for a block."""
    full = gathered_numel(run, u)
    numel = sum(math.prod(s) for _, s in u.params)
    src = "_fsdp_collectives.py:foreach_reduce"
    gloo = (Term(f"gloo reduce-scatter copy of the whole input ({u.name})", full * run.r,
                 "measured: ProcessGroupGloo (see gloo_copy)"),) if run.settings.backend == "gloo" else ()  # fmt: skip
    return (Term(f"unsharded gradients ({u.name})", numel * run.p, "autograd", len(u.params)),
            _fp(f"reduce-scatter input ({u.name})", full * run.r, src),
            _fp(f"reduce-scatter output ({u.name})", full // run.nd * run.r, src),
            _fp(f"gradient cast to the module dtype ({u.name})", full // run.nd * run.m if run.r != run.m else 0,
                src + " (_to_dtype_if_needed)"), gloo)  # fmt: skip


def last_side_unit(run: Fsdp2Run) -> ShardUnit:
    """With a split root, the unit whose reduce-scatter ends backward (the root's, or the embeddings' when the
    root holds nothing): the largest of the units not after the layers, a bound when several remain."""
    rest = [u for u in _side_units(run) if u not in head_units(run)]
    return max(rest, key=lambda u: gathered_numel(run, u))


def final_callback_units(run: Fsdp2Run) -> list[ShardUnit]:
    """The units reduced in the root's final callback (their inputs, token ids, need no gradient, so no
    post-backward hook of theirs fires): the root with parameters and the units before the layers, in
    ``all_states`` order, the root first (_fsdp_state.py:FSDPState._lazy_init walks ``named_modules()``;
    ``_root_post_backward_final_callback``). Measured: validate/transformer.py's CausalLM with its embeddings
    apart, the root (head, norm) reduced with the embeddings' unsharded gradient and parameters alive."""
    rest = [u for u in _side_units(run) if u not in head_units(run)]
    return sorted(rest, key=lambda u: (not u.root, u.first))


def side_regathers(run: Fsdp2Run, when: str) -> tuple[Term, ...]:
    """Units beside the decoder layers (the root, embeddings, ``[norm, output]``) resharded after forward
    are gathered again for backward, each all-gather output beside the unsharded parameters while it is
    copied out (``ag_output``; the profile keeps every such unit gathered, ``profile_units``). ``"start"``:
    the root and the units after the decoder layers, gathered as backward reaches them, first
    (_fsdp_state.py:FSDPState._pre_backward); ``"end"``: the units before them (the embeddings), prefetched
    by the first block's backward after its copy-out (_fsdp_param_group.py:FSDPParamGroup._backward_prefetch;
    ``with_embedding_prefetch``)."""
    blocks = {u.name for u in run.units[1:]}
    first = min((u.first for u in run.shard_units if u.name in blocks), default=0)
    out = []
    for u in run.shard_units:
        if u.name in blocks or not u.params or u.post_forward_group(run.nd) == 1 or u in spanning_resharded(run):
            continue  # a group spanning the layers is the root's prefetch, kept to the end (spanning_resharded)
        if (when == "start") == (u.root or u.first > first):
            numel = run.nd * sum(padded_shard_numel(s, run.nd) for _, s in u.params)
            out.append(_fp(f"all-gather output ({u.name}, gathered again for backward)", numel * run.p,
                           "_fsdp_collectives.py:foreach_all_gather; _fsdp_param_group.py:FSDPParamGroup.pre_backward"))  # fmt: skip
    return tuple(out)


def split_root_regathers(run: Fsdp2Run, base: tuple[Term, ...], held: tuple[Term, ...], log_softmax: Term
                         ) -> tuple[Moment, ...]:
    """A split root resharded after forward (True passed explicitly), gathered again by its pre-backward
    (on the loss with ``labels=``, before the cross-entropy backward): its all-gather output beside its
    unsharded parameters while it is copied out, freed when ``wait_for_unshard`` returns in backward
    (_fsdp_param_group.py:FSDPParamGroup.wait_for_unshard keeps it only in forward); measured: qwen2 under a
    FILE wrapping with the root True, none of it left at the reduce-scatters."""
    if not split_root(run) or not run.loss_in_forward:
        return ()
    roots = [u for u in run.shard_units if u.root and u.params and u.post_forward_group(run.nd) > 1]
    if not roots:
        return ()
    loss_base = (*base[:-1], root_side(run, "loss"))
    return (Moment("backward", "root backward copy-out", (*loss_base, *held, log_softmax, _fp(
        "all-gather output (root, gathered again for backward, freed after copy-out)", gathered_numel(run, roots[0])
        * run.p, "_fsdp_collectives.py:foreach_all_gather; _fsdp_state.py:FSDPState._pre_backward"))),)  # fmt: skip


def head_prefetched(run: Fsdp2Run, at_copy_out: bool = False) -> tuple[Term, ...]:
    """The all-gather outputs of the units after the layers (or spanning them) resharded by their post-forward,
    prefetched by the root's pre-backward and alive until their own copies them out (``resharded_after_head``,
    ``spanning_resharded``). A spanning group is the root's prefetch only when the root has parameters (a param
    group: _fsdp_state.py:FSDPState._pre_backward) and its hook fires on the loss (labels=); else its own
    pre-backward gathers it (``at_copy_out``: its all-gather output at its copy-out either way). Measured:
    draw 1-22 (the root without parameters) is +14.4% over in backward with the prefetch counted."""
    root = any(u.root and u.params for u in run.shard_units) and run.loss_in_forward
    units = (*resharded_after_head(run), *(spanning_resharded(run) if root or at_copy_out else ()))
    return tuple(_fp(f"all-gather output ({u.name}, the root's backward prefetch)", gathered_numel(run, u) * run.p,
                     "_fsdp_param_group.py:FSDPParamGroup._backward_prefetch") for u in units)  # fmt: skip


def with_embedding_prefetch(run: Fsdp2Run, out: list[Moment]) -> list[Moment]:
    """The units before the layers resharded after forward (the embeddings) are prefetched by block 1's
    pre_backward *after* block 1's copy-out (_fsdp_param_group.py:FSDPParamGroup.pre_backward: ``unshard``,
    ``wait_for_unshard``, then ``_backward_prefetch``, whose target is the previous group in
    ``post_forward_order``): their all-gather output is alive from then until their own copy-out, so in
    block 1's moments after its copy-out, and a moment of its own where it is made, block 1's all-gather output
    freed (``wait_for_unshard`` frees it in backward on return). Blocks kept gathered (no copy-out in
    backward): from block 1's pre_backward, so in each block-1 moment but block 2's prefetch of block 1, which
    comes before. Traced (differential draw 3-5 of
    generator 4, MemTracker's live bytes at FSDPParamGroup's calls): ``layers.0``'s copy-out adds nothing to
    the peak; its ``_backward_prefetch`` -> ``embed_tokens.unshard`` adds 8,916,480 B (N_d·S), 78,579,036 B live,
    this moment exactly; counted at the copy-out instead, the backward peak was 1,762,304 B (+2.11%) over."""
    end = side_regathers(run, "end")
    if not end:
        return out
    at = next((i for i, m in enumerate(out) if m.name == "block 1 copy-out"), None)
    before = ("block 1 copy-out", "block 1 backward all-gather (prefetch)")  # block 2's prefetch of block 1: earlier
    out = [Moment(m.phase, m.name, (*m.terms, *end)) if m.name.startswith("block 1 ") and m.name not in before else m
           for m in out]  # fmt: skip
    if at is None:
        return out
    freed = ag_output(run, 1, "prefetched, freed after copy-out")
    copy = out[at]
    prefetch = Moment("backward", f"{', '.join(u.name for u in embedding_units(run))} backward all-gather (block 1's "
                      "prefetch)", (*(t for t in copy.terms if t != freed), *embedding_prefetch_copy_in(run), *end))  # fmt: skip
    return [*out[:at + 1], prefetch, *out[at + 1:]]
