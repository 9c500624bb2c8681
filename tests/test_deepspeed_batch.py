"""The batch a ds_config trains (``zeroplan.engines.deepspeed.ds_batch``): DeepSpeed derives
``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps`` from whichever of them and
``train_batch_size`` the file gives (``runtime/config.py`` ``_set_batch_related_parameters``,
``_batch_assertion``). Activations scale with the micro-batch and accumulation keeps gradients between
micro-steps, so the file's batch is the run's: estimate, plan, sweep and validate take it, and a command
line that says otherwise is refused rather than guessed between."""

from __future__ import annotations

import json
import types

import pytest
from clicheck import assert_one_line_error, run, run_json

from zeroplan.engines.deepspeed import DsBatch, ds_batch

STAGE2 = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}

# (batch keys, N_d) -> (micro-batch, accumulation): every branch of _set_batch_related_parameters
DERIVED = [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 8, (2, 4)),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}, 8, (2, 4)),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 8, (4, 2)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 8, (3, 5)),
    ({"train_batch_size": 64}, 8, (8, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, 8, (3, 1)),
]
REFUSED = [  # DeepSpeed's asserts, refused here before any work
    ({"train_batch_size": 60, "train_micro_batch_size_per_gpu": 2}, 8, "train_batch_size=60 is not"),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 8,
     "2 x 2 x 8"),
    ({"train_batch_size": 4}, 8, "= 0 x 1 x 8"),
    ({"gradient_accumulation_steps": 4}, 8, "without train_batch_size or train_micro_batch_size_per_gpu"),
    ({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2}, 8, "without train_batch_size"),
    ({"train_micro_batch_size_per_gpu": 2.0}, 8, "must be a whole number >= 1"),
    ({"train_micro_batch_size_per_gpu": True}, 8, "must be a whole number >= 1"),
    ({"gradient_accumulation_steps": 0, "train_micro_batch_size_per_gpu": 1}, 8, "must be a whole number >= 1"),
    ({"train_micro_batch_size_per_gpu": 2**16 + 1}, 8, "must be at most 65536"),
    ({"train_batch_size": 64}, None, "fixes the micro-batch for one N_d only"),
]


@pytest.mark.parametrize("keys, nd, expected", DERIVED)
def test_derived_as_deepspeed_derives(keys, nd, expected):
    assert ds_batch({**STAGE2, **keys}, nd) == DsBatch(*expected)


@pytest.mark.parametrize("keys, nd, expected", DERIVED)
def test_deepspeeds_own_rule_agrees(keys, nd, expected):
    """The same files through DeepSpeed's own code (its two methods run on a stand-in holding the keys)."""
    config = pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed is an optional extra")
    held = types.SimpleNamespace(world_size=nd, train_batch_size=keys.get("train_batch_size"),
                                 train_micro_batch_size_per_gpu=keys.get("train_micro_batch_size_per_gpu"),
                                 gradient_accumulation_steps=keys.get("gradient_accumulation_steps"))  # fmt: skip
    config.DeepSpeedConfig._set_batch_related_parameters(held)
    config.DeepSpeedConfig._batch_assertion(held)
    assert (held.train_micro_batch_size_per_gpu, held.gradient_accumulation_steps) == expected


@pytest.mark.parametrize("keys, nd, message", REFUSED)
def test_refused_in_one_line(keys, nd, message):
    with pytest.raises(ValueError, match=None) as err:
        ds_batch({**STAGE2, **keys}, nd)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_no_batch_key_leaves_the_command_lines():
    """Neither a file without batch keys nor one whose keys are "auto" (the HF Trainer fills those from its own
    arguments; here the command line is those arguments) fixes the batch."""
    assert ds_batch(STAGE2, 8) is None
    auto = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    assert ds_batch({**STAGE2, **auto}, 8) is None


@pytest.fixture
def ds_file(tmp_path):
    def write(**keys) -> str:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({**STAGE2, **keys}))
        return str(path)

    return write


def _peak(*args: str) -> tuple[int, int, int]:
    out = run_json("estimate", "--engine", "deepspeed", "--model", "llama2-7b", "--gpus", "8", *args)
    step = out["inputs"]["step"]
    return out["stages"][0]["peak_bytes"], step["micro_batch"], step["grad_accum"]


def test_estimate_runs_the_files_batch(ds_file):
    """train_batch_size 64 at 8 GPUs with 2 sequences a micro-step is 4 micro-steps: the peak is the one
    of --micro-batch 2 --grad-accum 4, and far from the command line's default (1, 1)."""
    from_file = _peak("--deepspeed-config", ds_file(train_batch_size=64, train_micro_batch_size_per_gpu=2))
    plain = ds_file()
    assert from_file == _peak("--deepspeed-config", plain, "--micro-batch", "2", "--grad-accum", "4")
    assert from_file[1:] == (2, 4) and from_file[0] > _peak("--deepspeed-config", plain)[0]
    # the command line may repeat the file, not contradict it
    assert from_file == _peak("--deepspeed-config", ds_file(train_batch_size=64, train_micro_batch_size_per_gpu=2),
                              "--micro-batch", "2")  # fmt: skip


@pytest.mark.parametrize("command", [
    ("estimate", "--gpus", "8", "--micro-batch", "3"),
    ("plan", "--gpus", "8", "--gpu", "h100-80gb", "--grad-accum", "2"),
    ("sweep", "--gpus", "8", "--micro-batch", "3"),
])  # fmt: skip
def test_a_command_line_that_contradicts_the_file_is_refused(ds_file, command):
    name, *rest = command
    result = run(name, "--engine", "deepspeed", "--model", "llama2-7b", *rest,
                 "--deepspeed-config", ds_file(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4))  # fmt: skip
    assert_one_line_error(result, "contradicts the DeepSpeed config, whose")


def test_plan_emits_the_files_batch(ds_file):
    out = run_json("plan", "--engine", "deepspeed", "--model", "llama2-7b", "--gpus", "8", "--gpu", "h100-80gb",
                   "--deepspeed-config", ds_file(train_batch_size=64, gradient_accumulation_steps=2))  # fmt: skip
    emitted = out["recommendation"]["deepspeed"]
    assert (emitted["train_micro_batch_size_per_gpu"], emitted["gradient_accumulation_steps"]) == (4, 2)


def test_sweep_takes_a_micro_batch_and_refuses_what_it_cannot_model(ds_file):
    rows = run_json("sweep", "--engine", "deepspeed", "--model", "llama2-7b", "--gpus", "8,16",
                    "--deepspeed-config", ds_file(train_micro_batch_size_per_gpu=3))["rows"]  # fmt: skip
    assert {r["micro_batch"] for r in rows} == {3} and {r["gpus"] for r in rows} == {8, 16}
    varied = run("sweep", "--engine", "deepspeed", "--model", "llama2-7b", "--gpus", "8,16",
                 "--deepspeed-config", ds_file(train_batch_size=64))  # fmt: skip
    assert_one_line_error(varied, "fixes the micro-batch for one N_d only")
    accum = run("sweep", "--engine", "deepspeed", "--model", "llama2-7b", "--gpus", "8",
                "--deepspeed-config", ds_file(train_batch_size=64, gradient_accumulation_steps=2))  # fmt: skip
    assert_one_line_error(accum, "accumulates 2 micro-steps per step and a sweep row is one")
    several = run("sweep", "--engine", "deepspeed", "--model", "llama2-7b", "--gpus", "8", "--micro-batch", "1,2",
                  "--deepspeed-config", ds_file(train_micro_batch_size_per_gpu=3))  # fmt: skip
    assert_one_line_error(several, "--micro-batch lists several values and the DeepSpeed config sets the batch")
    # a file without batch keys keeps the command line's list
    rows = run_json("sweep", "--engine", "deepspeed", "--model", "llama2-7b", "--gpus", "8", "--micro-batch", "1,2",
                    "--deepspeed-config", ds_file())["rows"]  # fmt: skip
    assert sorted(r["micro_batch"] for r in rows) == [1, 2]


def test_validate_checks_the_batch_before_any_rank_starts(ds_file):
    pytest.importorskip("torch")
    # without DeepSpeed the CLI's first answer is "--engine deepspeed needs DeepSpeed" (one line, exit 2)
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra")
    path = ds_file(train_batch_size=8)
    assert_one_line_error(run("validate", "--engine", "deepspeed", "--deepspeed-config", path, "--micro-batch", "2"),
                          "--micro-batch does not apply with a DeepSpeed config that sets the batch")  # fmt: skip
    assert_one_line_error(run("validate", "--engine", "deepspeed", "--deepspeed-config", path, "--world-size", "3"),
                          "2 x 1 x 3")  # fmt: skip


def test_validate_trains_the_batch_deepspeed_derives():
    """The config the ranks get spells out the derived batch, so DeepSpeed, the runner's micro-steps and the
    prediction all agree (validate/engines/deepspeed.py run_configs)."""
    from validate.config import ValidateConfig
    from validate.engines.deepspeed import run_configs

    given = {**STAGE2, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}
    config = ValidateConfig(engine="deepspeed", deepspeed_config=given, world_sizes=(2, 4))
    assert [(c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"]) for nd in (2, 4)
            for c in run_configs(config, nd)] == [(2, 4), (2, 2)]  # fmt: skip
    plain = ValidateConfig(engine="deepspeed", deepspeed_config=STAGE2, batch_per_rank=3)
    assert run_configs(plain, 2)[0]["train_micro_batch_size_per_gpu"] == 3


def test_the_python_api_runs_the_files_batch_too():
    """zeroplan.estimate / zeroplan.plan with ``ds_config=`` follow the same rule (``run_batch``): the
    notebooks' path, where a silent micro-batch of 1 would be the same wrong number."""
    import zeroplan

    ds = {**STAGE2, "train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}
    est = zeroplan.estimate(model="llama2-7b", gpus=8, engine="deepspeed", ds_config=ds)
    same = zeroplan.estimate(model="llama2-7b", gpus=8, engine="deepspeed", ds_config=STAGE2, micro_batch=2,
                             grad_accum=4)  # fmt: skip
    assert (est.workload.micro_batch, est.workload.grad_accum) == (2, 4)
    assert est.stages[0].peak.peak_bytes == same.stages[0].peak.peak_bytes
    with pytest.raises(ValueError, match="micro_batch 3 contradicts the DeepSpeed config"):
        zeroplan.estimate(model="llama2-7b", gpus=8, engine="deepspeed", ds_config=ds, micro_batch=3)
    rows = zeroplan.sweep(gpus=[8, 16], model="llama2-7b", engine="deepspeed",
                          ds_config={**STAGE2, "train_micro_batch_size_per_gpu": 2})  # fmt: skip
    assert list(rows["micro_batch"]) == [2, 2]
    with pytest.raises(ValueError, match="accumulates 4 micro-steps per step and a sweep row is one"):
        zeroplan.sweep(gpus=[8], model="llama2-7b", engine="deepspeed", ds_config=ds)
    plan = zeroplan.plan("llama2-7b", gpu="h100-80gb", gpus=8, engine="deepspeed", ds_config=ds)
    emitted = plan.launchers["deepspeed"]
    assert (emitted["train_micro_batch_size_per_gpu"], emitted["gradient_accumulation_steps"]) == (2, 4)
