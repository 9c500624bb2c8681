"""Record FSDP2 under torchtitan's layer selective activation checkpointing (every k-th layer in
``checkpoint_wrapper``: ``zeroplan/engines/fsdp2/selective_ac.py``) into ``tests/data/measured/fsdp2.json``.

Real gloo ranks (torchrun, N_d = 2, fp32) run ``validate.engines.fsdp2`` with ``Fsdp2Settings(checkpointing=True,
selective_ac=k)``: its ``shard`` wraps layers k, 2k, ... (1-based) as torchtitan 0.2.2's ``_apply_layer_sac`` does.
Each row is written as ``benchmarks/record_measured.py`` writes the others (the run, the planner's inputs, per
rank every phase's measured peak and the prediction of the day), replacing a row of the same name; the rows are
predicted again by ``tests/test_measured_rows.py``.

    DS_ACCELERATOR=cpu PYTHONPATH=$PWD nice -n 5 python benchmarks/record_layer_sac.py [NAME ...]
"""

from __future__ import annotations

import datetime
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.record_measured import _finish, _peaks, _summary  # noqa: E402
from tests.test_measured_rows import MEASURED, workload_json  # noqa: E402

HF = ROOT / "tests" / "data" / "hf_configs"
# transformers' LlamaForCausalLM of realistic proportions: 27.8M parameters (d 512, 8 layers, GQA 8/4 heads, SwiGLU
# 1,408, vocabulary 8,192, untied), at 2 x 128 tokens per rank
LLAMA_28M = {**json.loads((HF / "tiny-llama.json").read_text()), "hidden_size": 512, "intermediate_size": 1408,
             "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 8192,
             "max_position_embeddings": 128, "tie_word_embeddings": False}  # fmt: skip
# the validator's own Llama-style CausalLM, 7 layers: with k = 2 the last layer is not checkpointed (layer 6 is)
LLAMA_7 = {**LLAMA_28M, "num_hidden_layers": 7}
# 21.7M parameters, 2 x 512 tokens and a vocabulary of 1,024: the forward peaks in the last layer's forward (not
# checkpointed, its whole saved set), the backward in layer 6's recompute
LLAMA_7_LONG = {**LLAMA_7, "vocab_size": 1024, "max_position_embeddings": 512}
SAC_CHANGE = ("layer selective AC: torchtitan 0.2.2's _apply_layer_sac rule copied into validate/engines/fsdp2.py:shard "
              "(layers k, 2k, ... in checkpoint_wrapper(preserve_rng_state=False)); torchtitan 0.3.0 has none to import",
              "per-op selective AC: torchtitan 0.3.0's own SelectiveAC(SelectiveAC.Config())._wrap_block per layer")
"""What the runner does beyond the probes for each policy (``runner_changes``, as validate's report rows say it)."""
CASES = {
    # name: (config.json, Fsdp2Settings fields)
    "hf-llama-28m-fp32-sac2": (LLAMA_28M, dict(hf=True, selective_ac=2)),
    "hf-llama-28m-fp32-sac3-meta": (LLAMA_28M, dict(hf=True, selective_ac=3, init="meta")),
    "llama-7-layers-fp32-sac2": (LLAMA_7, dict(selective_ac=2)),
    "hf-llama-7-layers-s512-fp32-sac2": (LLAMA_7_LONG, dict(hf=True, selective_ac=2)),
    # torchtitan's per-op policy, with torchtitan 0.3.0's own SelectiveAC (validate/engines/fsdp2.py op_sac_block)
    "hf-llama-7-layers-s512-fp32-op": (LLAMA_7_LONG, dict(hf=True, selective_ac="op")),
    "hf-llama-28m-fp32-op": (LLAMA_28M, dict(hf=True, selective_ac="op")),
}


def run_case(name: str, model: dict, fields: dict, tmp: Path, nd: int = 2) -> dict:
    from validate.engines.fsdp2_compare import Fsdp2Settings, _workload, predict, runner_changes
    from validate.engines.fsdp2_rows import run_world

    path = tmp / f"{name}.json"
    path.write_text(json.dumps(model))
    settings = Fsdp2Settings(model=str(path), checkpointing=True, batch_per_rank=2, steps=2, **fields)
    result = run_world(settings, nd, timeout_s=3600)
    meta, rows = result["meta"], result["rows"]
    row0, engine = predict(settings, meta, 0)
    record = {
        "name": f"fsdp2-real-2-{name}-nd{nd}", "engine": "fsdp2", "nd": nd,
        "run": {**asdict(settings), "model": Path(settings.model).name, "config_json": model,
                "runner_changes": [*runner_changes(meta), SAC_CHANGE[settings.selective_ac == "op"]],
                "command": "DS_ACCELERATOR=cpu PYTHONPATH=$PWD python benchmarks/record_layer_sac.py " + name},
        "workload": workload_json(_workload(settings, meta)), "settings": engine.model_dump(mode="json"),
        "unchecked_phases": [],
        "ranks": [{"rank": r["rank"], "measured_peak_bytes_by_phase": _peaks(r),
                   "measured_model_states_bytes": r["readings_bytes"]["after_backward"][-1]} for r in rows],
    }  # fmt: skip
    record = _finish(record, _summary(rows[0]["calls_by_step"][-1]))
    assert record["ranks"][0]["predicted_peak_bytes_by_phase"] == row0.peak.by_phase()  # the validator's own
    return record


def main(names: list[str]) -> None:
    names = names or list(CASES)
    path = MEASURED / "fsdp2.json"
    data = json.loads(path.read_text())
    with tempfile.TemporaryDirectory(prefix="zeroplan-sac-") as tmp:
        for name in names:
            model, fields = CASES[name]
            t = time.time()
            record = run_case(name, model, fields, Path(tmp))
            record["recorded"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            data["rows"] = [r for r in data["rows"] if r["name"] != record["name"]] + [record]
            for r in record["ranks"]:
                m, p = r["measured_peak_bytes_by_phase"], r["predicted_peak_bytes_by_phase"]
                print(name, r["rank"], {k: (m[k], p[k] - m[k], f"{(p[k] - m[k]) / m[k]:+.3%}") for k in m}, flush=True)
            print(f"{name}: {time.time() - t:.0f} s", flush=True)
            path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
