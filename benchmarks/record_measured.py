"""Record what the validator measures on real engines, once, for ``tests/test_measured_rows.py``.

Runs the reference runtime, FSDP2 and DeepSpeed 0.19.8 (gloo, CPU ranks under torchrun) through the
validator's own runners (``validate.harness.run_matrix``, ``validate.engines.deepspeed.run_world``) over
the matrix the live tests cover (tests/test_validate_runs.py, test_fsdp2_engine.py, test_deepspeed_engine.py,
test_deepspeed_features.py, test_deepspeed_zero_init.py) plus a 5.4M-parameter GPT (``GPT_5M``, a config.json
written to a temporary directory: 4 x d256, vocab 8,192, 128 positions) at buckets of 1e5 elements, where the thresholds bite, and writes
``tests/data/measured/<engine>.json``: per row the run's configuration, the planner's inputs (``Workload``,
the engine's ``Settings``), per rank the measured peak of every phase and model states with the prediction
of the day, the collectives of one steady step, torch / DeepSpeed versions and the date.

Every prediction written is cross-checked against the validator's own comparison of the same run
(``validate.report.predicted_peak``, ``validate.engines.fsdp2.predicted_run``,
``validate.engines.deepspeed.compare_row``): the test's reconstruction of the inputs is the validator's.

    DS_ACCELERATOR=cpu PYTHONPATH=$PWD python benchmarks/record_measured.py [reference] [fsdp2] [deepspeed]
    DS_ACCELERATOR=cpu PYTHONPATH=$PWD python benchmarks/record_measured.py deepspeed:z3-llama-head-bucket,...
        (those DeepSpeed cases alone, merged into the file: each row with its own date and command;
        fsdp2:NAME,... alike)

2026-12-01 on 2 shared cores at load 13-17: reference 12 min, FSDP2 16 min, DeepSpeed 12 min (three
torchrun worlds of 22, 14 and 17 configs); an engine that fails is reported and the others still written.
"""

from __future__ import annotations

import datetime
import json
import logging
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.test_fsdp2_engine import LLAMA_4_LAYERS  # noqa: E402
from tests.test_fsdp2_engine import RUNS as FSDP2_TEST_RUNS  # noqa: E402
from tests.test_measured_rows import MEASURED, dtype_name, predict, workload_json  # noqa: E402

HF = ROOT / "tests" / "data" / "hf_configs"
LLAMA = str(HF / "tiny-llama.json")
GPT_5M = {"model_type": "gpt2", "activation_function": "gelu", "n_layer": 4, "n_embd": 256, "n_head": 4,
          "vocab_size": 8192, "n_positions": 128, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "resid_pdrop": 0.0}  # fmt: skip
SMALL = {"reduce_bucket_size": 5000, "allgather_bucket_size": 5000, "stage3_prefetch_bucket_size": 5000,
         "stage3_param_persistence_threshold": 100}  # fmt: skip
# issue 17 (differential seed 5 draw 6, the smallest reproduction): a Llama whose untied LM head (V·h = 131,072) is
# larger than the bucket, reduced at the final norm's gradient hook (zero3_epilogue.py final_norm_hook); 32 positions
HEAD_BUCKET_LLAMA = {**json.loads(Path(LLAMA).read_text()), "hidden_size": 128, "intermediate_size": 256,
                     "vocab_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 32, "max_position_embeddings": 32, "tie_word_embeddings": False}  # fmt: skip
# a Mistral with one kv head and its window below the sequence (32 < 64): SDPA gets the mask, ``repeat_kv``'s reshape
# is a view of k, v (llama_nograd.kv_copied); transformers' class (hf), fp32, N_d = 2, micro-batch 2
MISTRAL_KV1 = {"model_type": "mistral", "hidden_size": 120, "intermediate_size": 328, "num_attention_heads": 5,
               "num_key_value_heads": 1, "num_hidden_layers": 3, "vocab_size": 3001, "max_position_embeddings": 64,
               "tie_word_embeddings": False, "sliding_window": 32}  # fmt: skip
HEAD_BUCKET = {"reduce_bucket_size": 81_920, "allgather_bucket_size": 81_920, "stage3_param_persistence_threshold": 100}
BIG_MODEL_BUCKETS = {"reduce_bucket_size": 100_000, "allgather_bucket_size": 100_000,
                     "stage3_prefetch_bucket_size": 100_000, "stage3_param_persistence_threshold": 1_000}  # fmt: skip


def _phase(p: str) -> str:
    return p.replace(" ", "_")


def _peaks(rank_row: dict) -> dict[str, int]:
    return {_phase(p): b for p, b in rank_row["peak_bytes_by_phase"].items()}


def _summary(calls: list[list], ops: tuple[str, ...] | None = None) -> dict[str, int]:
    out: dict[str, int] = {}
    for op, phase, dtype, elements in calls:
        if ops is not None and op not in ops:
            continue
        key = f"{op}|{_phase(phase)}|{dtype_name(dtype)}"
        out[key] = out.get(key, 0) + elements
    return out


def _finish(record: dict, measured_collectives: dict[str, int]) -> dict:
    """Fill in the prediction of the day per rank and whether the collectives matched."""
    predicted = predict({**record, "collectives": {}})
    for r, p in zip(record["ranks"], predicted):
        r["predicted_peak_bytes_by_phase"] = p["peak_bytes_by_phase"]
        r["predicted_model_states_bytes"] = p["model_states_bytes"]
    record["collectives"] = {"measured": measured_collectives,
                             "matched_at_recording": predicted[0]["collectives"] == measured_collectives}  # fmt: skip
    if not record["collectives"]["matched_at_recording"]:
        print(f"  {record['name']}: collectives differ: predicted {predicted[0]['collectives']}", flush=True)
    return record


# ---- the reference runtime ----

REFERENCE_RUNS = {
    # name: ValidateConfig fields (gpt-tiny, stages 0-3, 3 steps, bf16 unless said)
    "gpt-tiny": dict(world_sizes=(2, 4)),
    "gpt-tiny-ckpt": dict(world_sizes=(2,), checkpointing="full"),
    "gpt-tiny-accum2": dict(world_sizes=(2,), grad_accum=2),
    "gpt-tiny-fp16-foreach": dict(world_sizes=(2,), param_dtype="fp16", foreach=True),
    "tiny-llama": dict(world_sizes=(2,), model=LLAMA),
    # --params 2e6 builds a 13.9M-parameter GPT (1 x d256; tests/test_validate_runs.py): stages 0 and 3
    "gpt-13.9m": dict(world_sizes=(2,), stages=(0, 3), params=2e6, seq_len=16, batch_per_rank=1),
}


def record_reference() -> list[dict]:
    from validate.config import ValidateConfig
    from validate.harness import run_matrix
    from validate.models import spec_for
    from validate.report import observed_collectives, predicted_peak
    from zeroplan.architectures.spec import transformer_shapes
    from zeroplan.engines.base import Workload
    from zeroplan.engines.reference import Settings
    from zeroplan.policy import PrecisionPolicy

    out = []
    for name, fields in REFERENCE_RUNS.items():
        config = ValidateConfig(engine="reference", device="cpu", timeout_s=1800, **fields)  # 3 steps (default)
        t = time.time()
        worlds = run_matrix(config)
        spec = spec_for(config.model_name, config.params)
        for meta, ranks in worlds:
            nd = meta["world_size"]
            for i, stage in enumerate(config.stages):
                rows = [rr[i] for rr in ranks]
                foreach = bool(rows[0].get("foreach", config.foreach))
                workload = Workload(transformer_shapes(spec), spec, config.seq_len or spec.max_seq_len,
                                    config.batch_per_rank, config.checkpointing, config.grad_accum, foreach)  # fmt: skip
                settings = Settings(stages=(stage,), policy=PrecisionPolicy(param_dtype=config.param_dtype),
                                    block_bytes=1, stat_bytes=2, cuda_capability=None, backend="gloo")  # fmt: skip
                record = {
                    "name": f"reference-{name}-z{stage}-nd{nd}", "engine": "reference", "nd": nd,
                    "run": config.model_dump(mode="json"), "workload": workload_json(workload),
                    "settings": settings.model_dump(mode="json"),
                    "ranks": [{"rank": k, "measured_peak_bytes_by_phase": _peaks(r),
                               "measured_model_states_bytes": r["boundary_bytes"][-1]} for k, r in enumerate(rows)],
                }  # fmt: skip
                coll = {k: v["elements"] for k, v in observed_collectives(rows[0]["calls_by_step"][-1], nd).items()}
                out.append(_finish(record, {k.replace("optimizer step", "optimizer_step"): v for k, v in coll.items()}))
                want = predicted_peak(config, meta, stage, foreach).by_phase()  # the validator's own prediction
                assert out[-1]["ranks"][0]["predicted_peak_bytes_by_phase"] == want, (name, stage, nd, want)
        print(f"reference {name}: {time.time() - t:.0f} s", flush=True)
    return out


# ---- FSDP2 ----

FSDP2_RUNS = {
    # name: ValidateConfig fields (2 steps, gpt-tiny unless said): the live test's runs, from their one home
    **FSDP2_TEST_RUNS,
    # a 5.4M-parameter GPT: terms in proportion (recorded only: too slow for the suite)
    "real-2-gpt-5m-bf16-reshard": dict(world_sizes=(2,), model="GPT5M", param_dtype="bf16", reduce_dtype="fp32",
                                       batch_per_rank=2, seq_len=64),
    "real-4-gpt-5m-fp32-k2-ckpt": dict(world_sizes=(4,), model="GPT5M", param_dtype="fp32", reshard_after_forward=2,
                                       checkpointing="full", batch_per_rank=2, seq_len=64),
    "real-2-mistral-kv1-w32-fp32-hf": dict(world_sizes=(2,), model="MISTRALKV1", hf=True, param_dtype="fp32",
                                           batch_per_rank=2, seq_len=64),
}  # fmt: skip


def _model_files(tmp: Path) -> dict[str, str]:
    llama4 = {**json.loads(Path(LLAMA).read_text()), "num_hidden_layers": 4}
    (tmp / "tiny-llama-4-layers.json").write_text(json.dumps(llama4))
    (tmp / "gpt-5m.json").write_text(json.dumps(GPT_5M))
    (tmp / "head-bucket-llama.json").write_text(json.dumps(HEAD_BUCKET_LLAMA))
    (tmp / "mistral-kv1-w32.json").write_text(json.dumps(MISTRAL_KV1))
    return {LLAMA_4_LAYERS: str(tmp / "tiny-llama-4-layers.json"), "GPT5M": str(tmp / "gpt-5m.json"),
            "HEADBUCKET": str(tmp / "head-bucket-llama.json"), "MISTRALKV1": str(tmp / "mistral-kv1-w32.json")}


def record_fsdp2(models: dict[str, str], only: tuple[str, ...] = ()) -> list[dict]:
    """Every FSDP2 run's rows; ``only``: those runs alone (names without ``fsdp2-`` and ``-nd``)."""
    from validate.config import ValidateConfig
    from validate.engines.fsdp2 import FAKE_TENSOR_PHASES, Fsdp2Settings, predicted_run
    from validate.engines.fsdp2_compare import _workload as fsdp2_workload
    from validate.harness import run_matrix

    out = []
    for name, fields in FSDP2_RUNS.items():
        if only and name not in only:
            continue
        fields = {**fields, "model": models.get(fields.get("model"), fields.get("model"))}
        config = ValidateConfig(engine="fsdp2", steps=2, device="cpu", **{k: v for k, v in fields.items() if v is not None})
        t = time.time()
        worlds = run_matrix(config)
        s = Fsdp2Settings.from_validate(config)
        for meta, ranks in worlds:
            nd, rows = meta["world_size"], [rr[0] for rr in ranks]
            (_, engine), workload = predicted_run(config, meta, 0), fsdp2_workload(s, meta)  # the validator's own
            record = {
                "name": f"fsdp2-{name}-nd{nd}", "engine": "fsdp2", "nd": nd, "run": config.model_dump(mode="json"),
                "workload": workload_json(workload), "settings": engine.model_dump(mode="json"),
                "unchecked_phases": sorted(FAKE_TENSOR_PHASES) if meta.get("fake_tensors") else [],
                "ranks": [{"rank": r["rank"], "measured_peak_bytes_by_phase": _peaks(r),
                           "measured_model_states_bytes": r["readings_bytes"]["after_backward"][-1]} for r in rows],
            }  # fmt: skip
            out.append(_finish(record, _summary(rows[0]["calls_by_step"][-1])))
            for r in out[-1]["ranks"]:  # the validator's own prediction of each rank
                assert r["predicted_peak_bytes_by_phase"] == predicted_run(config, meta, r["rank"])[0].peak.by_phase()
        print(f"fsdp2 {name}: {time.time() - t:.0f} s", flush=True)
    return out


# ---- DeepSpeed ----


def _deepspeed_cases(models: dict[str, str]) -> dict[str, tuple[dict, dict]]:
    """name -> (ds_config, run: model, checkpointing, zero_init, hf): every case of the DeepSpeed tests."""
    from validate.engines.deepspeed import ds_config

    adam = {"torch_adam": True}
    cases: dict[str, tuple[dict, dict]] = {}
    # tests/test_deepspeed_engine.py CASES
    for s in (1, 2, 3):
        cases[f"z{s}-fp32-default"] = (ds_config(s, "fp32", zero=None, optimizer_params=adam), {})
        cases[f"z{s}-fp32-small"] = (ds_config(s, "fp32", zero=SMALL, optimizer_params=adam), {})
        cases[f"z{s}-bf16-small"] = (ds_config(s, "bf16", zero=SMALL, optimizer_params=adam), {})
    for s, d in ((1, "fp32"), (2, "fp32"), (3, "bf16")):
        cases[f"z{s}-{d}-small-fusedadam"] = (ds_config(s, d, zero=SMALL, optimizer_params={}), {})
    for s in (1, 2):
        cases[f"z{s}-fp32-small-overlap"] = (ds_config(s, "fp32", zero={**SMALL, "overlap_comm": True},
                                                       optimizer_params=adam), {})  # fmt: skip
    cases["z1-bf16-small-fp32acc"] = (ds_config(1, "bf16", zero=SMALL, optimizer_params=adam, grad_accum_dtype="fp32"), {})
    # tests/test_deepspeed_features.py
    for s in (1, 2, 3):
        cases[f"z{s}-accum2"] = ({**ds_config(s, zero=SMALL, optimizer_params=adam), "gradient_accumulation_steps": 2}, {})
        cases[f"z{s}-fp16"] = (ds_config(s, "fp16", zero=SMALL, optimizer_params=adam), {})
    for s in (2, 3):
        cases[f"z{s}-checkpointing"] = (ds_config(s, zero=SMALL, optimizer_params=adam), {"checkpointing": "full"})
        cases[f"z{s}-llama"] = (ds_config(s, zero=SMALL, optimizer_params=adam), {"model": LLAMA})
    default_prefetch = {**SMALL, "stage3_prefetch_bucket_size": 50_000_000, "stage3_max_reuse_distance": 0}
    cases["z3-llama-prefetch-r0"] = (ds_config(3, zero={**SMALL, "stage3_max_reuse_distance": 0}, optimizer_params=adam),
                                     {"model": LLAMA})
    cases["z3-llama-prefetch-r1e4"] = (ds_config(3, zero={**SMALL, "stage3_max_reuse_distance": 10_000},
                                                 optimizer_params=adam), {"model": LLAMA})
    cases["z3-default-prefetch-r0"] = (ds_config(3, zero=default_prefetch, optimizer_params=adam), {})
    cases["z3-llama-hf-default-prefetch-r0"] = (ds_config(3, zero=default_prefetch, optimizer_params=adam),
                                                {"model": LLAMA, "hf": True})
    # tests/test_deepspeed_zero_init.py (ZeRO-3 cases above are built whole: zero_init False)
    no_prefetch = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 10_000}
    cases["z3-gpt-fp32-zero-init"] = (ds_config(3, "fp32", zero=SMALL, optimizer_params=adam), {"zero_init": True})
    cases["z3-llama-bf16-zero-init"] = (ds_config(3, "bf16", zero=SMALL, optimizer_params=adam),
                                        {"model": LLAMA, "zero_init": True})
    cases["z3-llama-fp32-zero-init-no-prefetch"] = (ds_config(3, "fp32", zero={**SMALL, **no_prefetch},
                                                              optimizer_params=adam), {"model": LLAMA, "zero_init": True})
    # the 5.4M-parameter GPT at buckets of 1e5 elements (~2% of the model)
    for s in (1, 2, 3):
        cases[f"z{s}-gpt-5m-bf16-buckets1e5"] = (ds_config(s, "bf16", zero=BIG_MODEL_BUCKETS, optimizer_params=adam),
                                                 {"model": models["GPT5M"]})
    cases["z2-gpt-5m-fp32-buckets1e5-overlap-ckpt"] = (
        ds_config(2, "fp32", zero={**BIG_MODEL_BUCKETS, "overlap_comm": True}, optimizer_params=adam),
        {"model": models["GPT5M"], "checkpointing": "full"})
    # N_d = 3 (an odd world: the head's gradient padded, so reduce_scatter_coalesced cats it), transformers' class;
    # the draw's own settings too (overlap_comm, G = 2, zero.Init), which the mechanism does not depend on
    for s in (2, 3):  # one kv head, window 32 < seq 64 (MISTRAL_KV1); the worlds' seq_len is the config's 64
        cases[f"z{s}-mistral-kv1-w32-fp32-hf"] = (ds_config(s, "fp32", zero=SMALL, optimizer_params=adam),
                                                  {"model": models["MISTRALKV1"], "hf": True})
    head = {"model": models["HEADBUCKET"], "hf": True}
    cases["z3-llama-head-bucket"] = (ds_config(3, "fp32", micro_batch=1, zero=HEAD_BUCKET, optimizer_params=adam), head)
    cases["z3-llama-head-bucket-overlap-accum2-zero-init"] = (
        {**ds_config(3, "fp32", micro_batch=1, zero={**HEAD_BUCKET, "overlap_comm": True}, optimizer_params=adam),
         "gradient_accumulation_steps": 2}, {**head, "zero_init": True})
    return cases  # fmt: skip


# one world per (N_d, steps): the live tests' worlds (test_deepspeed_engine.py: N_d = 2 and 4, 3 steps;
# test_deepspeed_features.py: N_d = 2, 2 steps; test_deepspeed_zero_init.py: N_d = 2, 3 steps)
FEATURES = ("accum2", "fp16", "checkpointing", "llama", "default-prefetch")
AT_4 = ("default", "small", "z3-gpt-5m", "z3-gpt-fp32-zero-init")
AT_3 = "head-bucket"  # only at N_d = 3


def _worlds(cases: dict) -> list[tuple[int, int, dict]]:
    feature = lambda k: any(s in k for s in FEATURES) and "zero-init" not in k and "gpt-5m" not in k
    at_3 = {k: v for k, v in cases.items() if AT_3 in k}
    cases = {k: v for k, v in cases.items() if k not in at_3}
    return [
        (2, 3, {k: v for k, v in cases.items() if not feature(k)}),
        (2, 2, {k: v for k, v in cases.items() if feature(k)}),
        (4, 3, {k: v for k, v in cases.items() if any(k.startswith(f"z{s}-{a}") or a in k
                                                       for s in (1, 2, 3) for a in AT_4) and not feature(k)}),
        (3, 3, at_3),
    ]  # fmt: skip


def deepspeed_record(name: str, nd: int, run: dict, ds: dict, rows: list[dict], workload) -> dict:
    """One DeepSpeed row (tests/data/measured/README.md) from every rank's runner row of one config, with the
    prediction of the day (``_finish``); benchmarks/ds_boundary_rows.py records its rows with it too."""
    from zeroplan.engines import deepspeed as D

    zero_init = bool(rows[0].get("zero_init", False))
    settings = D.Settings.from_ds_config(ds, zero_init=zero_init)
    record = {
        "name": name, "engine": "deepspeed", "nd": nd, "run": run,
        "ds_config": ds, "zero_init": zero_init, "workload": workload_json(workload),
        "estimate_kwargs": {"stat_bytes": D.DTYPE_BYTES[settings.dtype]},
        "ranks": [{"rank": k, "measured_peak_bytes_by_phase": _peaks(r),
                   "measured_model_states_bytes": [b for p, b in r["boundary_bytes"].items() if p != "init"][-1]}
                  for k, r in enumerate(rows)],
        "gloo_unsettled": sum(r["gloo_settle"]["unsettled"] for r in rows),
    }  # fmt: skip
    return _finish(record, _summary(rows[0]["calls_by_step"][-1], ("all-reduce", "reduce-scatter", "all-gather")))


def record_deepspeed(models: dict[str, str], only: tuple[str, ...] = ()) -> list[dict]:
    """Every DeepSpeed case's rows; ``only``: those cases alone (names without ``-nd``)."""
    from validate.engines.deepspeed import compare_row, run_world, workload_for

    out = []
    for nd, steps, cases in _worlds(_deepspeed_cases(models)):
        cases = {k: v for k, v in cases.items() if not only or k in only}
        if not cases:
            continue
        configs, runs = [c for c, _ in cases.values()], [r for _, r in cases.values()]
        t = time.time()
        ranks = run_world(configs, nd, steps=steps, runs=runs, timeout_s=5400)
        print(f"deepspeed N_d={nd}, {steps} steps: {len(cases)} configs, {time.time() - t:.0f} s", flush=True)
        for i, (name, (ds, run)) in enumerate(cases.items()):
            rows = [r[i] for r in ranks]
            workload = workload_for(run.get("model", "gpt-tiny"), ds["train_micro_batch_size_per_gpu"], None,
                                    ds.get("gradient_accumulation_steps", 1), run.get("checkpointing", "none"),
                                    hf=run.get("hf", False))  # fmt: skip
            out.append(deepspeed_record(f"deepspeed-{name}-nd{nd}", nd, {
                **run, "model": Path(run.get("model", "gpt-tiny")).name, "steps": steps}, ds, rows, workload))
            row = compare_row(ds, nd, rows, workload, name, 0.01, 0.03)  # the validator's own comparison
            mine = {p: max(r["predicted_peak_bytes_by_phase"][p] for r in out[-1]["ranks"]) for p in row["predicted_peak_bytes_by_phase"]}
            assert mine == row["predicted_peak_bytes_by_phase"], (name, mine, row["predicted_peak_bytes_by_phase"])
    return out


def _write(engine: str, rows: list[dict], command: str, merge: bool = False) -> None:
    """``rows`` as ``tests/data/measured/<engine>.json``; ``merge``: into the file on disk, each row replacing the one
    of its name (or appended) with its own date and command, the file's others and its header kept."""
    import torch

    versions = {"torch": torch.__version__}
    if engine == "deepspeed":
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    data = {"engine": engine, "recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "zeroplan_commit": commit, **versions, "command": command, "device": "cpu", "backend": "gloo",
            "rows": rows}  # fmt: skip
    if merge:
        old = json.loads((MEASURED / f"{engine}.json").read_text())
        new = {r["name"]: {**r, "recorded": data["recorded"], "zeroplan_commit": commit, "command": command} for r in rows}
        data = {**old, "rows": [new.pop(r["name"], r) for r in old["rows"]] + list(new.values())}
    MEASURED.mkdir(parents=True, exist_ok=True)
    (MEASURED / f"{engine}.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {MEASURED / f'{engine}.json'}: {len(rows)} rows", flush=True)


def main(engines: list[str]) -> None:
    logging.disable(logging.WARNING)
    command = "DS_ACCELERATOR=cpu python benchmarks/record_measured.py " + " ".join(engines)
    with tempfile.TemporaryDirectory(prefix="zeroplan-measured-") as tmp:
        models = _model_files(Path(tmp))
        for arg in engines:  # one engine's failure does not cost the others' recording
            t = time.time()
            engine, _, only = arg.partition(":")  # deepspeed:NAME,...: those cases, merged into the file
            try:
                names = tuple(filter(None, only.split(",")))
                rows = {"reference": record_reference, "fsdp2": lambda: record_fsdp2(models, names),
                        "deepspeed": lambda: record_deepspeed(models, names)}[engine]()  # fmt: skip
            except Exception as e:
                if type(e).__name__ == "Interrupted":  # validate.harness: SIGTERM / SIGHUP stop everything
                    raise
                traceback.print_exc()
                continue
            _write(engine, rows, command, merge=bool(only))
            print(f"{engine}: {time.time() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["reference", "fsdp2", "deepspeed"])
