"""FSDP2's backward, module by module, as the validator measures it: rank 0 of a fake process group with real tensors
(``validate.engines.fsdp2 --simulated --real-tensors``: the same MemTracker, the same peaks as the gloo ranks on
these cases), with, per backward module, the largest live total in the second step and MemTracker's live storages
there by category (the method that found ``engines/fsdp2/norms.py input_projections_backward``).

    PYTHONPATH=$PWD python benchmarks/fsdp2_backward_trace.py 2 [MODULE ...]   # case 0-2 of fsdp2_embedding_unit.json

A window is named by MemTracker's deepest active module (``ModTracker.parents``), which may lag one module behind
in backward (q_proj's ops were seen under v_proj's name). About 20 CPU-s for case 0-2 (6.5M, N_d = 4)."""

from __future__ import annotations

import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]
CASES = ROOT / "tests" / "data" / "measured" / "fsdp2_embedding_unit.json"


def main(argv: list[str]) -> None:
    import torch
    from torch.distributed._tools import mem_tracker as MT

    import validate.engines.fsdp2 as V
    import validate.probes as P
    from validate.engines.differential import Draw, _fsdp2_settings
    from validate.simulate import init_fake_world

    (record,) = (r for r in json.loads(CASES.read_text())["results"] if r["draw"]["index"] == int(argv[0]))
    draw = Draw(**record["draw"])
    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps(draw.config))
    best, listing, step = defaultdict(int), {}, [0]

    class Tracing(MT.MemTracker):
        def _update_peak_stats(self, peak_state) -> None:  # validate/probes.py's global peak, and the windows
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev], self._peak_mem_snap[dev] = snap["Total"], dict(snap)
            if step[0] != 1 or not self._mod_tracker.is_bw:
                return
            parents = [q for q in self._mod_tracker.parents if q != "Global"]
            label = max(parents, key=lambda q: q.count(".")) if parents else "-"
            total = sum(s[MT._TOTAL_KEY] for s in self._curr_mem_snap.values())
            if total > best[label]:
                best[label] = total
                listing[label] = [(w.mem_consumed, str(w.reftype).split(".")[-1])
                                  for w, _ in list(self._WINFO.values()) if w.mem_consumed > 0]  # fmt: skip

    P._tracker = Tracing
    adam_step = torch.optim.Adam.step

    def counted_step(self, *a, **k):
        out = adam_step(self, *a, **k)
        step[0] += 1
        return out

    torch.optim.Adam.step = counted_step
    init_fake_world(draw.nd, 0)
    row = V.measure(_fsdp2_settings(draw, str(path)), draw.nd, 0, torch.device("cpu"), fake=False)
    print(f"{record['name']}\nmeasured here {row['peak_bytes_by_phase']}\nrecorded rank 0 {record['measured']['0']}")
    for label, peak in sorted(best.items(), key=lambda x: -x[1])[:25]:
        print(f"{peak:>14,}  {label}")
    for label in argv[1:] or [max(best, key=best.get)]:
        print(f"== {label}: {best.get(label, 0):,}")
        by: dict[str, list[int]] = defaultdict(list)
        for nbytes, kind in listing.get(label, []):
            by[kind].append(nbytes)
        for kind, sizes in by.items():
            print(f"  {kind:<8} {sum(sizes):>13,}  " + " ".join(f"{n:,}" for n in sorted(sizes, reverse=True) if n >= 1024))


if __name__ == "__main__":
    main(sys.argv[1:])
