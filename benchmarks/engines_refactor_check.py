"""Every FSDP2 and reference-engine answer over a grid, dumped, so a refactor can prove it changed none.

    python benchmarks/engines_refactor_check.py --against /work/main   # compare this tree with another
    python benchmarks/engines_refactor_check.py --dump rows.json        # write this tree's answers

``--against`` runs the same dump in a subprocess with ``PYTHONPATH`` set to the other tree and fails
(exit 1, the first differing cases named) unless every case is equal. A case is the ``repr`` of what the
engine returns (``EngineEstimate`` rows, peaks with every moment's terms, collectives, plan candidates and
their snippets), so any changed byte, term name or citation shows. Imports only zeroplan (and the stdlib).

Grid: FSDP2 over reshard_after_forward True / False / 2, param and reduce dtypes, module dtype,
checkpointing, init meta / materialized, CUDA+NCCL and CPU+gloo, ranks 0 and last, N_d 2..64, shapes-only
workloads, the plan search and the launcher snippets; reference over stages 0-3, policies (the runtime's
for the peak, others on bare shapes), checkpointing, accumulation, foreach, CUDA capability, N_d 1..64;
and ``zeroplan.estimate`` for both engines (its "vs DP" row goes through the reference engine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests" / "data" / "hf_configs"
MODELS = (str(TESTS / "tiny-gpt2.json"), str(TESTS / "tiny-gpt2-untied.json"), str(TESTS / "tiny-llama.json"),
          str(TESTS / "tiny-llama-tied-bias.json"), "gpt2-xl", "llama2-7b")  # fmt: skip
NDS = (2, 4, 8, 16, 64)


def _workload(model: str, seq_len: int, micro_batch: int = 1, checkpointing: str = "none", foreach: bool = True):
    from zeroplan.estimation.workload import model_workload
    from zeroplan.presets import resolve_model

    return model_workload(resolve_model(model), seq_len, micro_batch, checkpointing, 1, foreach)


ADDED_SINCE = (", micro_steps=1)", ", beside_states=())")
"""Fields added to the records since (``Collective.micro_steps``, ``EngineEstimate.beside_states``), dropped
from a repr where they hold their default, so that a case differs only where the new field says something."""


def _answer(fn) -> str:
    try:
        out = repr(fn())
        for tail in ADDED_SINCE:
            out = out.replace(tail, ")")
        return out
    except ValueError as exc:  # a refusal is an answer too: its message must not change either
        return f"ValueError: {exc}"


def fsdp2_cases() -> dict[str, str]:
    from zeroplan.engines import fsdp2
    from zeroplan.engines.base import PlannerOptions, Workload
    from zeroplan.formulas.offload import Offload

    out: dict[str, str] = {}
    dtypes = ((None, None, "fp32"), ("bf16", None, "fp32"), ("bf16", "fp32", "fp32"), (None, None, "bf16"))
    for model in MODELS:
        big = model in ("gpt2-xl", "llama2-7b")
        for ckpt in ("none", "full"):
            w = _workload(model, 64 if big else 16, 2, ckpt, foreach=not big)
            for reshard in (True, False, 2):
                for param, reduce, module in dtypes:
                    for nd in (2, 8, 64) if big else NDS:
                        for init in ("meta", "materialized"):
                            for device, backend in (("cuda", "nccl"), ("cpu", "gloo")):
                                if big and (init, device) != ("meta", "cuda"):
                                    continue
                                for rank in (0, nd - 1):
                                    s = fsdp2.Settings(reshard_after_forward=reshard, param_dtype=param,
                                                       reduce_dtype=reduce, module_dtype=module, init=init,
                                                       device=device, backend=backend, rank=rank)  # fmt: skip
                                    key = f"fsdp2 {model} {ckpt} {s!r} nd={nd}"
                                    out[key] = _answer(lambda: fsdp2.estimate(w, nd, s))
    shapes = Workload(tuple((f"tensor {i}", (n, 3)) for i, n in enumerate((5, 17, 1000, 1))))
    for nd in (1, *NDS, 3):
        for reshard in (True, False, 2, 3):
            s = fsdp2.Settings(reshard_after_forward=reshard)
            out[f"fsdp2 shapes {s!r} nd={nd}"] = _answer(lambda: fsdp2.estimate(shapes, nd, s))
    for model in MODELS[:3]:
        w = _workload(model, 16, 2)
        for cap in (10**6, 10**7, 10**9):
            for param in (None, "bf16"):
                opts = PlannerOptions(param_dtype=param)
                out[f"fsdp2 plan {model} {cap} {param}"] = _answer(lambda: fsdp2.planner_plan(w, 4, cap, opts))
    for opts in (PlannerOptions(), PlannerOptions(reshard_after_forward=4, param_dtype="bfloat16", reduce_dtype="fp32")):
        s = fsdp2.planner_settings(opts)
        out[f"fsdp2 planner {opts!r}"] = repr((s, fsdp2.planner_policy(s), fsdp2.planner_block_bytes(s)))
    for stage in (0, 1, 2, 3):
        for off in (Offload(), Offload("cpu", "none"), Offload("cpu", "cpu")):
            out[f"fsdp2 snippet {stage} {off!r}"] = _answer(lambda: fsdp2.fsdp2_snippet(stage, off))
    for reshard in (True, False, 4):
        for ckpt in ("none", "full"):
            for init in ("meta", "materialized"):
                s = fsdp2.Settings(reshard_after_forward=reshard, param_dtype="bf16", init=init, foreach=True)
                out[f"fsdp2 settings_snippet {s!r} {ckpt}"] = fsdp2.settings_snippet(s, ckpt)
    return out


def reference_cases() -> dict[str, str]:
    from zeroplan.engines import reference
    from zeroplan.engines.base import PlannerOptions, Workload
    from zeroplan.policy import PrecisionPolicy

    out: dict[str, str] = {}
    for model in MODELS:
        big = model in ("gpt2-xl", "llama2-7b")
        for ckpt in ("none", "full"):
            for accum in (1, 3):
                w = _workload(model, 64 if big else 16, 2, ckpt, foreach=accum == 1)
                w = Workload(w.shapes, w.spec, w.seq_len, w.micro_batch, w.checkpointing, accum, w.foreach)
                for nd in (1, 2, 8, 64) if big else (1, *NDS, 3):
                    for cap in ((9, 0), None):
                        s = reference.Settings(cuda_capability=cap, stat_bytes=4 if cap else 2)
                        out[f"reference {model} {ckpt} {accum} {s!r} nd={nd}"] = _answer(
                            lambda: reference.estimate(w, nd, s))  # fmt: skip
    policies = (PrecisionPolicy(), PrecisionPolicy(param_dtype="fp32"), PrecisionPolicy(master_weights=False),
                PrecisionPolicy(optimizer="sgd"), PrecisionPolicy(param_dtype="bf16", grad_dtype="fp32"))  # fmt: skip
    shapes = Workload(tuple((f"tensor {i}", (n,)) for i, n in enumerate((5, 17, 1000, 1, 10**9))))
    for policy in policies:
        for flat in (True, False):
            for nd in (1, 2, 3, 8, 64):
                s = reference.Settings(policy=policy, flat_layout=flat)
                out[f"reference shapes {s!r} nd={nd}"] = _answer(lambda: reference.estimate(shapes, nd, s))
        w = _workload(MODELS[0], 16)
        s = reference.Settings(policy=policy, stages=(3, 1))
        out[f"reference peak-policy {policy!r}"] = _answer(lambda: reference.estimate(w, 4, s))
    opts = PlannerOptions(stages=(1, 3), policy=policies[1], flat_layout=False)
    s = reference.planner_settings(opts)
    out["reference planner"] = repr((s, reference.planner_policy(s), reference.planner_block_bytes(s)))
    return out


def api_cases() -> dict[str, str]:
    import zeroplan

    out: dict[str, str] = {}
    for model in ("gpt2-xl", "llama2-7b", str(TESTS / "tiny-llama.json")):
        for gpus in (8, 64):
            out[f"api reference {model} {gpus}"] = _answer(lambda: zeroplan.estimate(model=model, gpus=gpus))
            out[f"api fsdp2 {model} {gpus}"] = _answer(lambda: zeroplan.estimate(
                model=model, gpus=gpus, engine="fsdp2", param_dtype="bf16", reshard_after_forward=False))  # fmt: skip
    for params in (7.5e9, 1e12):
        out[f"api params {params}"] = _answer(lambda: zeroplan.estimate(params, 64, gpu_memory_bytes=80 * 2**30))
    out["api plan fsdp2"] = _answer(lambda: zeroplan.plan(model="llama2-7b", gpus=8, gpu="h100-80gb", engine="fsdp2"))
    for gpus in (8, 64):  # the reference engine's plan: the ladder, link times (ring_link) and the lever note
        out[f"api plan reference {gpus}"] = _answer(lambda: zeroplan.plan(model="llama2-7b", gpus=gpus, gpu="h100-80gb"))
    return out


def dump() -> dict[str, str]:
    return {**fsdp2_cases(), **reference_cases(), **api_cases()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", help="write this tree's answers to this JSON file")
    ap.add_argument("--against", help="another checkout: its answers must equal this tree's")
    args = ap.parse_args()
    mine = dump()
    if args.dump:
        Path(args.dump).write_text(json.dumps(mine, indent=0, sort_keys=True))
        print(f"{len(mine)} cases written to {args.dump}")
    if args.against:
        env = {**os.environ, "PYTHONPATH": str(Path(args.against).resolve())}
        code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                "import engines_refactor_check as c; print(json.dumps(c.dump()))")  # fmt: skip
        theirs = json.loads(subprocess.run([sys.executable, "-c", code], env=env, check=True, text=True,
                                           capture_output=True, cwd=args.against).stdout)  # fmt: skip
        differ = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
        for k in differ[:10]:
            print(f"DIFFERS: {k}\n  here:  {str(mine.get(k))[:300]}\n  there: {str(theirs.get(k))[:300]}")
        print(f"{len(mine)} cases here, {len(theirs)} there, {len(differ)} differ")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
