"""A training step as an ordered allocation trace, built from an engine profile's moments, so that one
description feeds both the allocated peak (``zeroplan.formulas.peak``) and the allocator model (``replay``).

An engine profile lists, phase by phase, the moments at which memory can peak and the terms live there
(``Moment``). The trace walks those moments in order and, between two of them, frees what the first holds
and the second does not, then allocates what the second adds: each term is ``tensors`` tensors of equal size
(``Term.rounded``'s convention), a term is the same buffer in two moments when its name, source and tensor
size agree (a collection "of N" grows or shrinks by its last tensors; a one-tensor term whose bytes change is
one buffer that grows by a piece of the difference, as gradients accumulating or parts packed so far, or
shrinks by its last pieces; with ``block_bytes`` > 1 each piece is a multiple of the block, so that the
rounded total is ``Term.rounded``'s), and a buffer freed and one of the same size allocated on the same stream in the same transition
are one buffer renamed (the profile names one all-gather output "this unit" in one moment and "kept until
the root's post-forward" in the next). Frees come before the next phase starts and allocations after, as
``reset_peak_memory_stats`` between phases sees the state between them.

By construction the live bytes at each moment are the moment's total, and between moments they are never
above the larger of the two, so the trace's live-bytes maximum over each phase equals ``peak_of``'s peak of
that phase (``AllocTrace.phase_live_bytes``; tests/test_step_trace.py checks the equality on every engine).
What the trace adds is order and streams: which blocks the caching allocator sees freed before which are
requested, and on which stream's pool (``stream_of``: FSDP2's all-gather and reduce-scatter streams,
DeepSpeed's reduction stream; 0, the default stream, otherwise). Within a transition, frees go last-allocated
first and allocations follow the moment's term order: an approximation of the real order, which the
recorded histories (docs/allocator.md, "Recording on a GPU") can check.

``steps``: the training steps walked after init (default 2): the moments describe a steady step (Adam's
states already exist), and the second step meets the blocks the first one cached, as a real run does. The
last step's events, from one of its moments on, are copied from the step before's from the same moment (ids
renamed) where the builder's states there agree (``step_repeat``: to the step's end, or to a later moment
whence the builder resumes, when a grown buffer's bottom pieces differ until the step before pops them); the
moments tried are the step's first, second, third, fifth, ninth, ...; otherwise the step is built moment by
moment (a speed-up, no rule: tests/test_step_trace.py compares the two on every engine).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter

from zeroplan.allocator.gc_pause import gc_paused
from zeroplan.allocator.replay import Event
from zeroplan.allocator.runs import chunk_runs
from zeroplan.allocator.step_repeat import GROWN, copy_events, copy_plan as _repeats, resumed
from zeroplan.allocator.trace_moves import move_to, plan_move
from zeroplan.allocator.trace_terms import Rounded as _Rounded, _collection, default_stream, moved_terms, tensor_sizes
from zeroplan.formulas.peak import PHASES, Moment, Term

Key = tuple[str, str, int]  # (term name, source, bytes of one tensor)
INCREMENTAL = True
"""Each moment's tensors built from the one before's (``_Builder.wanted_after``; False: from every term, as the
test that compares the two sets it)."""
_ALIKE: dict[tuple, tuple[tuple[Key, int, int], ...]] = {}
"""``_Builder._tensors`` by (stream_of, block bytes, a term's fields), across traces: a ``stream_of`` reads a
term's fields alone (every engine's does: FSDP2's and DeepSpeed's by its name)."""


@dataclass(frozen=True)
class AllocTrace:
    """One step's allocations and frees in order (``Event``s: alloc / free / phase), and the live bytes the
    trace reaches per phase (each tensor rounded up to ``block_bytes``, as ``Term.rounded``)."""

    events: tuple[Event, ...]
    block_bytes: int
    phase_live_bytes: dict[str, int]
    """the largest live bytes in each phase: equal to ``peak_of(moments, block_bytes).by_phase()``."""
    runs: dict[int, int] | None = field(default=None, compare=False, repr=False)
    """``runs.alloc_runs(events)``, known to the builder (``chunk_runs``): the replay need not look for them."""

    @property
    def live_peak_bytes(self) -> int:
        return max(self.phase_live_bytes.values(), default=0)

    def streams(self) -> tuple[int, ...]:
        """The streams the trace allocates on, in first-use order."""
        return tuple(dict.fromkeys(e.stream for e in self.events if e.action == "alloc"))


class _Builder:
    """The live buffers (per key, a stack of (id, size, stream)) and the events so far."""

    def __init__(self, block_bytes: int, stream_of: Callable[[Term], int]) -> None:
        self.block, self.stream_of = block_bytes, stream_of
        self._round_of = _Rounded(block_bytes)
        self.live: dict[Key, list[tuple[int, int, int]]] = {}
        self.events: list[Event] = []
        self.chunks: list[tuple[int, int, int, int]] = []  # (index, size, stream, count) of each alloc chunk
        self.next_id, self.live_bytes, self.phase_max = 0, 0, {}
        self.phase: str | None = None
        self._seen: dict[int, tuple[Term, tuple[tuple[Key, int, int], ...]]] = {}
        # when each live key was added: ``live``'s own order, so that a transition walks its few changed keys in
        # that order rather than every live key (hundreds: FSDP2 names each block's buffers apart)
        # a moment's terms and their ids, by the moment's id (``wanted_after``)
        self._terms_of: dict[int, tuple[tuple[Term, ...], set[int]]] = {}
        self.since: dict[Key, int] = {}
        self._added, self.moves = 0, 0  # keys added; the moments walked
        self.popped: list[tuple[int, int]] = []  # (moves walked, id) of each grown piece popped (step_repeat)

    def wanted(self, moment: Moment, resident: Sequence[Term]) -> dict[Key, list[int]]:
        """{key: [count, stream]} of the tensors ``moment`` holds, in term order; a one-tensor term is keyed
        ``GROWN`` with its (rounded) bytes in place of the count."""
        seen, tensors = self._seen, self._tensors
        terms = (*moment.terms, *resident)
        # every term's (key, amount, stream), found in C (``chain``, ``map``): a moment holds ~150 terms
        try:
            rows = list(chain.from_iterable(map(itemgetter(1), map(seen.__getitem__, map(id, terms)))))
        except KeyError:  # a term met for the first time
            for term in [t for t in terms if id(t) not in seen]:
                tensors(term)
            rows = list(chain.from_iterable(map(itemgetter(1), map(seen.__getitem__, map(id, terms)))))
        out = {key: [amount, stream] for key, amount, stream in rows}
        if len(out) == len(rows):  # the usual moment: no key twice
            ids = set(map(id, terms))
            if len(ids) == len(terms):  # and no term twice: ``wanted_after`` may build the next one from it
                self._terms_of[id(moment)] = (terms, ids)
            return out
        out = {}
        get = out.get
        for key, amount, stream in rows:  # a key held by several terms: their amounts add up
            entry = get(key)
            if entry is None:
                out[key] = [amount, stream]
            else:
                entry[0] += amount
        return out

    def wanted_after(self, before: Moment, want_before: dict[Key, list[int]], moment: Moment,
                     resident: Sequence[Term]) -> tuple[dict[Key, list[int]], tuple] | None:
        """``wanted(moment, resident)`` and ``changed`` from ``before`` (whose ``wanted`` is ``want_before``), built
        from the terms the two moments do not share (a few of ~150: a moment differs from the one before by a
        block's buffers) rather than from every term; None (build it whole) unless each moment holds no key and
        no term twice, the condition under which a moment's ``wanted`` is the sum of its terms' keys."""
        prior = self._terms_of.pop(id(before), None)  # read once: the next moment's first build (freed early)
        terms = (*moment.terms, *resident)
        moved = None if prior is None else moved_terms(*prior, terms)  # (gone, new: in term order) or None
        if moved is None:
            return None
        seen, tensors = self._seen, self._tensors
        want = want_before.copy()  # ``dict.copy``: its table copied at once (``dict(...)`` inserts key by key)
        gone, new = [], []
        for term in moved[0]:
            for key, _, _ in seen[id(term)][1]:
                del want[key]
                gone.append(key)
        for term in moved[1]:  # in term order: the order of the allocations
            for key, amount, stream in tensors(term):
                if key in want:  # a key two terms hold: their amounts add up (``wanted``)
                    return None
                want[key] = [amount, stream]
                new.append(key)
        self._terms_of[id(moment)] = (terms, prior[1])  # ``moved_terms`` made them its ids
        return want, plan_move(want_before, want, gone, new)  # the keys of the terms kept hold what they held

    def _tensors(self, term: Term) -> tuple[tuple[Key, int, int], ...]:
        """(key, count or grown bytes, stream) of ``term``'s tensors; found once per term object (a run's terms
        are shared by its moments: the model states are in every one)."""
        got = self._seen.get(id(term))
        if got is not None:
            return got[1]
        # a term alike one an earlier trace met (a plan traces several candidates, whose terms are mostly alike;
        # ``stream_of`` reads a term's fields): its keys, found once (a speed-up, no rule)
        like = (self.stream_of, self.block, term.name, term.source, term.bytes, term.tensors)
        keys = _ALIKE.get(like)
        if keys is None:  # ``identity``, ``tensor_sizes`` (but for unrounded sizes) inline: a speed-up, no rule
            name, size, n, stream = term.name, term.bytes, term.tensors, self.stream_of(term)
            name = _collection(name) if " of " in name else name
            if size <= 0:
                keys = ()
            elif n <= 1:
                keys = (((name, term.source, GROWN), self._round_of[size], stream),)
            elif self.block > 1:  # ``n`` tensors of one size
                keys = (((name, term.source, -(-size // n)), n, stream),)
            else:
                keys = tuple(((name, term.source, size), count, stream) for size, count in tensor_sizes(term, 1))
            if len(_ALIKE) >= 50_000:  # a bound on what a long process keeps
                _ALIKE.clear()
            _ALIKE[like] = keys
        self._seen[id(term)] = (term, keys)  # the term kept: its id stays its own
        return keys

    @staticmethod
    def changed(want: dict[Key, list[int]], before: dict[Key, list[int]]) -> tuple:
        """The transition between two moments' ``wanted`` (``plan_move``): after ``move_to`` the live buffers are
        exactly what its moment wanted, so the next transition touches only the keys that differ (the others are
        neither freed, grown nor paired), those ``want`` holds in its order (the order of the allocations)."""
        return plan_move(before, want, list(before), list(want))

    move_to = move_to  # (trace_moves): free what a moment no longer holds, then allocate what it adds

    def _paired(self, freed: list[tuple[int, int, int]], fresh: list[tuple[Key, int, int, int]]) -> list:
        """``move_to``'s pairing: each new tensor (``fresh``, in order) takes a freed buffer of its size and stream
        first, the last freed first; ``fresh`` keeps what is still to allocate; the buffers left to free."""
        spare: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for buf in freed:
            spare.setdefault((buf[1], buf[2]), []).append(buf)
        live, out = self.live, []
        for key, size, stream, need in fresh:
            pool = spare.get((size, stream))
            if pool:  # equal tensors: the spare ones first, last freed first (in C)
                take = min(need, len(pool))
                live[key].extend(pool[:-take - 1:-1])
                del pool[-take:]
                need -= take
            if need:
                out.append((key, size, stream, need))
        fresh[:] = out
        return list(chain.from_iterable(spare.values()))

    def snapshot(self) -> tuple:
        """What the rest of a step's events depend on (``step_repeat``'s fields), copied (in C: cheap enough to
        take at several moments of a step; each key's buffers as a tuple)."""
        live = self.live
        return (self.phase, self.live_bytes, dict(zip(live, map(tuple, live.values()))), dict(self.since),
                self.next_id, len(self.events), self._added, self.moves)  # fmt: skip

    def repeat_step(self, plan: tuple, now: tuple, marks: dict[int, tuple], end: int) -> int | None:
        """Copy the last step's events from the step before (``step_repeat.copy_plan``'s ``plan``, from the mark
        ``now``) to the step's end (``end``: its events; None: the trace ends), or to a later mark, whose state,
        renamed, the builder takes on: that mark's offset (``now``'s when nothing is copied)."""
        later, earlier, _, rename, _, renamed, columns = plan
        state = None if later is None else resumed(marks[later], earlier, now, plan)
        if later is not None and state is None:
            return next(j for j, mark in marks.items() if mark is earlier)
        stop = end if later is None else marks[later][5]
        copy_events(self.events, self.chunks, earlier, now, rename, stop, renamed, columns)
        if later is not None:
            self.phase, self.live_bytes, self.live, self.since, self.next_id, self._added, self.moves = state
        return later


def step_trace(
    moments: Iterable[Moment], block_bytes: int = 1, resident: tuple[Term, ...] = (),
    stream_of: Callable[[Term], int] = default_stream, steps: int = 2,
) -> AllocTrace:  # fmt: skip
    """The ordered trace of ``moments`` (``init`` once, then ``steps`` times forward, backward and the
    optimizer step); ``resident``: terms live from the first moment after init on (the library workspaces,
    as ``peak_of``); ``stream_of``: the stream each term's tensors are allocated on."""
    if steps < 1 or block_bytes < 1:
        raise ValueError(f"steps={steps}, block_bytes={block_bytes}: must be >= 1")
    with gc_paused():
        return _step_trace(moments, block_bytes, resident, stream_of, steps)


def _step_trace(moments: Iterable[Moment], block_bytes: int, resident: tuple[Term, ...],
                stream_of: Callable[[Term], int], steps: int) -> AllocTrace:  # fmt: skip
    by_phase: dict[str, list[Moment]] = {p: [] for p in PHASES}
    for m in moments:
        if m.phase not in by_phase:
            raise ValueError(f"phase={m.phase!r}: expected one of {', '.join(PHASES)}")
        by_phase[m.phase].append(m)
    builder = _Builder(block_bytes, stream_of)
    order = [*by_phase["init"], *[m for _ in range(steps) for p in PHASES[1:] for m in by_phase[p]]]
    wants: dict[int, dict[Key, list[int]]] = {}  # each moment's tensors, found once for every step that meets it
    changes: dict[tuple[int, int], tuple[set[Key], list[Key]]] = {}  # each transition's keys, once for every step
    per_step = (len(order) - len(by_phase["init"])) // steps
    firsts = range(len(by_phase["init"]), len(order), per_step or 1)  # each step's first moment
    last = firsts[-1] if per_step and steps > 1 else -1
    # the moments of a step (from its first) where the last step may start copying the one before: the first (a
    # step alike from its start), then ever further ones (FSDP2's block input grown in pieces in step 1 only)
    offsets = [j for j in (0, *(1 << n for n in range(per_step.bit_length()))) if j < per_step] if last >= 0 else []
    marks_at = {**{firsts[-2] + j: j for j in offsets}, **{last + j: j for j in offsets}} if last >= 0 else {}
    marks: dict[int, tuple] = {}  # in the step before the last, by offset: its ``snapshot``
    last_start = 0  # how many events there were when the last step began
    before: Moment | None = None
    at = 0
    move_to, n = builder.move_to, len(order)
    while at < n:
        m = order[at]
        pair = (id(before), id(m))
        want = wants.get(pair[1])
        if want is None:
            held = () if m.phase == "init" else resident
            after = None if before is None or not INCREMENTAL else \
                builder.wanted_after(before, wants[pair[0]], m, held)
            if after is None:
                want = wants[pair[1]] = builder.wanted(m, held)
            else:
                want, changes[pair] = after
                wants[pair[1]] = want
        change = changes.get(pair)
        if change is None:
            change = changes[pair] = builder.changed(want, wants[pair[0]] if before is not None else {})
        if at == last:
            last_start = len(builder.events)
        move_to(m, want, change)
        before = m
        if at in marks_at:
            mark = builder.snapshot()
            if at < last:
                marks[marks_at[at]] = mark
            else:
                plan = _repeats(marks, marks_at[at], mark, order[at:], changes, builder.popped, last,
                                builder.events, last_start)
                reached = builder.repeat_step(plan, mark, marks, last_start) if plan else marks_at[at]
                if reached is None:  # copied to the step's end
                    break
                at, before = last + reached, order[last + reached]  # the builder's state: that after this moment
        at += 1
    return AllocTrace(tuple(builder.events), block_bytes, dict(builder.phase_max), chunk_runs(builder.chunks))
