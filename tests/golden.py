"""Golden outputs: a fixed set of `zeroplan` commands and what they printed when the files were made.

`tests/test_golden.py` reruns every command and compares its stdout with the stored file byte for byte
(JSON also parsed and compared exactly), so a refactoring that changes any printed number, key, order
or column fails. The stored files are never rewritten by the tests.

Regenerate only on purpose, when a change of output is intended and reviewed (say why in the commit):

    PYTHONPATH=$PWD python tests/golden.py --regenerate

then inspect `git diff tests/data/golden/` before committing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

GOLDEN = Path(__file__).parent / "data" / "golden"
INPUTS = GOLDEN / "inputs"
SHAPES = str(INPUTS / "shapes.json")
DS_CONFIG = str(INPUTS / "ds_config.json")
GPT2 = "gpt2-no-dropout.json"  # GPT-2's config.json with dropout 0 and exact GELU; relative: printed as given

# name -> argv after `zeroplan`. The extension of the stored file follows the output format.
COMMANDS: dict[str, list[str]] = {
    # estimate
    "estimate_params.json": ["estimate", "--params", "7.5e9", "--gpus", "64", "--json"],
    "estimate_params.txt": ["estimate", "--params", "7.5e9", "--gpus", "64"],
    "estimate_params.csv": ["estimate", "--params", "7.5e9", "--gpus", "64", "--csv"],
    "estimate_shapes.json": ["estimate", "--shapes", SHAPES, "--gpus", "6", "--json"],
    "estimate_shapes_mp.json": ["estimate", "--shapes", SHAPES, "--gpus", "12", "--model-parallel", "4", "--json"],
    "estimate_stage3_bf16.json": ["estimate", "--params", "1e9", "--gpus", "8", "--stage", "3",
                                  "--param-dtype", "bf16", "--json"],
    "estimate_fp32_sgd.json": ["estimate", "--params", "13B", "--gpus", "16", "--param-dtype", "fp32",
                               "--optimizer", "sgd", "--json"],
    "estimate_adam8bit_mp.json": ["estimate", "--params", "7B", "--gpus", "32", "--model-parallel", "4",
                                  "--optimizer", "adam8bit", "--gpu-memory", "80GiB", "--json"],
    "estimate_lion_fp32grads.json": ["estimate", "--params", "3.3B", "--gpus", "24", "--param-dtype", "bf16",
                                     "--grad-dtype", "fp32", "--optimizer", "lion", "--no-master-weights",
                                     "--json"],
    "estimate_deepspeed.json": ["estimate", "--params", "7B", "--gpus", "8", "--deepspeed-config", DS_CONFIG,
                                "--json"],
    "estimate_gib_fits.txt": ["estimate", "--params", "7.5B", "--gpus", "64", "--units", "GiB",
                              "--gpu-memory", "32GiB"],
    "estimate_stage1.csv": ["estimate", "--params", "1e9", "--gpus", "8", "--csv", "--stage", "1"],
    "estimate_model_llama.json": ["estimate", "--model", "llama2-7b", "--gpus", "8", "--json"],
    "estimate_model_llama.txt": ["estimate", "--model", "llama2-7b", "--gpus", "8", "--gpu-memory", "80GiB"],
    "estimate_model_gpt2_config.json": ["estimate", "--model", GPT2, "--gpus", "4", "--seq-len", "512",
                                        "--micro-batch", "2", "--checkpointing", "full", "--no-foreach", "--json"],
    "estimate_model_gpt2_config.txt": ["estimate", "--model", GPT2, "--gpus", "4", "--stage", "3"],
    # plan
    "plan_llama70b.json": ["plan", "--model", "llama2-70b", "--gpu", "h100-80gb", "--gpus", "64", "--json"],
    "plan_llama70b.txt": ["plan", "--model", "llama2-70b", "--gpu", "h100-80gb", "--gpus", "64"],
    "plan_params_offload.json": ["plan", "--params", "13B", "--gpu-memory", "40GiB", "--gpus", "4",
                                 "--offload", "cpu", "--host-memory", "1TB", "--json"],
    "plan_params_offload.txt": ["plan", "--params", "13B", "--gpu-memory", "40GiB", "--gpus", "4",
                                "--offload", "cpu", "--host-memory", "1TB"],
    "plan_no_model.json": ["plan", "--gpu-memory", "32GB", "--gpus", "64", "--headroom", "0", "--json"],
    "plan_no_model.txt": ["plan", "--gpu-memory", "32GB", "--gpus", "64", "--headroom", "0"],
    "plan_grad_accum.json": ["plan", "--model", "gpt2-xl", "--gpu", "a100-40gb", "--gpus", "16",
                             "--gpus-per-node", "4", "--micro-batch", "2", "--grad-accum", "8",
                             "--checkpointing", "selective", "--algorithm", "tree", "--json"],
    "plan_nothing_fits.json": ["plan", "--model", "llama3-405b", "--gpu", "a100-40gb", "--gpus", "8",
                               "--offload", "nvme", "--json"],
    "plan_nothing_fits.txt": ["plan", "--model", "llama3-405b", "--gpu", "a100-40gb", "--gpus", "8",
                              "--offload", "nvme"],
    "plan_mp_fp16.json": ["plan", "--model", "llama3-8b", "--gpu-memory", "24GB", "--gpus", "16",
                          "--model-parallel", "2", "--param-dtype", "fp16", "--bw", "100",
                          "--inter-bw", "25", "--peak-tflops", "300", "--mfu", "0.5", "--json"],
    "plan_model_gpt2_config.json": ["plan", "--model", GPT2, "--gpu", "a100-40gb", "--gpus", "4",
                                    "--checkpointing", "none", "--micro-batch", "8", "--json"],
    "plan_model_llama.txt": ["plan", "--model", "llama3-8b", "--gpu", "h100-80gb", "--gpus", "8",
                             "--checkpointing", "none"],
    # sweep
    "sweep_params.json": ["sweep", "--params", "7B,70B", "--gpus", "8,64", "--model-parallel", "1,8",
                          "--gpu-memory", "80GiB", "--json"],
    "sweep_params.csv": ["sweep", "--params", "7B,70B", "--gpus", "8,64", "--model-parallel", "1,8",
                         "--gpu-memory", "80GiB"],
    "sweep_model_offload.json": ["sweep", "--model", "llama2-7b", "--gpus", "1,8,16", "--stage", "1,2,3",
                                 "--offload", "none,cpu,cpu/cpu,nvme/nvme", "--micro-batch", "1,4",
                                 "--gpu", "h100-80gb", "--json"],
    "sweep_model_offload.csv": ["sweep", "--model", "llama2-7b", "--gpus", "1,8,16", "--stage", "1,2,3",
                                "--offload", "none,cpu,cpu/cpu,nvme/nvme", "--micro-batch", "1,4",
                                "--gpu", "h100-80gb"],
    "sweep_gpt_checkpointing.csv": ["sweep", "--model", "gpt2-xl", "--gpus", "4,8", "--model-parallel", "1,2",
                                    "--checkpointing", "none", "--seq-len", "512", "--micro-batch", "2"],
    "sweep_model_peak.csv": ["sweep", "--model", "llama2-7b", "--gpus", "8,64", "--stage", "1,2,3",
                             "--checkpointing", "none", "--micro-batch", "1,2", "--gpu", "h100-80gb"],
    "sweep_model_gpt2_config.json": ["sweep", "--model", GPT2, "--gpus", "2,4", "--seq-len", "1024",
                                     "--offload", "none,cpu", "--json"],
    "sweep_shapes.csv": ["sweep", "--shapes", SHAPES, "--gpus", "1,3,6", "--param-dtype", "bf16",
                         "--optimizer", "adam8bit"],
}


def run(argv: list[str]) -> str:
    """stdout of `zeroplan *argv`, in process; AssertionError if the command fails."""
    from typer.testing import CliRunner

    from zeroplan.cli import app

    here = os.getcwd()
    os.chdir(INPUTS)  # relative input paths (GPT2) are printed as given, so the outputs do not name a checkout
    try:
        result = CliRunner().invoke(app, argv)
    finally:
        os.chdir(here)
    assert result.exit_code == 0, f"zeroplan {' '.join(argv)}: exit {result.exit_code}\n{result.output}"
    return result.stdout


def regenerate() -> None:
    """Rewrite every stored output from the current tree (explicit only; see the module docstring)."""
    for name, argv in COMMANDS.items():
        (GOLDEN / name).write_text(run(argv))
        print(f"wrote {GOLDEN / name}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python tests/golden.py --regenerate   (rewrites tests/data/golden/; review the diff)")
    regenerate()
