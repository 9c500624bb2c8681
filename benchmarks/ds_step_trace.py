"""One DeepSpeed case of tests/test_deepspeed_engine.py measured as the runner measures it, with every change of
MemTracker's live total in its optimizer step printed: the op (and DeepSpeed's line) or free that made it.

Written for the ZeRO-1 step flake (docs/benchmarks.md, 2026-12-02): each rank's step readings, and which of them
a storage of ``--size`` bytes still alive would have raised to ``--reading`` (rank 2's norm copy at 349,208 B, plus
the 20,000 B bucket buffer: 369,208 B). Real gloo ranks (~1 min at N_d = 4 on 2 shared cores), never in CI:

    DS_ACCELERATOR=cpu PYTHONPATH=$PWD python benchmarks/ds_step_trace.py [--nd 4] [--case 1 fp32 small]
        [--steps 3] [--step 1] [--reading 369208 --size 20000] [--rank 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _where() -> str:
    """DeepSpeed's innermost frame on the stack: file:line function."""
    frames = [f for f in traceback.extract_stack(limit=30) if "site-packages/deepspeed" in f.filename]
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].name}" if frames else ""


def _traced_probe(events: list):
    """The runner's CPU probe (``validate.engines.deepspeed._cpu_probe``) logging, in the optimizer step, the live
    total after every op that changed it and after every free."""
    import torch

    from validate.engines.deepspeed import _cpu_probe

    base = _cpu_probe()

    class Traced(type(base)):
        def phase(self, name):
            super().phase(name)
            self.open = name
            events.append(["phase", name or "", self.current_bytes()])

        def __enter__(self):
            super().__enter__()
            tracker, probe, last = self.tracker, self, [0]
            update, delete = tracker._update_peak_stats, tracker._delete_callback

            def total() -> int:
                return sum(s["Total"] for d, s in tracker._curr_mem_snap.items() if torch.device(d).type == "cpu")

            def log(kind: str, what: str) -> None:
                now = total()
                if now != last[0] and getattr(probe, "open", None) == "optimizer_step":
                    events.append([kind, what, now])
                last[0] = now

            def updated(state):
                update(state)
                log("op", probe.op)

            def deleted(winfo, ref):
                delete(winfo, ref)
                log("free", f"{winfo.mem_consumed} B")

            class Named(type(tracker)):
                def __torch_dispatch__(self_, func, types, args=(), kwargs=None):
                    probe.op = f"{func} @ {_where()}"
                    return super().__torch_dispatch__(func, types, args, kwargs)

            tracker._update_peak_stats, tracker._delete_callback = updated, deleted
            tracker.__class__ = Named
            return self

    return Traced(torch.device("cpu"))


def _rank(rank: int, nd: int, port: int, args: argparse.Namespace, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nd),
                      LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")  # fmt: skip
    import warnings

    warnings.filterwarnings("ignore")
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    from tests.test_deepspeed_engine import CASES, _configs
    from validate.engines import deepspeed as V

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as the runner (validate/engines/deepspeed.py)
    deepspeed.init_distributed(dist_backend="gloo")
    case = (int(args.case[0]), args.case[1], args.case[2])
    model_fn, batches = V._model_and_batches("gpt-tiny", nd, rank, 2, args.steps)
    events: list = []
    row = V.measure(model_fn, _configs()[CASES.index(case)], batches, rank, nd, probe=_traced_probe(events))
    Path(f"{out}.{rank}").write_text(json.dumps({"peaks": row["peak_bytes_by_phase"], "events": events,
                                                 "gloo_settle": row["gloo_settle"]}))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def _steps(events: list) -> list[list]:
    """The optimizer step's events, one list per step."""
    out: list[list] = []
    for e in events:
        if e[0] == "phase" and e[1] == "optimizer_step":
            out.append([e])
        elif e[0] != "phase" and out:
            out[-1].append(e)
    return out


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nd", type=int, default=4)
    parser.add_argument("--case", nargs=3, default=["1", "fp32", "small"], metavar=("STAGE", "DTYPE", "BUCKETS"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--step", type=int, default=1, help="the step whose events --rank prints")
    parser.add_argument("--rank", type=int, default=None, help="print this rank's step event by event")
    parser.add_argument("--reading", type=int, default=369208, help="a step reading to explain")
    parser.add_argument("--size", type=int, default=20000, help="the storage that would have raised a moment to it")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args.nd, port, args, str(Path(tmp, "rank"))), nprocs=args.nd)
        ranks = [json.loads(Path(tmp, f"rank.{r}").read_text()) for r in range(args.nd)]
    for r, got in enumerate(ranks):
        steps = _steps(got["events"])
        moments = [e for e in steps[args.step] if e[2] + args.size == args.reading]
        print(f"rank {r}: peaks {got['peaks']}, gloo_settle {got['gloo_settle']}")
        step = steps[args.step]
        at = [f"{e[1]} ({e[2]:,} B)" for e in moments] or "nowhere"
        print(f"  step {args.step}: starts at {step[0][2]:,} B, largest {max(e[2] for e in step):,} B; "
              f"+{args.size:,} B reads {args.reading:,} B at: {at}")  # fmt: skip
        if r == args.rank:
            for e in steps[args.step]:
                print(f"    {e[2]:>9,}  {e[0]:<5} {e[1]}")


if __name__ == "__main__":
    main()
