"""DeepSpeed configs in DeepSpeed's own keys turn into the planner's stage and precision policy."""

import json

import pytest
from typer.testing import CliRunner

import zeroplan
from zeroplan.cli import app
from zeroplan.engines.deepspeed import from_deepspeed
from clicheck import assert_one_line_error

runner = CliRunner()


@pytest.mark.parametrize(
    "config, expected",
    [
        ({}, {"stage": 0, "param_dtype": "fp32"}),
        ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}}, {"stage": 1, "param_dtype": "fp16"}),
        (
            {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}},
            {"stage": 3, "param_dtype": "bf16", "optimizer": "adamw"},
        ),
        (
            {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, "optimizer": {"type": "Lamb"}},
            {"stage": 0, "param_dtype": "bf16", "grad_dtype": "fp32", "optimizer": "lamb"},
        ),
        (
            {"fp16": {"enabled": True}, "communication_data_type": "fp32",
             "optimizer": {"type": "SGD", "params": {"momentum": 0.9}}},
            {"stage": 0, "param_dtype": "fp16", "grad_dtype": "fp32", "optimizer": "sgd-momentum"},
        ),  # fmt: skip
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, {"stage": 0, "param_dtype": "fp32", "optimizer": "sgd"}),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}, {"stage": 2, "param_dtype": "fp32"}),
    ],
)
def test_deepspeed_keys(config, expected):
    assert from_deepspeed(config) == expected


@pytest.mark.parametrize(
    "config, message",
    [
        ([], "expected a JSON object"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4"),
        ({"zero_optimization": {"stage": True}}, "zero_optimization.stage=True"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true"),
        ({"bf16": {"enabled": "auto"}}, "'auto'"),
        ({"optimizer": {"type": "Adagrad"}}, "optimizer.type='Adagrad'"),
        ({"communication_data_type": "int4"}, "'int4'"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "zeroplan plan --engine reference --offload"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "offload_param.device='nvme'"),
        ({"zero_optimization": 3}, "'zero_optimization' must be an object"),
    ],
)
def test_bad_deepspeed_configs(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        from_deepspeed(config)


def test_cli_reads_deepspeed_config(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                                "optimizer": {"type": "AdamW"}, "train_micro_batch_size_per_gpu": 4}))  # fmt: skip
    r = runner.invoke(app, ["estimate", "--params", "7.5e9", "--gpus", "64", "--deepspeed-config", str(path), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [s["stage"] for s in doc["stages"]] == [3]
    assert doc["inputs"]["policy"]["param_dtype"] == "bf16" and doc["inputs"]["policy"]["optimizer"] == "adamw"
    expected = zeroplan.estimate(7.5e9, gpus=64, stage=3, param_dtype="bf16", optimizer="adamw")
    assert doc["stages"][0]["model_states_bytes"] == expected.stage(3).memory.model_states_bytes == 1_875_000_000


def test_cli_refuses_contradicting_options(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    r = runner.invoke(app, ["estimate", "--params", "1e9", "--deepspeed-config", str(path), "--stage", "3"])
    assert_one_line_error(r, "--stage contradicts the DeepSpeed config; drop one of them")
    # The same value on both sides is not a contradiction.
    r = runner.invoke(app, ["estimate", "--params", "1e9", "--deepspeed-config", str(path), "--stage", "2"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("content, message", [("{oops", "not valid JSON"), (None, "No such file")])
def test_cli_malformed_deepspeed_file(tmp_path, content, message):
    path = tmp_path / "ds_config.json"
    if content is not None:
        path.write_text(content)
    r = runner.invoke(app, ["estimate", "--params", "1e9", "--deepspeed-config", str(path)])
    assert_one_line_error(r, message)
