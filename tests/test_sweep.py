"""`zeroplan.sweep` and `zeroplan sweep`: the vectorised grid equals `zeroplan.estimate` row by row."""

import csv
import io
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from typer.testing import CliRunner

import zeroplan
import zeroplan.presets
from zeroplan.cli import app
from zeroplan.formulas.offload import Offload
from zeroplan.planning.plan import rank_states
from zeroplan.render.estimate import stage_dict
from zeroplan.parsing import parse_offload
from zeroplan.render.sweep import to_records
from zeroplan.sweeping.grid import COLUMNS, collectives_summary, sweep
from zeroplan.types import error_line
from clicheck import assert_one_line_error

runner = CliRunner()

POLICIES = [
    {},  # the paper's mixed-precision Adam: 2 + 2 + 12 bytes per parameter
    {"param_dtype": "bf16", "grad_dtype": "fp32"},
    {"param_dtype": "fp32", "optimizer": "sgd-momentum"},
    {"param_dtype": "fp8", "master_weights": True, "optimizer": "adamw", "optimizer_dtype": "bf16"},
    {"optimizer": "adam8bit"},  # one fp32 absmax per 2048 elements: rounding up per shard matters
    {"optimizer": "adafactor", "master_weights": False},
]


def scalar_rows(psi=None, gpus=1, mp=1, numels=None, gpu_memory_bytes=None, **policy):
    """What `zeroplan.estimate` says, as sweep rows (collectives summarised the sweep's way)."""
    e = zeroplan.estimate(
        psi, gpus, model_parallel=mp, tensor_numels=numels, gpu_memory_bytes=gpu_memory_bytes, **policy
    )
    rows = []
    for s in e.stages:
        d = stage_dict(s, e)
        d["collectives"] = collectives_summary(s.collectives)
        del d["phases"], d["peak_terms"]  # estimate's peak detail; a sweep row keeps bytes, phase and fit
        rows.append(
            {
                "params": e.total_params,
                "gpus": gpus,
                "model_parallel": mp,
                "nd": e.nd,
                "psi": e.psi,
                "micro_batch": 1,
                "offload": "none",
                **d,
                **NOTHING_OFFLOADED,
                **NO_ACTIVATIONS,
            }
        )
    return rows


NOTHING_OFFLOADED = {"host_bytes": 0, "nvme_bytes": 0, "h2d_bytes": 0, "d2h_bytes": 0}
NO_ACTIVATIONS = {"activation_bytes": None, "total_bytes": None, "total_fits": None, "peak_fits": None,
                  "peak_rank": None, "reserved_bytes": None, "reserved_fits": None}  # no model


def assert_same_rows(frame, expected):
    got = to_records(frame)
    assert len(got) == len(expected)
    for g, x in zip(got, expected):
        assert g == {
            k: x[k] for k in g
        }  # exact: ints equal ints, the ratio bit for bit, fits True/False/None
        assert set(g) == set(x)


@pytest.mark.parametrize(
    "policy", POLICIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "paper"
)
def test_rows_equal_estimate_on_a_grid_with_padding_and_model_parallel(policy):
    # Odd Ψ and N_d where ceil(Ψ/N_d) pads, N_d = 1 (no communication), and N_m that does not divide Ψ.
    params = [1, 1001, 7_500_000_001, 175_000_000_000]
    gpus = [1, 3, 8, 24, 1000]
    mps = [1, 2, 8]
    frame = sweep(params, gpus, model_parallel=mps, gpu_memory_bytes=40 * 10**9, **policy)
    expected = [
        row
        for p in params
        for g in gpus
        for m in mps
        if g % m == 0
        for row in scalar_rows(p, g, m, gpu_memory_bytes=40 * 10**9, **policy)
    ]
    assert_same_rows(frame, expected)


def test_rows_equal_estimate_for_known_tensor_sizes():
    # With tensor sizes the full buffers of stages 1-3 are the padded flat buffers (flat layout).
    numels = [50257 * 768, 768, 3 * 768 * 768, 3 * 768, 7, 1]
    frame = sweep(tensor_numels=numels, gpus=[1, 2, 3, 7, 64], model_parallel=[1, 7], optimizer="adam8bit")
    expected = [
        r
        for g in (1, 2, 3, 7, 64)
        for m in (1, 7)
        if g % m == 0
        for r in scalar_rows(None, g, m, numels, optimizer="adam8bit")
    ]
    assert_same_rows(frame, expected)


@settings(max_examples=60, deadline=None)
@given(
    psi=st.integers(min_value=1, max_value=10**13),
    nd=st.integers(min_value=1, max_value=5000),
    mp=st.sampled_from([1, 2, 3, 8]),
    stage=st.sampled_from([0, 1, 2, 3]),
    policy=st.sampled_from(POLICIES),
)
def test_any_single_configuration_equals_estimate(psi, nd, mp, stage, policy):
    frame = sweep([psi], [nd * mp], model_parallel=[mp], stages=[stage], **policy)
    (expected,) = [r for r in scalar_rows(psi, nd * mp, mp, **policy) if r["stage"] == stage]
    assert_same_rows(frame, [expected])


def test_paper_table_1_row_and_grid_order():
    # ZeRO paper Table 1, Ψ = 7.5B, N_d = 64: 120, 31.4, 16.6, 1.88 GB; exactly 16Ψ, 4Ψ + 12Ψ/64,
    # 2Ψ + 14Ψ/64, 16Ψ/64 bytes.
    frame = sweep([7.5e9, 1e12], [64, 1024])
    assert list(frame.columns) == list(COLUMNS)
    assert len(frame) == 2 * 2 * 4
    assert list(frame["params"][:8]) == [7_500_000_000] * 8  # params slowest, then gpus, then stage
    assert list(frame["gpus"][:8]) == [64] * 4 + [1024] * 4
    assert list(frame["stage"][:8]) == [0, 1, 2, 3] * 2
    assert list(frame["model_states_bytes"][:4]) == [
        120_000_000_000,
        31_406_250_000,
        16_640_625_000,
        1_875_000_000,
    ]
    # Paper section 7: 2Ψ elements per step for stages 0-2, 3Ψ for stage 3.
    assert list(frame["comm_volume_elements"][:4]) == [15_000_000_000] * 3 + [22_500_000_000]


def test_trillion_parameters_stay_exact_integers():
    # 1T parameters on one GPU at 16 B/param: 1.6e13 bytes, beyond float32 and exact in int64.
    frame = sweep([1e12 + 1], [1], stages=[0])
    assert frame["model_states_bytes"].dtype == "int64"
    assert int(frame["model_states_bytes"][0]) == 16 * (10**12 + 1)


def test_model_parallel_pairs_that_do_not_divide_are_skipped():
    frame = sweep([1e9], [8, 12], model_parallel=[1, 8], stages=[3])
    assert list(zip(frame["gpus"], frame["model_parallel"], frame["nd"])) == [
        (8, 1, 8),
        (8, 8, 1),
        (12, 1, 12),
    ]


def test_fits_is_missing_without_gpu_memory_and_boolean_with_it():
    assert frame_fits(sweep([7.5e9], [64])) == [None] * 4
    # 31.4 GB does not fit in 32 GiB? It does (34.36e9 bytes); DP's 120 GB does not.
    assert frame_fits(sweep([7.5e9], [64], gpu_memory_bytes=32 * 2**30)) == [False, True, True, True]


def frame_fits(frame):
    return [r["fits"] for r in to_records(frame)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"params": [7e9, -1]}, "params=-1.0: must be a positive finite number of parameters"),
        ({"params": [7.5]}, "params=7.5: must be a whole number of parameters"),
        ({"params": [float("nan")]}, "params=nan"),
        ({"params": [1e18]}, "params=1e+18: must be <= 1e+15 parameters"),
        ({"params": []}, "params: give at least one value"),
        ({"params": [7e9, 7e9]}, "params: 7e+09 is listed twice"),
        ({"params": [7e9], "gpus": [8, 0]}, "gpus=0: must be >= 1"),
        ({"params": [7e9], "gpus": [8.5]}, "gpus=8.5: must be a whole number"),
        ({"params": [7e9], "model_parallel": [0]}, "model_parallel=0: must be >= 1"),
        (
            {"params": [7e9], "gpus": [8], "model_parallel": [3]},
            "no model_parallel in [3] divides any gpus in [8]",
        ),
        ({"params": [7e9], "stages": [0, 4]}, "stages=4: must be one of 0, 1, 2, 3"),
        ({"params": [7e9], "gpu_memory_bytes": 0}, "gpu_memory_bytes=0: must be >= 1"),
        ({"params": [7e9], "tensor_numels": [10]}, "give exactly one of params, tensor_numels and model"),
        ({"gpus": [8]}, "give exactly one of params, tensor_numels and model"),
        ({"params": [7e9], "optimizer": "no-such-optimizer"}, "unknown optimizer 'no-such-optimizer'"),
    ],
)
def test_bad_input_names_the_value(kwargs, message):
    with pytest.raises((ValidationError, ValueError)) as info:
        sweep(**kwargs)
    text = error_line(info.value) if isinstance(info.value, ValidationError) else str(info.value)
    assert message in text


def test_cli_csv_and_json_equal_the_api(tmp_path):
    args = [
        "sweep",
        "--params",
        "1001,7.5B",
        "--gpus",
        "1,3,64",
        "--model-parallel",
        "1,3",
        "--gpu-memory",
        "32GB",
    ]
    api = to_records(sweep([1001, 7.5e9], [1, 3, 64], model_parallel=[1, 3], gpu_memory_bytes=32 * 10**9))

    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert [int(row["model_states_bytes"]) for row in rows] == [a["model_states_bytes"] for a in api]
    assert [float(row["reduction_vs_dp"]) for row in rows] == [a["reduction_vs_dp"] for a in api]
    assert [row["fits"] for row in rows] == [str(a["fits"]) for a in api]

    out = tmp_path / "sweep.json"
    r = runner.invoke(app, [*args, "--json", "--out", str(out)])
    assert r.exit_code == 0 and r.stdout == ""
    doc = json.loads(out.read_text())
    assert doc["schema"] == "zeroplan.sweep/1" and doc["inputs"]["gpu_memory_bytes"] == 32 * 10**9
    assert doc["rows"] == api
    assert [p.name for p in tmp_path.iterdir()] == ["sweep.json"]  # no temporary file left behind


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params", "7e9,,8"], "params='7e9,,8': empty item between commas"),
        (["--params", "7e9", "--gpus", "8,x"], "gpus='x': not a whole number"),
        (["--params", "7e9", "--gpus", "8,8"], "gpus: 8 is listed twice"),
        (["--params", "7e9", "--model-parallel", "1.5"], "model-parallel='1.5': not a whole number"),
        (["--params", "7e9", "--stage", "0,9"], "stages=9: must be one of 0, 1, 2, 3"),
        (["--params", "7e9", "--gpu-memory", "lots"], "gpu-memory='lots'"),
        (["--gpus", "8"], "give exactly one of --params, --shapes and --model"),
        (["--model", "llama2-7b", "--params", "7e9"], "give exactly one of --params, --shapes and --model"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--params", "7e9", "--micro-batch", "2"], "micro_batch and seq_len change only activations"),
        (["--model", "llama2-7b", "--micro-batch", "1,x"], "micro-batch='x': not a whole number"),
        (["--model", "llama2-7b", "--checkpointing", "most"], "checkpointing='most'"),
        (
            ["--params", "7e9", "--out", "/nonexistent-dir/x.csv"],
            "directory '/nonexistent-dir' does not exist",
        ),
    ],
)
def test_cli_bad_values_are_one_line_and_exit_2(args, message, tmp_path):
    assert_one_line_error(runner.invoke(app, ["sweep", *args]), message)


def test_cli_bad_value_leaves_no_output_file(tmp_path):
    out = tmp_path / "s.csv"
    r = runner.invoke(app, ["sweep", "--params", "7e9", "--gpus", "0", "--out", str(out)])
    assert r.exit_code == 2 and not out.exists() and list(tmp_path.iterdir()) == []


def test_zero_offload_keeps_only_16_bit_parameters_on_the_gpu():
    # ZeRO-Offload (Ren et al. 2021, sec. 4.2): with ZeRO-2 + CPU offload the GPU keeps the 2Ψ fp16
    # parameters; each GPU's host share is its partition of fp16 gradients and K·Ψ optimizer states,
    # (2 + 12)·Ψ/N_d. Ψ = 7.5e9, N_d = 64: 15 GB on the GPU, 1.640625 GB on the host.
    (row,) = to_records(sweep([7.5e9], [64], stages=[2], offload=["cpu"]))
    assert row["offload"] == "optimizer->cpu"
    assert (row["params_bytes"], row["grads_bytes"], row["optimizer_bytes"]) == (15_000_000_000, 0, 0)
    assert row["host_bytes"] == 1_640_625_000
    assert row["reduction_vs_dp"] == 120e9 / 15e9


@pytest.mark.parametrize("offload", ["cpu", "nvme", "cpu/cpu", "none/cpu", "nvme/nvme"])
def test_offload_rows_equal_zeroplan_plan(offload):
    policy = {"param_dtype": "bf16", "optimizer": "adam8bit"}
    frame = sweep([7_500_000_001], [3, 64], offload=["none", offload], gpu_memory_bytes=32 * 10**9, **policy)
    labels = {parse_offload(o).label: parse_offload(o) for o in ("none", offload)}
    plans = {
        g: zeroplan.plan(
            params=7_500_000_001,
            gpus=g,
            gpu_memory_bytes=32 * 10**9,
            headroom=0,
            policy=zeroplan.PrecisionPolicy(**policy),
        )
        for g in (3, 64)
    }
    rows = to_records(frame)
    # Stage 0 has no offload; stages 1-2 take optimizer offload to the CPU only; stage 3 takes all five.
    expected_pairs = {"cpu": 7, "nvme": 5, "cpu/cpu": 5, "none/cpu": 5, "nvme/nvme": 5}[offload]
    assert len(rows) == 2 * expected_pairs
    for row in rows:
        off = labels[row["offload"]]
        # The plan lists the options DeepSpeed users pick (no parameter-only offload); the scalar
        # placement function it uses answers for every pair.
        s = rank_states(
            (7_500_000_001,), row["nd"], row["stage"], off, zeroplan.PrecisionPolicy(**policy), 1, False
        )
        listed = [o for o in plans[row["gpus"]].options if (o.stage, o.offload) == (row["stage"], off)]
        if off == Offload("none", "cpu"):
            assert listed == []  # parameter-only offload is not a plan option
        else:
            (option,) = listed
            assert option.states == s and row["fits"] == option.fits
            assert row["comm_bytes_per_rank"] == option.comm_bytes_per_rank
        assert (row["params_bytes"], row["grads_bytes"], row["optimizer_bytes"]) == (
            s.gpu.params_bytes,
            s.gpu.grads_bytes,
            s.gpu.optimizer_bytes,
        )
        assert (row["host_bytes"], row["nvme_bytes"], row["h2d_bytes"], row["d2h_bytes"]) == (
            s.host_bytes,
            s.nvme_bytes,
            s.h2d_bytes,
            s.d2h_bytes,
        )
        assert row["fits"] == (s.gpu.model_states_bytes <= 32 * 10**9)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"offload": ["gpu"]}, "offload='gpu': expected 'none', or OPT[/PARAMS]"),
        ({"offload": ["cpu/cpu/cpu"]}, "offload='cpu/cpu/cpu'"),
        ({"offload": ["cpu", "cpu/none"]}, "offload: optimizer->cpu is listed twice"),
        ({"offload": ["cpu"], "stages": [0]}, "stage 0: optimizer offload needs ZeRO stage 1 or higher"),
    ],
)
def test_bad_offload_names_the_value(kwargs, message):
    with pytest.raises((ValidationError, ValueError)) as info:
        sweep([7e9], [8], **kwargs)
    assert message in str(info.value)


def test_model_preset_rows_equal_estimate_and_activations_equal_the_plan():
    # Llama-2-70B on H100s: model states from estimate(tensor_numels=...), activations (Korthikanti et al.
    # 2022, full recomputation: 2·s·b·h·L bytes) from the same function zeroplan.plan uses.
    h100 = 80 * 2**30
    frame = sweep(
        model="llama2-70b",
        gpus=[64, 128],
        model_parallel=[1, 8],
        micro_batch=[1, 4],
        stages=[2, 3],
        gpu_memory_bytes=h100,
        param_dtype="bf16",
    )
    numels = zeroplan.presets.get_model("llama2-70b").tensor_numels
    rows = to_records(frame)
    assert len(rows) == 2 * 2 * 2 * 2
    for row in rows:
        (expected,) = [
            r
            for r in scalar_rows(None, row["gpus"], row["model_parallel"], numels, h100, param_dtype="bf16")
            if r["stage"] == row["stage"]
        ]
        skip = ("micro_batch", "peak_bytes", "peak_phase", *NO_ACTIVATIONS)  # peaks: tests/test_peak_cli.py
        core = {k: v for k, v in row.items() if k not in skip}
        assert core == {k: v for k, v in expected.items() if k not in skip}
        plan = zeroplan.plan(
            "llama2-70b",
            gpu="h100-80gb",
            gpus=row["gpus"],
            model_parallel=row["model_parallel"],
            micro_batch=row["micro_batch"],
        )
        assert row["activation_bytes"] == plan.activation_bytes
        assert row["total_bytes"] == row["model_states_bytes"] + plan.activation_bytes
        assert row["total_fits"] == (row["total_bytes"] <= h100)
    # 2 · 4096 tokens · 8192 hidden · 80 layers bytes for one sequence.
    assert rows[0]["activation_bytes"] == 2 * 4096 * 8192 * 80


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"params": [7e9], "micro_batch": [2]}, "micro_batch and seq_len change only activations"),
        ({"model": "llama2-7b", "params": [7e9]}, "give exactly one of params, tensor_numels and model"),
        ({"model": "no-such-model"}, "unknown model 'no-such-model'"),
        ({"model": "llama2-7b", "micro_batch": [0]}, "micro_batch=0: must be >= 1"),
        ({"model": "llama2-7b", "micro_batch": [2, 2]}, "micro_batch: 2 is listed twice"),
        ({"model": "llama2-7b", "seq_len": 0}, "seq_len=0: must be >= 1"),
        (
            {"model": "llama2-7b", "checkpointing": "some"},
            "checkpointing='some': Input should be 'none', 'selective' or 'full'",
        ),
    ],
)
def test_bad_model_and_micro_batch_values(kwargs, message):
    with pytest.raises((ValidationError, ValueError)) as info:
        sweep(**kwargs)
    text = error_line(info.value) if isinstance(info.value, ValidationError) else str(info.value)
    assert message in text


def test_cli_model_and_micro_batch_columns():
    r = runner.invoke(
        app,
        [
            "sweep",
            "--model",
            "llama2-70b",
            "--gpus",
            "64",
            "--stage",
            "3",
            "--micro-batch",
            "1,8",
            "--gpu",
            "h100-80gb",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert [row["micro_batch"] for row in rows] == ["1", "8"]
    # Full recomputation keeps each layer's input: 2·s·b·h·L bytes = 2·4096·b·8192·80 (Korthikanti et al.).
    assert [int(row["activation_bytes"]) for row in rows] == [2 * 4096 * b * 8192 * 80 for b in (1, 8)]
    assert [row["total_fits"] for row in rows] == ["True", "True"]


@pytest.mark.parametrize("out, message", [("{d}", "is a directory"), ("/proc/zeroplan-sweep.csv", "cannot write there")])
def test_cli_unwritable_output_is_one_line(tmp_path, out, message):
    r = runner.invoke(app, ["sweep", "--params", "7e9", "--out", out.format(d=tmp_path)])
    assert_one_line_error(r, message)
    assert list(tmp_path.iterdir()) == []


TINY_LLAMA = "tests/data/hf_configs/tiny-llama.json"
TINY_STEP = dict(seq_len=8, checkpointing="none")


@pytest.mark.parametrize("engine, stages", [("reference", {"stages": [1, 3]}), ("fsdp2", {}),
                                            ("deepspeed", {"stages": [2, 3]})])  # fmt: skip
def test_peak_rank_and_reserved_bytes_equal_estimate(engine, stages):
    frame = zeroplan.sweep(model=TINY_LLAMA, gpus=[2, 3], engine=engine, alloc_conf="expandable_segments:True",
                           **stages, **TINY_STEP)  # fmt: skip
    checked = 0
    for row in to_records(frame):
        one = {"stage": row["stage"]} if engine == "deepspeed" else {}
        e = zeroplan.estimate(model=TINY_LLAMA, gpus=row["gpus"], engine=engine, alloc_conf="expandable_segments:True",
                              **one, **TINY_STEP)  # fmt: skip
        (s,) = [s for s in e.stages if s.stage == row["stage"]]
        assert (row["peak_rank"], row["reserved_bytes"]) == (s.peak_rank, s.reserved.reserved_bytes)
        assert row["reserved_fits"] is None  # no GPU memory given
        checked += 1
    assert checked == len(frame) >= 2
    assert engine != "deepspeed" or [r["peak_rank"] for r in to_records(frame)] == [0, None, 0, None]  # stage 2: rank 0


def test_reserved_fits_keeps_the_headroom_and_alloc_conf_changes_the_reserved_bytes():
    plain = zeroplan.sweep(model=TINY_LLAMA, gpus=[2], stages=[3], **TINY_STEP)
    reserved = int(plain["reserved_bytes"][0])
    assert reserved > plain["peak_bytes"][0] > 0  # whole segments above the live bytes
    memory = reserved + 1  # fits with no headroom; 10% kept free does not
    for headroom, fits in ((0.0, True), (0.1, False)):
        frame = zeroplan.sweep(model=TINY_LLAMA, gpus=[2], stages=[3], gpu_memory_bytes=memory, headroom=headroom,
                               **TINY_STEP)  # fmt: skip
        assert (bool(frame["reserved_fits"][0]), int(frame["reserved_bytes"][0])) == (fits, reserved)
        assert bool(frame["fits"][0]) == (frame["model_states_bytes"][0] <= int(memory * (1 - headroom)))
    grown = zeroplan.sweep(model=TINY_LLAMA, gpus=[2], stages=[3], alloc_conf="expandable_segments:True", **TINY_STEP)
    assert int(grown["reserved_bytes"][0]) != reserved


def test_the_json_inputs_say_what_the_fits_and_reserved_columns_assumed():
    args = ["sweep", "--model", "llama2-7b", "--gpus", "8", "--stage", "3", "--json"]
    plain = json.loads(runner.invoke(app, args).output)["inputs"]
    assert (plain["headroom"], plain["alloc_conf"]) == (0.0, "")
    given = json.loads(runner.invoke(app, [*args, "--headroom", "0.1", "--alloc-conf",
                                          "expandable_segments:True"]).output)["inputs"]  # fmt: skip
    assert (given["headroom"], given["alloc_conf"]) == (0.1, "expandable_segments:True")
    bare = json.loads(runner.invoke(app, ["sweep", "--params", "1e9", "--gpus", "8", "--json"]).output)["inputs"]
    assert (bare["headroom"], bare["alloc_conf"]) == (0.0, None)  # no reserved column without a model


def test_reserved_columns_are_null_without_a_peak_and_alloc_conf_needs_a_model():
    frame = zeroplan.sweep(model=TINY_LLAMA, gpus=[2], stages=[3], offload=["cpu"], **TINY_STEP)
    assert frame[["peak_rank", "reserved_bytes", "reserved_fits"]].isna().all().all()
    with pytest.raises(ValidationError, match="alloc_conf changes only reserved_bytes"):
        zeroplan.sweep(params=[1e9], alloc_conf="expandable_segments:True")
    with pytest.raises(ValidationError, match=r"headroom=1.0: must be a fraction in \[0, 1\)"):
        zeroplan.sweep(params=[1e9], headroom=1.0)
    r = CliRunner().invoke(app, ["sweep", "--params", "1e9", "--alloc-conf", "expandable_segments:True"])
    assert r.exit_code == 2 and "--alloc-conf does not apply without --model" in r.output


def test_estimate_csv_reserved_bytes_is_the_json_one():
    args = ["estimate", "--model", TINY_LLAMA, "--gpus", "2", "--seq-len", "8", "--checkpointing", "none",
            "--stage", "3"]  # fmt: skip
    as_json = json.loads(CliRunner().invoke(app, [*args, "--json"]).output)["stages"]
    rows = list(csv.DictReader(io.StringIO(CliRunner().invoke(app, [*args, "--csv"]).output)))
    assert [int(r["reserved_bytes"]) for r in rows] == [s["reserved_bytes"] for s in as_json]
    assert all(s["reserved_bytes"] > s["peak_bytes"] for s in as_json)


ZERO2_CPU = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
ZERO3_NVME = {"bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}}
# one 8192 x 64 tied embedding (524,288 elements): a ZeRO-3 partition above DeepSpeed's 1 MiB swap threshold at N_d 1, 2
WIDE_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 88, "max_position_embeddings": 32,
              "num_attention_heads": 4, "num_hidden_layers": 1, "num_key_value_heads": 2, "vocab_size": 8192,
              "tie_word_embeddings": True}  # fmt: skip


@pytest.mark.parametrize(
    ("engine", "options", "gpus", "want"),
    [
        # tiny-llama Ψ = 47,760, largest tensor 103 x 48 = 4,944; ZeRO-2 cpu at N_d = 2, partition P = 23,880 (bf16):
        # host 18P + 2·4,944 (test_engine_offload.py's terms), fp32 gradients down 4P, bf16 partition up 2P
        ("deepspeed", {"ds_config": ZERO2_CPU}, [2], [("optimizer->cpu", "steady", 23_880 * 18 + 4_944 * 2, 0,
                                                       23_880 * 2, 23_880 * 4)]),
        # ZeRO-3 nvme: the NVMe holds master, m, v at the 256-aligned partition A and the swapped embedding slice
        # (nvme.nvme_traffic): N_d = 1: A = 553,728, slice 524,288; N_d = 2: A = 276,992, slice 262,144 (1 MiB).
        # The host's peak is the first optimizer step (nvme.py step_terms, measured on MoE rows 2026-12-02): the steady
        # bytes (9,966,976 at N_d = 1; 4,985,536 at 2), DeepSpeedCPUAdam's m and v of the partition P (553,664;
        # 276,832) made beside the swap pool, 8P, and the fp32 gradient slices below the 1 MiB swap threshold,
        # 4(P - slice); above init's peak (initialize_optimizer_states: 11,074,304 and 5,539,200)
        ("deepspeed", {"ds_config": ZERO3_NVME}, [1, 2], [
            ("optimizer->nvme", "steady", 9_966_976 + 8 * 553_664 + 4 * (553_664 - 524_288),
             12 * 553_728 + 4 * 524_288, 553_664 * 2, 553_664 * 2),
            ("optimizer->nvme", "steady", 4_985_536 + 8 * 276_832 + 4 * (276_832 - 262_144),
             12 * 276_992 + 4 * 262_144, 276_832 * 2, 276_832 * 2)]),
        # FSDP2 CPUOffloadPolicy: the fp32 shard (23,928 elements padded) fetched for forward and backward, gradients
        # down; materialized init (the whole model, 4Ψ, on the CPU) stays below the steady bytes at N_d = 2
        ("fsdp2", {"offload_policy": "cpu", "init": "materialized"}, [2], [
            ("optimizer->cpu, params->cpu", "steady", 478_644, 0, 8 * 23_928, 4 * 23_928)]),
    ],
)  # fmt: skip
def test_engine_offload_rows_are_estimates_host_memory(engine, options, gpus, want, tmp_path):
    """A one-row engine's offload (issue 21): the sweep's offload, host_bytes, nvme_bytes, h2d_bytes and d2h_bytes are
    the engine's HostMemory, the numbers ``estimate`` prints (host_bytes_per_gpu: the larger of the steady bytes and
    init's peak; nvme_write_bytes_per_step), not the zeros and "none" they were."""
    model = TINY_LLAMA
    if options.get("ds_config") is ZERO3_NVME:
        model = str(tmp_path / "wide.json")
        (tmp_path / "wide.json").write_text(json.dumps(WIDE_LLAMA))
    rows = to_records(zeroplan.sweep(model=model, gpus=gpus, engine=engine, **options, **TINY_STEP))
    assert len(rows) == len(gpus) == len(want)
    for row, w in zip(rows, want):
        e = zeroplan.estimate(model=model, gpus=row["gpus"], engine=engine, **options, **TINY_STEP)
        (s,) = e.stages
        printed = stage_dict(s, e)
        assert (row["offload"], row["host_bytes"]) == (s.host.offload.label, printed["host_bytes_per_gpu"])
        assert (row["h2d_bytes"], row["d2h_bytes"]) == (s.host.h2d_bytes, s.host.d2h_bytes)
        assert row["nvme_bytes"] == (printed["nvme_write_bytes_per_step"] or 0)
        step = sum(t.bytes for t in s.host.step_terms)  # the optimizer step's host temporaries, on the steady bytes
        assert row["host_bytes"] == max(printed["host_steady_bytes_per_gpu"] + step, printed["host_init_peak_bytes_per_gpu"])
        assert (row["offload"], printed["host_peak_at"], row["host_bytes"], row["nvme_bytes"], row["h2d_bytes"],
                row["d2h_bytes"]) == w  # fmt: skip
        assert row["peak_bytes"] == s.peak.peak_bytes > 0


def test_cli_fsdp_offload_fills_the_host_column():
    """``sweep --engine fsdp2 --fsdp-offload cpu``: the flag estimate takes, the row test_engine_offload_rows_... checks."""
    args = ["sweep", "--engine", "fsdp2", "--model", TINY_LLAMA, "--gpus", "2", "--seq-len", "8", "--checkpointing",
            "none", "--init", "materialized"]  # fmt: skip
    (row,) = csv.DictReader(io.StringIO(runner.invoke(app, [*args, "--fsdp-offload", "cpu"]).output))
    (plain,) = csv.DictReader(io.StringIO(runner.invoke(app, args).output))
    assert (row["offload"], int(row["host_bytes"]), int(row["h2d_bytes"])) == ("optimizer->cpu, params->cpu", 478_644,
                                                                               8 * 23_928)  # fmt: skip
    assert (plain["offload"], int(plain["host_bytes"])) == ("none", 0)


def test_csv_compute_falls_back_to_the_public_module(monkeypatch):
    """render/sweep.py calls pyarrow's compute functions from the private ``pyarrow._compute`` (no wrappers to
    build); a pyarrow that moves them gets the public ``pyarrow.compute``, not an error."""
    import types

    pytest.importorskip("pyarrow")
    import pyarrow.compute

    from zeroplan.render import sweep as render_sweep

    monkeypatch.setitem(__import__("sys").modules, "pyarrow._compute", types.ModuleType("pyarrow._compute"))
    assert render_sweep._compute() is pyarrow.compute
    monkeypatch.undo()
    assert render_sweep._compute().__name__ == "pyarrow._compute"
