"""DeepSpeed ZeRO-1 with ``overlap_comm`` accumulating (G = 2 and 3): measure gpt-tiny (5,000-element buckets, fp32,
gloo, 3 steps) at N_d 2, 3 and 4, print each rank's per-phase error against the profile and, with ``--record``,
append the rows to tests/data/measured/deepspeed.json (replacing rows of the same name), where
tests/test_measured_rows.py predicts them again (the boundary micro-step's backward:
zeroplan/engines/deepspeed/boundary.py).

    DS_ACCELERATOR=cpu PYTHONPATH=$PWD python benchmarks/ds_boundary_rows.py [--nd 2 3 4] [--record]
        [--save DIR | --load DIR]                       # ~1-2 min per N_d on 2 shared cores

``--save DIR`` keeps each world's rank rows as JSON (``ranks-nd{N}.json``), ``--load DIR`` reads them instead of
running (the rows recorded on 2026-12-02 were measured once and recorded from the saved rows)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from benchmarks.record_measured import SMALL, deepspeed_record  # noqa: E402
from tests.test_measured_rows import MEASURED  # noqa: E402

ACCUM = (2, 3)
PHASES = ("init", "forward", "backward", "optimizer_step")
RECORDED_BY = ("z1ovl 2026-12-02: benchmarks/ds_boundary_rows.py (run_world, 3 steps), DS_ACCELERATOR=cpu, "
               "torch 2.13.0+cpu, DeepSpeed 0.19.8, gloo")  # fmt: skip


def configs() -> list[dict]:
    from validate.engines.deepspeed_compare import ds_config

    base = ds_config(1, zero={**SMALL, "overlap_comm": True}, optimizer_params={"torch_adam": True})
    return [{**base, "gradient_accumulation_steps": g} for g in ACCUM]


def world(nd: int, save: Path | None, load: Path | None) -> list[list[dict]]:
    """rows[rank][config] of one world of ``configs()`` at ``nd``."""
    if load is not None:
        return json.loads((load / f"ranks-nd{nd}.json").read_text())
    from validate.engines.deepspeed_compare import run_world

    ranks = run_world(configs(), nd, steps=3)
    if save is not None:
        save.mkdir(parents=True, exist_ok=True)
        (save / f"ranks-nd{nd}.json").write_text(json.dumps(ranks))
    return ranks


def records(nd: int, ranks: list[list[dict]]) -> list[dict]:
    """One record per accumulation (tests/data/measured/README.md), each rank's error printed."""
    from validate.engines.deepspeed_compare import workload_for

    out = []
    for i, ds in enumerate(configs()):
        rows, g = [r[i] for r in ranks], ds["gradient_accumulation_steps"]
        workload = workload_for("gpt-tiny", ds["train_micro_batch_size_per_gpu"], None, g)
        out.append(deepspeed_record(f"deepspeed-z1-overlap-accum{g}-nd{nd}", nd,
                                    {"model": "gpt-tiny", "steps": 3, "recorded_by": RECORDED_BY}, ds, rows, workload))
        for r in out[-1]["ranks"]:
            m, p = r["measured_peak_bytes_by_phase"], r["predicted_peak_bytes_by_phase"]
            print(f"{out[-1]['name']} rank {r['rank']}: " + "  ".join(
                f"{ph} {m[ph]:,} {m[ph] - p[ph]:+,} B ({(m[ph] - p[ph]) / m[ph]:+.3%})" for ph in PHASES), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nd", type=int, nargs="*", default=[2, 3, 4])
    parser.add_argument("--record", action="store_true", help="append the rows to tests/data/measured/deepspeed.json")
    parser.add_argument("--save", type=Path, default=None)
    parser.add_argument("--load", type=Path, default=None)
    opts = parser.parse_args(argv)
    new = [rec for nd in opts.nd for rec in records(nd, world(nd, opts.save, opts.load))]
    if opts.record:
        path = MEASURED / "deepspeed.json"
        data = json.loads(path.read_text())
        names = {r["name"] for r in new}
        data["rows"] = [r for r in data["rows"] if r["name"] not in names] + new
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {path}: {len(new)} rows", flush=True)


if __name__ == "__main__":
    main()
