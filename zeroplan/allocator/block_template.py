"""A block of moments copied from a template block the trace builder walked (``step_trace``: a speed-up, no rule).

An engine may declare (``Moment.block``: (template, place, substitution)) that a block's moments are a template
block's, place by place, with a few terms substituted: {id of a template term: this block's term, or None where the
block lacks it}. The builder walks the template and each block's first moment (the move from the block before),
then copies the block's other moves from the template's where the declaration holds, checked once per block:

- each moment is the template's with the substitution, term for term (``tuple`` of ``map``: in C); no substituted
  term is a template term kept as it is; a dropped term holds only keys the template's moves never change;
- the substitution's terms map keys one to one (``_keys``): the same source, size slot and stream, a grown buffer
  the same bytes, a collection a count moved by a constant (``shift``), none of it held by a kept term, and a key
  whose count moves is held at every moment (its frees and allocations are then the template's);
- the buffers of the keys the moves change agree from the top (their sizes and streams: what a move pops, pairs
  and frees), the keys were added in the template's order (``_Builder._paired`` reads it), the buffers' ids keep
  their order (a move frees last id first), and grown keys of equal bytes keep their order (``plan_move`` pairs
  them by (bytes, key)).

Then the template's events are the block's, ids renamed (a buffer the moves find: its counterpart; a newer one:
shifted by the ids made in between), and the builder's state moves as the walk would have moved it. Otherwise the
block is walked. ``COPY`` switches the copy (tests/test_block_template.py compares the traces with and without it
on every engine and on real models).
"""

from __future__ import annotations

from itertools import repeat
from operator import add, itemgetter

from zeroplan.allocator.replay import Event
from zeroplan.allocator.step_repeat import GROWN

COPY = True
"""Declared blocks copied from their template (False: every block walked, as the test that compares the two sets it)."""
GIVE_UP = 3
"""A template none of whose first ``GIVE_UP`` blocks could be copied is given up (a speed-up, no rule)."""
_new = tuple.__new__
_EVENT = repeat(Event)
_ID, _SIZE_STREAM = itemgetter(0), itemgetter(1, 2)


class Template:
    """A walked template block: its moments, the builder's counters after its first move and after each move
    after, the buffers of the keys its moves change before the first move that changes each (``note``) and after
    the last (``record``), and what its moves did (``close``, once the block is walked)."""

    def __init__(self, builder, moment) -> None:
        self.start, self.start_since, self.stop, self.stop_since = {}, {}, {}, {}
        self.moments, self.states, self.ready = [moment], [_state(builder, self.start, self.start_since)], None
        self.failed = self.copied = 0

    def note(self, builder, change: tuple) -> None:
        """Before a move: the buffers of the keys it changes, where no move before changed them."""
        live, since, start = builder.live, builder.since, self.start
        for k in (*change[0], *change[1]):
            if k not in self.stop and k not in start and k in live:
                start[k], self.start_since[k] = tuple(live[k]), since[k]

    def record(self, builder, moment, change: tuple) -> None:
        """After a move: the buffers of the keys it changed."""
        live, since, stop, stop_since = builder.live, builder.since, self.stop, self.stop_since
        for k in (*change[0], *change[1]):
            if k in live:
                stop[k], stop_since[k] = tuple(live[k]), since[k]
            else:
                stop[k] = stop_since[k] = None
        self.moments.append(moment)
        self.states.append(_state(builder, stop, stop_since))

    def close(self, builder, wants: dict, changes: dict, resident: tuple) -> bool:
        """Work out, once, what a copy needs from the template; False: it cannot be copied (a phase starts, a key
        held twice, a free of a buffer no move finds)."""
        if self.ready is not None:
            return self.ready
        self.ready = False
        ms, first, end = self.moments, self.states[0], self.states[-1]
        if len(ms) < 2 or any(m.phase != ms[0].phase for m in ms):
            return False
        plans = [changes.get((id(a), id(b))) for a, b in zip(ms, ms[1:])]
        if any(p is None for p in plans) or any(wants.get(id(m)) is None for m in ms):
            return False
        touched, varied = {}, set()
        for dropped, wanted, _, _, _, adds in plans:
            touched.update(dict.fromkeys(dropped))
            touched.update(dict.fromkeys(wanted))
            varied.update(dropped, adds)
        seen = builder._seen
        holders: dict = {}  # key: the ids of the template terms holding it
        for m in ms:
            rows = 0
            for t in (*m.terms, *resident):
                for key, _, _ in seen[id(t)][1]:
                    holders.setdefault(key, set()).add(id(t))
                    rows += 1
            if rows != len(wants[id(m)]):  # a key held by two terms (their amounts add up: no shift of one)
                return False
        start, stop = first[0], {k: v for k, v in end[0].items() if v is not None}
        keys = []  # (key, buffers at the start, how many of them stay, buffers the moves leave above them or None)
        # (the moves pop a stack's last buffers and push on it: what they leave of it is its first ``keep``)
        for k in touched:
            old, new = start.get(k, ()), stop.get(k)
            keep = 0
            if new is not None:
                while keep < min(len(old), len(new)) and old[keep][0] == new[keep][0]:
                    keep += 1
            keys.append((k, old, keep, None if new is None else new[keep:]))
        e0, n0 = first[2], first[1]
        events = builder.events[e0:end[2]]
        old_ids = {b[0] for _, old, keep, _ in keys for b in old[keep:]}
        at_old = [i for i, e in enumerate(events) if e.id < n0 and e.action != "phase"]
        if any(e.action == "phase" for e in events) or any(events[i].id not in old_ids for i in at_old) or \
                any(b[0] < n0 and b[0] not in old_ids for _, _, _, tail in keys if tail for b in tail):
            return False  # fmt: skip
        self.plans, self.touched, self.varied, self.holders = plans, touched, varied, holders
        self.tops = [(list(map(_SIZE_STREAM, old[keep:])), list(map(_ID, old[keep:]))) for _, old, keep, _ in keys]
        self.keys, self.at_old, self.columns = keys, at_old, tuple(zip(*events)) if events else ()
        self.untouched = {i for k, ids in holders.items() if k not in touched for i in ids} - \
            {i for k, ids in holders.items() if k in touched for i in ids}  # fmt: skip
        self.order = sorted((k for k, old, _, _ in keys if k in first[3]), key=first[3].__getitem__)
        self.sorted_old = sorted(old_ids)
        self.ties = _ties(plans, [wants[id(m)] for m in ms])
        self.chunks = [c for c in builder.chunks if e0 <= c[0] < end[2]]
        self.popped = [p for p in builder.popped if first[5] < p[0] <= end[5]]
        lives = [s[4] for s in self.states[1:]]
        self.deltas = (end[1] - n0, end[6] - first[6], end[5] - first[5], end[4] - first[4], max(lives) - first[4])
        self.first, self.end = first, end
        self.ready = True
        return True


def _state(builder, live: dict, since: dict) -> tuple:
    """(the buffers by key of the keys the template's moves change, next id, events, since, live bytes, moves, keys
    added)."""
    return live, builder.next_id, len(builder.events), since, builder.live_bytes, builder.moves, builder._added


def _ties(plans: list, wants: list) -> list:
    """The grown keys each pairing move sorts (gone, new), where two or more are sorted: their order must hold
    renamed."""
    out = []
    for (dropped, wanted, pairs, _, _, _), before in zip(plans, wants):
        if pairs:
            gone = [k for k in dropped if k[2] == GROWN]
            new = [k for k in wanted if k[2] == GROWN and k not in before]
            out.extend(ks for ks in (gone, new) if len(ks) > 1)
    return out


def copy_block(builder, tpl: Template, block: list, decl: tuple) -> dict | None:
    """Copy ``block``'s moves (its moments but the first, which the builder has just walked to) from the template's
    where ``decl`` (substitution, pairs, dropped ids) holds (the module's checks): the key map {template key:
    (key, count shift)} once copied, None where the block must be walked."""
    sub, pairs, dropped = decl
    get = sub.get
    for m, n in zip(tpl.moments, block):  # each moment the template's substituted, term for term (in C)
        if n.terms != tuple(filter(None, map(get, map(id, m.terms), m.terms))):
            return None
    if not tpl.untouched.issuperset(dropped):
        return None
    rho = _keys(builder, tpl, pairs, sub.keys())
    if rho is None:
        return None
    found = _found(builder, tpl, rho)
    if found is None:
        return None
    _copy(builder, tpl, rho, *found)
    return rho


def _keys(builder, tpl: Template, pairs: tuple, domain) -> dict | None:
    """{template key: (this block's key, count shift)} of the substituted terms, or None where they do not map
    keys one to one (the module's second check)."""
    tensors, rho = builder._tensors, {}
    for a, b in pairs:
        ka, kb = tensors(a), tensors(b)
        if len(ka) != len(kb):
            return None
        for (k1, n1, s1), (k2, n2, s2) in zip(ka, kb):
            if s1 != s2 or k1[1:] != k2[1:] or (k1[2] == GROWN and n1 != n2):
                return None
            got, now = rho.get(k1), (k2, n2 - n1)
            if got is None:
                rho[k1] = now
            elif got != now:
                return None
    images, holders, none = set(), tpl.holders, frozenset()
    for k1, (k2, d) in rho.items():
        if k2 in images:
            return None
        images.add(k2)
        if k1 == k2 and not d:
            continue
        if not domain >= holders.get(k1, none) or not domain >= holders.get(k2, none) or (d and k1 in tpl.varied):
            return None
    for ks in tpl.ties:  # grown keys of equal bytes: ``plan_move`` pairs them in their order
        names = [rho[k][0] if k in rho else k for k in ks]
        if [n for _, n in sorted(zip(ks, names))] != sorted(names):
            return None
    return rho


def _found(builder, tpl: Template, rho: dict) -> tuple | None:
    """The ids the template's moves find renamed to this block's, and where each key's buffers the moves leave
    start here; None where the buffers do not agree (the module's third check)."""
    live, since, start = builder.live, builder.since, tpl.first[0]
    phi, cuts = {}, []
    for (k, old, keep, tail), (sizes, ids) in zip(tpl.keys, tpl.tops):
        stack = live.get(rho[k][0] if k in rho else k)
        if (stack is None) != (k not in start):
            return None
        if stack is None:
            cuts.append(0)
            continue
        at = len(stack) - len(sizes)
        if at < 0 or (tail is None and at) or list(map(_SIZE_STREAM, stack[at:])) != sizes:
            return None
        phi.update(zip(ids, map(_ID, stack[at:])))
        cuts.append(at)
    ages = [since[rho[k][0] if k in rho else k] for k in tpl.order]
    found = list(map(phi.__getitem__, tpl.sorted_old))
    if ages != sorted(ages) or found != sorted(found):
        return None
    return phi, cuts


def _copy(builder, tpl: Template, rho: dict, phi: dict, cuts: list) -> None:
    """The template's events, ids renamed, after the builder's; its state moved as the walk would have."""
    first, n0 = tpl.first, tpl.first[1]
    shift, events, e0 = builder.next_id - n0, builder.events, first[2]
    base = len(events)
    if tpl.columns:
        actions, ids, sizes, streams, addresses = tpl.columns
        events.extend(map(_new, _EVENT, zip(actions, map(add, ids, repeat(shift)), sizes, streams, addresses)))
        for i in tpl.at_old:
            action, ident, size, stream, address = events[e0 + i]
            events[base + i] = _new(Event, (action, phi[ident], size, stream, address))
    moved, step = base - e0, builder.moves - first[5]
    builder.chunks.extend((at + moved, size, stream, n) for at, size, stream, n in tpl.chunks)
    builder.popped.extend((at + step, phi.get(i, i + shift)) for at, i in tpl.popped)
    live, since, end_since, first_since = builder.live, builder.since, tpl.end[3], first[3]
    added = builder._added - first[6]
    for (k, _, _, tail), at in zip(tpl.keys, cuts):
        key = rho[k][0] if k in rho else k
        if tail is None:  # dropped (or made and dropped by the moves: never here)
            if live.pop(key, None) is not None:
                del since[key]
            continue
        top = [(i + shift if i >= n0 else phi[i], size, stream) for i, size, stream in tail]
        age = end_since[k]
        stack = live.get(key)
        if stack is not None and age == first_since.get(k):
            del stack[at:]
            stack.extend(top)
            continue
        if stack is not None:  # made again by the moves: last in ``live``'s order
            del live[key]
        live[key], since[key] = ([] if stack is None else stack[:at]) + top, age + added
    grown, adds, moves, delta, highest = tpl.deltas
    builder.next_id += grown
    builder._added += adds
    builder.moves += moves
    before = builder.live_bytes
    builder.live_bytes = before + delta
    phase, peaks = tpl.moments[0].phase, builder.phase_max
    if before + highest >= peaks.get(phase, 0):
        peaks[phase] = before + highest


class Changes(dict):
    """``step_trace``'s transitions by (id of a moment, id of the next): a copied block's, asked for by
    ``step_repeat.copy_plan`` (the keys each drops and wants), are its template's renamed, made when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.copied: dict[tuple[int, int], tuple] = {}

    def __missing__(self, pair: tuple[int, int]) -> tuple:
        plan, rho = self.copied[pair]
        return tuple([rho[k][0] if k in rho else k for k in keys] for keys in plan[:2])


class Blocks:
    """The declared blocks of one trace: their templates, walked, and the copies (``moved``)."""

    def __init__(self, builder, wants: dict, changes: Changes, resident: tuple) -> None:
        self.builder, self.wants, self.changes, self.resident = builder, wants, changes, resident
        self.templates: dict = {}

    def before(self, m, change: tuple) -> None:
        """Before the builder's move to ``m``: a template's moment notes the buffers the move changes."""
        template, place, decl = m.block
        if decl is None and place and (tpl := self.templates.get(template)) is not None and tpl.ready is None \
                and place == len(tpl.moments):
            tpl.note(self.builder, change)

    def moved(self, m, at: int, order: list, marks: dict, change: tuple) -> int:
        """After the builder's move to ``m`` (``order[at]``): the moments after it copied (how many)."""
        template, place, decl = m.block
        tpl = self.templates.get(template)
        if decl is None:  # a template's moment: its state recorded while it is walked the first time
            if tpl is None and place == 0:
                self.templates[template] = Template(self.builder, m)
            elif tpl is not None and tpl.ready is None and place == len(tpl.moments):
                tpl.record(self.builder, m, change)
            return 0
        if place or tpl is None or not tpl.close(self.builder, self.wants, self.changes, self.resident):
            return 0
        k = len(tpl.moments)
        block = order[at:at + k]
        if len(block) != k or not marks.keys().isdisjoint(range(at + 1, at + k)) or \
                any(n.block != (template, p, decl) for p, n in enumerate(block)):
            return 0  # fmt: skip
        rho = copy_block(self.builder, tpl, block, decl)
        if rho is None:  # a template whose first blocks all fail is given up (its blocks walked: checks saved)
            tpl.failed += 1
            if tpl.failed >= GIVE_UP and not tpl.copied:
                tpl.ready = False
            return 0
        tpl.copied += 1
        copied, plans = self.changes.copied, tpl.plans
        for a, b, plan in zip(block, block[1:], plans):
            copied[id(a), id(b)] = (plan, rho)
        last = block[-1]
        self.wants[id(last)] = self.builder.wanted(last, self.resident)
        return k - 1
