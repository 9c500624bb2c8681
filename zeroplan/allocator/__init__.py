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

import importlib
import sys
import types

_HOMES = {"CachingAllocator": "caching", "OutOfMemory": "caching", "AllocatorConfig": "config",
          "allocation_size": "config", "parse_alloc_conf": "config", "round_size": "config",
          "Event": "replay", "PhasePeak": "replay", "Replay": "replay"}
"""Each name the package exports and its home module, imported at the name's first use: a command that reads
``allocator.config`` alone (``estimate`` without a model: no replay) does not import the replay's modules."""

__all__ = ["AllocatorConfig", "CachingAllocator", "Event", "OutOfMemory", "PhasePeak", "Replay", "allocation_size",
           "parse_alloc_conf", "replay", "round_size"]


def __getattr__(name: str) -> object:
    if name in _HOMES:
        return getattr(importlib.import_module(f"zeroplan.allocator.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'zeroplan.allocator' has no attribute {name!r}")


class _Package(types.ModuleType):
    """``zeroplan.allocator.replay`` is the function, as when the package imported it eagerly: the import
    system binds the submodule ``replay`` on the package at its first import; that binding is dropped."""

    @property
    def replay(self) -> object:
        from zeroplan.allocator.replay import replay

        return replay

    @replay.setter
    def replay(self, submodule: object) -> None:
        pass


sys.modules[__name__].__class__ = _Package  # a module's class: Python's documented way to give it a property
