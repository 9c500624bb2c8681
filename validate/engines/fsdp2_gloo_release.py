"""FSDP2's collectives on gloo, each finished and let go by gloo's worker thread before the rank goes on: one
moment per free. Used by both FSDP2 runners (``validate.engines.fsdp2``: plain, HSDP; ``validate.engines.fsdp2_tp``).

gloo runs every collective on a worker thread of its process group, and its work object holds the collective's
tensors until that thread drops it, a moment *after* the rank's ``wait`` has returned
(``ProcessGroupGloo::runLoop`` resets ``workInProgress_`` after ``AsyncWork::execute`` has completed the work).
A tensor the rank has already let go of (DTensor's all-gathered activation once its chunks are joined, gloo's
own copy of a reduce-scatter's input, FSDP2's all-gather input once its call returned) is then freed on gloo's
thread, and MemTracker counts it live until that thread runs, which on a loaded machine can be after the rank
has allocated its next tensors: the phase's peak then holds a stale buffer. The world-4 TP row (fp32, SP,
2 x 32 tokens) failed so once in a full-suite run: the backward peak 12,288 B (b·s·d fp32: one SP all-gather
output) over the prediction, +2.06 %. Diagnostic runs (every storage's free, by thread) saw such frees on gloo's
thread on most ranks of most loaded runs; with each such free delayed 20 ms before MemTracker counts it, one run
in four reproduced the failure exactly (backward +12,288 B on two ranks, a freed all-gather buffer still in the
count at the peak op): a timing-dependent reading, never a byte the engine holds on purpose (docs/engines/fsdp2.md,
the TP section). The plain runner's earlier poll ("three equal readings 1 ms apart") had the same weakness: with
such frees delayed 300 ms it read gloo's late reduce-scatter copy in a later phase (tests/test_fsdp2_gloo_release.py).

Two waits, both for an event rather than a time:

- DTensor's functional collectives (``torch.ops._c10d_functional``: TP's all-gathers and reduce-scatters, loss
  parallel's all-reduces, called by funcol from DTensor's redistributions and from inside its dispatch): each is
  waited where it is issued, then the rank waits until gloo has dropped every tensor it was handed and the views
  it made of them: each tensor's ``TensorImpl`` and storage use counts back to theirs before the call (a new
  output's: the rank's own reference). Nothing is allocated between issue and wait on CPU (the output exists
  from the call), so only the waiting moves.
- FSDP2's synchronous ``torch.distributed`` all-gathers, reduce-scatters and HSDP all-reduces: their work object is
  Python's until the call returns; after it, the rank waits until every storage first seen during the call
  (gloo's copy of a reduce-scatter's input, split on the rank's thread at ``wait``) has been freed *in
  MemTracker's count*, and until gloo has dropped the tensors it was handed (use counts back to theirs before the
  call: gloo's all-gather still holds its input after ``wait`` in about one call in four, measured on 2 ranks).

After both, every free a collective leaves to gloo has happened before the rank's next op, whatever the load:
the peaks are those of a rank whose collectives complete and let go where they are issued (the model's
moments); the waits cost the rank's clock (``step_time_s`` probed), not its bytes. MemTracker's own reading is
unchanged (``validate/probes.py``); the NCCL path has no worker thread of this kind and is not run here.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from validate.engines.gloo_holds import use_counts

RELEASE_DEADLINE_S = 60.0
"""Longest wait for gloo's thread to let a finished collective's tensors go (milliseconds, even under load); past
it the run stops: a tensor still held then is held by the rank itself (a bug here), never to be let go."""
DIST_COLLECTIVES = ("reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single", "all_gather_into_tensor",
                    "all_reduce")
"""FSDP2's synchronous collectives (``torch.distributed``): reduce-scatter and all-gather (the ``_single`` forms in
torch 2.13's ``_fsdp_collectives.py``, ``_tensor`` ones before; those this torch has), HSDP's all-reduce."""


def _await(held, what: str) -> None:
    """Sleep (the GIL released: gloo's thread may need it to free a tensor) until ``held()`` is false."""
    deadline = time.monotonic() + RELEASE_DEADLINE_S
    while held():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: gloo still holds the collective's tensors after {RELEASE_DEADLINE_S} s")
        time.sleep(0.0002)


FUNCTIONAL_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single",
                  "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "all_reduce_coalesced")
"""``torch.ops._c10d_functional``'s out-of-place collectives, as funcol calls them (``_functional_collectives.py``),
from DTensor's redistributions and from inside its dispatch (loss parallel's all-reduces) alike."""


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def released_functional(op, args: tuple, kwargs: dict):
    """Run the functional collective ``op``, wait for it and for gloo to let its tensors go; returns its output
    (already waited: funcol's later ``wait_tensor`` finds no work and returns)."""
    given = _tensors((args, kwargs))
    uses = [use_counts(t) for t in given]
    result = op(*args, **kwargs)
    out = [t for t in _tensors(result) if not any(t is g for g in given)]  # new outputs (not in-place ones)
    for t in out:
        torch.ops._c10d_functional.wait_tensor(t)
    tensors, uses = [*given, *out], [*uses, *((1, 2) for _ in out)]

    def held() -> bool:
        return any(u > b for t, base in zip(tensors, uses) for u, b in zip(use_counts(t), base))

    _await(held, f"_c10d_functional.{op._qualified_op_name.split('::')[-1]}")
    return result


class _Released:
    """An op packet whose call is ``released_functional``; its overloads (``.default``, which torch's own
    kernels look up on the namespace) are the packet's own."""

    def __init__(self, op) -> None:
        self._op = op

    def __call__(self, *args, **kwargs):
        return released_functional(self._op, args, kwargs)

    def __getattr__(self, name: str):
        return getattr(self._op, name)


@contextmanager
def functional_collectives_released():
    """While entered, each of ``FUNCTIONAL_OPS`` returns once finished and let go by gloo (``released_functional``;
    the op namespace's attribute replaced, so every caller of funcol is covered)."""
    ns = torch.ops._c10d_functional
    originals = {n: getattr(ns, n) for n in FUNCTIONAL_OPS if hasattr(ns, n)}
    for n, op in originals.items():
        setattr(ns, n, _Released(op))
    try:
        yield
    finally:
        for n, op in originals.items():
            setattr(ns, n, op)


@contextmanager
def dist_collectives_released(tracker):
    """While entered, each synchronous ``DIST_COLLECTIVES`` call returns once every storage MemTracker
    (``tracker``) added during it is freed *in its count*: its delete callback has run (on gloo's thread, a
    moment after the storage's weak reference died). Asynchronous calls are left alone: FSDP2 issues none on
    CPU. The tracker's own ``_update_snap`` and ``_delete_callback`` are wrapped (on this instance) to see that.
    The call also waits until gloo has dropped the tensors it was handed (``gloo_holds.use_counts`` back to theirs before it)."""
    originals = {n: getattr(dist, n) for n in DIST_COLLECTIVES if hasattr(dist, n)}
    update, delete = tracker._update_snap, tracker._delete_callback  # MemTracker binds the latter at each ADD
    added: list = []

    def update_snap(u_type, winfo, *args, **kwargs) -> None:
        update(u_type, winfo, *args, **kwargs)
        if u_type.name == "ADD":
            added.append(winfo)

    def delete_callback(winfo, w_st) -> None:
        delete(winfo, w_st)
        winfo.freed_in_count = True

    def released(name, original):
        def call(*args, **kwargs):
            given = _tensors((args, kwargs))
            uses = [use_counts(t) for t in given]
            added.clear()
            work = original(*args, **kwargs)
            made = list(added)
            added.clear()
            if work is None:
                _await(lambda: not all(getattr(w, "freed_in_count", False) for w in made)
                       or any(u > b for t, base in zip(given, uses) for u, b in zip(use_counts(t), base)),
                       f"torch.distributed.{name}")  # fmt: skip
            return work

        return call

    tracker._update_snap, tracker._delete_callback = update_snap, delete_callback
    for n, f in originals.items():
        setattr(dist, n, released(n, f))
    try:
        yield
    finally:
        del tracker._update_snap, tracker._delete_callback
        for n, f in originals.items():
            setattr(dist, n, f)
