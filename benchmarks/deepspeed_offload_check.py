"""Proof that a refactor of DeepSpeed's offload profile (``zeroplan/engines/deepspeed/offload*.py``, the wrappers'
``offload``) changed no number: ``deepspeed_refactor_check.py`` has no offload case, so this dumps, for a grid of ZeRO
1-3 x fp32/bf16/fp16 x ``offload_optimizer`` and ``offload_param`` (none, cpu, nvme) x ``overlap_comm`` x two bucket
sizes x torch Adam x G = 1, 2 x N_d = 1, 2, 4 (gpt-tiny; llama-tiny at N_d = 2), everything the offload profile
predicts: the GPU model-state terms, every moment, the host record (``host_memory``: terms, PCIe and NVMe bytes, init
and step peaks), the one-memory peaks of a CPU run, the collectives, DeepSpeed's own estimator and, with
``overlap_comm`` at N_d = 2, the allocation trace; a refused configuration, its one-line reason.

    PYTHONPATH=BASE python benchmarks/deepspeed_offload_check.py --dump base.json    # a checkout before
    PYTHONPATH=$PWD python benchmarks/deepspeed_offload_check.py --compare base.json  # after: exit 1 naming each change

Imports only zeroplan and validate (no torch).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path


def _config(stage: int, dtype: str, opt, prm, overlap, bucket: int, torch_adam: bool) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if overlap is not None:
        zero["overlap_comm"] = overlap
    for key, device in (("offload_optimizer", opt), ("offload_param", prm)):
        if device:
            zero[key] = {"device": device, **({"nvme_path": "/tmp/nvme"} if device == "nvme" else {})}
    config = {"zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"torch_adam": torch_adam}}}
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    return config


def rows() -> dict[str, dict]:
    from validate.engines.deepspeed_compare import workload_for
    from zeroplan.engines import deepspeed as D
    from zeroplan.engines.deepspeed.alloc_trace import alloc_traces
    from zeroplan.engines.deepspeed.offload import host_memory
    from zeroplan.engines.deepspeed.offload_one_memory import one_memory_by_phase
    from zeroplan.engines.deepspeed.phases import moments
    from zeroplan.engines.deepspeed.wrapper import collectives, ds_run

    out = {}
    grid = itertools.product(("gpt-tiny", "llama-tiny"), (1, 2, 3), ("fp32", "bf16", "fp16"), (None, "cpu", "nvme"),
                             (None, "cpu", "nvme"), (None, True), (5000, 500_000_000), (False, True), (1, 2), (1, 2, 4))
    for model, stage, dtype, opt, prm, overlap, bucket, torch_adam, ga, nd in grid:
        if model == "llama-tiny" and nd != 2:
            continue
        key = f"{model} z{stage} {dtype} opt={opt} prm={prm} overlap={overlap} bucket={bucket} torch_adam={torch_adam} G={ga} nd={nd}"
        try:
            s = D.Settings.from_ds_config(_config(stage, dtype, opt, prm, overlap, bucket, torch_adam))
            w = workload_for(model, 1, None, grad_accum=ga)
            run = ds_run(s, w, nd, stat_bytes=4)
            row = {"terms": repr(run.model_terms), "moments": repr(moments(run)), "host": repr(host_memory(run)),
                   "one_memory": one_memory_by_phase(run), "collectives": repr(collectives(s, run.numels, nd, ga)),
                   "ds_estimate": D.ds_estimate_bytes(s, run.numels, nd)}
            if overlap and nd == 2 and ga == 1 and not torch_adam:
                row["trace"] = repr(alloc_traces(w, nd, s, 4))
        except ValueError as e:  # refused: its reason
            row = {"refused": str(e)}
        out[key] = row
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", type=Path, help="write every case's predictions to this JSON file")
    parser.add_argument("--compare", type=Path, help="compare every case with a file --dump wrote")
    args = parser.parse_args()
    got = rows()
    modelled = sum("refused" not in r for r in got.values())
    if args.dump:
        args.dump.write_text(json.dumps(got, sort_keys=True))
    if args.compare:
        want = json.loads(args.compare.read_text())
        changed = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        for k in changed:
            print(f"changed: {k}")
        print(f"{len(got) - len(changed)} of {len(got)} cases identical ({modelled} modelled, the rest refused)")
        return 1 if changed else 0
    print(f"{len(got)} cases ({modelled} modelled)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
