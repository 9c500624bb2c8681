"""The last step of a step trace copied from the step before (``step_trace``: a speed-up, no rule).

The builder (``step_trace._Builder``) takes a ``snapshot`` at some moments of the step before the last and at
the same moments of the last: (phase, live bytes, the live buffers as (id, size, stream) by key, when each
live key was added, the next id, how many events so far). From two snapshots whose states agree
(``repeats``), the same transitions make the same events, so the rest of the last step is the step before's
from its mark, with ids renamed (``repeat_events``). tests/test_step_trace.py compares the copy with the
step built moment by moment on every engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter

from zeroplan.allocator.replay import Event
from zeroplan.formulas.peak import Moment

_SIZE_STREAM = itemgetter(1, 2)
_new = tuple.__new__  # ``Event(*fields)`` without its Python-level ``__new__``


def repeat_events(events: list[Event], earlier: tuple, now: tuple, end: int) -> None:
    """Append to ``events`` the last step's events from the ``now`` mark on (a ``snapshot``), copied from the
    step before (its events from its ``earlier`` mark, taken at the same moment of that step, to ``end``, where
    the last step began): from equal states the same transitions make the same events, each id renamed (a
    buffer live at the mark: its counterpart; a newer one: shifted by the ids made in between); the live bytes,
    so each phase's largest, repeat too. The builder's buffers stay as they were at ``now``: the trace ends."""
    old_live, new_live = earlier[2], now[2]
    rename = {o[0]: n[0] for k, stack in old_live.items() for o, n in zip(stack, new_live[k])}
    shift, start = now[4] - earlier[4], earlier[5]
    for e in events[start:end]:
        if e.action == "alloc":
            events.append(_new(Event, ("alloc", e.id + shift, e.size, e.stream, None)))
        elif e.action == "free":
            events.append(Event("free", rename.get(e.id, e.id + shift)))
        else:
            events.append(e)


def repeats(earlier: tuple, now: tuple, step: Sequence[Moment], changes: dict) -> bool:
    """Whether the last step, from a moment on (``step``: its moments from there), makes the events of the one
    before from the same moment (renamed: ``repeat_events``): at both marks (``snapshot``s) the same phase, live
    bytes and live buffers ((size, stream) of each, by key), and the keys its transitions change (``changes`` of
    the pairs of ``step``, all met in the step before; the others are neither freed nor grown) added in the same
    order and their buffers' ids in the same order (a transition frees the spare buffers by id)."""
    old_live, new_live = earlier[2], now[2]
    if earlier[:2] != now[:2] or old_live.keys() != new_live.keys():
        return False
    for k, stack in old_live.items():
        other = new_live[k]
        if len(stack) != len(other) or list(map(_SIZE_STREAM, stack)) != list(map(_SIZE_STREAM, other)):
            return False
    touched = set().union(*(changes[id(a), id(b)][0] for a, b in zip(step, step[1:])))
    old_since, new_since = earlier[3], now[3]
    live = touched.intersection(new_live)
    if sorted(live, key=old_since.__getitem__) != sorted(live, key=new_since.__getitem__):
        return False
    pairs = sorted((o[0], n[0]) for k in live for o, n in zip(old_live[k], new_live[k]))  # by the old id
    return all(a[1] < b[1] for a, b in zip(pairs, pairs[1:]))  # and the new ids in the same order
