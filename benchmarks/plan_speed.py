"""Issue 20's target: `zeroplan plan --engine fsdp2 --model llama3-405b --gpus 2048 --gpu h100-80gb` (and with
`--dp-shard auto`) in under a second of CPU; and the speed-up changes no printed number.

Runs each command of ``COMMANDS`` as a fresh process, records its child CPU time (user + sys, from
``resource.getrusage``: wall time means nothing on a shared machine) and its output (``--json``; the
``-text`` cases the table as printed). With
``--save DIR`` the outputs are written there; with ``--compare DIR`` each output is compared byte for byte
with the one saved (a baseline from another checkout: run it with that checkout first on PYTHONPATH); an output
that differs only in rows not replayed (their reserved bytes ``—`` / null with ``reserved_not_replayed``, and the
footnote under the table: ``planning/reserved_fit.py live_over``) is reported as such (``not_replayed_only``).

Each runs as ``python -P -m zeroplan.cli`` (-P: not the current directory first), so PYTHONPATH picks the
checkout. Run: python benchmarks/plan_speed.py [--save DIR | --compare DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import resource
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's rules, whatever PYTHONPATH runs
from zeroplan.planning.reserved_fit import AFTER_FIT  # noqa: E402
from zeroplan.render.plan_cells import NOT_REPLAYED_CELL  # noqa: E402

BIG = ["--model", "llama3-405b", "--gpus", "2048", "--gpu", "h100-80gb", "--json"]
COMMANDS: dict[str, list[str]] = {
    "plan-fsdp2-405b": ["plan", "--engine", "fsdp2", *BIG],
    "plan-fsdp2-405b-auto": ["plan", "--engine", "fsdp2", *BIG, "--dp-shard", "auto"],
    "plan-fsdp2-405b-1024": ["plan", "--engine", "fsdp2", "--model", "llama3-405b", "--gpus", "1024", "--gpu",
                             "h100-80gb", "--json"],
    "plan-fsdp2-405b-bf16": ["plan", "--engine", "fsdp2", *BIG, "--param-dtype", "bf16", "--reduce-dtype", "fp32"],
    "plan-fsdp2-13b-cpu": ["plan", "--engine", "fsdp2", "--model", "llama2-13b", "--gpus", "6", "--gpu", "a100-40gb",
                           "--device", "cpu", "--init", "materialized", "--json"],
    "plan-fsdp2-405b-hsdp": ["plan", "--engine", "fsdp2", *BIG, "--dp-shard", "64"],
    "plan-fsdp2-7b-titan": ["plan", "--engine", "fsdp2", "--model", "llama2-7b", "--gpus", "24", "--gpu", "a100-40gb",
                            "--fsdp-wrap", "torchtitan", "--param-dtype", "bf16", "--json"],
    "plan-fsdp2-13b-auto": ["plan", "--engine", "fsdp2", "--model", "llama2-13b", "--gpus", "32", "--gpu",
                                "a100-40gb", "--dp-shard", "auto", "--param-dtype", "bf16", "--json"],
    "plan-fsdp2-405b-1024-text": ["plan", "--engine", "fsdp2", "--model", "llama3-405b", "--gpus", "1024", "--gpu",
                                  "h100-80gb"],
    "plan-fsdp2-13b-text": ["plan", "--engine", "fsdp2", "--model", "llama2-13b", "--gpus", "12", "--gpu", "a100-40gb"],
    "plan-deepspeed-405b": ["plan", "--engine", "deepspeed", *BIG],
    "plan-reference-405b": ["plan", "--engine", "reference", *BIG],
    "estimate-fsdp2-405b": ["estimate", "--engine", "fsdp2", *BIG],
    "estimate-fsdp2-405b-k8": ["estimate", "--engine", "fsdp2", *BIG, "--reshard-after-forward", "8",
                               "--param-dtype", "bf16", "--reduce-dtype", "fp32"],
    "estimate-fsdp2-405b-keep": ["estimate", "--engine", "fsdp2", *BIG, "--reshard-after-forward", "false",
                                 "--checkpointing", "full"],
    "estimate-fsdp2-405b-hsdp": ["estimate", "--engine", "fsdp2", *BIG, "--dp-shard", "64"],
    "estimate-fsdp2-7b-titan": ["estimate", "--engine", "fsdp2", "--model", "llama2-7b", "--gpus", "24",
                                "--fsdp-wrap", "torchtitan", "--param-dtype", "bf16", "--json"],
    "estimate-fsdp2-13b-cpu": ["estimate", "--engine", "fsdp2", "--model", "llama2-13b", "--gpus", "6",
                               "--device", "cpu", "--init", "materialized", "--json"],
    "plan-fsdp2-13b": ["plan", "--engine", "fsdp2", "--model", "llama2-13b", "--gpus", "12", "--gpu", "a100-40gb",
                          "--json"],
    "estimate-deepspeed-7b": ["estimate", "--engine", "deepspeed", "--model", "llama2-7b", "--gpus", "64", "--stage", "3",
                              "--json"],
    "estimate-reference-405b": ["estimate", "--model", "llama3-405b", "--gpus", "2048", "--json"],
}  # fmt: skip

DS_INPUTS = "tests/data/golden/inputs/ds_config.json"  # ZeRO-2, overlap_comm, bf16, fp32 gradient accumulation
BIG_1024 = ["--model", "llama3-405b", "--gpus", "1024", "--gpu", "h100-80gb"]
DEEPSPEED_REFERENCE: dict[str, list[str]] = {
    "plan-deepspeed-405b-1024": ["plan", "--engine", "deepspeed", *BIG_1024, "--json"],
    "plan-deepspeed-405b-1024-text": ["plan", "--engine", "deepspeed", *BIG_1024],
    "plan-reference-405b-1024": ["plan", *BIG_1024, "--json"],
    "plan-reference-405b-1024-text": ["plan", *BIG_1024],
    "plan-reference-8b-ckpt-ga4": ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "a100-40gb",
                                   "--checkpointing", "full", "--grad-accum", "4", "--json"],
    "plan-deepspeed-13b-ga4": ["plan", "--engine", "deepspeed", "--model", "llama2-13b", "--gpus", "12", "--gpu",
                               "a100-40gb", "--grad-accum", "4", "--json"],
    "plan-deepspeed-7b-overlap-ckpt": ["plan", "--engine", "deepspeed", "--model", "llama2-7b", "--gpus", "16", "--gpu",
                                       "a100-80gb", "--deepspeed-config", DS_INPUTS, "--checkpointing", "full", "--json"],
    "estimate-deepspeed-405b-1024-s1": ["estimate", "--engine", "deepspeed", *BIG_1024, "--stage", "1", "--json"],
    "estimate-deepspeed-405b-1024-s2": ["estimate", "--engine", "deepspeed", *BIG_1024, "--stage", "2", "--json"],
    "estimate-deepspeed-7b-overlap": ["estimate", "--engine", "deepspeed", "--model", "llama2-7b", "--gpus", "16",
                                      "--deepspeed-config", DS_INPUTS, "--json"],
    "estimate-deepspeed-7b-s1-ga2": ["estimate", "--engine", "deepspeed", "--model", "llama2-7b", "--gpus", "24",
                                     "--stage", "1", "--grad-accum", "2", "--json"],
    "estimate-deepspeed-7b-s2-ga2": ["estimate", "--engine", "deepspeed", "--model", "llama2-7b", "--gpus", "24",
                                     "--stage", "2", "--grad-accum", "2", "--json"],
}  # fmt: skip
"""Issue 16's DeepSpeed and reference `plan` speed (docs/benchmarks.md): the cases those engines' speed-up touches."""
COMMANDS.update(DEEPSPEED_REFERENCE)


def run(args: list[str]) -> tuple[float, bytes]:
    """(CPU seconds of the child, its stdout); a failing command stops the benchmark."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-P", "-m", "zeroplan.cli", *args], capture_output=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        sys.exit(f"zeroplan {' '.join(args)}: exit {done.returncode}: {done.stderr.decode()[-300:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.stdout




def not_replayed_only(old: bytes, new: bytes) -> int | None:
    """How many rows of ``new`` were not replayed when that is its only difference from ``old`` (their reserved
    bytes null or ``—``, the reason beside them, a footnote per reason under a table; a row after the
    recommendation, ``reserved_fit.AFTER_FIT``, its fit null or ``—`` too); None when anything else differs."""
    try:
        return _json_rows(json.loads(old), json.loads(new))
    except ValueError:  # a table as printed
        return _text_rows(old.decode().splitlines(), new.decode().splitlines())


def _json_rows(old: dict, new: dict) -> int | None:
    count = 0
    for key in ("stages", "offload"):
        for was, now in zip(old.get(key, []), new.get(key, [])):
            if "reserved_not_replayed" in now and "reserved_not_replayed" not in was:
                why = now["reserved_not_replayed"]
                was.update(reserved_bytes=None, reserved_phases=None, reserved_not_replayed=why)
                if why == AFTER_FIT:
                    was.update(fits=None)
                count += 1
    return count if count and old == new else None


def _text_rows(old: list[str], new: list[str]) -> int | None:
    notes = [i for i, line in enumerate(new) if line.startswith(f"reserved {NOT_REPLAYED_CELL}: ") and line not in old]
    if not notes or len(old) != len(new) - len(notes):
        return None
    new = [line for i, line in enumerate(new) if i not in notes]
    cells = [re.split(r"\s{2,}", line.strip()) for line in new]
    column = next((c.index("reserved") for c in cells if "reserved" in c), None)  # the table's header
    fits = None if column is None else next(c.index("fits") for c in cells if "reserved" in c)
    count = 0
    for was, now, b in zip(old, new, cells):
        if was == now:
            continue
        a = re.split(r"\s{2,}", was.strip())
        if len(a) != len(b) or column is None:
            return None
        if a == b or all(set(c) == {"-"} for c in a + b):  # the header and the rule under it, realigned
            continue
        undecided = b[fits] == NOT_REPLAYED_CELL  # a row after the recommendation: its fit not decided either
        kept = [i for i in range(len(a)) if i != column and not (undecided and i == fits)]
        if b[column] != NOT_REPLAYED_CELL or [a[i] for i in kept] != [b[i] for i in kept]:
            return None
        count += 1
    return count or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", type=pathlib.Path, help="write each command's output here")
    parser.add_argument("--compare", type=pathlib.Path, help="compare each output with the one saved here")
    opts = parser.parse_args()
    differ = []
    for name, args in COMMANDS.items():
        cpu, out = run(args)
        same = ""
        if opts.save:
            opts.save.mkdir(parents=True, exist_ok=True)
            (opts.save / f"{name}.json").write_bytes(out)
        if opts.compare:
            saved = (opts.compare / f"{name}.json").read_bytes()
            skipped = None if saved == out else not_replayed_only(saved, out)
            same = "same output" if saved == out else f"same but {skipped} rows not replayed" if skipped \
                else "OUTPUT DIFFERS"
            if same == "OUTPUT DIFFERS":
                differ.append(name)
        print(f"{name:28s} {cpu:6.2f} s CPU  {same}", flush=True)
    if differ:
        sys.exit(f"outputs differ: {', '.join(differ)}")


if __name__ == "__main__":
    main()
