"""One torchrun world of the plain FSDP2 runner with gloo's late frees injected: every free MemTracker counts on a
thread other than the rank's own (gloo's worker thread dropping a finished collective's tensors) is delayed
``--delay`` seconds before it reaches the count, as a descheduled thread on a loaded machine delays it.

``torchrun --nproc-per-node 2 tests/fsdp2_gloo_release_world.py --delay 0.3 --out F`` runs
``validate.engines.fsdp2.measure`` (gpt-tiny, fp32, 2 steps) with its release waits
(``validate.engines.fsdp2_gloo_release``); ``--poll`` runs the runner's earlier wait instead (``polled``: "three
equal readings 1 ms apart", kept here as the reference it replaced). Rank 0 writes ``{"meta", "rows"}`` and the
number of delayed frees per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist


def delay_frees(tracker, wait) -> None:
    """Make ``tracker`` (a MemTracker) call ``wait()`` before counting a free run off the main thread."""
    original = tracker._delete_callback  # bound at each ADD (MemTracker._update_snap): the instance's attribute

    def late(winfo, w_st):
        if threading.current_thread() is not threading.main_thread():
            wait()
        original(winfo, w_st)

    tracker._delete_callback = late


def delayed_tracker(delay_s: float, delayed: list):
    """``validate.probes._tracker`` whose delete callback sleeps ``delay_s`` first when run off the main thread."""
    import validate.probes as probes

    make = probes._tracker

    def tracker():
        t = make()
        delay_frees(t, lambda: (delayed.append(1), time.sleep(delay_s)))
        return t

    return tracker


@contextmanager
def polled(probe, gloo: bool):
    """The plain runner's wait before the release events: each synchronous gloo reduce-scatter or all-gather
    returned once three readings of the live bytes 1 ms apart agreed (at most 0.5 s)."""
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single",
                         "all_gather_into_tensor") if hasattr(dist, n)]  # fmt: skip
    originals = {n: getattr(dist, n) for n in names}

    def settled(original):
        def call(*args, **kwargs):
            work = original(*args, **kwargs)
            if work is None:
                last, same, deadline = probe.current_bytes(), 0, time.monotonic() + 0.5
                while same < 3 and time.monotonic() < deadline:
                    time.sleep(0.001)
                    now = probe.current_bytes()
                    same, last = (same + 1 if now == last else 0), now
            return work

        return call

    for n in names if gloo else ():
        setattr(dist, n, settled(originals[n]))
    try:
        yield
    finally:
        for n in names:
            setattr(dist, n, originals[n])


def main() -> None:
    import validate.engines.fsdp2 as runner
    import validate.probes as probes
    from validate.engines.fsdp2_compare import Fsdp2Settings

    parser = argparse.ArgumentParser()
    parser.add_argument("--delay", type=float, default=0.3)
    parser.add_argument("--poll", action="store_true", help="the earlier wait (polled) instead of the events")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    nd, rank = dist.get_world_size(), dist.get_rank()
    delayed: list = []
    probes._tracker = delayed_tracker(args.delay, delayed)
    if args.poll:
        runner.released_on_gloo = polled
    row = runner.measure(Fsdp2Settings(model="gpt-tiny", param_dtype="fp32", steps=2), nd, rank,
                         torch.device("cpu"), fake=False)
    row["delayed_frees"] = len(delayed)
    rows = [None] * nd if rank == 0 else None
    dist.gather_object(row, rows, dst=0)
    if rank == 0:
        meta = {"world_size": nd, "backend": "gloo", "device": "cpu", "torch": torch.__version__,
                "fake_tensors": False}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
