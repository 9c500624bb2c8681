"""``--hf-zero-init`` (``Settings.hf_zero3_build``): the planner's option for a transformers model built by
transformers under ZeRO-3 (an ``HfDeepSpeedConfig`` alive: its own ``zero.Init``, then ``initialize_weights_zero3``;
engines/deepspeed/build.py), refused where it does not apply, set by the HF Trainer's and accelerate's readers, and
the build snippet the plan prints (docs/engines/deepspeed.md "zero.Init under transformers")."""

import json
from pathlib import Path

import pytest
from clicheck import assert_one_line_error, run, run_json

import zeroplan.engines.deepspeed as D
from tests.test_deepspeed_zero_init import HF_BUFFERS, HF_BUILDS

HF = Path(__file__).parent / "data" / "hf_configs"
INTEGRATIONS = Path(__file__).parent / "data" / "integrations"
#: the measured rows' ds_config (validate/engines/deepspeed.py ``ds_config(3, dtype, micro_batch=1,
#: optimizer_params={"torch_adam": True})``), restated: the planner's tests import no validator
MEASURED_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                   "optimizer": {"type": "Adam", "params": {"lr": 0.001, "torch_adam": True}},
                   "zero_optimization": {"stage": 3}, "steps_per_print": 1_000_000_000}  # fmt: skip


def _config(dtype: str) -> dict:
    return {**MEASURED_CONFIG, **({"bf16": {"enabled": True}} if dtype == "bf16" else {})}


def _planner_run(name_or_path: str, config: dict, nd: int, **own):
    """The run the planner predicts for ``--model`` with the engine options ``own`` (the CLI's path after parsing:
    ``EstimateConfig`` -> ``planner_options`` -> the engine's ``planner_settings``), on the CPU accelerator."""
    from zeroplan.engines import get_engine
    from zeroplan.engines.base import EngineOptions
    from zeroplan.estimation.config import EstimateConfig

    cfg = EstimateConfig(model=str(name_or_path), seq_len=16, engine="deepspeed", gpus=nd, foreach=False,
                         engine_options=EngineOptions(ds_config=config, device="cpu", **own))  # fmt: skip
    settings = get_engine("deepspeed").planner_settings(cfg.planner_options)
    return D.ds_run(settings, cfg.workload, nd, stat_bytes=4)


def _build_peak(run) -> int:
    return max(m.total() for m in D.zero_init_moments(run))


MEASURED = [k for k in HF_BUILDS if k[0] != "draw 5-3"]  # the draw's model is a generated config, not a file


@pytest.mark.parametrize("key", MEASURED, ids=[f"{n}-{d}-nd{k}" for n, d, k in MEASURED])
def test_the_option_predicts_the_measured_transformers_build(key):
    """``hf_zero3_build`` given as the planner's option moves the build's peak by the bytes transformers gathers
    together (a module with its direct children): within the fp32 buffers of the measurement with it (0-64 B),
    ``before`` under without it (tiny-llama fp32: 30,944 B, its attention's four projections), as recorded."""
    name, dtype, nd = key
    measured, before = HF_BUILDS[key]
    config = _config(dtype)
    built = _build_peak(_planner_run(HF / f"{name}.json", config, nd, hf_zero3_build=True))
    assert 0 <= measured - built <= HF_BUFFERS, (measured, built)
    assert measured - _build_peak(_planner_run(HF / f"{name}.json", config, nd)) == before


#: a Llama whose MLP outweighs its embedding, at N_d = 64 with small buckets: the init phase's peak is the build
WIDE = {**json.loads((HF / "tiny-llama.json").read_text()), "vocab_size": 1024, "hidden_size": 1024,
        "intermediate_size": 4096, "num_attention_heads": 8, "num_key_value_heads": 8}  # fmt: skip
SMALL_BUCKETS = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5_000_000,
                                       "stage3_prefetch_bucket_size": 5_000_000}}  # fmt: skip


def test_the_option_moves_the_init_phase_of_estimate(tmp_path):
    """``estimate --hf-zero-init``: the init phase's peak is transformers' build (the MLP's three projections
    gathered at once: 3 x 4,194,304 fp32 elements), above the script's build; the default is the script's."""
    model, ds = tmp_path / "wide.json", tmp_path / "ds.json"
    model.write_text(json.dumps(WIDE))
    ds.write_text(json.dumps({**MEASURED_CONFIG, **SMALL_BUCKETS}))
    args = ("estimate", "--engine", "deepspeed", "--model", str(model), "--gpus", "64", "--seq-len", "16",
            "--device", "cpu", "--no-foreach", "--deepspeed-config", str(ds))  # fmt: skip
    init = {flag: run_json(*args, *flag)["stages"][0]["phases"]["init"] for flag in ((), ("--hf-zero-init",),
                                                                                     ("--no-hf-zero-init",))}
    config = {**MEASURED_CONFIG, **SMALL_BUCKETS}
    hf = _planner_run(model, config, 64, hf_zero3_build=True)
    gathered = [t for m in D.zero_init_moments(hf) for t in m.terms if "gathered" in t.name]
    assert max(t.bytes for t in gathered) == 3 * 1024 * 4096 * 4
    assert init[("--hf-zero-init",)] == _build_peak(hf) > init[()] == init[("--no-hf-zero-init",)]
    plain = _planner_run(model, config, 64)
    assert init[()] == max(m.total() for m in D.moments(plain) if m.phase == "init") > _build_peak(plain)


@pytest.mark.parametrize("args, message", [
    (("--stage", "2"), "at ZeRO-3 only, not stage 2"),
    (("--stage", "3", "--no-zero-init"), "it contradicts --no-zero-init"),
    (("--engine", "fsdp2"), "--hf-zero-init does not apply to --engine fsdp2"),
    (("--engine", "reference"), "--hf-zero-init does not apply to --engine reference"),
])  # fmt: skip
def test_refused_where_it_does_not_apply(args, message):
    base = ("--model", str(HF / "tiny-llama.json"), "--gpus", "2", "--hf-zero-init")
    if "--engine" not in args:
        args = ("--engine", "deepspeed", *args)
    assert_one_line_error(run("estimate", *base, *args), message)


def test_refused_without_a_model_and_below_zero3_in_sweep():
    assert_one_line_error(run("estimate", "--params", "7e9", "--engine", "deepspeed", "--stage", "3",
                              "--hf-zero-init"), "--hf-zero-init does not apply without --model")  # fmt: skip
    assert_one_line_error(run("sweep", "--model", str(HF / "tiny-llama.json"), "--engine", "deepspeed", "--gpus",
                              "2", "--stage", "2,3", "--hf-zero-init"), "at ZeRO-3 only, not stage 2")  # fmt: skip


def test_the_snippet_is_the_build_predicted():
    """Each build's snippet, and no line claiming the other build does the same."""
    script = D.build_snippet(D.Settings(stage=3))
    hf = D.build_snippet(D.Settings(stage=3, hf_zero3_build=True))
    assert "with deepspeed.zero.Init(config_dict_or_path='ds_config.json'):" in script
    assert "HfDeepSpeedConfig" not in script.replace("(HfDeepSpeedConfig, the HF Trainer)", "")
    assert "does the same" not in script + hf
    assert "dschf = HfDeepSpeedConfig('ds_config.json')" in hf and "deepspeed.zero.Init(" not in hf
    assert "AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MODEL), dtype=torch.float32)" in hf
    assert hf.index("HfDeepSpeedConfig(") < hf.index("from_config(") < hf.index("deepspeed.initialize(")
    assert D.build_snippet(D.Settings(stage=2)) is None
    with pytest.raises(ValueError, match="at ZeRO-3 only"):
        D.Settings(stage=3, zero_init=False, hf_zero3_build=True)


def test_plan_prints_the_transformers_build(tmp_path):
    """``plan --hf-zero-init``: the ZeRO-3 rows built by transformers (their build snippet), the ZeRO-1/2 rows
    built whole as without the option (the same peaks)."""
    from zeroplan.presets import get_model

    model, ds = tmp_path / "gpt2-xl.json", tmp_path / "ds.json"
    model.write_text(json.dumps({**get_model("gpt2-xl").hf_config, "attn_pdrop": 0, "embd_pdrop": 0,
                                 "resid_pdrop": 0}))  # fmt: skip
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                              "zero_optimization": {"stage": 3}}))  # fmt: skip
    args = ("plan", "--engine", "deepspeed", "--deepspeed-config", str(ds), "--model", str(model), "--gpus", "64",
            "--gpu-memory", "6GiB")  # fmt: skip
    hf, plain = run_json(*args, "--hf-zero-init"), run_json(*args)
    assert "dschf = HfDeepSpeedConfig('ds_config.json')" in hf["recommendation"]["deepspeed_build"]
    assert "with deepspeed.zero.Init(" in plain["recommendation"]["deepspeed_build"]
    peaks = [{o["label"]: o["peak_bytes"] for o in d["stages"] if not o["label"].startswith("ZeRO-3")}
             for d in (hf, plain)]  # fmt: skip
    assert peaks[0] == peaks[1] and peaks[0]


def test_the_readers_set_it_at_zero3(tmp_path):
    """An HF Trainer ds_config (``"auto"``) and an accelerate DeepSpeed config at ZeRO-3: transformers' build, as
    ``--hf-zero-init`` on the same file (one line says so); ``--no-hf-zero-init`` keeps the script's; a ZeRO-2
    file leaves it off."""
    model = tmp_path / "wide.json"
    model.write_text(json.dumps(WIDE))
    auto = json.loads((INTEGRATIONS / "ds_configs" / "accelerate_zero_stage3.json").read_text())
    auto["zero_optimization"].update(SMALL_BUCKETS["zero_optimization"])
    ds = tmp_path / "auto.json"
    ds.write_text(json.dumps(auto))
    args = ("estimate", "--engine", "deepspeed", "--model", str(model), "--gpus", "64", "--seq-len", "16",
            "--device", "cpu", "--deepspeed-config", str(ds))  # fmt: skip

    def init(*flags: str) -> int:
        return run_json(*args, *flags)["stages"][0]["phases"]["init"]

    assert init() == init("--hf-zero-init") != init("--no-hf-zero-init")
    assert "build: transformers' own under ZeRO-3 (--hf-zero-init), as the HF Trainer's" in run(*args).stdout
    assert "build:" not in run(*args, "--no-hf-zero-init").stdout
    accelerate = ("estimate", "--model", str(model), "--seq-len", "16", "--accelerate-config")
    table = run(*accelerate, str(INTEGRATIONS / "accelerate" / "deepspeed_fields.yaml")).stdout
    assert "build: transformers' own under ZeRO-3 (--hf-zero-init), as accelerate's DeepSpeedPlugin" in table
    assert "build:" not in run(*accelerate, str(INTEGRATIONS / "accelerate" / "deepspeed_stage2.yaml")).stdout


def test_accelerate_reads_the_engine_options_typed_beside_it(tmp_path):
    """``--accelerate-config`` (DEEPSPEED, ZeRO-3) with ``--device cpu``: the numbers of ``--deepspeed-config`` given
    the ds_config accelerate prepares, with the same options and transformers' build (before, the typed options
    were dropped: a cuda prediction)."""
    from zeroplan.integrations.accelerate_config import prepare_deepspeed, read_accelerate_config

    yaml_file = INTEGRATIONS / "accelerate" / "deepspeed_fields.yaml"
    model = ("--model", str(HF / "tiny-llama.json"), "--seq-len", "16")
    plain = tmp_path / "ds.json"
    plain.write_text(json.dumps(prepare_deepspeed(read_accelerate_config(yaml_file), 1, hidden_size=48).config))
    given = ("estimate", "--engine", "deepspeed", "--gpus", "4", *model, "--deepspeed-config", str(plain))
    for typed in (("--device", "cpu"), ("--no-hf-zero-init",), ("--device", "cpu", "--no-zero-init")):
        got = run_json("estimate", *model, "--accelerate-config", str(yaml_file), *typed)
        hf = () if {"--no-hf-zero-init", "--no-zero-init"} & set(typed) else ("--hf-zero-init",)
        assert got == run_json(*given, *typed, *hf), typed
    assert run_json("estimate", *model, "--accelerate-config", str(yaml_file), "--device", "cpu") != run_json(
        "estimate", *model, "--accelerate-config", str(yaml_file))


def test_plan_rows_below_zero3_build_whole_whatever_the_options():
    """``--zero-init`` / ``--hf-zero-init`` set the ZeRO-3 rows' build only (build.py ``at_stage``): the ZeRO-1/2
    offload rows stay (before, ``Settings``' ZeRO-3-only check dropped them from a plan with ``--zero-init``)."""
    from zeroplan.engines.deepspeed.plan import offload_candidates, plain_candidates

    for own in ({"zero_init": True}, {"hf_zero3_build": True}):
        base = D.Settings(stage=3).model_copy(update=own)
        rows = offload_candidates(base)
        assert [s.stage for _, s in rows] == [1, 2, 3, 3], own
        for _, s in (*rows, *plain_candidates(base)):
            assert s.builds_partitioned == (s.stage == 3) and s.hf_zero3_build == (s.stage == 3 and "hf_zero3_build" in own)
