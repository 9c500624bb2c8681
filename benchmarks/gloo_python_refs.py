"""gloo keeps a Python reference to a collective's tensor after both its use counts are back: the ZeRO-1 step flake.

Each of N gloo ranks (one process each, all pinned to one CPU, gloo's worker threads reniced to 19 so that they lose
the CPU right after waking the rank) runs ``--calls`` all-reduces the way ZeRO-1 reduces its last bucket
(``stage_1_and_2.py``: a 108-element view of a 5,000-element fp32 bucket buffer, flattened as a view) through
``GlooSettled`` under MemTracker, then drops every reference to the view and the buffer. Printed per rank: the calls
after which the view's Python object still had a reference the rank did not hold (``sys.getrefcount``) while its
tensor and storage use counts were back, and the frees MemTracker saw run off the rank's thread (the 20,000 B buffer,
freed on gloo's thread whenever it let go). ``--before DIR``: the same with the checkout in DIR (GlooSettled's rule
there). Run on a quiet machine, never in CI:

    PYTHONPATH=$PWD python benchmarks/gloo_python_refs.py [--ranks 4] [--calls 3000] [--before /tmp/base | --plain]

``--plain``: the calls alone, no dispatch mode, no MemTracker, no GlooSettled (``dist.all_reduce``, then waiting on the
view's use count): the reference is torch's own.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _renice_gloo_threads() -> int:
    """gloo's worker threads (comm name ``pt_gloo_runloop``) at nice 19: the rank's thread runs first once woken."""
    n = 0
    for task in glob.glob("/proc/self/task/*"):
        try:
            name = Path(task, "comm").read_text().strip()
        except OSError:
            continue
        if "gloo" in name:
            os.setpriority(os.PRIO_PROCESS, int(task.rsplit("/", 1)[1]), 19)
            n += 1
    return n


def _plain(calls: int) -> dict:
    """The same calls with no dispatch mode, no MemTracker and no GlooSettled: ``dist.all_reduce``, then waiting
    until the view's use count is back (gloo's work let go of it) before counting its Python references."""
    import time

    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors

    extra = 0
    for _ in range(calls):
        bucket = torch.ones(5000)
        view = _flatten_dense_tensors([bucket.narrow(0, 0, 108)])
        dist.all_reduce(view)
        while view._use_count() > 1:
            time.sleep(0.0002)
        extra += sys.getrefcount(view) > 2
        del view, bucket
    return {"python_ref_left": extra}


def _rank(rank: int, nd: int, port: int, calls: int, root: str, out: str) -> None:
    sys.path.insert(0, root)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import gc

    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors
    from torch.distributed._tools.mem_tracker import MemTracker

    from validate.engines import deepspeed_changes as C

    dist.init_process_group("gloo", rank=rank, world_size=nd)
    dist.barrier()
    reniced = _renice_gloo_threads()

    class Backend:  # deepspeed.comm's cdb, as far as GlooSettled wraps it
        def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    if root == "plain":
        Path(f"{out}.{rank}").write_text(json.dumps({"rank": rank, **_plain(calls)}))
        dist.destroy_process_group()
        return
    backend, tracker, extra = Backend(), MemTracker(), 0
    gc.disable()
    with tracker, C.GlooSettled(backend) as settled:
        frees = C.OffThreadFrees(tracker)
        for _ in range(calls):
            bucket = torch.empty(5000)
            bucket.fill_(1.0)
            view = _flatten_dense_tensors([bucket.narrow(0, 0, 108)])  # one tensor: a view, not a copy
            backend.all_reduce(view)
            extra += sys.getrefcount(view) > 2  # the name and getrefcount's argument
            del view, bucket
    row = {"rank": rank, "gloo_threads_reniced": reniced, "python_ref_left": extra, **settled.stats, **frees.stats}
    Path(f"{out}.{rank}").write_text(json.dumps(row))
    dist.destroy_process_group()


def run(root: str, nd: int, calls: int) -> list[dict]:
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "row"))
        mp.spawn(_rank, args=(nd, port, calls, root, out), nprocs=nd)
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(nd)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--before", default=None, help="a checkout whose GlooSettled to run as well")
    parser.add_argument("--plain", action="store_true", help="only the plain calls (no GlooSettled, no probe)")
    parser.add_argument("--cpu", type=int, default=None, help="the one CPU every rank runs on (default: the last)")
    args = parser.parse_args()
    if os.environ.get("_GLOO_REFS_PINNED") is None:  # re-run pinned to one CPU, one intra-op thread a rank
        cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
        env = {**os.environ, "_GLOO_REFS_PINNED": "1", "OMP_NUM_THREADS": "1"}
        sys.exit(subprocess.call(["taskset", "-c", str(cpu), sys.executable, *sys.argv], env=env))
    if args.plain:
        rows = run("plain", args.ranks, args.calls)
        print(f"plain dist.all_reduce: {args.ranks} ranks x {args.calls} calls")
        for r in rows:
            print(f"  rank {r['rank']}: python reference left {r['python_ref_left']}")
        return
    for label, root in (("before", args.before), ("now", str(ROOT))):
        if root is None:
            continue
        rows = run(root, args.ranks, args.calls)
        print(f"{label} ({root}): {args.ranks} ranks x {args.calls} calls")
        for r in rows:
            print(f"  rank {r['rank']}: python reference left {r['python_ref_left']}, freed off thread "
                  f"{r['freed_off_thread']}, held {r['held']}, unsettled {r['unsettled']}")  # fmt: skip


if __name__ == "__main__":
    main()
