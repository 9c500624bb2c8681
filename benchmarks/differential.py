"""The randomized differential matrix (validate/engines/differential.py): N seeded draws, each trained by the real
engine (FSDP2 or DeepSpeed 0.19.8 on gloo, CPU) with transformers' own classes and loss, every phase of every
rank against that rank's prediction. docs/benchmarks.md quotes its result (N of N within the targets, the
worst under- and over-prediction).

    DS_ACCELERATOR=cpu PYTHONPATH=$PWD python benchmarks/differential.py --seed 1 --draws 12 --out diff.json
    DS_ACCELERATOR=cpu PYTHONPATH=$PWD python benchmarks/differential.py --seed 1 --only 3 7   # some draws again
    DS_ACCELERATOR=cpu PYTHONPATH=$PWD python benchmarks/differential.py --seed 3 --generator 4 --draws 12 --out d.json

Each draw's result is written to --out as soon as it is measured (a long sweep keeps what it ran); a draw
whose run fails is listed with its error, not dropped; a draw the profile refuses (``differential_families.refusal``)
is not run, listed with the profile's reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from validate.engines.differential import DrawResult, draw, run_draw, summary  # noqa: E402
from validate.engines.differential_families import refusal  # noqa: E402


def _provenance(argv: list[str] | None) -> dict:
    """When, on what and by which command the draws were measured (tests/data/measured/differential.json)."""
    import datetime
    import platform

    import deepspeed
    import torch
    import transformers

    return {"recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs", "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "transformers": transformers.__version__, "backend": "gloo",
            "command": "DS_ACCELERATOR=cpu python benchmarks/differential.py " + " ".join(argv or sys.argv[1:])}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--draws", type=int, default=12)
    parser.add_argument("--only", type=int, nargs="*", default=None, help="draw indices to run (default: all)")
    parser.add_argument("--engine", choices=("fsdp2", "deepspeed"), default=None)
    parser.add_argument("--generator", type=int, default=1,
                        help="the generator's version (2: FSDP2 wrappings; 3: and meta init, checkpointing; "
                             "4: and DeepSpeed's checkpointing and bf16; 5: the newer families)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    indices = args.only if args.only else range(args.draws)
    provenance = _provenance(argv)
    results: list[DrawResult] = []
    failed: list[dict] = []
    refused: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="zeroplan-differential-") as tmp:
        for i in indices:
            d = draw(args.seed, i, args.engine, args.generator)
            if (why := refusal(d)) is not None:  # outside what the profile models: not run, counted by reason
                refused.append({"name": d.name, "refused": why})
                print(f"REFUSED {d.name}: {why}", flush=True)
                continue
            start = time.process_time()
            try:
                res = run_draw(d, Path(tmp))
            except Exception as e:  # noqa: BLE001 (a failed run is reported, the sweep goes on)
                failed.append({"name": d.name, "error": str(e)[-2000:]})
                print(f"FAILED {d.name}: {str(e)[-300:]}", flush=True)
                continue
            results.append(res)
            under, over = res.worst()
            worst = {r: {p: f"{e:+.3%}" for p, e in errs.items()} for r, errs in res.errors().items()}
            print(f"{'ok  ' if res.ok() else 'MISS'} {d.name}: under {under:+.3%} over {over:+.3%} "
                  f"({time.process_time() - start:.1f} s CPU here) {worst}", flush=True)  # fmt: skip
            if args.out:
                args.out.write_text(json.dumps({**provenance, "seed": args.seed, "results": [r.as_json() for r in results],
                                                "failed": failed, "refused": refused, "summary": summary(results)}, indent=1))  # fmt: skip
    s = summary(results)
    print(f"{s['within_target']} of {s['draws']} draws within 1% (no under-prediction beyond 0.5%); worst under "
          f"{s['worst_under']:+.3%}, worst over {s['worst_over']:+.3%}; {len(failed)} runs failed, {len(refused)} draws refused")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
