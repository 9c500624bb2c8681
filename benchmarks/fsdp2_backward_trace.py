"""FSDP2's backward, module by module, as the validator measures it: rank 0 of a fake process group with real tensors
(``validate.engines.fsdp2 --simulated --real-tensors``: the same MemTracker, the same peaks as the gloo ranks on
these cases), with, per backward module, the largest live total in the second step and MemTracker's live storages
there by category (the method that found ``engines/fsdp2/norms.py input_projections_backward``).

    PYTHONPATH=$PWD python benchmarks/fsdp2_backward_trace.py 2 [MODULE ...]   # case 0-2 of fsdp2_embedding_unit.json
    PYTHONPATH=$PWD python benchmarks/fsdp2_backward_trace.py gpt2-untied        # a row of test_fsdp2_hf_recorded.py
    PYTHONPATH=$PWD python benchmarks/fsdp2_backward_trace.py qwen2-untied+ckpt  # the same, checkpointed blocks
    PYTHONPATH=$PWD python benchmarks/fsdp2_backward_trace.py differential_families.json:511  # another file's draw

Then the profile's backward moments of rank 0 (``moments.backward_moments``), largest first, to set beside them.

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
    from validate.simulate import init_fake_world

    path = Path(tempfile.mkdtemp()) / "config.json"
    settings, nd, name, recorded = _case(argv[0], path)
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
    init_fake_world(nd, 0)
    row = V.measure(settings, nd, 0, torch.device("cpu"), fake=False)
    print(f"{name}\nmeasured here {row['peak_bytes_by_phase']}\nrecorded rank 0 {recorded}")
    for label, peak in sorted(best.items(), key=lambda x: -x[1])[:25]:
        print(f"{peak:>14,}  {label}")
    for label in argv[1:] or [max(best, key=best.get)]:
        print(f"== {label}: {best.get(label, 0):,}")
        by: dict[str, list[int]] = defaultdict(list)
        for nbytes, kind in listing.get(label, []):
            by[kind].append(nbytes)
        for kind, sizes in by.items():
            print(f"  {kind:<8} {sum(sizes):>13,}  " + " ".join(f"{n:,}" for n in sorted(sizes, reverse=True) if n >= 1024))

    _predicted(settings, nd)


def _case(which: str, path: Path):
    """(Fsdp2Settings, N_d, name, rank 0's recorded peaks) of a draw index of ``CASES`` (or ``FILE:INDEX``, a draw
    of tests/data/measured/FILE) or a ``RECORDED`` row of tests/test_fsdp2_hf_recorded.py (``+ckpt``: with
    checkpointed blocks, not recorded)."""
    from dataclasses import replace

    from validate.engines.differential import Draw, _fsdp2_settings
    from validate.engines.fsdp2_rows import Fsdp2Settings

    file, _, index = which.rpartition(":")
    if index.isdigit():
        cases = CASES.with_name(file) if file else CASES
        (record,) = (r for r in json.loads(cases.read_text())["results"] if r["draw"]["index"] == int(index))
        draw = Draw(**record["draw"])
        path.write_text(json.dumps(draw.config))
        return _fsdp2_settings(draw, str(path)), draw.nd, record["name"], record["measured"]["0"]
    sys.path.insert(0, str(ROOT / "tests"))
    from test_fsdp2_hf_recorded import CONFIGS, RECORDED

    row, ckpt = which.removesuffix("+ckpt"), which.endswith("+ckpt")
    config, nd, kw, peaks = RECORDED[row]
    path.write_text(json.dumps(CONFIGS[config]))
    settings = Fsdp2Settings(model=str(path), hf=True, seq_len=kw.get("seq_len", 64),
                             **{k: v for k, v in kw.items() if k != "seq_len"})  # fmt: skip
    return replace(settings, checkpointing=ckpt), nd, which, None if ckpt else peaks[0]


def _predicted(settings, nd: int) -> None:
    """The profile's backward moments of rank 0, largest first."""
    from validate.engines.fsdp2_compare import _workload, predict
    from zeroplan.engines.fsdp2.moments import moments
    from zeroplan.engines.fsdp2.plan import rank_run

    meta = {"device": "cpu", "backend": "gloo", "world_size": nd}
    row, engine = predict(settings, meta, 0)
    print(f"predicted rank 0 {row.peak.by_phase()}")
    run, _ = rank_run(_workload(settings, meta), nd, engine)
    backward = sorted((m for m in moments(run) if m.phase == "backward"), key=lambda m: -m.total())
    for m in backward[:25]:
        print(f"{m.total():>14,}  {m.name}")


if __name__ == "__main__":
    main(sys.argv[1:])
