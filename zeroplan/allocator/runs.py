"""Runs of identical allocations fast-forwarded: the steady state of the caching allocator model, exact.

A trace allocates many equal tensors in a row (a collection term's tensors: FSDP2's sharded parameters, 1,136
of 704,476 B for llama3-405b; its forward's 3,410 of 469,652 B), and ``replay`` spent ~40% of its events on
them. Such a run settles into a fixed pattern, which this module proves and then repeats instead of
simulating it request by request.

The pattern (``CachingAllocator.malloc``, no memory limit, no expandable segments). Call a point of the run
*settled* when the request's pool (stream and size class) holds no cached block of at least the rounded
request ``r``. From a settled point the next request finds no block (``get_free_block`` looks only at blocks
>= ``r``), so it gets a new segment of ``allocation_size(r)`` bytes at ``_next_address``; until the run is
settled again, every request of the period is served from that segment, since nothing else in the pool is
>= ``r`` and a run frees nothing. What the period does is then a function of ``r``, the request, the config
and the new segment's address alone, and a translation of that address (the next segment lies ``D`` bytes
higher, ``D`` the aligned segment size) translates every block it makes: best fit compares sizes, then
addresses inside the new segment, whose order a translation keeps. So the next period, starting settled,
repeats the first one ``D`` bytes up, as do all after it.

``fast_forward`` replays the run request by request up to a settled point, then through one period, checks
that it was one (settled at both ends, exactly one new segment, made by the period's first request, every
request served from it, in address order) and stamps out as many copies as the run still has
whole periods for; the rest is replayed request by request. Anything else (a memory limit, which can run out
or trigger garbage collection; expandable segments; recorded segment addresses; an id already live or
repeated) replays every request. tests/test_allocator_replay.py checks the result against the request-by-
request replay on FSDP2, DeepSpeed and reference traces under several configs.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, compress, cycle, groupby, repeat
from operator import attrgetter, itemgetter

from zeroplan.allocator.blocks import Block, Pool, Segment
from zeroplan.allocator.cached_runs import _cached_after, take_cached
from zeroplan.allocator.config import K_MIN_BLOCK_SIZE, is_small, round_size

MIN_RUN = 16
"""Runs shorter than this are replayed request by request (a period needs a settled point and a full copy; a
short run's checks cost more than its copies save: FSDP2's runs of 9 equal tensors per block, llama3-405b's
plan replays 6% fewer instructions at 16 than at 8, valgrind's instruction count, docs/benchmarks.md)."""


def alloc_runs(events: Sequence) -> dict[int, int]:
    """{index of its first event: length} of every run of at least ``MIN_RUN`` consecutive ``alloc`` events with
    the same size and stream and no recorded segment address (``events``: ``Event``s or their tuples); the last
    trace's answer kept (a plan replays one trace twice: its fragmentation line's ``expandable_segments``)."""
    if events is _last[0]:
        return dict(_last[1])
    runs, start = {}, 0
    keys = [e[2:4] if e[0] == "alloc" and (len(e) < 5 or e[4] is None) else None for e in events]
    for key, group in groupby(keys):  # consecutive equal keys, counted in C
        length = len(list(group))
        if key is not None and length >= MIN_RUN:
            runs[start] = length
        start += length
    if isinstance(events, tuple):  # immutable: the same object is the same trace
        _last[:] = [events, runs]
    return dict(runs)


_last: list = [None, {}]


def chunk_runs(chunks: Sequence[tuple[int, int, int, int]]) -> dict[int, int]:
    """``alloc_runs`` of a trace builder's events from its alloc chunks ((index of the first event, size, stream,
    count) of each batch of equal allocations without a segment address, by index; ``step_trace._Builder``): a
    run is chunks that follow one another with the same size and stream (no other event between them), and
    every alloc event lies in a chunk; a chunk per batch rather than an event per event (a speed-up, no rule:
    tests/test_step_trace.py compares it with ``alloc_runs`` of the events on every engine)."""
    runs: dict[int, int] = {}
    start = end = -1
    key = None
    for at, size, stream, count in chunks:
        if at == end and key == (size, stream):
            end += count
            continue
        if end - start >= MIN_RUN:
            runs[start] = end - start
        start, end, key = at, at + count, (size, stream)
    if end - start >= MIN_RUN:
        runs[start] = end - start
    return runs


def _settled(pool: Pool, rounded: int) -> bool:
    return pool.first(rounded) is None


def _copy_periods(alloc, pool: Pool, template: Segment, blocks: list[Block], shift: int, ids: Sequence, copies: int,
                  run) -> None:  # fmt: skip
    """``copies`` more periods: ``template``'s segment (``blocks``: its blocks) ``shift``, 2 ``shift``, ... bytes up,
    its allocated blocks given to ``ids`` in turn (each period's in address order, the order it handed them out),
    its free blocks cached in ``pool``. A speed-up, no rule (tests/test_allocator_replay.py): each ``Segment(...)``
    and ``Block(...)`` made without its ``__init__`` (~6,000 per FSDP2 replay), a block's fields that every copy
    shares set from one tuple prepared from the template, the links in one loop; then the blocks handed out, the
    blocks cached (their size's addresses joined at once, after the others where they lie above them: new
    segments lie above every other, as ``Pool.insert`` one by one), the segments and their log entries, each
    in one call over all the copies."""
    stream, small, clock, start = template.stream, template.small, pool.clock[0], template.address
    head, *rest = [(b.address - start, (b.size, stream, small, True, False, b.allocated, b.requested if b.allocated
                    else 0, b.gc_base if b.allocated else clock)) for b in blocks]  # fmt: skip
    head = head[1]
    bases = range(start + shift, start + (copies + 1) * shift, shift)
    made, segs, new = [], [], _new
    keep, keep_segment, shared = made.append, segs.append, (stream, small, False, 0)
    for base in bases:
        segment, block = new(Segment), new(Block)
        segment.stream, segment.small, segment.expandable, segment.page = shared
        block.size, block.stream, block.small, block.mapped, block.pending, block.allocated, block.requested, \
            block.gc_base = head  # fmt: skip
        segment.address, segment.head, block.address, block.segment, block.prev = base, block, base, segment, None
        keep_segment(segment)
        keep(block)
        for offset, fields in rest:
            prev, block = block, new(Block)
            block.size, block.stream, block.small, block.mapped, block.pending, block.allocated, block.requested, \
                block.gc_base = fields  # fmt: skip
            block.address, block.segment, block.prev = base + offset, segment, prev
            prev.next = block
            keep(block)
        block.next = None
    mask = [b.allocated for b in blocks]
    given = list(compress(made, cycle(mask)))  # in order: period by period, each in address order
    run.live.update(zip(ids, given))
    if run.details:
        run.addresses.extend(zip(ids, map(_ADDRESS, given)))
    cached = list(compress(made, cycle([not m for m in mask])))
    pool.blocks.update(zip(map(_ADDRESS, cached), cached))
    for size in dict.fromkeys(b.size for b in blocks if not b.allocated):
        new_blocks = [made[j::len(blocks)] for j, b in enumerate(blocks) if not b.allocated and b.size == size]
        addresses = list(map(_ADDRESS, chain.from_iterable(new_blocks)))
        _cached_after(pool, size, addresses if len(new_blocks) == 1 else sorted(addresses))
    alloc.segments.update(zip(bases, segs))
    alloc.log.extend(zip(repeat("segment_alloc"), bases, repeat(sum(b.size for b in blocks)), repeat(stream)))


_new = object.__new__
_EVENT_ID = itemgetter(1)  # an ``Event``'s id
_ADDRESS = attrgetter("address")


def _copy_whole(alloc, template: Segment, shift: int, ids: Sequence, run) -> None:
    """``_copy_periods`` of a period that is one request given a segment of its own, whole (the large requests
    that leave under 1 MiB of their segment: FSDP2's gathered parameters), for each of ``ids`` in turn."""
    b, new = template.head, _new
    shared = (b.size, template.stream, template.small, b.requested, True, False, True, None, None, b.gc_base)
    bases = range(template.address + shift, template.address + (len(ids) + 1) * shift, shift)
    segs, made = [], []
    keep_segment, keep = segs.append, made.append
    for base in bases:
        segment, block = new(Segment), new(Block)  # ``Segment(...)``, ``Block(...)``: their fields set at once
        segment.address, segment.stream, segment.small, segment.expandable, segment.page, segment.head = \
            base, template.stream, template.small, False, 0, block
        block.size, block.stream, block.small, block.requested, block.allocated, block.pending, block.mapped, \
            block.prev, block.next, block.gc_base = shared  # fmt: skip
        block.address, block.segment = base, segment
        keep_segment(segment)
        keep(block)
    run.live.update(zip(ids, made))
    if run.details:
        run.addresses.extend(zip(ids, bases))
    alloc.segments.update(zip(bases, segs))
    alloc.log.extend(zip(repeat("segment_alloc"), bases, repeat(b.size), repeat(template.stream)))


def _period_template(alloc, pool: Pool, run, events: Sequence, rounded: int) -> tuple[int, Segment | None]:
    """Replay ``events`` (a settled point first) one by one until settled again: (how many were replayed, the
    segment the period made, or None if they were not one period)."""
    log_before = len(alloc.log)
    done = 0
    for e in events:
        run.fast_step(e)
        done += 1
        if _settled(pool, rounded):
            break
    if not _settled(pool, rounded) or len(alloc.log) != log_before + 1:
        return done, None
    action, address, _, _ = alloc.log[-1]
    segment = alloc.segments.get(address)
    blocks = [run.live[e.id] for e in events[:done]]
    if action != "segment_alloc" or segment is None or any(b.segment is not segment for b in blocks):
        return done, None
    if [b.address for b in blocks] != sorted(b.address for b in blocks):
        return done, None  # not handed out in address order: ``_copy_periods`` gives ids in address order
    # the pool changed inside the new segment only: a request takes a cached block (its own) or splits one
    # (the rest goes back), and only a memory limit frees cached blocks of other segments (not here)
    return done, segment


def fast_forward(run, events: Sequence) -> bool:
    """Replay the run ``events`` (``alloc_runs``; ``Event``s) on ``run`` (``replay._Run``), its whole periods
    copied; False (nothing replayed) when the run does not qualify."""
    alloc = run.alloc
    size, stream = events[0].size, events[0].stream
    ids = list(map(_EVENT_ID, events))  # in C, as the checks: every id new and none live
    if alloc.capacity is not None or len(set(ids)) != len(ids) or not run.live.keys().isdisjoint(ids):
        return False
    rounded = round_size(size, alloc.config)
    pool = alloc._pool(stream, is_small(rounded))
    i, n = 0, len(events)
    if alloc.config.expandable_segments:  # one growing segment: carved in closed form once settled
        while i < n and not expandable_run(run, events[i:], rounded, pool, stream):
            run.fast_step(events[i])
            i += 1
        return True
    if run.plain:  # the requests the pool's cached blocks serve, whole ones taken together
        i = take_cached(run, events, rounded, pool)
    while i < n and not _settled(pool, rounded):  # up to a settled point
        run.fast_step(events[i])
        i += 1
    stats = alloc.stats
    counted = (stats.allocated, stats.requested, stats.reserved, stats.segments)
    before, address_before = [s.current for s in counted], alloc._next_address
    done, template = _period_template(alloc, pool, run, events[i:], rounded) if i < n else (0, None)
    i += done
    copies = 0 if template is None else (n - i) // done
    if copies:
        deltas = [s.current - b for s, b in zip(counted, before)]
        shift = alloc._next_address - address_before
        blocks = template.blocks()
        if done == 1 and len(blocks) == 1 and blocks[0].allocated:  # one whole segment per request
            _copy_whole(alloc, template, shift, ids[i:i + copies], run)
        else:
            _copy_periods(alloc, pool, template, blocks, shift, ids[i:i + copies * done], copies, run)
        alloc._next_address += copies * shift
        for stat, delta in zip(counted, deltas):
            stat.add(copies * delta)  # a run only allocates: every stat grows, its peak is where the run ends
    for e in events[i + copies * done:]:
        run.fast_step(e)
    return True


def expandable_run(run, events: Sequence, rounded: int, pool: Pool, stream: int) -> bool:
    """The run ``events`` on expandable segments in closed form; False (nothing done) unless the stream's
    segment has one unmapped range, its pages whole, room for the run, and no cached block of at least ``r``
    but its free tail (the cached block right before the unmapped range).

    Then every request is carved at the frontier ``F`` of that tail (or of the unmapped range, without one):
    the tail is the only cached block that is or can grow to ``r`` (``get_free_block`` or
    ``find_expandable_block`` takes it, with the unmapped range after it), so when ``F + r`` passes the
    mapped end ``M`` the pages up to it are mapped (``map_block``: ``ceil((F + r - M) / page)`` pages from
    ``M``, one ``segment_map``), the tail and the new pages merge, and the request splits off its front (the
    rest, a multiple of 512 B, stays cached; none left: the block handed out whole is still ``r`` bytes).
    Blocks of ``r`` bytes at ``F, F + r, ...``, the tail ``[F_n, M_n)`` cached, the range from ``M_n`` unmapped."""
    alloc = run.alloc
    ranges = alloc.unmapped.get((stream, pool.small), [])
    if len(ranges) != 1:
        return False
    rest = ranges[0]
    segment, page = rest.segment, rest.segment.page
    before = rest.prev
    tail = before if before is not None and before.free_for_merge() and before.mapped else None
    frontier = rest.address if tail is None else tail.address
    end = rest.address + rest.size
    first = pool.first(rounded)  # none but ``tail`` may be >= the request
    if (rounded % K_MIN_BLOCK_SIZE or page % K_MIN_BLOCK_SIZE or (rest.address - segment.address) % page
            or frontier + len(events) * rounded + page > end
            or (first is not None and (first is not tail or pool.after(first) is not None))):  # fmt: skip
        return False
    if tail is not None:
        pool.remove(tail)
        before = tail.prev
    stats, mapped_to, small, live, size, grown_all = alloc.stats, rest.address, pool.small, run.live, events[0].size, 0
    if run.details:
        run.addresses.extend(zip(map(_EVENT_ID, events), range(frontier, frontier + len(events) * rounded, rounded)))
    shared = (rounded, stream, small, segment, size, True, False, True, 0)
    # each ``Block(...)`` made without its ``__init__`` and linked here, to a stand-in first, its ``next`` set by
    # the next block or ``_link`` below (a speed-up, no rule)
    ahead = before
    before = anchor = _new(Block) if ahead is None else ahead
    for ident in map(_EVENT_ID, events):
        if frontier + rounded > mapped_to:
            grown = -(-(frontier + rounded - mapped_to) // page) * page
            alloc.log.append(("segment_map", mapped_to, grown, stream))
            grown_all += grown
            mapped_to += grown
        block = _new(Block)
        block.size, block.stream, block.small, block.segment, block.requested, block.allocated, block.pending, \
            block.mapped, block.gc_base = shared  # the fields every block shares, set from one tuple
        block.address, block.prev = frontier, before
        before.next = before = live[ident] = block
        frontier += rounded
    if ahead is None:  # the stand-in out: the first block heads the segment
        anchor.next.prev = None
        segment.head = anchor.next
    # a run only allocates and maps: each stat grows, its peak is where the run ends
    stats.reserved.add(grown_all)
    stats.allocated.add(len(events) * rounded)
    stats.requested.add(len(events) * size)
    if frontier < mapped_to:
        cached = Block(frontier, mapped_to - frontier, stream, pool.small, segment)
        before = _link(segment, before, cached)
        pool.insert(cached)
    rest.address, rest.size = mapped_to, end - mapped_to
    _link(segment, before, rest)
    return True


def _link(segment: Segment, before: Block | None, block: Block) -> Block:
    """Put ``block`` right after ``before`` (None: first in ``segment``); returns ``block``."""
    block.prev = before
    if before is None:
        segment.head = block
    else:
        before.next = block
    return block
