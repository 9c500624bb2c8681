"""Issue 19's target: every ds_config in the projects' own folders, read by zeroplan (docs/integrations.md).

Usage: ``PYTHONPATH=$PWD python benchmarks/ds_config_survey.py LABEL=DIR [LABEL=DIR ...]``: every ``*.json`` under
each DIR (a checkout, or ``git archive`` of one) that is a ds_config (a JSON object with one of DeepSpeed's
top-level sections) is

1. resolved where it holds ``"auto"``, as the HF Trainer resolves it for a run consistent with the file
   (``integrations.hf_trainer.resolve_trainer_auto``: N_d = 2, the file's 16-bit type (bf16 where both are
   "auto"), hidden 1024, 100 steps);
2. read by the DeepSpeed engine (``engines.deepspeed.Settings.from_ds_config``), or, at stage 0 (no ZeRO: the
   DeepSpeed engine models ZeRO-1..3), by the reference engine's reader (``engines.deepspeed.config.from_deepspeed``).

It prints one line per file (read, or the one-line refusal) and a table of counts per source. Nothing is
downloaded: give it the folders.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

SECTIONS = ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "fp16", "bf16", "bfloat16",
            "optimizer", "gradient_accumulation_steps")  # fmt: skip


def _has_auto(value: object) -> bool:
    if isinstance(value, dict):
        return any(_has_auto(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_auto(v) for v in value)
    return value == "auto"


def _dtype(config: dict) -> str:
    """The file's 16-bit type: fp16 where fp16 is enabled (true), else bf16 where bf16/bfloat16 is on or "auto",
    fp16 where only fp16 is "auto", else fp32."""
    def on(key: str) -> object:
        section = config.get(key)
        return section.get("enabled") if isinstance(section, dict) else None

    if on("fp16") is True:
        return "fp16"
    if on("bf16") in (True, "auto") or on("bfloat16") in (True, "auto"):
        return "bf16"
    return "fp16" if on("fp16") == "auto" else "fp32"


def survey_file(path: Path) -> tuple[str, str]:
    """(kind, detail): kind is "not a ds_config", "read", "refused by the resolver" or "refused by the engine"."""
    from zeroplan.engines.deepspeed import Settings
    from zeroplan.engines.deepspeed.config import from_deepspeed
    from zeroplan.integrations.hf_trainer import TrainerRun, resolve_trainer_auto

    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        return "not a ds_config", f"not JSON ({type(exc).__name__})"
    if not isinstance(config, dict) or not any(k in config for k in SECTIONS):
        return "not a ds_config", "no DeepSpeed section"
    auto = _has_auto(config)
    if auto:
        run = TrainerRun(nd=2, dtype=_dtype(config), hidden_size=1024, num_training_steps=100)  # type: ignore[arg-type]
        try:
            config = resolve_trainer_auto(config, run).config
        except ValueError as exc:
            return "refused by the resolver", str(exc)
    zero = config.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    offload = ""
    try:
        if stage == 0:
            from_deepspeed(config)
        else:
            s = Settings.from_ds_config(config)
            offload = "".join(f", {k} {t.device}" for k, t in (("offload_optimizer", s.offload_optimizer),
                                                              ("offload_param", s.offload_param)) if t.on)  # fmt: skip
    except ValueError as exc:
        return "refused by the engine", str(exc).splitlines()[0]
    return "read", ("auto resolved, " if auto else "") + f"stage {stage}{offload}"


def main(argv: list[str]) -> int:
    if not argv or any("=" not in a for a in argv):
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    table = []
    for arg in argv:
        label, folder = arg.split("=", 1)
        root = Path(folder)
        counts: Counter = Counter()
        autos = 0
        for path in sorted(root.rglob("*.json")):
            kind, detail = survey_file(path)
            counts[kind] += 1
            if kind != "not a ds_config":
                autos += _has_auto(json.loads(path.read_text()))
            print(f"{label}: {path.relative_to(root)}: {kind}: {detail}")
        files = sum(counts.values()) - counts["not a ds_config"]
        table.append((label, files, autos, counts["read"], counts["refused by the resolver"],
                      counts["refused by the engine"], counts["not a ds_config"]))  # fmt: skip
    print("\n| source | ds_configs | with \"auto\" | read | refused by the resolver | refused by the engine "
          "| other .json |\n|---|---|---|---|---|---|---|")
    for row in table:
        print("| " + " | ".join(str(v) for v in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
