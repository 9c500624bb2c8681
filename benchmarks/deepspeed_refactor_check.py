"""Proof that a refactor of the DeepSpeed profile (``zeroplan/engines/deepspeed/``) changed no number.

Dumps, for a grid of ``Settings`` x workloads (ZeRO 1-3; bf16, fp32, fp16 and BF16_Optimizer; bucket sizes;
``overlap_comm``; ``zero.Init``; prefetch, persistence, live and reuse limits; torch Adam and foreach;
checkpointing; gradient accumulation; the validator's ``CausalLM`` and the transformers tree; N_d 2, 4 and
64), everything the profile predicts: ``estimate`` (model states, peak per phase, collectives), every
moment of ``moments(ds_run(...))``, ``terms``, DeepSpeed's own estimator, the ds_config written back, the
candidates of ``planner_plan`` and the legacy ``deepspeed_config`` writer. Each case is hashed (SHA-256 of
its canonical JSON); the hashes of the code before the refactor are kept in
``benchmarks/deepspeed_refactor_check.json``.

    python benchmarks/deepspeed_refactor_check.py --write   # before: record the hashes
    python benchmarks/deepspeed_refactor_check.py           # after: exit 1 naming every case that changed
    python benchmarks/deepspeed_refactor_check.py --dump rows.json   # the rows themselves, to diff

The plan's candidate *order* and its choice are recorded apart (``plan order``) so that a deliberate change
of the order shows as that and nothing else. Imports only zeroplan.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines import deepspeed as D
from zeroplan.engines.base import PlannerOptions, Workload
from zeroplan.formulas.offload import Offload
from zeroplan.policy import PrecisionPolicy
from zeroplan.presets import resolve_model

HASHES = Path(__file__).with_suffix(".json")

GPT_TINY = {"model_type": "gpt2", "activation_function": "gelu", "n_layer": 2, "n_embd": 36, "n_head": 3,
            "vocab_size": 101, "n_positions": 16}  # fmt: skip
LLAMA_TINY = {"model_type": "llama", "hidden_size": 48, "intermediate_size": 88, "max_position_embeddings": 32,
              "num_attention_heads": 6, "num_hidden_layers": 3, "num_key_value_heads": 2, "vocab_size": 103}  # fmt: skip
LLAMA_TIED = {**LLAMA_TINY, "tie_word_embeddings": True, "num_hidden_layers": 2}


def _workloads() -> dict[str, Workload]:
    gpt = spec_from_hf_config(GPT_TINY, "gpt-tiny")
    llama = spec_from_hf_config(LLAMA_TINY, "llama-tiny")
    tied = spec_from_hf_config(LLAMA_TIED, "llama-tied")
    out = {}
    for name, spec in (("gpt-tiny", gpt), ("llama-tiny", llama), ("llama-tied", tied)):
        shapes = tuple(transformer_shapes(spec))
        for hf in (False, True):
            for ckpt in ("none", "full"):
                for ga in (1, 2):
                    key = f"{name} {'transformers' if hf else 'CausalLM'} ckpt={ckpt} ga={ga}"
                    out[key] = Workload(shapes, spec, 16, 2, ckpt, ga, ga == 2, hf)
    out["bare tensors"] = Workload((("a.weight", (300, 7)), ("b.bias", (5,)), ("c.weight", (4000,))))
    return out


def _settings() -> dict[str, dict]:
    """ds_config fragments (beyond the stage) x stages."""
    small = {"reduce_bucket_size": 2000, "allgather_bucket_size": 2000}
    tiny3 = {"stage3_param_persistence_threshold": 50, "stage3_prefetch_bucket_size": 3000}
    variants: dict[str, tuple[dict, dict]] = {
        "fp32": ({}, {}),
        "bf16": ({"bf16": {"enabled": True}}, {}),
        "fp16": ({"fp16": {"enabled": True}}, {}),
        "bf16 fp32 grads": ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, {}),
        "bf16 small buckets": ({"bf16": {"enabled": True}}, small),
        "bf16 small buckets overlap": ({"bf16": {"enabled": True}}, {**small, "overlap_comm": True}),
        "fp32 small buckets no overlap": ({}, {**small, "overlap_comm": False}),
        "fp32 no contiguous": ({}, {**small, "contiguous_gradients": False}),
        "bf16 torch adam": ({"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, small),
        "fp32 torch adam foreach": ({"optimizer": {"type": "Adam", "params": {"torch_adam": True, "foreach": True,
                                                                               "adam_w_mode": False}}}, {}),
        "bf16 stage3 small": ({"bf16": {"enabled": True}}, {**small, **tiny3}),
        "bf16 stage3 no prefetch": ({"bf16": {"enabled": True}}, {**small, **tiny3, "stage3_prefetch_bucket_size": 0}),
        "fp32 stage3 reuse": ({}, {**tiny3, "stage3_max_reuse_distance": 500, "stage3_max_live_parameters": 4000}),
        "fp16 stage3 persistence 0": ({"fp16": {"enabled": True}}, {"stage3_param_persistence_threshold": 0}),
    }  # fmt: skip
    out = {}
    for name, (top, zero) in variants.items():
        for stage in (1, 2, 3):
            if "stage3" in name and stage != 3:
                continue
            out[f"ZeRO-{stage} {name}"] = {**top, "zero_optimization": {"stage": stage, **zero}}
    return out


ADDED_SINCE_RECORD = {"micro_steps": 1, "beside_states": ()}
"""Fields added to the records after the hashes were recorded, dumped only where they differ from these values
(so a case changes only where the new field says something)."""


def _plain(x: object) -> object:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)
                if f.name not in ADDED_SINCE_RECORD or getattr(x, f.name) != ADDED_SINCE_RECORD[f.name]}
    if hasattr(x, "model_dump"):
        return _plain(x.model_dump())
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    return x


def _row(settings: D.Settings, w: Workload, nd: int) -> dict:
    import math

    numels = tuple(math.prod(s) for _, s in w.shapes)
    row = {
        "estimate": _plain(D.estimate(w, nd, settings)),
        "terms": _plain(D.terms(settings, numels, nd)),
        "ds_estimate_bytes": D.ds_estimate_bytes(settings, numels, nd),
        "classes": [D.optimizer_class(settings), D.inner_optimizer_class(settings)],
        "to_ds_config": json.dumps(D.to_ds_config(settings, w.micro_batch, w.grad_accum)),
    }
    if w.spec is not None:
        row["moments"] = _plain(D.moments(D.ds_run(settings, w, nd)))
        row["stat_bytes 2"] = _plain(D.estimate(w, nd, settings, 2)[0].peak)
    return row


def _plan(w: Workload, nd: int, capacity: int, ds: dict) -> tuple[dict, list]:
    plan = D.planner_plan(w, nd, capacity, PlannerOptions(ds_config=ds))
    rows = {c.label: _plain(dataclasses.replace(c, launcher=json.dumps(c.launcher))) for c in plan.candidates}
    order = [[c.label for c in plan.candidates], plan.recommended, plan.order]
    return rows, order


def cases() -> dict[str, object]:
    """Every case: name -> its JSON-able rows."""
    out: dict[str, object] = {}
    works = _workloads()
    for sname, ds in _settings().items():
        for zinit in (None, False) if "ZeRO-3" in sname else (None,):
            s = D.Settings.from_ds_config(ds, zero_init=zinit)
            for wname, w in works.items():
                for nd in (2, 4, 64) if wname.startswith(("gpt-tiny CausalLM ckpt=none ga=1", "llama-tiny transformers ckpt=full ga=1", "bare")) else (2, 4):
                    out[f"{sname} zero_init={zinit} | {wname} | nd={nd}"] = _row(s, w, nd)
    # the planner: every candidate of a small and a large model, by label; the order apart
    for wname, w, nd, cap in (("gpt-tiny CausalLM ckpt=none ga=1", works["gpt-tiny CausalLM ckpt=none ga=1"], 4, 400_000),
                              ("llama-tiny transformers ckpt=full ga=2", works["llama-tiny transformers ckpt=full ga=2"], 2, 10**9)):
        for dname, ds in (("defaults", {}), ("bf16", {"bf16": {"enabled": True}})):
            rows, order = _plan(w, nd, cap, ds)
            out[f"plan {wname} nd={nd} {dname}"] = rows
            out[f"plan order {wname} nd={nd} {dname}"] = order
    spec = resolve_model("llama2-7b")
    big = Workload(tuple(transformer_shapes(spec)), spec, 4096, 1, "full", 1, True, True)
    rows, order = _plan(big, 64, 80 * 2**30, {"bf16": {"enabled": True}})
    out["plan llama2-7b nd=64"] = rows
    out["plan order llama2-7b nd=64"] = order
    legacy = {}
    for stage in (0, 1, 2, 3):
        for off in ("none", "cpu", "nvme"):
            for dtype in ("bf16", "fp16", "fp32"):
                try:
                    cfg = D.deepspeed_config(stage, Offload(off), 2, 4, PrecisionPolicy(param_dtype=dtype), 5_000_000)
                    legacy[f"{stage} {off} {dtype}"] = json.dumps(cfg)
                except ValueError as exc:
                    legacy[f"{stage} {off} {dtype}"] = f"ValueError: {exc}"
    out["deepspeed_config"] = legacy
    return out


def digest(rows: object) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=repr).encode()).hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the hashes (before a refactor)")
    parser.add_argument("--dump", type=Path, help="write every case's rows to this JSON file")
    args = parser.parse_args()
    rows = cases()
    if args.dump:
        args.dump.write_text(json.dumps(rows, sort_keys=True, default=repr, indent=1))
    hashes = {name: digest(r) for name, r in rows.items()}
    if args.write:
        HASHES.write_text(json.dumps(hashes, indent=0, sort_keys=True) + "\n")
        print(f"{len(hashes)} cases recorded in {HASHES}")
        return 0
    before = json.loads(HASHES.read_text())
    changed = sorted(k for k in before.keys() | hashes.keys() if before.get(k) != hashes.get(k))
    for name in changed:
        print(f"changed: {name}", file=sys.stderr)
    print(f"{len(hashes) - len(changed)} of {len(before)} cases identical")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
