"""The one rule the runners use to tell that gloo has let go of a collective's tensors (DeepSpeed's
``deepspeed_changes.GlooSettled``, FSDP2's ``fsdp2_gloo_release``): gloo's worker thread keeps the finished work,
and with it the tensor itself (all-reduce) or views of it (all-gather chunks), a moment after ``wait()`` returns
(``ProcessGroupGloo::runLoop`` resets ``workInProgress_`` after marking the future done); both use counts are back
to their values before the call once gloo is done."""

from __future__ import annotations


def use_counts(t) -> tuple[int, int]:
    """(the ``TensorImpl``'s, its storage's) use counts. The storage count includes the Python storage object made
    here (so a tensor alone reads (1, 2))."""
    import torch

    return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)
