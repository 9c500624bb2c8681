"""How long the worst case at the size bounds takes (docs/limits.md, "Architecture dimensions").

Every architecture dimension is bounded before any work (``zeroplan.types.DIMENSION_LIMITS``); of them only
the layer count changes how much work a command does (widths, vocabulary and positions enter closed-form
counts). This times ``zeroplan.estimate``, ``zeroplan.plan`` and ``zeroplan.sweep`` (one configuration) for
each engine on a Llama-layout config.json with ``MAX_LAYERS`` layers (and, for the trend, fewer), in
process, as CPU seconds of this process (``time.process_time``: what a loaded machine does not inflate)
and wall seconds. Run: python benchmarks/size_bounds.py [LAYERS ...]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import zeroplan
from zeroplan.types import MAX_LAYERS

ENGINES = ("reference", "fsdp2", "deepspeed")


def config_file(folder: Path, layers: int) -> Path:
    """A small-width Llama config with ``layers`` decoder layers (widths do not change the work)."""
    path = folder / f"llama-{layers}.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 32000, "hidden_size": 256,
                                "num_hidden_layers": layers, "num_attention_heads": 4,
                                "intermediate_size": 512}))  # fmt: skip
    return path


def calls(model: str, engine: str) -> dict:
    """The three Python entry points for ``engine``: the same questions the CLI asks."""
    stage = {"stage": 3} if engine == "deepspeed" else {}
    stages = {"stages": (3,)} if engine == "deepspeed" else {}
    return {
        "estimate": lambda: zeroplan.estimate(model=model, gpus=8, engine=engine, **stage),
        "plan": lambda: zeroplan.plan(model=model, gpus=8, gpu="h100-80gb", engine=engine),
        "sweep": lambda: zeroplan.sweep(model=model, gpus=(8,), engine=engine, **stages),
    }


def timed(call) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    call()
    return time.process_time() - cpu, time.perf_counter() - wall


def main(layer_counts: list[int]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        print("| layers | engine | estimate cpu s (wall) | plan cpu s (wall) | sweep, 1 config, cpu s (wall) |")
        print("|---|---|---|---|---|")
        for layers in layer_counts:
            model = str(config_file(Path(folder), layers))
            for engine in ENGINES:
                cells = [f"{c:.1f} ({w:.1f})" for c, w in (timed(f) for f in calls(model, engine).values())]
                print(f"| {layers} | {engine} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [MAX_LAYERS // 4, MAX_LAYERS // 2, MAX_LAYERS])
