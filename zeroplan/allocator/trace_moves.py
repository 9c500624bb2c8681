"""A transition of the trace builder (``step_trace._Builder``) from one moment to the next, planned once from the
two moments' tensors and walked on the live buffers (a speed-up, no rule).

After a move the live buffers hold exactly what its moment wanted (a key's count, or a grown buffer's bytes,
each buffer on its key's stream), so what a transition does to each key it changes is known from the two
moments' ``wanted`` alone (``plan_move``): the grown buffers gone that continue as new ones (paired largest to
largest, on their stream), the keys dropped (every buffer freed), those that shrink (their last buffers
freed), those made anew, and the tensors to allocate; the move (``move_to``) then touches each such key once,
rather than looking each changed key up in the live buffers, the wanted tensors and their ages several times.
What stays dynamic: a grown buffer's pieces (the bytes a shrink leaves) and the order of the keys' ages, which
only the pairing of freed and new tensors reads (``_Builder._paired``: rare; else the frees go by id).
tests/test_step_trace.py compares the traces with those of the move that reads the live buffers, on every engine.
"""

from __future__ import annotations

from itertools import chain, repeat
from operator import itemgetter

from zeroplan.allocator.replay import Event
from zeroplan.allocator.step_repeat import GROWN

PAIR_SKIP = True
"""A transition whose frees no new tensor can take (no freed (size, stream) among the new ones', found in C) skips
``_Builder._paired`` (False: every transition with frees and new tensors pairs them, as the test that compares the
two sets it)."""
_new = tuple.__new__  # ``Event(*fields)`` without its Python-level ``__new__`` (a trace makes ~20,000)
_ID, _SIZE, _SIZE_STREAM = itemgetter(0), itemgetter(1), itemgetter(1, 2)  # a live buffer's (id, size, stream) fields
# an ``Event``'s fields, repeated (``zip`` stops at its one finite argument, so that these serve every call)
_EVENT, _FREE, _ALLOC, _ZERO, _NONE = repeat(Event), repeat("free"), repeat("alloc"), repeat(0), repeat(None)


def plan_move(before: dict, want: dict, gone: list, new: list) -> tuple:
    """A transition from the moment whose tensors are ``before`` to the one whose are ``want`` ({key: [amount,
    stream]}); ``gone``: keys ``before`` holds that may be gone, ``new``: keys ``want`` holds that may differ, in its
    order (a key of neither holds in both what it held). (dropped: the keys ``want`` lacks; wanted: those of
    ``new`` that differ; pairs: (grown key gone, new key it continues as); release: (key, what it keeps, what it
    holds), the keys that free buffers; fresh: (key, size, stream, count) to allocate, in ``wanted``'s order, a
    grown key that shrinks with size -1 (its pieces say what is left); adds: the keys made anew)."""
    dropped = [k for k in gone if k not in want]
    get = before.get
    wanted = [k for k in new if get(k) != want[k]]
    pairs, held = [], {}
    gone = [(before[k][0], k) for k in dropped if k[2] == GROWN]
    if gone:  # a grown buffer gone and a new one on its stream: the same buffer renamed, largest to largest
        new = [(want[k][0], k) for k in wanted if k[2] == GROWN and k not in before]
        gone.sort(reverse=True)
        new.sort(reverse=True)
        for size, old in gone if new else ():
            stream = before[old][1]
            for at, (_, k) in enumerate(new):
                if want[k][1] == stream:
                    del new[at]
                    pairs.append((old, k))
                    held[k] = size
                    break
    paired = {old for old, _ in pairs}
    release = [(k, 0, before[k][0]) for k in dropped if k not in paired]
    fresh, adds = [], []
    for key in wanted:
        amount, stream = want[key]
        had = held.get(key)
        if had is None:
            entry = before.get(key)
            if entry is None:
                had = 0
                adds.append(key)
            else:
                had = entry[0]
        if key[2] == GROWN:
            if had > amount:  # pieces popped: what is left to grow is known once they are
                fresh.append((key, -1, stream, 1))
                release.append((key, amount, had))
            elif amount > had:
                fresh.append((key, amount - had, stream, 1))
        elif had > amount:
            release.append((key, amount, had))
        elif amount > had:
            fresh.append((key, key[2], stream, amount - had))
    return dropped, wanted, pairs, release, fresh, adds


def move_to(self, moment, want: dict, changes: tuple) -> None:
    """``_Builder.move_to``: free what ``moment`` no longer holds, then allocate what it adds; ``changes``: the
    transition's ``plan_move``."""
    _, _, pairs, release, fresh, adds = changes
    self.moves += 1  # this move's pops are counted as the moves before it (``popped``)
    live, since, added = self.live, self.since, self._added  # each key made anew gets the next age
    for old, key in pairs:  # a grown buffer renamed: its pieces under the new key
        live[key], since[key] = live.pop(old), added
        added += 1
    freed, left = [], None
    if release:
        cuts, moves, popped = [], self.moves, self.popped
        for key, keep, total in release:
            stack = live[key]
            cuts.append(len(freed))
            if key[2] == GROWN:  # its last pieces, last first
                while stack and total > keep:
                    buf = stack.pop()
                    total -= buf[1]
                    freed.append(buf)
                    popped.append((moves, buf[0]))
                if keep:
                    if left is None:
                        left = {}
                    left[key] = keep - total
            else:  # the last tensors, last first (in C)
                freed.extend(stack[:keep - 1 if keep else None:-1])
                del stack[keep:]
            if not keep:  # a key dropped leaves ``live`` (the others keep their order)
                del live[key]
        cuts.append(len(freed))
    for key in adds:  # the keys made anew
        live[key], since[key] = [], added
        added += 1
    self._added = added
    if left is not None:  # a grown key that shrank: the piece that brings it back up, if any
        fresh = [f if f[1] >= 0 else (f[0], left[f[0]], f[2], 1) for f in fresh]
        fresh = [f for f in fresh if f[1] > 0]
    if freed:
        # a buffer freed and one of the same size allocated on the same stream: the same buffer renamed; most
        # transitions free no size they allocate (found in C), and free in id order, last first
        if fresh and not (PAIR_SKIP and {f[1:3] for f in fresh}.isdisjoint(map(_SIZE_STREAM, freed))):
            fresh = list(fresh)
            if len(release) > 1:  # the keys' buffers in the order the keys were added (``since``)
                at = sorted(range(len(release)), key=lambda i: since[release[i][0]])
                freed = list(chain.from_iterable(freed[cuts[i]:cuts[i + 1]] for i in at))
            freed = self._paired(freed, fresh)
        freed.sort(reverse=True)
        if len(freed) <= 4:  # the usual move: no chain of maps to make
            rounded, append = self._round_of, self.events.append
            for ident, size, _ in freed:
                append(_new(Event, ("free", ident, 0, 0, None)))
                self.live_bytes -= rounded[size]
        else:
            self.events.extend(map(_new, _EVENT, zip(_FREE, map(_ID, freed), _ZERO, _ZERO, _NONE)))  # ``Event(
            # "free", id)``, in C
            self.live_bytes -= sum(map(self._round_of.__getitem__, map(_SIZE, freed)))  # rounded, in C
    phase, phase_max = moment.phase, self.phase_max  # the phase's largest live bytes, kept as it goes
    if phase != self.phase:
        self.phase = phase
        self.events.append(Event("phase", phase))
        phase_max[phase] = max(phase_max.get(phase, 0), self.live_bytes)
    events, ident, added, chunks, rounded = self.events, self.next_id, 0, self.chunks, self._round_of
    for key, size, stream, count in fresh:  # a collection's tensors in one go (FSDP2's: thousands)
        chunks.append((len(events), size, stream, count))
        if count == 1:  # most: no comprehension to call
            events.append(_new(Event, ("alloc", ident, size, stream, None)))
            live[key].append((ident, size, stream))
        else:
            ids = range(ident, ident + count)
            events.extend(map(_new, _EVENT, zip(_ALLOC, ids, repeat(size), repeat(stream), _NONE)))  # in C
            live[key].extend(zip(ids, repeat(size), repeat(stream)))
        ident += count
        added += count * rounded[size]
    self.next_id = ident
    self.live_bytes = added = self.live_bytes + added
    if added >= phase_max.get(phase, 0):  # (set where the phase has none: live bytes are never negative)
        phase_max[phase] = added
