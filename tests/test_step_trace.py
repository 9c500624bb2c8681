"""One description of a step feeds both peaks: each engine's ordered allocation trace
(``zeroplan/engines/*/alloc_trace.py``, built by ``zeroplan.allocator.step_trace``) reaches, phase by phase,
exactly the live bytes the engine's moments predict (``EngineEstimate.peak``), on configurations drawn with a
fixed seed across engines, world sizes, batches, checkpointing, dtypes, resharding, init and device; and the
trace carries FSDP2's and DeepSpeed's side streams, which the allocator model keeps apart. Pure math."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from zeroplan.allocator import replay
from zeroplan.allocator.runs import alloc_runs
from zeroplan.allocator.step_trace import step_trace, tensor_sizes
from zeroplan.engines import deepspeed, fsdp2, reference
from zeroplan.engines.deepspeed.alloc_trace import alloc_traces as deepspeed_traces
from zeroplan.engines.fsdp2.alloc_trace import alloc_traces as fsdp2_traces
from zeroplan.engines.reference.alloc_trace import alloc_traces as reference_traces
from zeroplan.estimation.workload import model_workload
from zeroplan.formulas.peak import Moment, Term, peak_of
from zeroplan.presets import resolve_model

CONFIGS = Path(__file__).parent / "data" / "hf_configs"
MODELS = ("tiny-gpt2.json", "tiny-llama.json", "tiny-gpt2-untied.json", "tiny-llama-tied-bias.json")


def _workload(rng: random.Random):
    model = resolve_model(str(CONFIGS / rng.choice(MODELS)))
    return model_workload(model, rng.choice((8, 16)), rng.choice((1, 2, 3)), rng.choice(("none", "full")),
                          rng.choice((1, 2)), rng.choice((True, False)))  # fmt: skip


def _draws(engine: str, n: int):
    rng = random.Random(f"step-trace-{engine}")
    for _ in range(n):
        w, nd = _workload(rng), rng.choice((1, 2, 3, 4, 8))
        if engine == "reference":
            yield w, nd, reference.Settings(backend=rng.choice(("nccl", "gloo")),
                                            block_bytes=rng.choice((1, 512)))  # fmt: skip
        elif engine == "fsdp2":
            nd = max(nd, 2)
            rsf = rng.choice((True, False, *(k for k in (2, 4) if nd % k == 0 and k < nd)))
            # HSDP (2 replicas) where N_d allows it and no post-forward group is asked; rank None: the worst rank
            mesh = {"dp_replicate": 2} if nd >= 4 and rsf in (True, False) and rng.random() < 0.4 else {}
            yield w, nd, fsdp2.Settings(reshard_after_forward=rsf, param_dtype=rng.choice((None, "bf16")),
                                        device=rng.choice(("cuda", "cpu")), init=rng.choice(("meta", "materialized")),
                                        backend=rng.choice(("nccl", "gloo")),
                                        rank=rng.choice((None, rng.randrange(nd))), **mesh)  # fmt: skip
        else:
            stage = rng.choice((1, 2, 3))
            yield w, nd, deepspeed.Settings(stage=stage, overlap_comm=rng.choice((None, True, False)),
                                            reduce_bucket_size=rng.choice((500, 20_000, 500_000_000)),
                                            rank=rng.choice((None, rng.randrange(nd))))  # fmt: skip


ENGINES = {"reference": (reference.estimate, reference_traces), "fsdp2": (fsdp2.estimate, fsdp2_traces),
           "deepspeed": (deepspeed.estimate, deepspeed_traces)}  # fmt: skip


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_trace_reaches_exactly_the_moments_peak_in_every_phase(engine):
    estimate, traces = ENGINES[engine]
    checked = 0
    for w, nd, settings in _draws(engine, 12):
        rows, trs = estimate(w, nd, settings), traces(w, nd, settings)
        assert len(rows) == len(trs)
        for row, tr in zip(rows, trs):
            assert tr.phase_live_bytes == row.peak.by_phase(), (engine, nd, settings)
            assert tr.live_peak_bytes == row.peak.peak_bytes
            # the allocator hands out at least what is live: whole blocks, rounded to 512 B
            assert replay(tr.events).allocated_peak_bytes >= row.peak.peak_bytes
            checked += 1
    assert checked >= 12


def test_fsdp2_gathers_and_reduces_on_their_own_streams_and_deepspeed_reduces_on_its_own():
    w = model_workload(resolve_model(str(CONFIGS / "tiny-llama.json")), 16, 2, "none", 1, True)
    (tr,) = fsdp2_traces(w, 4, fsdp2.Settings(param_dtype="bf16"))
    assert tr.streams() == (0, 1, 2)  # default, all-gather copy-in, reduce-scatter
    (zero2,) = deepspeed_traces(w, 4, deepspeed.Settings(stage=2, overlap_comm=True))
    (plain,) = deepspeed_traces(w, 4, deepspeed.Settings(stage=2, overlap_comm=False))
    assert (zero2.streams(), plain.streams()) == ((0, 1), (0,))
    # one pool per stream: the side streams' cached blocks are reserved beside the default stream's
    one = replay([e._replace(stream=0) for e in tr.events])
    assert replay(tr.events).reserved_peak_bytes > one.reserved_peak_bytes


def test_moments_become_frees_then_allocations_and_a_renamed_buffer_stays_put():
    a, b = Term("all-gather output (block 1, this unit)", 4096, "x"), Term("activations", 1000, "y")
    kept = Term("all-gather output (block 1, kept)", 4096, "x")
    moments = (Moment("init", "i", (a,)), Moment("forward", "f1", (a, b)), Moment("forward", "f2", (kept,)),
               Moment("backward", "b", (b,)), Moment("optimizer_step", "o", ()))  # fmt: skip
    tr = step_trace(moments, steps=1)
    assert [e[:3] for e in tr.events] == [
        ("phase", "init", 0), ("alloc", 0, 4096), ("phase", "forward", 0), ("alloc", 1, 1000),
        ("free", 1, 0),  # f2: the activations go; the gathered buffer is the same one under another name
        ("free", 0, 0), ("phase", "backward", 0), ("alloc", 2, 1000), ("free", 2, 0), ("phase", "optimizer_step", 0)]
    assert tr.phase_live_bytes == peak_of(moments).by_phase()


def test_a_collection_of_n_grows_by_its_last_tensors():
    saved = [Term(f"saved activations of {n} blocks", 300 * n, "x", n) for n in (1, 2, 3)]
    moments = [Moment("init", "i", ()), *(Moment("forward", str(i), (t,)) for i, t in enumerate(saved)),
               Moment("backward", "b", (saved[0],)), Moment("optimizer_step", "o", ())]
    events = step_trace(moments, steps=1).events
    assert [e.action for e in events if e.action in ("alloc", "free")] == ["alloc"] * 3 + ["free"] * 3
    assert tensor_sizes(Term("t", 10, "x", 4), 1) == [(3, 2), (2, 2)]
    assert tensor_sizes(Term("t", 10, "x", 4), 512) == [(3, 4)]


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_last_step_copied_from_the_one_before_is_the_step_built(engine, monkeypatch):
    """``step_trace`` copies the last step's events from the step before where the builder's states agree
    (``_repeats``, to the step's end or to a later mark, whence it resumes): every event equal to the trace built
    moment by moment, on the drawn
    configurations of each engine (HSDP, k-sharded, CPU, ZeRO 1-3, ...), and the copy made (on most of FSDP2's);
    and each trace's ``runs`` (from the builder's alloc chunks, ``runs.chunk_runs``) those ``alloc_runs`` finds in
    its events (some on FSDP2's: its sharded parameters; the tiny models' other traces have none)."""
    import zeroplan.allocator.step_trace as module

    _, traces = ENGINES[engine]
    copied, repeat = [], module._Builder.repeat_step
    monkeypatch.setattr(module._Builder, "repeat_step",
                        lambda self, *a: (copied.append(a[0][0]), repeat(self, *a))[1])  # the mark reached
    checked = runs = 0
    for w, nd, settings in _draws(engine, 8):
        fast = traces(w, nd, settings)
        with monkeypatch.context() as m:
            m.setattr(module, "_repeats", lambda *a: False)
            built = traces(w, nd, settings)
        assert [t.events for t in fast] == [t.events for t in built], (engine, nd, settings)
        assert [t.phase_live_bytes for t in fast] == [t.phase_live_bytes for t in built]
        # the runs the builder knows (its alloc chunks, copied with the step): those ``alloc_runs`` finds
        assert all(t.runs == alloc_runs(list(t.events)) for t in (*fast, *built)), (engine, nd, settings)
        runs += sum(len(t.runs) for t in fast)
        checked += len(fast)
    assert checked >= 8 and copied and (runs or engine != "fsdp2"), (engine, len(copied), checked, runs)
    assert any(end is not None for end in copied)  # some copies stop at a later mark and the builder resumes
    if engine == "fsdp2":  # its moments start each step alike (DeepSpeed's first step often does not)
        assert len(copied) * 2 >= checked, (len(copied), checked)


def test_a_last_step_that_starts_elsewhere_is_copied_only_from_where_it_agrees(monkeypatch):
    """A one-tensor buffer grown in pieces: from init (1,500 B) to the first forward (2,000 B) it grows by a
    500-B piece, and by another in the backward (2,500 B); the optimizer step (1,000 B) frees the three pieces
    and makes one of 1,000 B, which the second forward grows by another. After the second forward the states
    agree but for the gradients' bottom pieces (1,500 + 500 B then, 1,000 + 1,000 B now), which the backward
    does not pop: the copy reaches the backward's mark and the builder resumes there with the last step's own
    pieces; the optimizer step pops them, so it is walked, and after it the states agree outright (nothing left
    to copy). The trace: the one built with no copy at all."""
    import zeroplan.allocator.step_trace as module

    grads = [Term("gradients", n, "g") for n in (1500, 2000, 2500, 1000)]
    x = Term("activations", 1000, "y")
    moments = (Moment("init", "i", (grads[0],)), Moment("forward", "f", (grads[1], x)),
               Moment("backward", "b", (grads[2],)), Moment("optimizer_step", "o", (grads[3],)))  # fmt: skip
    answers, repeats = [], module._repeats
    monkeypatch.setattr(module, "_repeats", lambda *a: answers.append(repeats(*a)) or answers[-1])
    tr = step_trace(moments, steps=2)
    assert [(plan[0], [len(ids) for ids, _ in plan[2].values()]) for plan in answers] == [(1, [2]), (None, [])]
    monkeypatch.setattr(module, "_repeats", lambda *a: None)
    assert step_trace(moments, steps=2) == tr
    allocs = [e.size for e in tr.events if e.action == "alloc"]
    # the second forward's gradients: two 1,000-B pieces, grown by 500 B in its backward
    assert allocs == [1500, 500, 1000, 500, 1000, 1000, 1000, 500]
    assert tr.phase_live_bytes == peak_of(moments).by_phase()


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_each_moment_built_from_the_one_before_is_the_moment_built_whole(engine, monkeypatch):
    """``_Builder.wanted_after`` (a moment's tensors from the terms it does not share with the one before) gives
    the trace ``wanted`` gives from every term, event for event, on the drawn configurations of each engine;
    and it is the path taken (not its fallback) for most moments."""
    import zeroplan.allocator.step_trace as module

    _, traces = ENGINES[engine]
    taken, after = [], module._Builder.wanted_after
    monkeypatch.setattr(module._Builder, "wanted_after", lambda self, *a: taken.append(after(self, *a)) or taken[-1])
    for w, nd, settings in _draws(engine, 6):
        fast = traces(w, nd, settings)
        with monkeypatch.context() as m:
            m.setattr(module, "INCREMENTAL", False)
            whole = traces(w, nd, settings)
        assert [t.events for t in fast] == [t.events for t in whole], (engine, nd, settings)
        assert [t.phase_live_bytes for t in fast] == [t.phase_live_bytes for t in whole]
    assert sum(t is not None for t in taken) * 2 > len(taken) > 0, (engine, len(taken))


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_transition_that_skips_the_pairing_makes_the_events_of_pairing(engine, monkeypatch):
    """``PAIR_SKIP``: a transition none of whose freed (size, stream) a new tensor wants skips
    ``_Builder._paired``; the traces are those of pairing every transition, event for event, on the drawn
    configurations of each engine (both paths taken)."""
    import zeroplan.allocator.step_trace as module
    import zeroplan.allocator.trace_moves as moves

    _, traces = ENGINES[engine]
    calls, pair = {True: 0, False: 0}, module._Builder._paired

    def counted(self, *args):
        calls[moves.PAIR_SKIP] += 1
        return pair(self, *args)

    monkeypatch.setattr(module._Builder, "_paired", counted)
    for w, nd, settings in _draws(engine, 6):
        skipped = traces(w, nd, settings)
        with monkeypatch.context() as m:
            m.setattr(moves, "PAIR_SKIP", False)
            every = traces(w, nd, settings)
        assert [t.events for t in skipped] == [t.events for t in every], (engine, nd, settings)
        assert [t.phase_live_bytes for t in skipped] == [t.phase_live_bytes for t in every]
        assert [t.runs for t in skipped] == [t.runs for t in every]
    assert calls[False] > calls[True] > 0, calls  # pairs made, and transitions skipped


def test_frees_kept_looks_at_the_renamed_frees_alone_and_answers_as_every_pair():
    """``step_repeat._frees_kept`` checks only the frees of renamed ids and their neighbours (two shifted ids keep
    their order): the answer of the loop over every two frees in a row, on seeded random windows of allocs, frees
    and phases with random renames (both answers drawn often)."""
    import random

    from zeroplan.allocator.replay import Event
    from zeroplan.allocator.step_repeat import _frees_kept

    def every_pair(events, start, stop, rename, shift):  # the definition: each two frees in a row
        prev = None
        for e in events[start:stop]:
            if e.action != "free":
                prev = None
                continue
            new = rename.get(e.id, e.id + shift)
            if prev is not None and prev[0] > e.id and prev[1] <= new:
                return False
            prev = (e.id, new)
        return True

    rng, answers = random.Random(16), []
    for _ in range(400):
        events = [Event("phase", "backward") if rng.random() < 0.05 else
                  Event(rng.choice(("alloc", "free", "free")), rng.randrange(40)) for _ in range(rng.randrange(1, 60))]
        rename = {i: rng.randrange(60) for i in rng.sample(range(40), rng.randrange(20))}
        start, shift = rng.randrange(len(events)), rng.randrange(-5, 20)
        stop = rng.randrange(start, len(events) + 1)
        answers.append(every_pair(events, start, stop, rename, shift))
        assert _frees_kept(events, start, stop, rename, shift) == answers[-1], (events, start, stop, rename, shift)
    assert 50 < sum(answers) < 350


def test_copy_events_in_c_makes_the_events_and_chunks_of_the_loop_per_event():
    """``step_repeat.copy_events`` (columns, ids renamed with ``map``, events made in C): the events and chunks of
    the loop per event that defines the copy, on seeded random windows of a builder's allocs (fresh ids), frees
    (of ids live at the mark, renamed or not, or newer) and phases, with random renames of the ids live at the
    mark, shifts and windows (empty ones, and ones that start or end at a phase, among them)."""
    from bisect import bisect_left

    from zeroplan.allocator.replay import Event
    from zeroplan.allocator.step_repeat import EVENTS, NEXT_ID, copy_events, renamed_at

    def per_event(events, chunks, earlier, now, rename, stop):  # the definition
        shift, start = now[NEXT_ID] - earlier[NEXT_ID], earlier[EVENTS]
        offset = len(events) - start
        chunks.extend([(at + offset, size, stream, count) for at, size, stream, count in
                       chunks[bisect_left(chunks, (start,)):bisect_left(chunks, (stop,))]])  # fmt: skip
        events.extend([Event("alloc", e.id + shift, e.size, e.stream) if e.action == "alloc" else
                       Event("free", rename.get(e.id, e.id + shift)) if e.action == "free" else e
                       for e in events[start:stop]])  # fmt: skip

    rng = random.Random(1603)
    for _ in range(300):
        events, chunks, next_id, live = [], [], 0, []
        for _ in range(rng.randrange(0, 80)):
            r = rng.random()
            if r < 0.08:
                events.append(Event("phase", rng.choice(("forward", "backward", "optimizer_step"))))
            elif r < 0.55 or not live:
                count, size, stream = rng.choice((1, 1, 3)), rng.choice((512, 1024)), rng.choice((0, 1))
                chunks.append((len(events), size, stream, count))
                events.extend(Event("alloc", next_id + i, size, stream) for i in range(count))
                live.extend(range(next_id, next_id + count))
                next_id += count
            else:
                events.append(Event("free", live.pop(rng.randrange(len(live)))))
        start = rng.randrange(len(events) + 1)
        stop = rng.randrange(start, len(events) + 1)
        before = {e.id for e in events[:start] if e.action == "alloc"}
        mark_id = max(before, default=-1) + 1
        rename = {i: rng.randrange(1000, 2000) for i in before if rng.random() < 0.4}
        earlier = (None,) * EVENTS + (start,)
        earlier = tuple(mark_id if k == NEXT_ID else v for k, v in enumerate(earlier))
        now = tuple(mark_id + rng.randrange(-3, 40) if k == NEXT_ID else None for k in range(NEXT_ID + 1))
        fast, want = (list(events), list(chunks)), (list(events), list(chunks))
        copy_events(*fast, earlier, now, rename, stop)
        per_event(*want, earlier, now, rename, stop)
        assert fast == want, (events, start, stop, rename)
        given = (list(events), list(chunks))  # the renamed events and the columns as ``copy_plan`` hands them
        copy_events(*given, earlier, now, rename, stop, renamed_at(events, start, stop, rename),
                    tuple(zip(*events[start:stop])) if stop > start else None)
        assert given == want, (events, start, stop, rename)
        assert all(type(e) is Event for e in fast[0])


def test_moved_terms_finds_the_terms_gone_and_new_of_the_sets_of_ids():
    """``trace_terms.moved_terms`` (the terms between two moments' common head and tail): the terms gone (in the
    first moment's order) and new (in the second's) of the sets of every term's id, the second moment's ids, and
    None exactly where the second holds a term twice, on seeded random moments (terms kept, dropped, added,
    moved, repeated; equal terms that are other objects among them)."""
    from zeroplan.allocator.trace_terms import moved_terms

    rng, answers = random.Random(1604), {"none": 0, "moved": 0, "same": 0}
    pool = [Term(f"t{i % 7}", 100, "s") for i in range(30)]  # equal names, bytes: equal terms, other objects
    for _ in range(2000):
        before = tuple(rng.sample(pool, rng.randrange(0, 12)))
        terms = list(before)
        for _ in range(rng.choice((0, 1, 2, 4))):
            r = rng.random()
            if r < 0.3 and terms:
                del terms[rng.randrange(len(terms))]
            elif r < 0.6:
                terms.insert(rng.randrange(len(terms) + 1), rng.choice(pool))
            elif r < 0.8 and terms:  # a term moved
                terms.insert(rng.randrange(len(terms) + 1), terms.pop(rng.randrange(len(terms))))
            elif terms:  # a term of the moment twice
                terms.insert(rng.randrange(len(terms) + 1), rng.choice(terms))
        terms = tuple(terms)
        ids = set(map(id, before))
        got = moved_terms(before, ids, terms)
        now = set(map(id, terms))
        if len(now) != len(terms):
            assert got is None, (before, terms)
            answers["none"] += 1
            continue
        gone, new = [t for t in before if id(t) not in now], [t for t in terms if id(t) not in set(map(id, before))]
        assert got is not None and got[0] == gone and got[1] == new, (before, terms, got)
        assert all(map(lambda a, b: a is b, got[0] + got[1], gone + new)) and ids == now
        answers["moved" if gone or new else "same"] += 1
    assert min(answers.values()) > 100, answers


def _move_reading_live(self, moment, want, changes):
    """The move that reads the live buffers for each changed key (main before ``trace_moves.plan_move``): the
    grown buffers gone paired with the new ones by their live bytes and stream, the changed keys live freed in
    the order they were added, each wanted key's missing tensors (or grown piece) from its live buffers."""
    from itertools import repeat

    from zeroplan.allocator.replay import Event
    from zeroplan.allocator.step_repeat import GROWN

    changed, wanted_changed = {*changes[0], *changes[1]}, changes[1]
    self.moves += 1
    live = self.live

    def grown(stack):
        return sum(b[1] for b in stack)

    def add(key, stack):  # a key made anew, its age the next
        live[key], self.since[key] = stack, self._added
        self._added += 1
        return stack

    def note():  # the phase's largest live bytes
        if self.phase is not None:
            self.phase_max[self.phase] = max(self.phase_max.get(self.phase, 0), self.live_bytes)

    gone = sorted(((grown(live[k]), k) for k in changed if k[2] == GROWN and k not in want and live.get(k)),
                  reverse=True)
    new = sorted(((want[k][0], k) for k in changed if k[2] == GROWN and k in want and not live.get(k)), reverse=True)
    for _, old_key in gone if new else ():
        stream = live[old_key][0][2]
        match = next((at for at, (_, k) in enumerate(new) if want[k][1] == stream), None)
        if match is not None:
            add(new.pop(match)[1], live.pop(old_key))
    freed = []
    for key in sorted([k for k in changed if k in live], key=self.since.__getitem__):
        stack, keep = live[key], want[key][0] if key in want else 0
        if key[2] == GROWN:
            total = grown(stack)
            while stack and total > keep:
                total -= stack[-1][1]
                freed.append(stack.pop())
                self.popped.append((self.moves, freed[-1][0]))
        elif len(stack) > keep:
            freed.extend(stack[keep:][::-1])
            del stack[keep:]
    emptied = [k for k in changed if not live.get(k, True)]
    fresh = []
    for key in wanted_changed:
        amount, stream = want[key]
        stack = live.get(key)
        if stack is None:
            stack = add(key, [])
        if key[2] == GROWN:
            if amount - grown(stack) > 0:
                fresh.append((key, amount - grown(stack), stream, 1))
        elif amount > len(stack):
            fresh.append((key, key[2], stream, amount - len(stack)))
    if freed:
        if fresh:
            freed = self._paired(freed, fresh)
        freed.sort(reverse=True)
        self.events.extend(Event("free", b[0]) for b in freed)
        self.live_bytes -= sum(self._round_of[b[1]] for b in freed)
    if moment.phase != self.phase:
        self.phase = moment.phase
        self.events.append(Event("phase", moment.phase))
        note()
    for key, size, stream, count in fresh:
        self.chunks.append((len(self.events), size, stream, count))
        ids = range(self.next_id, self.next_id + count)
        self.events.extend(Event("alloc", i, size, stream) for i in ids)
        live[key].extend(zip(ids, repeat(size), repeat(stream)))
        self.next_id += count
        self.live_bytes += count * self._round_of[size]
    note()
    for key in emptied:
        if not live[key]:
            del live[key]


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_move_planned_from_the_moments_makes_the_events_of_the_move_reading_the_live_buffers(engine, monkeypatch):
    """``trace_moves``: a transition planned once from the two moments' tensors (``plan_move``) and walked
    (``move_to``) makes the trace of the move that reads the live buffers for each changed key, event for event,
    on the drawn configurations of each engine (with the step copy on and off: the copy's states come from the
    moves)."""
    import zeroplan.allocator.step_trace as module

    _, traces = ENGINES[engine]
    for n, (w, nd, settings) in enumerate(_draws(engine, 6)):
        with monkeypatch.context() as m:
            if n % 2:
                m.setattr(module, "_repeats", lambda *a: False)
            planned = traces(w, nd, settings)
            m.setattr(module._Builder, "move_to", _move_reading_live)
            read = traces(w, nd, settings)
        assert [t.events for t in planned] == [t.events for t in read], (engine, nd, settings)
        assert [t.phase_live_bytes for t in planned] == [t.phase_live_bytes for t in read]
        assert [t.runs for t in planned] == [t.runs for t in read]


def test_a_term_alike_one_met_before_keys_as_it_on_its_own_stream_and_block(monkeypatch):
    """``_ALIKE``: a term's keys found once per (stream_of, block bytes, its fields), across traces; a trace built
    with the cache warm (every FSDP2 draw's terms met before) is the one built cold, event for event; other terms
    alike in all but one field, another ``stream_of`` or another block size key as their own."""
    import zeroplan.allocator.step_trace as module

    draws = list(_draws("fsdp2", 4))
    module._ALIKE.clear()
    cold = [fsdp2_traces(w, nd, settings) for w, nd, settings in draws]
    assert module._ALIKE
    warm = [fsdp2_traces(w, nd, settings) for w, nd, settings in draws]
    assert [[t.events for t in ts] for ts in cold] == [[t.events for t in ts] for ts in warm]
    terms = [Term("g of 2 x", 1000, "s", 2), Term("g of 3 x", 1000, "s", 2), Term("g of 2 x", 1001, "s", 2),
             Term("g of 2 x", 1000, "t", 2), Term("g of 2 x", 1000, "s", 1)]  # fmt: skip
    moments = [Moment("init", "i", ()), *(Moment("forward", f"f{i}", (t,)) for i, t in enumerate(terms))]
    cases = [(stream_of, block) for stream_of in (lambda t: 0, lambda t: 7) for block in (1, 512)]
    built = [step_trace(moments, block, stream_of=stream_of, steps=1) for stream_of, block in cases]  # warm
    for (stream_of, block), trace in zip(cases, built):
        module._ALIKE.clear()
        assert trace == step_trace(moments, block, stream_of=stream_of, steps=1)
        assert {e.stream for e in trace.events if e.action == "alloc"} == {stream_of(None)}
