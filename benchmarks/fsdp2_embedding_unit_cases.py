"""FSDP2 with the token embedding as its own ``fully_shard`` unit, built by hand beside differential draw 3-5
(issue 17): untied and tied (the tied head grouped with it), the root resharded and not, N_d 2 and 4, the
blocks resharded and kept. Each is trained on its N_d gloo ranks by the differential harness
(``validate.engines.differential.run_draw``) and predicted per rank; the records go to
tests/data/measured/fsdp2_embedding_unit.json, each a case of tests/test_differential.py (predicted again in CI).

    DS_ACCELERATOR=cpu PYTHONPATH=$PWD python benchmarks/fsdp2_embedding_unit_cases.py [--only 1 2] [--out F]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from validate.engines.differential import Draw, run_draw

OUT = Path(__file__).resolve().parents[1] / "tests/data/measured/fsdp2_embedding_unit.json"


def _llama(model_type: str, hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int, tied: bool) -> dict:
    return {"model_type": model_type, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter,
            "vocab_size": vocab, "max_position_embeddings": 256, "tie_word_embeddings": tied, "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0, "attention_dropout": 0.0}  # fmt: skip


def _fsdp2(units: list[dict], rsf, labels: bool, init: str) -> dict:
    return {"reshard_after_forward": rsf, "param_dtype": "fp32", "reduce_dtype": None, "labels": labels,
            "wrap": {"units": units}, "init": init, "checkpointing": False}  # fmt: skip


EMBED, LAYERS, ROOT = "model.embed_tokens", "model.layers.*", ""
# (index, why, config, N_d, seq, micro-batch, fsdp2 settings); psi is filled in from the config
CASES = (
    (1, "3-5's shape at N_d = 2, the root left at its default (kept gathered after forward): the embedding's "
        "prefetch is alive through block 1's backward (the peak there), not at block 1's copy-out",
     _llama("llama", 256, 2, 4, 2, 1024, 4000, False), 2, 64, 2,
     _fsdp2([{"modules": [EMBED]}, {"modules": [LAYERS], "reshard_after_forward": True}, {"modules": [ROOT]}],
            True, True, "meta")),
    (2, "3-5's shape at N_d = 4 on qwen2 (biased q, k, v), the root True, the loss outside forward (no labels), "
        "materialized: the peak when block 1's gradients are complete, the embedding's prefetch alive",
     _llama("qwen2", 384, 2, 6, 2, 1152, 4000, False), 4, 64, 2,
     _fsdp2([{"modules": [EMBED]}, {"modules": [LAYERS], "reshard_after_forward": True},
             {"modules": [ROOT], "reshard_after_forward": True}], True, False, "materialized")),
    (3, "tied: the embedding and the tied head as their own unit (a group spanning the layers, resharded after "
        "the head), the root at its default, N_d = 4: the root's pre-backward prefetches the group, which then stays "
        "unsharded to the final callback (forward -11.35%, backward -5.14% before side.spanning_resharded)",
     _llama("llama", 256, 3, 4, 2, 1024, 6000, True), 4, 64, 2,
     _fsdp2([{"modules": [EMBED, "lm_head"], "group": True}, {"modules": [LAYERS], "reshard_after_forward": True},
             {"modules": [ROOT]}], True, True, "meta")),
    (4, "the blocks kept gathered (False), the embedding resharded: its prefetch at block 1's pre_backward "
        "without a copy-out before it; mistral, the root True, N_d = 4",
     _llama("mistral", 256, 3, 4, 1, 1024, 6000, False), 4, 64, 2,
     _fsdp2([{"modules": [EMBED]}, {"modules": [LAYERS], "reshard_after_forward": False},
             {"modules": [ROOT], "reshard_after_forward": True}], False, True, "materialized")),
    (5, "tied as case 3, the root True (holding the norm), the loss outside forward (no labels), N_d = 2: the "
        "group gathered at the logits' gradient, not before the loss backward",
     _llama("llama", 256, 2, 4, 2, 1024, 6000, True), 2, 64, 2,
     _fsdp2([{"modules": [EMBED, "lm_head"], "group": True}, {"modules": [LAYERS], "reshard_after_forward": True},
             {"modules": [ROOT], "reshard_after_forward": True}], True, False, "materialized")),
)

# each case's stated margin (|predicted - measured| / measured, every phase of every rank): its measured error
# (2026-12-02) rounded up; tests/test_differential.py asserts it
MARGINS = {1: 0.001, 2: 0.005, 3: 0.001, 4: 0.001, 5: 0.001}


def cases() -> list[tuple[str, Draw]]:
    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.architectures.spec import param_count

    out = []
    for index, why, config, nd, seq, b, fsdp2 in CASES:
        psi = param_count(spec_from_hf_config(config))
        out.append((why, Draw(seed=0, index=index, engine="fsdp2", config=config, nd=nd, seq_len=seq, micro_batch=b,
                              fsdp2=fsdp2, psi=psi)))  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, nargs="*", help="these case indices (default: all)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    import torch

    records = []
    for why, d in cases():
        if args.only and d.index not in args.only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            got = run_draw(d, Path(tmp))
        under, over = got.worst()
        print(f"{d.name}: under {under:+.3%} over {over:+.3%}", flush=True)
        records.append({**got.as_json(), "why": why, "margin": MARGINS[d.index]})
    data = {"recorded": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, CPU", "torch": torch.__version__, "backend": "gloo",
            "command": "DS_ACCELERATOR=cpu PYTHONPATH=$PWD python benchmarks/fsdp2_embedding_unit_cases.py",
            "results": records}  # fmt: skip
    args.out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
