"""Python's cyclic garbage collector paused around the allocator model's hot loops (a speed-up, no rule).

A trace and its replay make tens of thousands of small objects (events, blocks, segments) and free almost none
while they run, so the collector's generation-0 passes find nothing to collect, and each pass that reaches
the oldest generation walks every object the plan built before (its moments and terms): 15-25% of a FSDP2
``plan``'s CPU time (docs/benchmarks.md). Pausing it changes no result: the blocks' reference cycles (``prev``
/ ``next``) are collected once it runs again.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off inside the block, back as it was after (nested uses keep it off)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
