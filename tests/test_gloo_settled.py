"""``GlooSettled`` (validate/engines/deepspeed_changes.py) settles the buffers gloo makes itself, not only the caller's.

gloo's reduce-scatter reduces into a buffer of its own and ``wait()`` copies this rank's chunk out of it; freed by
gloo's worker thread after the rank let go, MemTracker counted that free on gloo's thread at no fixed moment (seen
at ZeRO-3 on 4 loaded ranks, 2026-12-02: 576, 6,048 and 10,368 B). One gloo rank in a child process (a process
group in the test process would outlive the test): the call finds that buffer, holds it until gloo lets go, frees it
on its own thread; the memory probe counts no free off the main thread (``OffThreadFrees``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra")

_CHILD = textwrap.dedent("""
    import json, sys, tempfile, warnings
    import torch, torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker
    from validate.engines import deepspeed_changes as C

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)

    class Backend:  # deepspeed.comm's cdb, as far as GlooSettled wraps it
        def reduce_scatter_tensor(self, output, input, async_op=False):
            return dist.reduce_scatter_tensor(output, input, async_op=async_op)

    a, out = torch.ones(1000), torch.zeros(1000)
    with C._Returned() as returned:
        dist.reduce_scatter_tensor(out, a, async_op=True).wait()
    own = [st.nbytes() for st in returned.own_storages([out, a])]
    del returned
    backend, tracker = Backend(), MemTracker()
    with tracker, C.GlooSettled(backend) as settled:
        frees = C.OffThreadFrees(tracker)
        for async_op in (False, True, False):
            backend.reduce_scatter_tensor(out, a * 2, async_op=async_op)
        live = tracker.get_tracker_snapshot("current")
    print(json.dumps({"own": own, "stats": {**settled.stats, **frees.stats}, "out": out[0].item(),
                      "live": sum(s["Total"] for s in live.values())}))
""")


@pytest.mark.distributed
def test_gloo_reduce_scatter_buffer_is_found_held_and_freed_on_the_rank_thread():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["own"] == [4000]  # gloo's own 1,000-element fp32 buffer, not the caller's input or output
    assert got["stats"]["unsettled"] == 0 and got["stats"]["freed_off_thread"] == 0 and got["stats"]["calls"] == 3
    assert got["out"] == 2.0
    # after the calls only the caller's tensors MemTracker saw are live: out (4,000 B); a * 2 and gloo's buffers freed
    assert got["live"] == 4000, got



def _late_python_reference(settle: bool) -> dict:
    """A stand-in for gloo's late Python reference (``gloo_holds.python_refs``): the collective returns with the
    tensor's use counts back, and a thread of its own keeps the tensor's Python object a while longer (until the
    caller has looked, without the wait; 50 ms, with it: the wait is what ends the call). The caller reduces a view
    of a 5,000-element bucket, as ZeRO-1 reduces its last bucket, then drops both."""
    import threading

    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from validate.engines import deepspeed_changes as C

    looked, threads = threading.Event(), []

    class Backend:
        def all_reduce(self, tensor, op=None, group=None, async_op=False):
            held = [tensor]  # a Python reference only: the TensorImpl's and the storage's counts are unchanged

            def let_go():
                looked.wait(timeout=0.05 if settle else None)
                held.clear()

            threads.append(threading.Thread(target=let_go))
            threads[-1].start()

    tracker = MemTracker()
    with tracker, (C.GlooSettled(Backend()) if settle else contextlib.nullcontext(Backend())) as backend:
        frees = C.OffThreadFrees(tracker)
        bucket = torch.zeros(5000)
        (backend.backend if settle else backend).all_reduce(bucket.narrow(0, 0, 108))
        del bucket
        live = sum(s["Total"] for s in tracker.get_tracker_snapshot("current").values())
        looked.set()
        threads[0].join()  # the holder has let go, wherever the bucket was freed
        stats = {**(backend.stats if settle else {}), **frees.stats, "live_after_del": live}
    return stats


def test_a_late_python_reference_is_waited_for_and_the_bucket_freed_on_the_rank_thread():
    """Without the wait, the bucket outlives the caller's ``del`` (20,000 B still live) and is freed on the holder's
    thread: what read +20,000 B in a ZeRO-1 optimizer step (docs/benchmarks.md, 2026-12-02). With it, the call
    waits for the reference (held), and the bucket is freed at the ``del``, on the rank's thread."""
    unsettled = _late_python_reference(settle=False)
    assert unsettled["live_after_del"] == 20000 and unsettled["freed_off_thread"] == 1
    settled = _late_python_reference(settle=True)
    assert settled["held"] == 1 and settled["unsettled"] == 0 and settled["calls"] == 1
    assert settled["live_after_del"] == 0 and settled["freed_off_thread"] == 0
