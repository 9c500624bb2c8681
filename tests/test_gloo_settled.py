"""``GlooSettled`` (validate/engines/deepspeed_changes.py) settles the buffers gloo makes itself, not only the caller's.

gloo's reduce-scatter reduces into a buffer of its own and ``wait()`` copies this rank's chunk out of it; freed by
gloo's worker thread after the rank let go, MemTracker counted that free on gloo's thread at no fixed moment (seen
at ZeRO-3 on 4 loaded ranks, 2026-12-02: 576, 6,048 and 10,368 B). One gloo rank in a child process (a process
group in the test process would outlive the test): the call finds that buffer, holds it until gloo lets go, frees it
on its own thread; the memory probe counts no free off the main thread (``OffThreadFrees``).
"""

from __future__ import annotations

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

