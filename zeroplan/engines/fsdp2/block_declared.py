"""FSDP2's backward blocks declared as a template (``Moment.block``, read by ``allocator.block_template``): block
i's moments are built by the code path of every other block (``moments.block_backward_moments``), so they are a
template block's moments with the block's own terms substituted, term for term in the order they first occur, and
the blocks kept gathered between forward and backward (``terms.kept_blocks``: a prefix of one tuple) cut to block
i's prefix. A declaration and nothing else: the trace builder checks it before it copies (a speed-up, no rule)."""

from __future__ import annotations

from zeroplan.formulas.peak import Moment


def declared(templates: dict, i: int, got: tuple[Moment, ...], kept: tuple, shared: int, edge: tuple
             ) -> tuple[Moment, ...]:  # fmt: skip
    """Block ``i``'s moments (``got``) declared against the first block of their shape (``templates``: one per
    ``backward_moments`` call; ``kept``: every block's kept term, block 1 first; ``shared``: how many terms each
    moment starts with, before the kept ones); a block whose shape no block had before is the template of those
    that follow. The shape: what each moment is (its name, the block's number out) and how many terms it holds
    but the kept ones (block i holds blocks 1..i-1 kept, or 1..i at its copy-out), and ``edge``: the blocks whose
    collections ("of N") hold fewer than two tensors (a one-tensor term is a buffer of its own, not a collection:
    ``step_trace._Builder.wanted``) are shapes of their own. The substitution: the terms
    at each place of each moment (the kept ones out) where they differ from the template's."""
    cuts = [(i if "copy-out" in m.name else i - 1) if kept else 0 for m in got]
    shape = tuple((m.name.replace(f"block {i}", "block #").replace(f"block {i - 1}", "block #-1"), len(m.terms) - c)
                  for m, c in zip(got, cuts)) + edge  # fmt: skip
    tpl = templates.get(shape)
    if tpl is None:
        templates[shape] = (shape, i, got, cuts)
        return _declare(got, shape, None)
    _, j, theirs, their_cuts = tpl
    if j <= i or (kept and len(kept) < j):
        return got
    sub: dict[int, object] = {}
    for m, c, t, tc in zip(got, cuts, theirs, their_cuts):  # in C: every term of both, by place
        sub.update(zip(map(id, (*t.terms[:shared], *t.terms[shared + tc:])),
                       (*m.terms[:shared], *m.terms[shared + c:])))  # fmt: skip
    terms = {}
    for t in theirs:
        terms.update(zip(map(id, t.terms), t.terms))
    pairs = [(terms[k], new) for k, new in sub.items() if new is not terms[k]]
    sub = {id(old): new for old, new in pairs}
    if kept:  # blocks i..j-1 kept in the template, not in block i; the template's own (block j) is block i's
        sub.update(dict.fromkeys(map(id, kept[i - 1:j - 1])))
        sub[id(kept[j - 1])] = kept[i - 1]
        pairs.append((kept[j - 1], kept[i - 1]))
    return _declare(got, shape, (sub, tuple(pairs), tuple(map(id, kept[i - 1:j - 1]))))


def _declare(got: tuple[Moment, ...], template: tuple, decl: tuple | None) -> tuple[Moment, ...]:
    """``got``, each moment declared in place (they are new, made by this block's call: ``Moment.__init__``'s
    own way of setting the declaration, without a second object)."""
    for place, m in enumerate(got):
        m.__dict__["block"] = (template, place, decl)
    return got


def held_declared(out: tuple[Moment, ...], built: tuple[Moment, ...]) -> tuple[Moment, ...]:
    """``mesh.with_allreduce_held``'s moments (``out``) declared as ``built``'s were: the terms it appended to a
    block's moment are a substitution of the terms it appended to the template's moment at the same place, added to
    the block's (a sampled profile, whose moments it drops, declares nothing)."""
    if out is built or len(out) != len(built):
        return out
    theirs: dict[tuple, tuple] = {}  # (template, place): the terms appended to the template's moment
    decls: dict[tuple, tuple] = {}  # one substitution per block and appended terms
    for m, n in zip(built, out):
        block = m.block
        if block is None or n is m:
            continue
        extra = n.terms[len(m.terms):]
        template, place, decl = block
        if decl is None:
            theirs[template, place] = extra
        else:
            before = theirs.get((template, place))
            if before is None or len(before) != len(extra):
                continue
            key = (id(decl), *map(id, before), *map(id, extra))
            if (new := decls.get(key)) is None:
                sub, pairs, deleted = decl
                new = decls[key] = ({**sub, **dict(zip(map(id, before), extra))}, (*pairs, *zip(before, extra)),
                                    deleted)  # fmt: skip
            block = (template, place, new)
        n.__dict__["block"] = block
    return out
