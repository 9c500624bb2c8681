"""The caching allocator model (``zeroplan.allocator``) against the rules of ``c10/cuda/CUDACachingAllocator.cpp``,
each number worked out by hand from the source (the function named in each test)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from zeroplan.allocator import AllocatorConfig, CachingAllocator, parse_alloc_conf, replay, round_size
from zeroplan.allocator.config import _roundup_power2_next_division, allocation_size

MiB = 1 << 20


@pytest.mark.parametrize(("request_bytes", "block"), [(1, 512), (512, 512), (513, 1024), (1000, 1024),
                                                      (3_000_000, 3_000_320)])  # fmt: skip
def test_requests_round_up_to_512_bytes(request_bytes, block):
    assert round_size(request_bytes) == block  # round_size: kMinBlockSize * ceil(size / kMinBlockSize)


def test_power2_divisions_round_to_the_next_division():
    assert _roundup_power2_next_division(1200, 4) == 1280  # the source's own comment: 1024, 1280, 1536, 1792
    four = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1_153_434, four) == 1_310_720  # 1.1 MiB in [1, 2) MiB by quarters: 1.25 MiB
    assert round_size(1200, four) == 1536  # not above 512 x 4: plain 512-byte rounding
    assert round_size(1_153_434) == 1_153_536  # no divisions: 512-byte rounding


@pytest.mark.parametrize(("size", "segment"), [(512, 2 * MiB), (MiB, 2 * MiB), (MiB + 512, 20 * MiB),
                                               (10 * MiB - 512, 20 * MiB), (10 * MiB, 10 * MiB),
                                               (10 * MiB + 512, 12 * MiB)])  # fmt: skip
def test_segment_sizes(size, segment):
    assert allocation_size(size) == segment  # get_allocation_size: kSmallBuffer, kLargeBuffer, kRoundLarge


def test_small_requests_share_a_2_mib_segment_and_split_down_to_512_bytes():
    r = replay([("alloc", "a", 1000, 0), ("alloc", "b", 1000, 0), ("alloc", "c", MiB, 0)])
    assert r.segment_sizes() == [2 * MiB]  # 1024 + 1024 + 1 MiB fit in one small segment
    (seg,) = r.segments
    assert [b.size for b in seg.blocks] == [1024, 1024, MiB, MiB - 2048]
    assert (r.allocated_bytes, r.requested_bytes, r.reserved_bytes) == (MiB + 2048, MiB + 2000, 2 * MiB)


@pytest.mark.parametrize(("second", "allocated"), [
    (11 * MiB + MiB // 2, 12 * MiB),  # 0.5 MiB would remain: not split, handed out whole
    (11 * MiB, 12 * MiB),  # exactly 1 MiB remains: should_split needs remaining > kSmallSize
    (11 * MiB - 512, 11 * MiB - 512),  # 1 MiB + 512 B remain: split
])  # fmt: skip
def test_a_large_cached_block_is_handed_out_whole_when_under_1_mib_would_remain(second, allocated):
    """should_split (large pool): remaining > 1 MiB; alloc_found_block counts block->size in allocated_bytes."""
    r = replay([("alloc", "a", 12 * MiB, 0), ("free", "a"), ("alloc", "b", second, 0)])
    assert r.segment_sizes() == [12 * MiB]
    assert r.allocated_bytes == allocated
    assert r.requested_bytes == second
    assert r.allocated_peak_bytes == 12 * MiB


def test_best_fit_takes_the_smallest_block_then_the_lowest_address():
    events = [("alloc", "a", 12 * MiB, 0), ("alloc", "b", 14 * MiB, 0), ("alloc", "c", 12 * MiB, 0),
              ("free", "b"), ("free", "c"), ("free", "a"), ("alloc", "d", 11 * MiB + MiB // 2, 0)]  # fmt: skip
    r = replay(events)
    first = r.segments[0].address
    assert dict(r.addresses)["d"] == first  # a's 12 MiB (lowest address), not c's 12 MiB nor b's 14 MiB
    assert r.allocated_bytes == 12 * MiB


def test_freed_neighbours_merge_and_serve_a_larger_request():
    three = [("alloc", n, 3 * MiB, 0) for n in "abc"]
    r = replay([*three, ("free", "b"), ("free", "a"), ("alloc", "d", 5 * MiB + MiB // 2, 0)])
    assert r.segment_sizes() == [20 * MiB]  # 1-10 MiB requests share a 20 MiB segment
    (seg,) = r.segments
    assert dict(r.addresses)["d"] == seg.address  # a + b merged into 6 MiB at the segment's start
    assert [b.size for b in seg.blocks] == [6 * MiB, 3 * MiB, 11 * MiB]  # 6 - 5.5 < 1 MiB: whole


def test_each_stream_has_its_own_pool():
    same = replay([("alloc", "a", 12 * MiB, 0), ("free", "a"), ("alloc", "b", 12 * MiB, 0)])
    other = replay([("alloc", "a", 12 * MiB, 0), ("free", "a"), ("alloc", "b", 12 * MiB, 7)])
    assert same.reserved_bytes == 12 * MiB
    assert other.reserved_bytes == 24 * MiB  # the block cached on stream 0 is not handed to stream 7


def test_a_block_used_on_another_stream_is_reusable_only_once_that_stream_is_done():
    r = replay([("alloc", "a", 12 * MiB, 0), ("free_requested", "a"), ("alloc", "b", 12 * MiB, 0),
                ("free_completed", "a"), ("free", "b"), ("alloc", "c", 12 * MiB, 0)])  # fmt: skip
    assert r.segment_sizes() == [12 * MiB, 12 * MiB]
    assert r.allocated_bytes == 12 * MiB and r.reserved_bytes == 24 * MiB


def test_empty_cache_returns_only_entirely_free_segments():
    r = replay([("alloc", "a", 12 * MiB, 0), ("alloc", "b", 3 * MiB, 0), ("alloc", "c", 3 * MiB, 0),
                ("free", "a"), ("free", "b"), ("empty_cache",)])  # fmt: skip
    assert r.reserved_bytes == 20 * MiB  # the 12 MiB segment went; the 20 MiB one still holds c
    assert [a for a, *_ in r.segment_log] == ["segment_alloc", "segment_alloc", "segment_free"]


def test_max_split_size_keeps_oversize_blocks_whole():
    conf = parse_alloc_conf("max_split_size_mb:64")
    r = replay([("alloc", "a", 100 * MiB, 0), ("free", "a"), ("alloc", "b", 30 * MiB, 0)], conf)
    assert r.segment_sizes() == [100 * MiB, 30 * MiB]  # 30 < 64: the 100 MiB block may not serve it
    r = replay([("alloc", "a", 100 * MiB, 0), ("free", "a"), ("alloc", "b", 90 * MiB, 0)], conf)
    assert (r.segment_sizes(), r.allocated_bytes) == ([100 * MiB], 100 * MiB)  # within 20 MiB: whole
    r = replay([("alloc", "a", 100 * MiB, 0), ("free", "a"), ("alloc", "b", 80 * MiB, 0)], conf)
    assert r.segment_sizes() == [100 * MiB, 80 * MiB]  # 100 >= 80 + max_non_split_rounding (20 MiB)


def test_expandable_segments_grow_one_segment_in_20_mib_pages():
    events = [("alloc", "a", 12 * MiB, 0), ("alloc", "b", 12 * MiB, 0)]
    plain, grown = replay(events), replay(events, parse_alloc_conf("expandable_segments:True"))
    assert (plain.reserved_bytes, len(plain.segments)) == (24 * MiB, 2)
    assert (grown.reserved_bytes, len(grown.segments)) == (40 * MiB, 1)  # pages of kLargeBuffer
    assert [b.size for b in grown.segments[0].blocks] == [12 * MiB, 12 * MiB, 16 * MiB]
    assert grown.allocated_bytes == 24 * MiB
    shrunk = replay([*events, ("free", "b"), ("empty_cache",)], parse_alloc_conf("expandable_segments:True"))
    assert shrunk.reserved_bytes == 20 * MiB  # the second page is free again and unmapped


def test_expandable_segments_split_any_remainder_of_512_bytes():
    conf = parse_alloc_conf("expandable_segments:True")
    r = replay([("alloc", "a", 12 * MiB, 0), ("free", "a"), ("alloc", "b", 11 * MiB + MiB // 2, 0)], conf)
    assert r.allocated_bytes == 11 * MiB + MiB // 2  # should_split: remaining >= 512 with expandable segments


def test_out_of_memory_frees_the_cache_and_retries_before_failing():
    events = [("alloc", "a", 12 * MiB, 0), ("alloc", "b", 12 * MiB, 0), ("free", "a"),
              ("alloc", "c", 16 * MiB, 0), ("alloc", "d", 8 * MiB, 0)]  # fmt: skip
    r = replay(events, capacity_bytes=30 * MiB)
    # c: 24 + 16 > 30, the cached 12 MiB segment is freed and the retry fits 28 MiB (retry 1); d: a 20 MiB
    # segment, 28 + 20 > 30 with nothing left to free, the retry fails too (retry 2) and d runs out of memory
    assert r.num_alloc_retries == 2
    assert r.oom == (4, 8 * MiB)
    assert r.reserved_bytes == 28 * MiB
    assert replay(events).oom is None


def test_garbage_collection_frees_old_cached_blocks_above_the_threshold():
    conf = parse_alloc_conf("garbage_collection_threshold:0.5")
    events = [("alloc", "a", 30 * MiB, 0), ("free", "a"), ("alloc", "b", 40 * MiB, 0)]
    r = replay(events, conf, capacity_bytes=100 * MiB)
    assert r.reserved_bytes == 70 * MiB  # 30 MiB reserved is under 50 MiB: nothing collected
    r = replay([("alloc", "x", 30 * MiB, 0), *events], conf, capacity_bytes=100 * MiB)
    assert r.reserved_bytes == 70 * MiB  # 60 MiB > 50: the cached 30 MiB block goes before b's segment
    assert ("segment_free", r.segment_log[1][1], 30 * MiB, 0) in r.segment_log


def test_phases_reset_the_peaks():
    r = replay([("phase", "forward"), ("alloc", "a", 12 * MiB, 0), ("alloc", "t", 4 * MiB, 0), ("free", "t"),
                ("phase", "backward"), ("alloc", "g", 2 * MiB, 0)])  # fmt: skip
    assert r.phases["forward"].allocated_bytes == 16 * MiB
    assert r.phases["backward"].allocated_bytes == 14 * MiB  # peak reset to the 12 MiB still live
    assert r.phases["backward"].reserved_bytes == 32 * MiB  # t's 20 MiB segment is cached and reused
    assert r.allocated_peak_bytes == 16 * MiB


@pytest.mark.parametrize(("text", "message"), [
    ("expandable_segments:yes", "expandable_segments:yes: expected True or False"),
    ("max_split_size_mb:10", "max_split_size_mb:10: too small, must be >= 20"),
    ("max_split_size_mb:lots", "max_split_size_mb:lots: expected a whole number"),
    ("garbage_collection_threshold:1.5", "must be in (0.0, 1.0)"),
    ("roundup_power2_divisions:3", "roundup_power2_divisions=3: must be a power of 2 or 0"),
    ("colour:blue", "colour: unrecognized option"),
    ("backend:cudaMallocAsync", "only the native allocator is modelled"),
    ("expandable_segments", "expected key:value"),
])  # fmt: skip
def test_bad_alloc_conf_is_one_line(text, message):
    with pytest.raises(ValueError, match=None) as err:
        parse_alloc_conf(text)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_alloc_conf_reads_torchs_syntax():
    conf = parse_alloc_conf("expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.6,"
                            "roundup_power2_divisions:[256:1,512:2,>:8]")  # fmt: skip
    assert conf.expandable_segments and conf.max_split_size_bytes == 128 * MiB
    assert conf.garbage_collection_threshold == 0.6
    # parseRoundUpPower2Divisions: the first entry fills the intervals below it; '>' fills from the last on
    assert conf.roundup_power2_divisions == (1,) * 9 + (8,) * 7
    assert parse_alloc_conf("") == AllocatorConfig()


@pytest.mark.parametrize(("events", "message"), [
    ([("free", "a")], "free 'a': no live allocation"),
    ([("alloc", "a", 0, 0)], "an alloc needs a size > 0"),
    ([("grow", "a")], "action must be one of"),
    ([("alloc", "a", 512, 0), ("alloc", "a", 512, 0)], "that id is still live"),
])  # fmt: skip
def test_bad_traces_are_refused(events, message):
    with pytest.raises(ValueError) as err:
        replay(events)
    assert message in str(err.value)


def test_the_allocator_object_can_be_driven_directly():
    alloc = CachingAllocator()
    block = alloc.malloc(3 * MiB)
    assert (block.size, alloc.stats.reserved.current) == (3 * MiB, 20 * MiB)
    alloc.free(block)
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(block)


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:64", "roundup_power2_divisions:4"])
def test_random_traces_keep_the_allocators_invariants(conf):
    """3,000 seeded random allocations and frees on two streams: allocated bytes are the live blocks, reserved
    bytes the segments; blocks tile each segment without gaps; no two free neighbours stay unmerged."""
    import random

    rng, events, live = random.Random(21), [], []
    for i in range(3000):
        if live and rng.random() < 0.48:
            events.append(("free", live.pop(rng.randrange(len(live)))))
        else:
            size = rng.choice([rng.randint(1, 4096), rng.randint(1, MiB), rng.randint(MiB, 12 * MiB),
                               rng.randint(12 * MiB, 200 * MiB)])  # fmt: skip
            events.append(("alloc", i, size, rng.choice([0, 0, 7])))
            live.append(i)
    for end in ([], [("empty_cache",)]):
        r = replay(events + end, parse_alloc_conf(conf))
        assert r.allocated_bytes == sum(b.size for s in r.segments for b in s.blocks if b.state == "active_allocated")
        assert r.reserved_bytes == sum(s.total_size for s in r.segments) <= r.reserved_peak_bytes
        assert r.requested_bytes <= r.allocated_bytes <= r.allocated_peak_bytes
        for seg in r.segments:
            blocks = seg.blocks
            assert all(a.address + a.size == b.address for a, b in zip(blocks, blocks[1:]))
            assert not any(a.state == b.state == "inactive" for a, b in zip(blocks, blocks[1:]))
        if end:  # after empty_cache no segment is entirely free
            assert all(any(b.state != "inactive" for b in s.blocks) for s in r.segments)


def test_package_names_are_imported_at_first_use():
    # `import zeroplan.allocator` imports none of its modules (issue 16); each exported name is its home's,
    # and `replay` stays the function after its submodule is imported (which the import system binds)
    code = ("import sys, zeroplan.allocator as a\n"
            "print(sorted(m for m in sys.modules if m.startswith('zeroplan.allocator.')))\n"
            "import zeroplan.allocator.replay, zeroplan.allocator.caching\n"
            "from zeroplan.allocator import CachingAllocator, replay\n"
            "print(replay is sys.modules['zeroplan.allocator.replay'].replay, a.replay is replay,\n"
            "      CachingAllocator is sys.modules['zeroplan.allocator.caching'].CachingAllocator)\n"
            "try:\n    a.absent\nexcept AttributeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    absent = "module 'zeroplan.allocator' has no attribute 'absent'"
    assert out.splitlines() == ["[]", "True True True", absent]
