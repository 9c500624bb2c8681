"""``--torchtitan-config`` (zeroplan.integrations.torchtitan_config) on torchtitan v0.2.2's own TOML job configs,
with the defaults checked against the installed torchtitan's dataclasses (the fields kept by 0.3.0)."""

import dataclasses
import json
from pathlib import Path

import pytest

from zeroplan.integrations.torchtitan_config import (PARALLELISM_DEFAULTS, TRAINING_DEFAULTS, TorchtitanRun,
                                                     read_torchtitan_config)

DATA = Path(__file__).parent / "data" / "integrations" / "torchtitan"


RECORDED = DATA / "dataclass_defaults_0.3.0.json"


def _torchtitan_defaults():
    """The installed torchtitan's defaults; without it, the copy recorded from torchtitan 0.3.0 (CI does not
    install torchtitan: it pulls datasets, wandb and tensorboard for two dataclasses). The copy was written by
    ``json.dump({cls: {f.name: f.default for f in dataclasses.fields(getattr(torchtitan.config, cls))}})``
    over TrainingConfig and ParallelismConfig (JSON-serialisable defaults only)."""
    try:
        config = __import__("torchtitan.config", fromlist=["TrainingConfig"])
    except ImportError:
        recorded = json.loads(RECORDED.read_text())
        return recorded["TrainingConfig"], recorded["ParallelismConfig"]
    return ({f.name: f.default for f in dataclasses.fields(config.TrainingConfig)},
            {f.name: f.default for f in dataclasses.fields(config.ParallelismConfig)})


def test_defaults_are_torchtitans_own():
    training, parallelism = _torchtitan_defaults()
    assert {k: training[k] for k in TRAINING_DEFAULTS} == TRAINING_DEFAULTS
    assert {k: parallelism[k] for k in PARALLELISM_DEFAULTS} == PARALLELISM_DEFAULTS


def test_the_recorded_copy_is_the_installed_torchtitans():
    config = pytest.importorskip("torchtitan.config")
    recorded = json.loads(RECORDED.read_text())
    for cls in ("TrainingConfig", "ParallelismConfig"):
        live = {f.name: f.default for f in dataclasses.fields(getattr(config, cls))}
        assert {k: live[k] for k in recorded[cls]} == recorded[cls]


@pytest.mark.parametrize("name, gpus, expected", [
    # (nd, local batch, grad accum, seq len, module, param, reduce dtype, reshard, AC mode, AC option)
    ("llama3_debug_model.toml", 8, (8, 8, 1, 2048, "fp32", "bf16", "fp32", True, "selective", "2")),
    ("llama3_8b.toml", 64, (64, 1, 1, 8192, "fp32", "bf16", "fp32", True, "selective", "op")),
    ("qwen3_32b.toml", 16, (16, 2, 1, 4096, "fp32", "bf16", "fp32", True, "full", None)),
])  # fmt: skip
def test_the_values_torchtitan_runs(name, gpus, expected):
    run = read_torchtitan_config(DATA / name, world_size=gpus)
    assert isinstance(run, TorchtitanRun)
    got = (run.nd, run.local_batch_size, run.grad_accum, run.seq_len, run.module_dtype, run.param_dtype,
           run.reduce_dtype, run.reshard_after_forward, run.checkpointing, run.selective_ac_option)
    assert got == expected
    assert run.init == "meta" and run.compile is False and run.converters == ()
    assert [(u.modules, u.reshard_after_forward) for u in run.wrapping] == [
        ("tok_embeddings", True), ("each block of layers", True), ("[norm, output]", False),
        ("the root (every parameter not in a unit above)", None)]


def test_options_change_what_is_read(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[training]\nlocal_batch_size = 2\nglobal_batch_size = 64\ndtype = "bfloat16"\n'
                    '[parallelism]\ndata_parallel_shard_degree = 4\nfsdp_reshard_after_forward = "always"\n'
                    '[activation_checkpoint]\nmode = "none"\n[model]\nconverters = ["float8"]\n[compile]\nenable = true\n')
    run = read_torchtitan_config(path)
    assert (run.nd, run.grad_accum, run.module_dtype, run.checkpointing) == (4, 8, "bf16", "none")
    assert [u.reshard_after_forward for u in run.wrapping] == [True, True, True, None]
    assert run.converters == ("float8",) and run.compile is True
    path.write_text('[parallelism]\nfsdp_reshard_after_forward = "never"\n')
    assert [u.reshard_after_forward for u in read_torchtitan_config(path, world_size=2).wrapping] == [False, False, False, None]


@pytest.mark.parametrize("text, gpus, message", [
    ("", None, "data_parallel_shard_degree=-1 takes the ranks left over"),
    ("[parallelism]\ndata_parallel_shard_degree = 3\n", 8, "3 x replicate 1 != 8 GPUs"),
    ("[parallelism]\ndata_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 1\n", 2, "no FSDP"),
    ("[parallelism]\ndata_parallel_shard_degree = 1\n", None, "no FSDP"),
    ("[training]\nlocal_batch_size = 3\nglobal_batch_size = 10\n", 2, "not a multiple"),
    ('[training]\nmixed_precision_reduce = "bfloat16"\n', 2, "mixed_precision_reduce='bfloat16'"),
    ('[activation_checkpoint]\nmode = "memory_budget"\n', 2, "memory_budget"),
    ("[training\n", 2, "not valid TOML"),
])  # fmt: skip
def test_refused_in_one_line(tmp_path, text, gpus, message):
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        read_torchtitan_config(path, world_size=gpus)
    assert "\n" not in str(info.value)


def test_tensor_parallel_presets_are_refused():
    with pytest.raises(ValueError, match="tensor_parallel_degree=8: zeroplan models one data-parallel dimension"):
        read_torchtitan_config(DATA / "llama3_70b.toml", world_size=256)


def test_a_job_config_is_the_fsdp2_engine_with_torchtitans_wrapping(tmp_path):
    # apply_fsdp: tok_embeddings and each block resharded, [norm, output] kept (policy "default"), the root; the
    # batch, sequence, accumulation and checkpointing are the file's; init meta (train.py)
    from clicheck import assert_one_line_error, run, run_json

    job = tmp_path / "job.toml"
    job.write_text('[training]\nlocal_batch_size = 2\nseq_len = 512\nglobal_batch_size = 32\n'
                   '[parallelism]\ndata_parallel_shard_degree = 8\n[activation_checkpoint]\nmode = "full"\n')
    model = ("--model", "llama2-7b")
    got = run_json("estimate", *model, "--torchtitan-config", str(job))
    assert got == run_json("estimate", *model, "--engine", "fsdp2", "--gpus", "8", "--fsdp-wrap", "torchtitan",
                           "--param-dtype", "bf16", "--reduce-dtype", "fp32", "--init", "meta", "--micro-batch", "2",
                           "--seq-len", "512", "--grad-accum", "2", "--checkpointing", "full")  # fmt: skip
    assert got["stages"][0]["name"] == "fully_shard reshard_after_forward=True, param bf16, reduce fp32, wrap torchtitan"
    assert_one_line_error(run("estimate", *model, "--torchtitan-config", str(job), "--micro-batch", "4"),
                          "--micro-batch 4 contradicts the torchtitan-config (2)")


def test_hsdp_is_the_fsdp2_engines_2d_mesh(tmp_path):
    # ParallelDims: shard -1 takes world / replicate; trainer.py: accumulation = global / (local x replicate x shard);
    # apply_fsdp on the ("dp_replicate", "dp_shard_cp") mesh: the FSDP2 engine's --dp-replicate (engines/fsdp2/mesh.py)
    from clicheck import run_json

    job = tmp_path / "job.toml"
    job.write_text('[training]\nlocal_batch_size = 2\nseq_len = 512\nglobal_batch_size = 64\n'
                   '[parallelism]\ndata_parallel_replicate_degree = 2\n[activation_checkpoint]\nmode = "full"\n')
    run = read_torchtitan_config(job, world_size=16)
    assert (run.nd, run.dp_replicate, run.grad_accum) == (16, 2, 2)
    model = ("--model", "llama2-7b")
    got = run_json("estimate", *model, "--torchtitan-config", str(job), "--gpus", "16")
    assert got == run_json("estimate", *model, "--engine", "fsdp2", "--gpus", "16", "--dp-replicate", "2",
                           "--fsdp-wrap", "torchtitan", "--param-dtype", "bf16", "--reduce-dtype", "fp32", "--init",
                           "meta", "--micro-batch", "2", "--seq-len", "512", "--grad-accum", "2", "--checkpointing",
                           "full")  # fmt: skip
    assert got["stages"][0]["name"].endswith("wrap torchtitan, HSDP mesh 2 x 8")
