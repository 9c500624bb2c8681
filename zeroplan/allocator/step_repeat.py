"""The last step of a step trace copied from the step before (``step_trace``: a speed-up, no rule).

The builder (``step_trace._Builder``) takes a ``snapshot`` at some moments of the step before the last and at
the same moments of the last: (phase, live bytes, the live buffers as (id, size, stream) by key, when each
live key was added, the next id, how many events so far, how many keys added, how many moments walked). From
two snapshots whose states agree, the same transitions make the same events, so the last step's events are the
step before's from its mark, with ids renamed (``copy_plan``, ``copy_events``).

The states may agree but for a grown buffer's bottom pieces (``GROWN``): the same bytes in other pieces, as the
first step's block input grown from init's piece where the second step's is one piece, or DeepSpeed's gathered
parameters grown from the optimizer step's buffer in the second step only. Pieces are popped last first, so
while the step before never pops those bottom pieces (``_Builder.popped``) the transitions free, grow and pair
every buffer alike: its events are copied up to such a moment (a later mark, or the step's end), and the
builder resumes from the step before's state there, renamed, with the last step's own bottom pieces
(``resumed``). Only the keys the copied transitions change are compared (the others are neither freed, grown
nor paired: they stay as the last step holds them), and the frees of each transition, in id order, keep their
order renamed (``_frees_kept``). tests/test_step_trace.py compares the copy with the step built moment by
moment on every engine.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import compress, count, repeat
from operator import add, itemgetter

from zeroplan.allocator.replay import Event
from zeroplan.formulas.peak import Moment

GROWN = -1
"""The size slot of a one-tensor term's key: a buffer that grows by pieces (``step_trace._Builder.wanted``)."""
_ID, _SIZE, _SIZE_STREAM = itemgetter(0), itemgetter(1), itemgetter(1, 2)
_EVENT_ID = itemgetter(1)  # an ``Event``'s id
_new = tuple.__new__  # ``Event(*fields)`` without its Python-level ``__new__``
_EVENT = repeat(Event)  # ``_new``'s first argument, mapped (``zip`` stops at the finite ones)
# a snapshot's fields
PHASE, LIVE_BYTES, LIVE, SINCE, NEXT_ID, EVENTS, ADDED, MOVES = range(8)


def _key_agreement(k: tuple, old: tuple | None, new: tuple | None) -> tuple | bool | None:
    """False unless a key's buffers agree in two states (the same (size, stream) each, but a grown buffer's
    bottom pieces: the same bytes on one stream); else (the earlier bottom's ids and the later bottom's buffers,
    or None; the other buffers' ids paired)."""
    if old is None or new is None:
        return None if old is None and new is None else False
    if len(old) == len(new) and list(map(_SIZE_STREAM, old)) == list(map(_SIZE_STREAM, new)):
        return None, zip(map(_ID, old), map(_ID, new))
    if k[2] != GROWN or not old or not new:
        return False
    top = 0  # the pieces above the bottoms, alike in both
    while top < min(len(old), len(new)) - 1 and _SIZE_STREAM(old[-1 - top]) == _SIZE_STREAM(new[-1 - top]):
        top += 1
    low_old, low_new = old[: len(old) - top], new[: len(new) - top]
    if sum(map(_SIZE, low_old)) != sum(map(_SIZE, low_new)) or len({b[2] for b in (*low_old, *low_new)}) != 1:
        return False
    return (tuple(map(_ID, low_old)), low_new), zip(map(_ID, old[len(low_old):]), map(_ID, new[len(low_new):]))


def _agreement(earlier: tuple, now: tuple, keys: set, memo: dict) -> tuple[dict, dict[int, int]] | None:
    """None unless the two states agree on ``keys`` (``_key_agreement``, found once per key in ``memo``); else
    (the bottoms: by the earlier bottom's first id, (its ids, the later bottom's buffers); the ids renamed)."""
    old_live, new_live = earlier[LIVE], now[LIVE]
    bottoms, rename = {}, {}
    held = keys.intersection(old_live)  # a key live in neither state agrees and renames nothing: not looked at
    held.update(keys.intersection(new_live))  # (in C; most keys a step changes live between its marks only)
    for k in held:
        got = memo.get(k)
        if got is None:
            got = _key_agreement(k, old_live.get(k), new_live.get(k))
            got = memo[k] = got if got is None or got is False else (got[0], dict(got[1]))
        if got is False:
            return None
        if got is not None:
            rename.update(got[1])
            if got[0] is not None:
                bottoms[got[0][0][0]] = got[0]
    return bottoms, rename


def _since_kept(earlier: tuple, now: tuple, touched: set) -> bool:
    """The keys the transitions change (``touched``) added in the same order in both states (``_release`` pops
    the changed keys in that order)."""
    old_since, new_since = earlier[SINCE], now[SINCE]
    live = touched.intersection(now[LIVE])
    return sorted(live, key=old_since.__getitem__) == sorted(live, key=new_since.__getitem__)


def renamed_at(events: list[Event], start: int, stop: int, rename: dict[int, int]) -> list[int]:
    """The indices of the events from ``start`` to ``stop`` whose id ``rename`` renames (found in C)."""
    return list(compress(count(start), map(rename.__contains__, map(_EVENT_ID, events[start:stop]))))


def _frees_kept(events: list[Event], start: int, stop: int, rename: dict[int, int], shift: int,
                renamed: list[int] | None = None) -> bool:  # fmt: skip
    """A transition frees its spare buffers by id, last first: each two frees in a row whose ids fall keep
    falling renamed (the buffers live at the mark may be in another order in the last step). Two ids both
    shifted (``shift``) keep their order, so only the frees of a renamed id are looked at (``renamed``: their
    indices, ``renamed_at``), with their neighbours (a speed-up, no rule; tests/test_step_trace.py compares the
    copy with the step built)."""
    get = rename.get
    for at in renamed_at(events, start, stop, rename) if renamed is None else renamed:
        for a, b in ((at - 1, at), (at, at + 1)):  # the renamed free after, then before, its neighbour
            if a < start or b >= stop or events[a].action != "free" or events[b].action != "free":
                continue
            old, later = events[a].id, events[b].id
            if old > later and get(old, old + shift) <= get(later, later + shift):
                return False
    return True


def copy_plan(marks: dict[int, tuple], j: int, now: tuple, step: Sequence[Moment], changes: dict,
              popped: list[tuple[int, int]], moves: int, events: list[Event], end_events: int) -> tuple | None:
    """Whether the last step, from its mark at offset ``j`` (``now``; ``step``: its moments from there), makes
    the events of the one before from its mark ``marks[j]``: None, or (the offset of the later mark the copy
    reaches, None for the step's end; the earlier mark; the bottoms; the renamed ids; the keys touched; the
    indices of the events of a renamed id; the events copied as columns). ``popped``: (moves walked
    with the one popping, id) of each grown piece popped; ``moves``, ``end_events``: the moves walked and the
    events made when the last step began."""
    earlier = marks[j]
    if earlier[:LIVE] != now[:LIVE]:  # the phase and the live bytes
        return None
    ends = (None, *sorted((o for o in marks if o > j), reverse=True))
    at_n = {len(step) - 1 if end is None else end - j for end in ends}
    touched: set = set()
    reach: dict[int, set] = {0: set()}  # the keys changed from the mark to each end: the others are not met
    for n, (a, b) in enumerate(zip(step, step[1:]), 1):
        dropped, wanted = changes[id(a), id(b)][:2]
        touched.update(dropped)
        touched.update(wanted)
        if n in at_n:
            reach[n] = set(touched)
    memo: dict = {}
    cols: tuple = ()  # the events' fields as columns from the mark, for the largest window met (the first)
    for end in ends:
        n = len(step) - 1 if end is None else end - j
        stop = moves if end is None else marks[end][MOVES]
        agreed = _agreement(earlier, now, reach[n], memo)
        if agreed is None:
            continue
        bottoms, rename = agreed
        low = {i for ids, _ in bottoms.values() for i in ids}
        if low and any(earlier[MOVES] < at <= stop and i in low for at, i in popped):
            continue
        last = end_events if end is None else marks[end][EVENTS]
        shift = now[NEXT_ID] - earlier[NEXT_ID]
        size = last - earlier[EVENTS]
        if size > 0 and (not cols or len(cols[0]) < size):
            cols = tuple(zip(*events[earlier[EVENTS]:last]))
        window = tuple(c[:size] for c in cols) if size > 0 else None  # (shared with ``copy_events``)
        renamed = [] if window is None else list(compress(count(earlier[EVENTS]), map(rename.__contains__,
                                                                                          window[1])))
        if _since_kept(earlier, now, reach[n]) and _frees_kept(events, earlier[EVENTS], last, rename, shift,
                                                               renamed):
            return end, earlier, bottoms, rename, reach[n], renamed, window
    return None


def copy_events(events: list[Event], chunks: list[tuple], earlier: tuple, now: tuple, rename: dict[int, int],
                stop: int, renamed: list[int] | None = None, columns: tuple | None = None) -> None:  # fmt: skip
    """Append the step before's events from the ``earlier`` mark to ``stop`` to ``events``, each id renamed (a
    buffer live at the mark: its counterpart; a newer one: shifted by the ids made in between); and their alloc
    chunks (``_Builder.chunks``: (index, size, stream, count), by index; a mark falls between two moves, never
    inside a chunk) to ``chunks``, moved to where the copies lie. Made in C, no Python frame per event (a
    speed-up, no rule): the events' fields as columns (``zip(*...)``); between two phase events (each its own
    copy) the allocs and frees, each id shifted, each event ``Event(...)`` without its Python-level ``__new__``
    (``_new``; ``columns``: the events' columns, as ``copy_plan`` made them); then the few events of a renamed id
    (``renamed``: their indices, ``renamed_at``; an alloc's id is
    newer than the mark, so never renamed) made again with its counterpart. tests/test_step_trace.py compares
    the copy with the step built."""
    shift, start = now[NEXT_ID] - earlier[NEXT_ID], earlier[EVENTS]
    lo, hi = bisect_left(chunks, (start,)), bisect_left(chunks, (stop,))
    if lo < hi:
        at, sizes, streams, counts = zip(*chunks[lo:hi])
        chunks.extend(zip(map(add, at, repeat(len(events) - start)), sizes, streams, counts))
    if start >= stop:
        return
    actions, ids, sizes, streams, addresses = zip(*events[start:stop]) if columns is None else columns
    at, n, base = 0, stop - start, len(events) - start
    while at < n:
        try:
            phase = actions.index("phase", at)
        except ValueError:  # no phase event left
            phase = n
        if at < phase:
            events.extend(map(_new, _EVENT, zip(actions[at:phase], map(add, ids[at:phase], repeat(shift)),
                                                sizes[at:phase], streams[at:phase], addresses[at:phase])))
        if phase < n:
            events.append(events[start + phase])
        at = phase + 1
    for at in renamed_at(events, start, stop, rename) if renamed is None else renamed:
        action, ident, size, stream, address = events[at]
        events[at + base] = _new(Event, (action, rename[ident], size, stream, address))


def resumed(later: tuple, earlier: tuple, now: tuple, plan: tuple) -> tuple | None:
    """The last step's state at the step before's ``later`` mark, which the copy (``plan``) reached from
    ``earlier`` (the last step's mark ``now``): the keys it touched as the step before left them, renamed (their
    bottoms the last step's), the others as at ``now``; (phase, live bytes, live buffers by key, since, next id,
    keys added, moves);
    None when a buffer is neither renamed, newer nor a bottom (the copy's premise broken: build instead)."""
    _, _, bottoms, rename, touched = plan[:5]
    shift, first_new = now[NEXT_ID] - earlier[NEXT_ID], earlier[NEXT_ID]
    live = {k: list(stack) for k, stack in now[LIVE].items() if k not in touched}
    for k, stack in later[LIVE].items():
        if k not in touched:
            continue
        head = bottoms.get(stack[0][0]) if stack else None
        out = list(head[1]) if head is not None else []
        if head is not None and tuple(map(_ID, stack[: len(head[0])])) != head[0]:
            return None
        for ident, size, stream in stack[len(head[0]):] if head is not None else stack:
            new = rename.get(ident)
            if new is None:
                if ident < first_new:
                    return None
                new = ident + shift
            out.append((new, size, stream))
        live[k] = out
    added, new_since = earlier[ADDED], now[SINCE]
    more = now[ADDED] - added
    since = {k: s for k, s in new_since.items() if k not in touched}
    for k, s in later[SINCE].items():  # the keys of the mark first (``live``'s order)
        if k in touched:
            since[k] = new_since[k] if s < added else s + more
    return (*later[:LIVE], live, since, later[NEXT_ID] + shift, later[ADDED] + more,
            later[MOVES] + now[MOVES] - earlier[MOVES])  # fmt: skip
