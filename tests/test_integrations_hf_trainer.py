"""``"auto"`` in a ds_config resolved as the HF Trainer does (zeroplan.integrations.hf_trainer), compared
key by key with transformers' own ``HfTrainerDeepSpeedConfig`` and accelerate's ``DeepSpeedPlugin`` run on
the same file and the same arguments (skipped without transformers, accelerate and DeepSpeed)."""

import dataclasses
import importlib.util
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from zeroplan.integrations.hf_trainer import TRAINER_DEFAULTS, TrainerRun, resolve_trainer_auto

DATA = Path(__file__).parent / "data" / "integrations" / "ds_configs"
FILES = sorted(p.name for p in DATA.glob("*.json") if p.name != "SOURCES.json")


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


@pytest.fixture
def hf(monkeypatch):
    """transformers' and accelerate's classes, with no ``ACCELERATE_*`` variable set (a plain launch)."""
    pytest.importorskip("deepspeed")
    for key in list(os.environ):
        if key.startswith("ACCELERATE_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    yield SimpleNamespace(config=HfTrainerDeepSpeedConfig, plugin=DeepSpeedPlugin)
    unset_hf_deepspeed_config()


def real_resolution(hf, config: dict, run: TrainerRun) -> dict:
    """The same file through the real code, in a Trainer run's order: ``TrainingArguments.__post_init__``
    (trainer_config_process, then DeepSpeedPlugin), AcceleratorState (set_mixed_precision), deepspeed_init
    (trainer_config_finalize, deepspeed_optim_sched), Accelerator._prepare_deepspeed (its config_kwargs)."""
    values = {name: run.arg(name)[0] for name in TRAINER_DEFAULTS}
    warmup = values["warmup_steps"]
    args = SimpleNamespace(**values, world_size=run.nd, save_on_each_node=False, fp16_full_eval=False,
                           bf16_full_eval=False, get_warmup_steps=lambda n: int(warmup) if warmup >= 1 else math.ceil(n * warmup))
    args.fp16, args.bf16 = run.dtype == "fp16", run.dtype == "bf16"
    ds = hf.config(config)
    ds.trainer_config_process(args)
    plugin = hf.plugin(hf_ds_config=ds)
    plugin.set_mixed_precision(run.mixed_precision)
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=run.hidden_size))
    ds.trainer_config_finalize(args, model, run.num_training_steps or 1)  # no scheduler section where None
    if "optimizer" not in ds.config:
        ds.config["zero_allow_untested_optimizer"] = True
    h = run.hidden_size
    kwargs = {"gradient_clipping": 1.0, "zero_optimization.stage3_gather_16bit_weights_on_model_save": False}
    if h is not None:  # _prepare_deepspeed reads model.config.hidden_size only when a key needs it
        kwargs.update({"zero_optimization.reduce_bucket_size": h * h, "zero_optimization.stage3_prefetch_bucket_size":
                       int(0.9 * h * h), "zero_optimization.stage3_param_persistence_threshold": 10 * h})  # fmt: skip
    plugin.deepspeed_config_process(must_match=False, **kwargs)
    out = dict(plugin.deepspeed_config)
    out.pop("steps_per_print")  # accelerate sets it to inf (logging); zeroplan keeps the file's
    return out


BF16_4096 = TrainerRun(nd=4, micro_batch=2, grad_accum=3, dtype="bf16", hidden_size=4096, num_training_steps=1000)
FP16_ARGS = TrainerRun(nd=2, micro_batch=1, dtype="fp16", hidden_size=1023, num_training_steps=7, warmup_steps=0.1,
                       learning_rate=3e-4, adam_beta2=0.95, weight_decay=0.1, max_grad_norm=0.5)
FP16_577 = TrainerRun(nd=8, micro_batch=4, dtype="fp16", hidden_size=577, num_training_steps=50, warmup_steps=5)
CASES = [  # (file, run, None: resolved | the start of the real code's refusal, matched by zeroplan's one line)
    ("transformers_zero2.json", BF16_4096, None),
    ("transformers_zero2.json", FP16_ARGS, None),
    ("transformers_zero3_bf16.json", FP16_577, ("not found in kwargs", "bfloat16.enabled='auto'")),
    ("accelerate_zero_stage3.json", FP16_577, None),
    ("accelerate_zero_stage3.json", BF16_4096, ("`--mixed_precision` arg cannot be set to `bf16`", "fp16.enabled is true")),
    ("accelerate_zero_stage1.json", FP16_ARGS, None),
    ("accelerate_sp_alst.json", TrainerRun(nd=4, micro_batch=2, dtype="bf16"), None),
    ("accelerate_sp_alst.json", TrainerRun(nd=2, micro_batch=3, dtype="bf16"), None),
    # a plain file: the real Trainer checks every plain value against its arguments, so they are all stated
    ("deepspeed_torch_compile_z3.json", TrainerRun(nd=8, micro_batch=1, grad_accum=1, dtype="bf16", learning_rate=1e-3,
                                                   adam_beta1=0.8, weight_decay=3e-7, warmup_steps=1000,
                                                   num_training_steps=5000), None),
    ("deepspeed_torch_compile_z3.json", TrainerRun(nd=4, micro_batch=1, grad_accum=1, dtype="bf16"),
     ("Please correct the following DeepSpeed config values", "train_batch_size=8 vs")),
]


def test_the_cases_cover_every_file():
    assert sorted({name for name, _, _ in CASES}) == FILES


@pytest.mark.parametrize("name, run, refusal", CASES, ids=[f"{n[:-5]}-{i}" for i, (n, _, _) in enumerate(CASES)])
def test_every_key_as_the_trainer_resolves_it(hf, name, run, refusal):
    config = load(name)
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal[0]):
            real_resolution(hf, config, run)
        with pytest.raises(ValueError, match=refusal[1]):
            resolve_trainer_auto(config, run)
        return
    expected = real_resolution(hf, config, run)
    got = resolve_trainer_auto(config, run).config
    got.pop("steps_per_print", None)
    assert got == expected
    assert "auto" not in json.dumps(got)


def test_the_numbers_the_brief_names():
    """hidden² / int(0.9·hidden²) / 10·hidden, the batch from N_d, and the record of what was "auto"."""
    run = TrainerRun(nd=4, micro_batch=2, dtype="bf16", hidden_size=4091, num_training_steps=100)
    res = resolve_trainer_auto(load("accelerate_zero_stage3.json") | {"fp16": {"enabled": "auto"}}, run)
    zero = res.config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 4091**2 == 16_736_281
    assert zero["stage3_prefetch_bucket_size"] == 15_062_652  # 0.9 * 16736281 = 15062652.9: int() truncates
    assert zero["stage3_param_persistence_threshold"] == 40_910
    assert (res.config["train_micro_batch_size_per_gpu"], res.config["train_batch_size"]) == (2, 8)
    assert res.config["bf16"] == {"enabled": True} and res.config["fp16"]["enabled"] is False
    filled = {f.key: f.value for f in res.filled}
    assert filled["train_batch_size"] == 8 and filled["optimizer.params.lr"] == 5e-5
    assert "trainer_config_finalize" in next(f.source for f in res.filled if f.key == "zero_optimization.reduce_bucket_size")
    assert res.unresolved == ()


def test_zero2_fills_only_the_bucket_and_zero3_keys_stay_when_not_stage3():
    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}, "train_micro_batch_size_per_gpu": "auto"}
    res = resolve_trainer_auto(config, TrainerRun(nd=2, hidden_size=64))
    assert res.config["zero_optimization"]["reduce_bucket_size"] == 4096
    assert res.config["train_micro_batch_size_per_gpu"] == 8  # TrainingArguments.per_device_train_batch_size


def test_refusals_are_one_line():
    with pytest.raises(ValueError, match="reduce_bucket_size='auto'.*hidden_size"):
        resolve_trainer_auto({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}, TrainerRun())
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu=4 vs per_device_train_batch_size=2"):
        resolve_trainer_auto({"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 4}, TrainerRun(micro_batch=2))
    with pytest.raises(ValueError, match="no zero_optimization section"):
        resolve_trainer_auto({"train_batch_size": "auto"}, TrainerRun())
    with pytest.raises(ValueError, match="bfloat16.enabled='auto'"):
        resolve_trainer_auto(load("transformers_zero3_bf16.json"), TrainerRun(hidden_size=8, dtype="bf16"))
    with pytest.raises(ValueError, match="fp16.enabled is true and the run's mixed precision is bf16"):
        resolve_trainer_auto(load("accelerate_zero_stage1.json"), TrainerRun(hidden_size=8, dtype="bf16"))


def test_scheduler_steps_unknown_before_train_are_left_and_said():
    res = resolve_trainer_auto(load("transformers_zero2.json"), TrainerRun(hidden_size=8, dtype="fp16"))
    assert res.config["scheduler"]["params"]["warmup_num_steps"] == "auto"
    assert [k for k, _ in res.unresolved] == ["scheduler.params.warmup_num_steps"]


def test_plain_values_not_stated_stand():
    config = load("deepspeed_torch_compile_z3.json")
    res = resolve_trainer_auto(config, TrainerRun(nd=8))
    assert res.config["train_batch_size"] == 8 and res.config["optimizer"] == config["optimizer"]


def test_trainer_defaults_are_transformers_own():
    # read from transformers 5.24.0 and checked against the version installed (pyproject: transformers>=5.24; CI
    # installed 5.25.0 on 2026-12-03, whose defaults are the same): a release that changes one fails here
    transformers = pytest.importorskip("transformers")
    fields = {f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)}
    assert {k: fields[k] for k in TRAINER_DEFAULTS} == TRAINER_DEFAULTS
    assert tuple(map(int, transformers.__version__.split(".")[:2])) >= (5, 24)


def test_estimate_reads_a_trainer_config_and_says_what_auto_became(tmp_path):
    """``estimate --deepspeed-config`` of a file with "auto": the numbers of the same run given the resolved
    plain file, and the table's lines saying which keys were "auto" and what they became."""
    from clicheck import assert_one_line_error, run, run_json

    auto = str(DATA / "accelerate_zero_stage3.json")
    plain = tmp_path / "plain.json"
    resolved = resolve_trainer_auto(load("accelerate_zero_stage3.json"), TrainerRun(nd=8, micro_batch=2, hidden_size=4096))
    plain.write_text(json.dumps(resolved.config))
    common = ("--model", "llama2-7b", "--engine", "deepspeed", "--gpus", "8", "--micro-batch", "2")
    got, expected = run_json("estimate", *common, "--deepspeed-config", auto), run_json("estimate", *common, "--deepspeed-config", str(plain))
    records, still_auto = got["inputs"].pop("ds_config_auto"), expected["inputs"].pop("ds_config_auto")
    assert got == expected
    assert still_auto == records[-2:] and [r["value"] for r in still_auto] == ["auto", "auto"]  # the step counts
    assert [r["key"] for r in records] == [f.key for f in resolved.filled] + [k for k, _ in resolved.unresolved]
    table = run("estimate", *common, "--deepspeed-config", auto).stdout
    assert "zero_optimization.stage3_prefetch_bucket_size               = 15099494  (HfTrainerDeepSpeedConfig." \
           "trainer_config_finalize (hidden_size 4096, ZeRO-3))" in table
    assert "train_batch_size                                            = 16  " in table
    assert_one_line_error(run("estimate", "--params", "7B", "--engine", "deepspeed", "--deepspeed-config", auto),
                          "reduce_bucket_size='auto': the HF Trainer fills it from the model's hidden_size")


@pytest.mark.parametrize(
    "sections",
    [  # DeepSpeed 0.19.8 runtime/precision_config.py get_bfloat16_config: "bf16" whenever present and not null
        {"bf16": {"enabled": False}, "bfloat16": {"enabled": True}},
        {"bf16": {"enabled": True}, "bfloat16": {"enabled": False}},
        {"bf16": {}, "bfloat16": {"enabled": True}},
        {"bfloat16": {"enabled": True}},
        {},
    ],
)
def test_bf16_and_bfloat16_sections_as_deepspeed_reads_them(sections):
    from zeroplan.engines.deepspeed.config import from_deepspeed

    config = {"zero_optimization": {"stage": 1}, **sections}
    if importlib.util.find_spec("deepspeed") is not None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.runtime.precision_config import get_bfloat16_config

        expected = "bf16" if get_bfloat16_config(config).enabled else "fp32"
    else:  # the same table, recorded from DeepSpeed 0.19.8
        expected = "fp32" if sections in ({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}},
                                          {"bf16": {}, "bfloat16": {"enabled": True}}, {}) else "bf16"
    assert from_deepspeed(config)["param_dtype"] == expected


@pytest.mark.parametrize("engine", ["deepspeed", "reference"])
def test_mixed_precision_fills_auto_precision_on_either_engine(engine, tmp_path):
    """``--mixed-precision bf16`` is the Trainer's ``--bf16``: the file's ``bf16.enabled: "auto"`` becomes true, and
    the numbers are those of the resolved file given plain; ``--engine reference`` reads "auto" the same way."""
    from clicheck import assert_one_line_error, run, run_json

    auto = load("transformers_zero2.json")  # fp16 and bf16 "auto", optimizer and scheduler "auto"
    del auto["zero_optimization"]["offload_optimizer"]  # estimate models GPU-resident states
    auto_path = tmp_path / "auto.json"
    auto_path.write_text(json.dumps(auto))
    resolved = resolve_trainer_auto(auto, TrainerRun(nd=8, micro_batch=1, grad_accum=1, hidden_size=4096, dtype="bf16"))
    assert resolved.config["bf16"]["enabled"] is True and resolved.config["fp16"]["enabled"] is False
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(resolved.config))
    common = ("--model", "llama2-7b", "--engine", engine, "--gpus", "8", "--stage", "2")[: 6 if engine == "deepspeed" else 8]
    got = run_json("estimate", *common, "--deepspeed-config", str(auto_path), "--mixed-precision", "bf16")
    expected = run_json("estimate", *common, "--deepspeed-config", str(plain))
    filled = {r["key"]: r["value"] for r in got["inputs"].pop("ds_config_auto") if r["reason"] is None}
    assert (filled["bf16.enabled"], filled["fp16.enabled"]) == (True, False)
    expected["inputs"].pop("ds_config_auto")  # the scheduler's step count stays "auto" in the plain file
    assert got == expected
    assert got["inputs"]["policy"]["param_dtype"] == "bf16"  # without --mixed-precision: fp32 (the Trainer's default)
    table = run("estimate", *common, "--deepspeed-config", str(auto_path), "--mixed-precision", "bf16").stdout
    assert "bf16.enabled" in table and "= True  (HfTrainerDeepSpeedConfig.trainer_config_process)" in table
    assert_one_line_error(run("estimate", *common, "--mixed-precision", "bf16"), "--mixed-precision fills the \"auto\"")


def test_json_documents_say_what_each_auto_key_became(tmp_path):
    """``inputs.ds_config_auto`` of ``estimate --json`` and ``plan --json``: each "auto" of transformers' own
    ZeRO-2 example (tests/data/integrations/ds_configs/SOURCES.json) with the value the Trainer gives it for this
    run (hidden_size 4096 of llama2-7b; N_d 8; micro-batch 2; --mixed-precision fp16) and the function that
    decided it; the step count stays "auto" with its reason."""
    from clicheck import run_json

    config = load("transformers_zero2.json")
    del config["zero_optimization"]["offload_optimizer"]  # estimate models GPU-resident states
    config["zero_optimization"]["reduce_bucket_size"] = "auto"  # 2e8 in the file; "auto" as in its ZeRO-3 example
    path = tmp_path / "zero2.json"
    path.write_text(json.dumps(config))
    common = ("--model", "llama2-7b", "--engine", "deepspeed", "--gpus", "8", "--micro-batch", "2",
              "--deepspeed-config", str(path), "--mixed-precision", "fp16")
    estimate = run_json("estimate", *common)["inputs"]["ds_config_auto"]
    plan = run_json("plan", *common, "--gpu", "h100-80gb")["inputs"]["ds_config_auto"]
    assert plan == estimate
    by_key = {r["key"]: r for r in estimate}
    trainer = "transformers integrations/deepspeed.py HfTrainerDeepSpeedConfig."
    assert by_key["zero_optimization.reduce_bucket_size"] == {
        "key": "zero_optimization.reduce_bucket_size", "value": 4096**2, "reason": None,
        "source": trainer + "trainer_config_finalize (hidden_size 4096)"}
    assert (by_key["train_micro_batch_size_per_gpu"]["value"], by_key["train_batch_size"]["value"]) == (2, 16)
    assert (by_key["fp16.enabled"]["value"], by_key["bf16.enabled"]["value"]) == (True, False)
    assert by_key["optimizer.params.lr"]["value"] == 5e-5 and by_key["optimizer.params.betas"]["value"] == [0.9, 0.999]
    assert by_key["fp16.enabled"]["source"] == trainer + "trainer_config_process"
    left = [r for r in estimate if r["reason"] is not None]
    assert [(r["key"], r["value"], r["source"]) for r in left] == [("scheduler.params.warmup_num_steps", "auto", None)]
    assert "training steps" in left[0]["reason"]
    assert "auto" not in json.dumps([r["value"] for r in estimate if r["reason"] is None])
