"""The real-engine profiles in the planner commands (issues 10 and 11): `estimate`, `plan` and `sweep` with
`--engine fsdp2` and `--engine deepspeed` print what `zeroplan.engines.fsdp2` / `.deepspeed` predict, in
each engine's own vocabulary, and refuse options that do not apply in one line.

Expected values come from the engine modules (the plumbing must not change a number) and, for model
states, from the engines' partition rules written out by hand here. Pure math: no torch, tiny models.
"""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from clicheck import assert_one_line_error, run, run_json, runner

import zeroplan
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.cli import app
from zeroplan.engines import deepspeed, fsdp2, get_engine
from zeroplan.engines.base import EngineOptions, PlannerOptions
from zeroplan.estimation.workload import model_workload
from zeroplan.presets import resolve_model

DATA = Path(__file__).parent / "data"
GPT2 = str(DATA / "golden" / "inputs" / "gpt2-no-dropout.json")  # 124M, dropout 0
TINY = str(DATA / "hf_configs" / "tiny-gpt2.json")  # 2 layers, d = 36, 16 positions
DS_CONFIG = str(DATA / "golden" / "inputs" / "ds_config.json")  # ZeRO-2, bf16, fp32 grad accumulation


def workload(model: str, seq_len: int, micro_batch: int = 1, checkpointing: str = "none", foreach: bool = True):
    return model_workload(resolve_model(model), seq_len, micro_batch, checkpointing, 1, foreach)


def assert_row_is(out: dict, row, nd: int = 8) -> None:
    """One `stages[]` entry of `estimate --json` is exactly the engine's row, its collectives placed on the
    mesh of N_d ranks, 8 GPUs per node (``on_mesh``: group size and link class)."""
    from zeroplan.formulas.collectives import on_mesh

    assert out["stage"] == row.stage and out["name"] == row.label
    assert (out["params_bytes"], out["grads_bytes"], out["optimizer_bytes"]) == (
        row.memory.params_bytes, row.memory.grads_bytes, row.memory.optimizer_bytes)  # fmt: skip
    assert out["model_states_bytes"] == row.model_states_bytes
    assert out["collectives"] == [c.as_dict() for c in on_mesh(row.collectives, nd)]
    assert {(c["mesh_dim"], c["link"]) for c in out["collectives"]} <= {("dp_shard", "intra")}  # 8 GPUs: one node
    if row.peak is None:
        assert (out["peak_bytes"], out["phases"]) == (None, None)
    else:
        assert out["peak_bytes"] == row.peak.peak_bytes and out["phases"] == row.peak.by_phase()
        assert out["peak_phase"] == row.peak.peak_phase


# ---- estimate ----


@pytest.mark.parametrize(
    ("args", "settings"),
    [
        ([], fsdp2.Settings()),
        (["--reshard-after-forward", "false", "--param-dtype", "bf16"],
         fsdp2.Settings(reshard_after_forward=False, param_dtype="bf16")),
        (["--reshard-after-forward", "2", "--param-dtype", "bf16", "--reduce-dtype", "fp32"],
         fsdp2.Settings(reshard_after_forward=2, param_dtype="bf16", reduce_dtype="fp32")),
    ],
)  # fmt: skip
def test_estimate_fsdp2_json_is_the_engine_row(args, settings):
    d = run_json("estimate", "--engine", "fsdp2", "--model", GPT2, "--gpus", "8", *args)
    (row,) = fsdp2.estimate(workload(GPT2, 1024), 8, settings)
    assert d["inputs"]["engine"] == "fsdp2" and len(d["stages"]) == 1
    assert_row_is(d["stages"][0], row)
    assert d["inputs"]["step"]["block_bytes"] == 512  # fully_shard on CUDA: 512-byte blocks
    assert "own_estimator_bytes" not in d["stages"][0]  # FSDP2 has no estimator of its own


def test_fsdp2_model_states_by_hand_padded_fp32_shards_and_adam_on_the_local_shard():
    """fp32 module: params and grads = 4 B x the dim-0 padded shard (ceil(d0/N_d) rows per rank); Adam's m and v
    = 8 B x rank 0's local shard (zeros_like of the DTensor), its step 4 B per tensor."""
    nd = 8
    shapes = [s for _, s in transformer_shapes(resolve_model(GPT2))]
    padded = sum(-(-s[0] // nd) * math.prod(s[1:]) for s in shapes)
    local0 = sum(min(-(-s[0] // nd), s[0]) * math.prod(s[1:]) for s in shapes)
    d = run_json("estimate", "--engine", "fsdp2", "--model", GPT2, "--gpus", str(nd))
    out = d["stages"][0]
    assert out["params_bytes"] == 4 * padded and out["grads_bytes"] == 4 * padded
    assert out["optimizer_bytes"] == 8 * local0 + 4 * len(shapes)
    assert d["bytes_per_param"] == {"fp32 params": 4, "fp32 grads": 4, "fp32 Adam m": 4, "fp32 Adam v": 4}
    # GPT-2's 50257-row embedding: ceil(50257/8) = 6283 rows per rank, 0.875 rows x 768 more than its 1/8;
    # every other dim 0 (768, 1024, 2304, 3072) divides by 8
    assert padded - 124439808 / 8 == 0.875 * 768


def test_estimate_deepspeed_json_is_the_engine_row_with_deepspeeds_own_estimator_beside_it():
    d = run_json("estimate", "--engine", "deepspeed", "--deepspeed-config", DS_CONFIG, "--model", GPT2, "--gpus", "8")
    config = json.loads(Path(DS_CONFIG).read_text())
    settings = deepspeed.Settings.from_ds_config(config).model_copy(update={"device": "cuda"})  # the planner's GPU
    assert (settings.stage, settings.dtype, settings.grad_dtype) == (2, "bf16", "fp32")
    # the file's train_micro_batch_size_per_gpu (4) is the run's (engines/deepspeed/batch.py ds_batch)
    (row,) = deepspeed.estimate(workload(GPT2, 1024, micro_batch=config["train_micro_batch_size_per_gpu"]), 8, settings)
    assert d["inputs"]["engine"] == "deepspeed" and len(d["stages"]) == 1
    assert d["inputs"]["step"]["micro_batch"] == 4
    assert_row_is(d["stages"][0], row)
    psi = sum(math.prod(s) for _, s in transformer_shapes(resolve_model(GPT2)))
    assert d["stages"][0]["own_estimator_bytes"] == 2 * psi + int(18 * psi / 8)  # estimate_zero2_model_states_mem_needs
    text = run("estimate", "--engine", "deepspeed", "--deepspeed-config", DS_CONFIG, "--model", GPT2, "--gpus", "8")
    assert "DeepSpeed's estimator" in text.stdout and "0.529 GB" in text.stdout  # 528,869,184 B


def test_deepspeed_model_states_by_hand_zero3_partitions():
    """ZeRO-3, bf16, one tensor of Ψ (no architecture): a partition of ceil(Ψ/N_d) elements in bf16 (params),
    bf16 gradient partition plus the reduce bucket, fp32 master, m and v (12 B) plus the optimizer's scalars:
    inf/nan tracker (bool), FusedAdam's overflow buffer (int32), the fp64 gradient norm."""
    psi, nd, bucket = 7 * 10**9, 8, 10**6
    ds = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "reduce_bucket_size": bucket}}
    e = zeroplan.estimate(psi, nd, engine="deepspeed", ds_config=ds)
    (row,) = e.stages
    part = -(-psi // nd)
    assert row.memory.params_bytes == 2 * part
    assert row.memory.grads_bytes == 2 * part + 2 * bucket
    assert row.memory.optimizer_bytes == 12 * part + 1 + 4 + 8
    assert row.peak is None and row.collectives  # no architecture: no peak, but states and traffic
    assert row.own_estimate_bytes == 4 * psi + int(18 * psi / nd)  # estimate_zero3: 4 x largest layer + 18Ψ/N_d


def test_without_an_architecture_both_engines_give_model_states_and_collectives_but_no_peak():
    for args in (["--engine", "fsdp2"], ["--engine", "deepspeed", "--stage", "2"]):
        d = run_json("estimate", "--params", "1e9", "--gpus", "8", *args)
        (out,) = d["stages"]
        assert out["model_states_bytes"] > 0 and out["collectives"] and out["peak_bytes"] is None
        assert d["inputs"]["step"] is None
    (row,) = fsdp2.estimate(zeroplan.estimation.estimate.workload_of(
        zeroplan.EstimateConfig(params=10**9, gpus=8, engine="fsdp2")), 8, fsdp2.Settings())  # fmt: skip
    assert run_json("estimate", "--params", "1e9", "--gpus", "8", "--engine", "fsdp2")["stages"][0][
        "model_states_bytes"] == row.model_states_bytes  # fmt: skip


def test_reference_engine_still_reads_a_ds_config_into_its_policy():
    d = run_json("estimate", "--params", "7B", "--gpus", "8", "--deepspeed-config", DS_CONFIG)
    assert d["inputs"]["engine"] == "reference" and [s["stage"] for s in d["stages"]] == [2]
    assert d["inputs"]["policy"]["grad_dtype"] == "fp32" and "own_estimator_bytes" not in d["stages"][0]


def test_python_api_takes_each_engines_vocabulary():
    e = zeroplan.estimate(model=TINY, gpus=4, engine="fsdp2", reshard_after_forward=2, param_dtype="bf16")
    (row,) = fsdp2.estimate(workload(TINY, 16), 4, fsdp2.Settings(reshard_after_forward=2, param_dtype="bf16"))
    assert e.stages[0].peak == row.peak and e.stages[0].memory == row.memory
    with pytest.raises(ValueError, match="reshard_after_forward does not apply to engine 'reference'"):
        zeroplan.estimate(model=TINY, gpus=4, reshard_after_forward=True)
    with pytest.raises(ValueError, match="a precision policy .* does not apply to engine 'fsdp2'"):
        zeroplan.estimate(model=TINY, gpus=4, engine="fsdp2", grad_dtype="fp32")


def test_estimate_with_the_real_engines_imports_no_torch_pandas_matplotlib():
    for extra in (["--engine", "fsdp2"], ["--engine", "deepspeed", "--deepspeed-config", DS_CONFIG]):
        code = (
            "import sys\n"
            "from zeroplan.cli import main\n"
            f"sys.argv = ['zeroplan', 'estimate', '--model', {GPT2!r}, '--gpus', '8', '--json', *{extra!r}]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'pandas', 'matplotlib') if m in sys.modules), file=sys.stderr)\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert json.loads(out.stdout)["inputs"]["engine"] == extra[1]
        assert out.stderr.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "fsdp9"], "unknown engine 'fsdp9'"),
        (["--engine", "fsdp2", "--reshard-after-forward", "3"], "reshard_after_forward=3: must divide N_d=8"),
        (["--engine", "fsdp2", "--reshard-after-forward", "16"], "reshard_after_forward=16: must divide N_d=8"),
        (["--engine", "fsdp2", "--reshard-after-forward", "yes"], "reshard-after-forward='yes'"),
        (["--engine", "fsdp2", "--reshard-after-forward", "0"], "reshard-after-forward='0'"),
        (["--reshard-after-forward", "true"], "--reshard-after-forward does not apply to --engine reference"),
        (["--engine", "deepspeed", "--stage", "2", "--reshard-after-forward", "true"],
         "--reshard-after-forward does not apply to --engine deepspeed"),
        (["--engine", "fsdp2", "--grad-dtype", "fp32"], "--grad-dtype does not apply to --engine fsdp2"),
        (["--engine", "fsdp2", "--master-weights"], "--master-weights does not apply to --engine fsdp2"),
        (["--engine", "fsdp2", "--optimizer-dtype", "bf16"], "--optimizer-dtype does not apply to --engine fsdp2"),
        (["--engine", "fsdp2", "--stage", "3"], "--stage does not apply to --engine fsdp2"),
        (["--engine", "fsdp2", "--deepspeed-config", DS_CONFIG], "--deepspeed-config does not apply to --engine fsdp2"),
        (["--engine", "deepspeed", "--stage", "2", "--param-dtype", "bf16"],
         "--param-dtype does not apply to --engine deepspeed"),
        (["--engine", "deepspeed", "--reduce-dtype", "bf16"], "--reduce-dtype does not apply to --engine deepspeed"),
        (["--engine", "deepspeed"], "needs the ZeRO stage: give --stage or zero_optimization.stage"),
        (["--engine", "deepspeed", "--stage", "0"], "zero_optimization.stage=0: the DeepSpeed profile covers 1-3"),
        (["--engine", "deepspeed", "--deepspeed-config", DS_CONFIG, "--stage", "3"],
         "--stage 3 contradicts zero_optimization.stage=2"),
        (["--engine", "fsdp2", "--param-dtype", "fp8"], "param_dtype"),
    ],
)  # fmt: skip
def test_bad_engine_options_are_one_line_exit_2(args, message):
    assert_one_line_error(run("estimate", "--model", TINY, "--gpus", "8", *args), message)


def test_a_malformed_ds_config_is_one_line(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}}))
    assert_one_line_error(run("estimate", "--model", TINY, "--engine", "deepspeed", "--deepspeed-config", str(bad)),
                          "deepspeed config: zero_optimization.reduce_bucket_size='big'")  # fmt: skip
    bad.write_text("{not json")
    assert_one_line_error(run("estimate", "--model", TINY, "--engine", "deepspeed", "--deepspeed-config", str(bad)),
                          "not valid JSON")  # fmt: skip


# ---- plan: the engine's search by predicted peak, and exactly the configuration predicted ----

_DTYPE = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def parse_snippet(snippet: str) -> tuple[fsdp2.Settings, str]:
    """The ``fully_shard`` settings and checkpointing a snippet runs, read back from its code."""
    policy = re.search(r"MixedPrecisionPolicy\(param_dtype=(\S+), reduce_dtype=(\S+)\)", snippet)
    reshard = re.search(r"fully_shard\(block, mp_policy=policy, reshard_after_forward=(\w+)\)", snippet).group(1)
    foreach = re.search(r"torch\.optim\.Adam\(model\.parameters\(\), foreach=(\w+)\)", snippet).group(1)
    settings = fsdp2.Settings(
        reshard_after_forward={"True": True, "False": False}.get(reshard, None) if not reshard.isdigit() else int(reshard),
        param_dtype=_DTYPE[policy.group(1)], reduce_dtype=_DTYPE[policy.group(2)], foreach={"True": True, "False": False}[foreach],
    )  # fmt: skip
    return settings, "full" if "checkpoint_wrapper(block)" in snippet else "none"


def _fsdp2_peaks(nd: int) -> dict:
    w = workload(TINY, 16)
    settings = fsdp2.Settings(param_dtype="bf16", foreach=True)
    return {(o.settings.reshard_after_forward, o.checkpointing): o.estimate.peak.peak_bytes
            for o in fsdp2.plan_options(w, nd, 10**12, settings)}  # fmt: skip


def _fsdp2_reserved(nd: int) -> dict:
    """{candidate: reserved bytes} (the candidate's allocation trace replayed: zeroplan.allocator.reserved)."""
    from dataclasses import replace

    from zeroplan.allocator.reserved import reserved_of
    from zeroplan.engines.fsdp2.alloc_trace import alloc_traces

    w = workload(TINY, 16)
    settings = fsdp2.Settings(param_dtype="bf16", foreach=True)
    return {(o.settings.reshard_after_forward, o.checkpointing):
            reserved_of(alloc_traces(replace(w, checkpointing=o.checkpointing), nd, o.settings)[0]).reserved_bytes
            for o in fsdp2.plan_options(w, nd, 10**12, settings)}  # fmt: skip


def test_plan_fsdp2_recommends_by_reserved_bytes_and_its_snippet_predicts_the_same_peak():
    peaks, reserved = _fsdp2_peaks(2), _fsdp2_reserved(2)
    # gpt-tiny: two 32 MiB cuBLAS workspaces and a few small segments, whatever the candidate
    assert all(peaks[k] < reserved[k] for k in fsdp2.CANDIDATES)
    w = workload(TINY, 16)
    for memory in (reserved[(False, "none")], min(reserved.values()) - 1):
        d = run_json("plan", "--engine", "fsdp2", "--model", TINY, "--gpus", "2", "--gpu-memory", f"{memory}B",
                     "--replay-all")  # every row's reserved bytes (by default: up to the first that fits)
        assert [o["label"] for o in d["stages"]] == [f"reshard_after_forward={r}, checkpointing {c}"
                                                     for r, c in fsdp2.CANDIDATES] and d["offload"] == []  # fmt: skip
        assert [o["reserved_bytes"] for o in d["stages"]] == [reserved[k] for k in fsdp2.CANDIDATES]
        assert [o["fits"] for o in d["stages"]] == [reserved[k] <= memory for k in fsdp2.CANDIDATES]
        fitting = [k for k in fsdp2.CANDIDATES if reserved[k] <= memory]
        if not fitting:  # every peak of live bytes fits, no reserved one: fragmentation is what does not fit
            assert d["recommendation"] is None and d["fragmentation"].startswith(
                "reshard_after_forward=False, checkpointing none: its live bytes fit")
            continue
        options = {(o.settings.reshard_after_forward, o.checkpointing): o
                   for o in fsdp2.plan_options(w, 2, memory, fsdp2.Settings(param_dtype="bf16", foreach=True))}  # fmt: skip
        chosen = options[fitting[0]]  # the cheapest whose reserved bytes fit
        rec = d["recommendation"]
        assert rec["deepspeed"] is None and rec["fsdp2"] == chosen.snippet and d["fragmentation"] is None
        by_label = {o["label"]: o for o in d["stages"]}
        assert by_label[rec["label"]]["peak_bytes"] == chosen.estimate.peak.peak_bytes
        assert chosen.estimate.peak.peak_bytes <= by_label[rec["label"]]["reserved_bytes"] <= memory
        settings, ckpt = parse_snippet(rec["fsdp2"])  # the snippet, read back, is the configuration predicted
        (again,) = fsdp2.estimate(workload(TINY, 16, checkpointing=ckpt), 2, settings)
        assert again.peak.peak_bytes == by_label[rec["label"]]["peak_bytes"] == chosen.estimate.peak.peak_bytes


@pytest.mark.parametrize("nd,policy", [(2, {}), (3, {}), (2, {"reduce_dtype": "fp32"}), (3, {"param_dtype": None})])
def test_plan_fsdp2_every_snippet_read_back_estimates_the_same_bytes(nd, policy):
    # each snippet names reduce_dtype, where the planned settings may leave it None (the param dtype): torch
    # 2.13 clamps a reduce_dtype equal to param_dtype to None (_fsdp_param.py:FSDPParam.init_dtype_attrs), so
    # both are one run and must estimate to the same bytes (the 13,824 B once seen here at N_d 2 came from
    # plan_options dropping Workload.transformers, not from the dtype); N_d 3 pads gpt-tiny's shards
    from dataclasses import replace

    from zeroplan.allocator.reserved import reserved_of
    from zeroplan.engines.fsdp2.alloc_trace import alloc_traces

    w = workload(TINY, 16)
    options = fsdp2.plan_options(w, nd, 10**12, fsdp2.Settings(**{"param_dtype": "bf16", "foreach": True, **policy}))
    assert [(o.settings.reshard_after_forward, o.checkpointing) for o in options] == list(fsdp2.CANDIDATES)
    for o in options:
        settings, ckpt = parse_snippet(o.snippet)
        assert ckpt == o.checkpointing and settings.reduce == o.settings.reduce and settings.param == o.settings.param
        assert "reduce_dtype" in settings.model_fields_set and o.settings.reduce_dtype == policy.get("reduce_dtype")
        w_ckpt = replace(w, checkpointing=ckpt)
        (again,) = fsdp2.estimate(w_ckpt, nd, settings)
        assert again.peak.by_phase() == o.estimate.peak.by_phase() and again.peak_rank == o.estimate.peak_rank
        assert again.model_states_bytes == o.estimate.model_states_bytes and again.collectives == o.estimate.collectives
        planned = reserved_of(alloc_traces(w_ckpt, nd, o.settings)[0]).reserved_bytes
        assert reserved_of(alloc_traces(w_ckpt, nd, settings)[0]).reserved_bytes == planned


def test_plan_counts_each_engine_collective_once_per_optimizer_step():
    # the engines' collectives count one optimizer step already (EngineEstimate.collectives): DeepSpeed's
    # ZeRO-3 gathers and reduce-scatters in both micro-steps of --grad-accum 2, which the plan multiplied by 2
    # again before (llama2-7b on 8 GPUs: 269 GB sent per rank per step instead of 135 GB)
    d = run_json("plan", "--engine", "deepspeed", "--model", TINY, "--gpus", "4", "--grad-accum", "2",
                 "--gpu-memory", "80GiB")  # fmt: skip
    w = model_workload(resolve_model(TINY), 16, 1, "none", 2, False)
    tried = {t.label: t for t in deepspeed.ranked(w, 4, deepspeed.Settings.from_ds_config({}, 1))}
    sent = [o["comm_bytes_per_rank"] for o in d["stages"]]
    assert sent == [tried[o["label"]].sent_bytes for o in d["stages"]] == sorted(sent)  # the order is the column's
    for o in d["stages"]:
        est = tried[o["label"]].estimate
        assert o["comm_bytes_per_rank"] == sum(c.bytes_per_rank for c in est.collectives)
        calls = [c["calls_per_step"] for c in o["comm_time"]["collectives"]]
        assert calls == [c.micro_steps for c in est.collectives] and set(calls) <= {1, 2}
    # ZeRO-3 with every parameter gathered (none persistent): both micro-steps' gathers and reduce-scatters
    s3 = deepspeed.Settings.from_ds_config({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    (two,) = deepspeed.estimate(w, 4, s3)
    (one,) = deepspeed.estimate(model_workload(resolve_model(TINY), 16, 1, "none", 1, False), 4, s3)
    per_micro_step = [c for c in two.collectives if c.phase != "optimizer step"]
    assert [(c.op, c.phase, c.micro_steps) for c in per_micro_step] == [
        ("all-gather", "forward", 2), ("reduce-scatter", "backward", 2)]  # fmt: skip
    assert [c.bytes_per_rank for c in per_micro_step] == [2 * c.bytes_per_rank for c in one.collectives[:2]]


def test_plan_deepspeed_recommends_stage_and_buckets_and_its_ds_config_predicts_the_same_peak(tmp_path):
    w = workload(TINY, 16, checkpointing="full")
    base = deepspeed.Settings.from_ds_config({"bf16": {"enabled": True}}, 1).model_copy(update={"device": "cuda"})
    top = deepspeed.recommend(w, 4, 10**15, base)
    # everything fits a huge GPU: the first of the plan's order (fewest bytes sent per step: ZeRO-3 here)
    assert top.settings == deepspeed.ranked(w, 4, base)[0].settings and top.settings.stage == 3
    memory = top.estimate.peak.peak_bytes - 1  # the first candidate no longer fits
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    d = run_json("plan", "--engine", "deepspeed", "--deepspeed-config", str(cfg), "--model", TINY, "--gpus", "4",
                 "--gpu-memory", f"{memory}B", "--headroom", "0")  # fmt: skip
    chosen = deepspeed.recommend(w, 4, memory, base)
    assert chosen is not None
    rec = d["recommendation"]
    assert rec["fsdp2"] is None and rec["deepspeed"] == chosen.ds_config
    # ZeRO-1/2/3 and ZeRO-3 without prefetch at each bucket; the offload rows (offload_optimizer at ZeRO-1/2/3,
    # + offload_param at 3) only where nothing fits without them or the file asks for offload
    assert len(d["stages"]) == 4 * len(deepspeed.BUCKET_CHOICES) and d["offload"] == []
    assert len(d["stages"]) + 4 == len(deepspeed.candidates(base))
    # the emitted ds_config, read back, is the configuration whose peak was predicted
    settings = deepspeed.Settings.from_ds_config(rec["deepspeed"]).model_copy(update={"device": "cuda"})
    assert settings == chosen.settings
    (again,) = deepspeed.estimate(w, 4, settings)
    picked = next(o for o in d["stages"] if o["label"] == rec["label"])
    assert again.peak.peak_bytes == picked["peak_bytes"] == chosen.estimate.peak.peak_bytes <= memory


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "fsdp2", "--checkpointing", "none"], "--checkpointing does not apply to plan --engine fsdp2"),
        (["--engine", "fsdp2", "--grad-dtype", "fp32"], "--grad-dtype does not apply to --engine fsdp2"),
        (["--engine", "deepspeed", "--param-dtype", "bf16"], "--param-dtype does not apply to --engine deepspeed"),
        (["--engine", "deepspeed", "--offload", "cpu"], "got offload='cpu'"),
        (["--engine", "fsdp2", "--model-parallel", "2"], "got model_parallel=2"),
        (["--deepspeed-config", DS_CONFIG], "--deepspeed-config does not apply to plan --engine reference"),
    ],
)  # fmt: skip
def test_plan_refuses_what_an_engine_plan_cannot_honour(args, message):
    assert_one_line_error(run("plan", "--model", TINY, "--gpu", "h100-80gb", "--gpus", "4", *args), message)


# ---- sweep ----


def test_sweep_fsdp2_rows_are_estimate_rows():
    frame = zeroplan.sweep(gpus=[2, 4], model=TINY, micro_batch=[1, 3], checkpointing="none", engine="fsdp2",
                           reshard_after_forward=False, gpu_memory_bytes=10**6)  # fmt: skip
    assert len(frame) == 4 and set(frame["offload"]) == {"none"}
    for _, r in frame.iterrows():
        e = zeroplan.estimate(model=TINY, gpus=int(r["gpus"]), micro_batch=int(r["micro_batch"]), engine="fsdp2",
                              reshard_after_forward=False, gpu_memory_bytes=10**6)  # fmt: skip
        (s,) = e.stages
        assert (r["stage"], r["name"], r["model_states_bytes"]) == (s.stage, s.name, s.memory.model_states_bytes)
        assert (r["peak_bytes"], r["peak_phase"], r["comm_bytes_per_rank"]) == (
            s.peak.peak_bytes, s.peak.peak_phase, s.comm_bytes_per_rank)  # fmt: skip
        assert r["reduction_vs_dp"] == pytest.approx(s.reduction_vs_dp) and bool(r["peak_fits"]) == s.fits


def test_sweep_deepspeed_one_row_per_stage_given():
    ds = json.loads(Path(DS_CONFIG).read_text())
    ds["zero_optimization"].pop("stage")
    frame = zeroplan.sweep(gpus=[4], model=TINY, checkpointing="none", engine="deepspeed", stages=[1, 3], ds_config=ds)
    assert list(frame["stage"]) == [1, 3]
    for _, r in frame.iterrows():
        (s,) = zeroplan.estimate(model=TINY, gpus=4, engine="deepspeed", stage=int(r["stage"]), ds_config=ds).stages
        assert (r["model_states_bytes"], r["peak_bytes"]) == (s.memory.model_states_bytes, s.peak.peak_bytes)


def test_sweep_cli_engine_json_and_refusals():
    out = runner.invoke(app, ["sweep", "--model", TINY, "--gpus", "2", "--engine", "fsdp2", "--json"])
    assert out.exit_code == 0, out.output
    d = json.loads(out.stdout)
    assert d["inputs"]["engine"] == "fsdp2" and d["inputs"]["policy"]["param_dtype"] == "fp32"
    assert len(d["rows"]) == 1 and d["rows"][0]["collectives"].startswith("3 x all-gather(forward)")
    assert_one_line_error(run("sweep", "--model", TINY, "--engine", "fsdp2", "--stage", "3"),
                          "--stage does not apply to --engine fsdp2")  # fmt: skip
    assert_one_line_error(run("sweep", "--model", TINY, "--engine", "fsdp2", "--offload", "cpu", "--stage", "2"),
                          "--stage does not apply")  # fmt: skip
    assert_one_line_error(run("sweep", "--model", TINY, "--engine", "fsdp2", "--offload", "cpu"), "got offload=")
    assert_one_line_error(run("sweep", "--params", "1e9", "--engine", "fsdp2"), "--engine does not apply")


def test_planner_options_are_data_per_engine():
    """Each engine's planner_settings reads only its vocabulary; the registry says which it is."""
    assert fsdp2.planner_settings(PlannerOptions(reshard_after_forward=4, param_dtype="bfloat16")) == fsdp2.Settings(
        reshard_after_forward=4, param_dtype="bf16")  # fmt: skip
    ds = deepspeed.planner_settings(PlannerOptions(ds_config={"zero_optimization": {"stage": 3}}))
    assert ds == deepspeed.Settings(stage=3, device="cuda")  # a planner predicts the GPU (plan.on_device)
    assert get_engine("fsdp2").one_row and get_engine("deepspeed").one_row and not get_engine("reference").one_row
    assert hash(EngineOptions(ds_config={"a": [1]})) == hash(EngineOptions(ds_config={"a": [1]}))


def test_plan_python_api_routes_engine_keywords_and_refuses_a_policy_the_engine_does_not_read():
    p = zeroplan.plan(TINY, gpu="h100-80gb", gpus=2, engine="fsdp2", param_dtype="fp32")
    rec = fsdp2.recommend(workload(TINY, 16), 2, p.budget_bytes, fsdp2.Settings(param_dtype="fp32", foreach=True))
    assert p.recommendation.label.startswith(f"reshard_after_forward={rec.settings.reshard_after_forward},")
    assert p.launchers == {"deepspeed": None, "fsdp2": rec.snippet}
    with pytest.raises(ValueError, match="a precision policy .* does not apply to engine 'deepspeed'"):
        zeroplan.plan(TINY, gpu="h100-80gb", engine="deepspeed", policy=zeroplan.PrecisionPolicy(param_dtype="fp32"))


def test_plan_python_api_refuses_what_the_engine_chooses():
    with pytest.raises(ValueError, match="checkpointing does not apply to plan --engine fsdp2"):
        zeroplan.plan(TINY, gpu="h100-80gb", engine="fsdp2", checkpointing="none")


def test_plan_sizes_the_cublas_workspaces_for_the_gpu_preset():
    # an A100 (compute capability 8.0) keeps two 8.125 MiB cuBLAS workspaces, an H100 (9.0) two 32 MiB ones
    # (formulas/cuda_workspaces.py): the --gpu preset's capability reaches the engines' Settings
    from zeroplan.formulas.cuda_workspaces import CUBLAS_WORKSPACE_OTHER_BYTES, CUBLAS_WORKSPACE_SM90_BYTES

    less = 2 * (CUBLAS_WORKSPACE_SM90_BYTES - CUBLAS_WORKSPACE_OTHER_BYTES)  # 50,069,504 B
    for engine, key in (("reference", "stage"), ("fsdp2", "label")):
        peaks = {}
        for gpu in ("a100-80gb", "h100-80gb"):
            d = run_json("plan", "--engine", engine, "--model", TINY, "--gpus", "2", "--gpu", gpu)
            peaks[gpu] = {o[key]: o["peak_bytes"] for o in d["stages"]}
        assert {k: peaks["h100-80gb"][k] - v for k, v in peaks["a100-80gb"].items()} == dict.fromkeys(peaks["a100-80gb"], less)
    assert fsdp2.planner_settings(PlannerOptions(gpu_capability=(8, 0))).cuda_capability == (8, 0)
    assert fsdp2.planner_settings(PlannerOptions()).cuda_capability == (9, 0)  # no preset: the default
