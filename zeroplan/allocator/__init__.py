"""A model of PyTorch's CUDA caching allocator: what ``max_memory_allocated`` and ``max_memory_reserved``
become for an ordered trace of allocations and frees (docs/allocator.md).

Glossary: a *request* is the bytes a tensor asks for; a *block* is what the allocator hands out (the
request rounded up to 512 B, or a whole cached block when splitting it would leave too little); a
*segment* is one ``cudaMalloc`` (2 MiB for the small pool, 20 MiB or the request rounded to 2 MiB for the
large one) that blocks are carved from; *allocated* bytes are the live blocks' sizes, *reserved* bytes the
segments'. A *pool* holds the cached free blocks of one stream and one size class.

Modules: ``config`` (constants, ``PYTORCH_CUDA_ALLOC_CONF``, the size rules), ``blocks`` (blocks, segments,
pools), ``caching`` (the allocator), ``expandable`` (``expandable_segments:True``), ``replay`` (a trace in,
peaks and segments out), ``runs`` (runs of equal requests fast-forwarded, exactly), ``snapshot`` (a recorded
``torch.cuda.memory._snapshot()`` as a trace), ``step_trace`` (a step's moments as a trace), ``gc_pause`` (the
cyclic garbage collector paused around the hot loops). Pure Python: no torch.
"""

from zeroplan.allocator.caching import CachingAllocator, OutOfMemory
from zeroplan.allocator.config import AllocatorConfig, allocation_size, parse_alloc_conf, round_size
from zeroplan.allocator.replay import Event, PhasePeak, Replay, replay

__all__ = ["AllocatorConfig", "CachingAllocator", "Event", "OutOfMemory", "PhasePeak", "Replay", "allocation_size",
           "parse_alloc_conf", "replay", "round_size"]
