"""The one rule the runners use to tell that gloo has let go of a collective's tensors (DeepSpeed's
``deepspeed_changes.GlooSettled``, FSDP2's ``fsdp2_gloo_release``): gloo's worker thread keeps the finished work,
and with it the tensor itself (all-reduce) or views of it (all-gather chunks), a moment after ``wait()`` returns
(``ProcessGroupGloo::runLoop`` resets ``workInProgress_`` after marking the future done); both use counts are back
to their values before the call once gloo is done. ``python_refs``: the third count ``GlooSettled`` waits on (gloo
keeps a Python reference a moment longer still); FSDP2's release does not read it."""

from __future__ import annotations


def use_counts(t) -> tuple[int, int]:
    """(the ``TensorImpl``'s, its storage's) use counts. The storage count includes the Python storage object made
    here (so a tensor alone reads (1, 2))."""
    import torch

    return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def python_refs(tensors) -> list[int]:
    """Each tensor's Python reference count (``sys.getrefcount``), read the same way before and after a call.

    torch's gloo path keeps a Python reference to the tensor object it was handed a moment after both use counts
    are back, and drops it on gloo's worker thread (2026-12-02, torch 2.13, gloo, no dispatch mode needed: a plain
    ``dist.all_reduce`` of a view then waiting on ``_use_count``, 4 ranks on one core with gloo's threads at
    nice 19, left the view's object with one reference more than the rank's own after 0-1 of 12,000 calls a run).
    A rank that drops its own references in that moment leaves the object, and the view's base, to be freed
    on gloo's thread whenever it lets go: ``benchmarks/gloo_python_refs.py``."""
    import sys

    return [sys.getrefcount(t) for t in tensors]
