"""The FSDP2 runners' release waits (validate/engines/fsdp2_gloo_release.py) against gloo's late frees, injected.

gloo's worker thread drops a finished collective's tensors a moment after the rank's ``wait`` returned; a tensor
the rank has let go of is then freed on that thread, late on a loaded machine. Here a stand-in collective hands
its tensors to a thread of its own (as gloo's work object holds them) and MemTracker's count of every free on
another thread is held back (``delay_frees``): the earlier poll (``polled``: three equal readings 1 ms apart)
returns with the tensor still counted; the release waits return once it is gone from the count. One process,
no process group: ~1 CPU-s. The same injection in a real world: ``tests/fsdp2_gloo_release_world.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

import validate.probes as probes
from fsdp2_gloo_release_world import delay_frees, polled
from validate.engines.fsdp2 import released_on_gloo

N = 4096  # fp32 elements of the collective's input (16 KiB), twice the output's


def stand_in(case: str, handed: list, late):
    """A synchronous collective as gloo runs it: ``copy`` makes gloo's copy of a reduce-scatter's input during
    the call and only the work holds it; ``input`` leaves the work holding a view of its input (gloo's
    all-gather, about one call in four). The work's thread drops them after ``late()``, the call returned."""

    def collective(output, input, group=None, async_op=False):
        held = [input.clone()] if case == "copy" else [input.detach()]  # a new TensorImpl: what gloo's work holds
        output.copy_(held[0][: output.numel()])
        thread = threading.Thread(target=lambda: (late(), held.clear()))
        handed.append(thread)
        thread.start()

    return collective


def off_by(case: str, waits, monkeypatch) -> int:
    """Live bytes counted beyond the output's once the collective returned and the rank let go of its input."""
    release, handed, make = threading.Event(), [], probes._tracker
    # late: until the rank read its bytes for the poll (which returns regardless); 50 ms for the release waits
    late = (lambda: release.wait(30.0)) if waits is polled else (lambda: release.wait(0.05))

    def tracker():
        t = make()
        delay_frees(t, late)  # the free's count held back too, as a descheduled thread holds it
        return t

    monkeypatch.setattr(probes, "_tracker", tracker)
    name = "reduce_scatter_tensor" if case == "copy" else "all_gather_into_tensor"
    monkeypatch.setattr(dist, name, stand_in(case, handed, late))
    with (probe := probes.MemoryProbe(torch.device("cpu"))), waits(probe, True):
        before = probe.current_bytes()
        output, input = torch.zeros(N // 2), torch.ones(N)
        getattr(dist, name)(output, input)
        del input
        over = probe.current_bytes() - before - output.nbytes
        release.set()
        for thread in handed:
            thread.join()
    return over


@pytest.mark.parametrize("case", ["copy", "input"])
def test_late_gloo_frees_are_counted_before_the_rank_goes_on(case, monkeypatch):
    # the poll returns with the late tensor still counted: gloo's copy of the input, or the input itself
    assert off_by(case, polled, monkeypatch) == N * 4
    assert off_by(case, released_on_gloo, monkeypatch) == 0
