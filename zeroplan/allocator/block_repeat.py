"""A run of moments copied from the same run of an earlier block (``step_trace``: a speed-up, no rule; an
experiment: measured slower than the walk, see docs/benchmarks.md, "2026-12-03, fifth session, blockcopy").

A step repeats its blocks: FSDP2's backward walks 80 blocks of 6-8 moments, each block's terms those of the
block before under other names (each block's buffers named apart: "unsharded parameters (block 66)") and with
collections one tensor larger or smaller ("sharded gradients of 14 unit(s)"). The builder notes, after each
moment it walks, whether the moment's shape (its phase and its last terms' sources) met before, P moments
earlier; it then walks the next P moments as a template (``Template``: its state before each, ``snapshot``).
From then on, a run of moments at the same places of a later block is copied from the template's run where the
builder proves the copy equal to the walk (``BlockCopy.copy``):

- the moments match the template's (``_match``), term by term: a term both share (the same object) holds its
  keys as themselves; from the first that differs the rest is matched from the end, the longer side's terms
  between held aside (other blocks' buffers), never one the run changes. The terms holding keys the run changes
  match key for key (``sig``, one to one), with the same source, size slot and stream and the same amount, but
  a collection's count, which may differ by one constant per key (``delta``); the builder's other terms are the
  same objects at every moment and hold no key twice nor a changed key's image. Then each transition is the
  template's renamed (``plan_move`` reads a transition's keys and amounts alone; a count that differs by a
  constant frees and allocates the same tensors at its top), and grown keys of equal bytes keep their order;
- the buffers the run touches agree (``_agree``): each changed key holds, from the lowest count the run reaches
  up (all of it but for a collection held throughout), buffers of the same (size, stream) in both states,
  renamed by their place; the keys' ages keep their order (the pairing of freed and new tensors sorts by them),
  no phase starts in the run, every freed buffer older than the run is renamed, and the frees of each
  transition keep their order renamed (``step_repeat._frees_kept``).

The copy: the template's events with ids renamed (``step_repeat.copy_events``), and the builder's state after
the run: the template's end state renamed for the touched keys (their untouched bottoms the builder's own),
live bytes, phase peak, ids, ages, grown pieces popped, moves. A transition the checks refuse is walked.
tests/test_step_trace.py compares the traces with the copy on and off (``BLOCK_COPY``) on every engine.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import chain, compress, count
from operator import attrgetter, is_not, itemgetter, not_

from zeroplan.allocator.step_repeat import (ADDED, EVENTS, GROWN, LIVE, LIVE_BYTES, MOVES, NEXT_ID, SINCE,
                                            _frees_kept, copy_events)  # fmt: skip

_ID, _SIZE_STREAM, _ROWS = itemgetter(0), itemgetter(1, 2), itemgetter(1)
_SOURCE = attrgetter("source")
LONGEST = 64
"""The longest period looked for (moments per block)."""
TAIL = 12
"""The terms whose sources make a moment's shape (its last: a moment lists the buffers of other blocks first)."""


class Template:
    """P moments walked from ``start`` on: the builder's ``snapshot`` before each and after the last (with how many
    grown pieces were popped), each moment's tensor rows (from the moment before ``start`` on), and each
    transition's keys changed (dropped and wanted)."""

    def __init__(self, start: int, period: int, snap: tuple, popped: int) -> None:
        self.start, self.period = start, period
        self.snaps, self.pops = [snap], [popped]
        self.terms: list[tuple] = []  # each moment's terms (from the one before ``start``)
        self.masks: dict[tuple[int, int], list] = {}  # (offset, moves): ``BlockCopy._masks``
        self.amounts: list[dict] = []
        self.limit: dict[int, int] = {}  # offset: the most moves a copy from there took
        self.touched: list[set] = []
        self.ties: list[list] = []
        self.keys: list[tuple] = []
        self.failed: set[int] = set()  # offsets whose first transition a copy could not take


class BlockCopy:
    """The template found so far and the copies made from it (``step_trace._step_trace``'s loop calls ``copy``
    before each moment and ``note`` after each walked one)."""

    def __init__(self, builder, order: list, resident: tuple, wants: dict, changes: dict, stops: list[int]):
        self.b, self.order, self.resident = builder, order, resident
        self.wants, self.changes, self.stops = wants, changes, stops
        self.last_at: dict[tuple, int] = {}
        self.tpl: Template | None = None
        self.rec: Template | None = None
        self.copied = 0  # moments copied (tests)

    def _terms(self, m) -> tuple:
        return (*m.terms, *(() if m.phase == "init" else self.resident))

    def _rows(self, m) -> list:
        terms, seen = self._terms(m), self.b._seen
        try:
            return list(chain.from_iterable(map(_ROWS, map(seen.__getitem__, map(id, terms)))))
        except KeyError:  # terms met for the first time
            for t in [t for t in terms if id(t) not in seen]:
                self.b._tensors(t)
            return list(chain.from_iterable(map(_ROWS, map(seen.__getitem__, map(id, terms)))))

    def _keys(self, terms: list) -> list:
        """Each term's rows (``_Builder._tensors``), found in C where every term was met."""
        seen = self.b._seen
        try:
            return list(map(_ROWS, map(seen.__getitem__, map(id, terms))))
        except KeyError:
            return list(map(self.b._tensors, terms))

    def note(self, at: int) -> None:
        """After the walked move to ``order[at]``: the template's next state, or a template begun where the
        moment's shape met before."""
        rec, b = self.rec, self.b
        if rec is not None:
            if at != rec.start + len(rec.snaps) - 1:  # a copy or a jump in between: not a walked run
                self.rec = None
                return
            rec.snaps.append(b.snapshot())
            rec.pops.append(len(b.popped))
            if len(rec.snaps) > rec.period:
                self.rec = None
                self._finish(rec)
            return
        if self.tpl is not None:
            return
        m = self.order[at]
        shape = (m.phase, tuple(map(_SOURCE, m.terms[-TAIL:])))  # a block's own terms last (a guess: proved later)
        before = self.last_at.get(shape)
        self.last_at[shape] = at
        if before is not None and 2 <= at - before <= LONGEST and at + 1 < len(self.order):
            self.rec = Template(at + 1, at - before, b.snapshot(), len(b.popped))

    def _finish(self, tpl: Template) -> None:
        order, changes = self.order, self.changes
        seen = self.b._seen
        for k in range(tpl.period + 1):
            rows = self._rows(order[tpl.start - 1 + k])
            if len({r[0] for r in rows}) != len(rows):  # a key twice: its amounts add up, not matched here
                return
            tpl.amounts.append({key: amount for key, amount, _ in rows})
            tpl.terms.append(self._terms(order[tpl.start - 1 + k]))
        for k in range(tpl.period):
            a, m = order[tpl.start - 1 + k], order[tpl.start + k]
            change, before, want = changes[id(a), id(m)], self.wants[id(a)], self.wants[id(m)]
            tpl.keys.append((change[0], change[1]))
            tpl.touched.append({*change[0], *change[1]})
            # ``plan_move`` pairs grown buffers gone and new by (bytes, key): keys of equal bytes, by their names
            gone = [(before[x][0], x) for x in change[0] if x[2] == GROWN]
            new = [(want[x][0], x) for x in change[1] if x[2] == GROWN and x not in before]
            ties = []
            for rows in (gone, new):
                by: dict[int, list] = {}
                for size, x in sorted(rows, reverse=True):
                    by.setdefault(size, []).append(x)
                ties.extend(group for group in by.values() if len(group) > 1)
            tpl.ties.append(ties)
        self.tpl = tpl

    @staticmethod
    def _ties_kept(tpl: Template, o: int, n: int, sig: dict) -> bool:
        """Grown keys of equal bytes that the template's transitions pair in their names' order keep that order
        renamed."""
        for ties in tpl.ties[o:o + n]:
            for group in ties:
                names = [sig.get(x, x) for x in group]
                if names != sorted(names, reverse=True):
                    return False
        return True

    def copy(self, at: int) -> int:
        """Copy the moves to ``order[at]`` and on from the template where proved equal: the position reached."""
        tpl = self.tpl
        if tpl is None or at < tpl.start + tpl.period:
            return at
        o = (at - tpl.start) % tpl.period
        if o in tpl.failed:
            return at
        stop = self.stops[bisect_left(self.stops, at)] if self.stops and self.stops[-1] >= at else len(self.order)
        most = min(tpl.period - o, stop - at, len(self.order) - at, tpl.limit.get(o, LONGEST))
        if most <= 0:
            return at
        while most > 0:
            got = self._try(tpl, at, o, most)
            if got is True:
                self.copied += most
                return at + most
            if got is None:  # the moment before is not one to build from: no copy from here
                return at
            most = tpl.limit[o] = got
        tpl.failed.add(o)
        if len(tpl.failed) == tpl.period:  # no run copies from this template: another may
            self.tpl = None
        return at

    def _masks(self, tpl: Template, o: int, n: int, touched: set) -> list[list[bool]]:
        """For each template moment of the run (from the one before), whether each term holds a key the run
        changes; found once per run."""
        got = tpl.masks.get((o, n))
        if got is None:
            seen = self.b._seen
            got = tpl.masks[o, n] = [[not touched.isdisjoint(map(_ID, seen[id(t)][1])) for t in terms]
                                     for terms in tpl.terms[o:o + n + 1]]  # fmt: skip
        return got

    def _match(self, tpl: Template, at: int, o: int, most: int, touched: set):
        """The template's moments of the run (from the one before ``at``'s place) matched to the builder's, term
        by term: a term the template's moment shares with the builder's (the same object) holds its keys as
        themselves; the first that differs on, the rest matched from the end, the longer side's terms between
        held aside (a block's buffers of the others). The terms that hold keys the run changes (``touched``)
        match key for key (``sig``), with counts that may differ by one constant per key (``delta``); the
        builder's other terms are the same at every moment. (moments matched, sig, delta)."""
        order, phase, seen = self.order, self.b.phase, self.b._seen
        masks = self._masks(tpl, o, most, touched)
        sig, inv, delta, same, done, others = {}, {}, {}, set(), set(), None
        for k in range(most + 1):
            mine = order[at - 1 + k]
            if mine.phase != order[tpl.start + o - 1 + k].phase or (k and mine.phase != phase):
                return k - 1, sig, delta
            model, terms, mask = tpl.terms[o + k], self._terms(mine), masks[k]
            head = next(compress(count(), map(is_not, model, terms)), min(len(model), len(terms)))
            extra = len(model) - len(terms)
            if extra > 0:  # the template's terms held aside: none changed by the run
                if any(mask[head:head + extra]):
                    return k - 1, sig, delta
                model, mask = model[:head] + model[head + extra:], mask[:head] + mask[head + extra:]
                kept = list(compress(terms, map(not_, mask)))
            else:
                kept = list(compress(terms[:head] + terms[head - extra:], map(not_, mask)))
                kept.extend(terms[head:head - extra])
                terms = terms[:head] + terms[head - extra:]
            if others is None:
                others = kept
                other_ids = set(map(id, kept))
            elif len(kept) != len(others) or not other_ids.issuperset(map(id, kept)):
                return k - 1, sig, delta  # a term the template's run leaves the builder's run changes
            # the terms that hold changed keys, as their rows (``_ALIKE``'s tuples, shared by alike terms): each
            # pair of row tuples matched once
            model_rows = list(map(_ROWS, map(seen.__getitem__, map(id, compress(model, mask)))))
            rows = self._keys(list(compress(terms, mask)))
            for r1, r2 in zip(model_rows, rows):
                if r1 is r2:
                    same.update(map(_ID, r1))
                    continue
                pair = (id(r1), id(r2))
                if pair in done:
                    continue
                done.add(pair)
                if len(r1) != len(r2):
                    return k - 1, sig, delta
                for (k1, a1, s1), (k2, a2, s2) in zip(r1, r2):
                    if s1 != s2 or k1[1] != k2[1] or k1[2] != k2[2]:
                        return k - 1, sig, delta
                    got = sig.get(k1)
                    if got is None:
                        if k2 in inv:
                            return k - 1, sig, delta
                        sig[k1], inv[k2] = k2, k1
                    elif got != k2:
                        return k - 1, sig, delta
                    d = a2 - a1
                    if d and (k1[2] == GROWN or delta.setdefault(k1, d) != d) or not d and k1 in delta:
                        return k - 1, sig, delta
        # one to one: a changed key kept as itself is no other key's image, nor renamed; the builder's other
        # terms hold no key twice, nor any changed key's image
        for k1, k2 in sig.items():
            if k1 != k2 and (k1 in same or k2 in same) or k1 in delta and k1 in same:
                return 0, sig, delta
        held = list(map(_ID, chain.from_iterable(map(_ROWS, map(seen.__getitem__, map(id, others or ()))))))
        unique = set(held)
        if len(unique) != len(held) or not unique.isdisjoint(same) or not unique.isdisjoint(inv):
            return 0, sig, delta
        return most, sig, delta

    def _try(self, tpl: Template, at: int, o: int, most: int):
        """True (copied), None (the moment before ``at`` unlike the template's), or how many moves to try."""
        touched = set().union(*tpl.touched[o:o + most])
        n, sig, delta = self._match(tpl, at, o, most, touched)
        if n < 0:
            return None
        if n < most:
            return n
        b, first = self.b, tpl.snaps[o]
        last = tpl.snaps[o + n]
        if not self._ties_kept(tpl, o, n, sig):
            return 0
        agreed = self._agree(tpl, o, n, touched, sig, delta)
        if not isinstance(agreed, tuple):
            return agreed
        rename, cuts = agreed
        start, end, first_new = first[EVENTS], last[EVENTS], first[NEXT_ID]
        events = b.events
        cols = tuple(zip(*events[start:end])) if end > start else None
        if cols is not None:
            if "phase" in cols[0] or not all(map(rename.__contains__, filter(first_new.__gt__, cols[1]))):
                return 0
            renamed = list(compress(count(start), map(rename.__contains__, cols[1])))
        else:
            renamed = []
        shift = b.next_id - first_new
        if not _frees_kept(events, start, end, rename, shift, renamed):
            return 0
        live = self._live_after(tpl, o, n, touched, sig, rename, cuts, shift)
        if live is None:
            return 0
        # the copy: events, state
        lb = b.live_bytes
        peak = lb + max(s[LIVE_BYTES] for s in tpl.snaps[o + 1:o + n + 1]) - first[LIVE_BYTES]
        now = (None,) * NEXT_ID + (b.next_id,)
        copy_events(events, b.chunks, (None,) * NEXT_ID + (first_new, start), now, rename, end, renamed, cols)
        for k2, stack in live.items():
            if stack is None:
                b.live.pop(k2, None)
            else:
                b.live[k2] = stack
        since, added0, end_since = b.since, first[ADDED], last[SINCE]
        for k1 in touched:  # the keys made anew in the run (those dropped again too, as a walk leaves them)
            s = end_since.get(k1)
            if s is not None and s >= added0:
                since[sig.get(k1, k1)] = s - added0 + b._added
        moves = b.moves - first[MOVES]
        b.popped.extend((m + moves, rename.get(i, i + shift)) for m, i in b.popped[tpl.pops[o]:tpl.pops[o + n]])
        b.live_bytes = lb + last[LIVE_BYTES] - first[LIVE_BYTES]
        phase_max = b.phase_max
        if peak > phase_max.get(b.phase, 0):
            phase_max[b.phase] = peak
        b.next_id += last[NEXT_ID] - first_new
        b._added += last[ADDED] - added0
        b.moves += n
        self._record(tpl, at, o, n, sig)
        return True

    def _agree(self, tpl, o, n, touched, sig, delta):
        """The touched keys' buffers alike from the lowest count the run reaches up, and their ages in the same
        order: (the ids renamed, each key's untouched bottom); else how many moves to try."""
        first, live = tpl.snaps[o], self.b.live
        old_live, rename, cuts = first[LIVE], {}, {}
        for k1 in touched:
            k2 = sig.get(k1, k1)
            old, new = old_live.get(k1), live.get(k2)
            if old is None or new is None:
                if old is not None or new is not None:
                    return self._first_touch(tpl, o, n, k1)
                continue
            d, cut = delta.get(k1, 0), 0
            if d:  # a collection's count that differs: held throughout (never dropped); below its lowest count
                # in the run its buffers are never freed
                counts = [a.get(k1) for a in tpl.amounts[o:o + n + 1]]
                if None in counts:
                    return self._first_touch(tpl, o, n, k1)
                cut = min(counts)
            top_old, top_new = old[cut:], new[cut + d:]
            if len(top_old) != len(top_new) or list(map(_SIZE_STREAM, top_old)) != list(map(_SIZE_STREAM, top_new)):
                return self._first_touch(tpl, o, n, k1)
            rename.update(zip(map(_ID, top_old), map(_ID, top_new)))
            cuts[k1] = cut
        keys = [k for k in touched if k in old_live]
        old_since, since = first[SINCE], self.b.since
        mine = sorted(keys, key=old_since.__getitem__)
        if [sig.get(k, k) for k in mine] != sorted((sig.get(k, k) for k in keys), key=since.__getitem__):
            return 0
        return rename, cuts

    def _first_touch(self, tpl, o, n, key) -> int:
        """How many transitions of the run come before the first that changes ``key``."""
        return next(k for k in range(n) if key in tpl.touched[o + k])

    def _live_after(self, tpl, o, n, touched, sig, rename, cuts, shift):
        """The touched keys' buffers after the run (None: a key dropped), the template's renamed over the
        builder's untouched bottoms; None where a buffer is neither renamed nor newer than the run."""
        first, last, live = tpl.snaps[o], tpl.snaps[o + n], self.b.live
        first_new, old_live, out = first[NEXT_ID], first[LIVE], {}
        for k1 in touched:
            k2 = sig.get(k1, k1)
            stack = last[LIVE].get(k1)
            if stack is None:
                out[k2] = None
                continue
            cut = cuts.get(k1, 0)
            bottom = live[k2][:len(live[k2]) - len(old_live[k1]) + cut] if k1 in old_live else []
            got = list(bottom)
            for ident, size, stream in stack[cut:]:
                new = rename.get(ident)
                if new is None:
                    if ident < first_new:
                        return None
                    new = ident + shift
                got.append((new, size, stream))
            out[k2] = got
        return out

    def _record(self, tpl, at, o, n, sig) -> None:
        """The copied transitions' keys changed (``step_repeat.copy_plan`` reads them; a walk plans them anew),
        and the last moment's tensors (the next moment is built from them)."""
        order, changes = self.order, self.changes
        for k in range(n):
            pair = (id(order[at - 1 + k]), id(order[at + k]))
            if pair not in changes:
                dropped, wanted = tpl.keys[o + k]
                changes[pair] = ([sig.get(x, x) for x in dropped], [sig.get(x, x) for x in wanted])
        m = order[at + n - 1]
        if id(m) not in self.wants:
            self.wants[id(m)] = self.b.wanted(m, () if m.phase == "init" else self.resident)
