"""`zeroplan plan` through typer's CliRunner: Table 2, the JSON schema, launchers and bad input."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from zeroplan.cli import app
from clicheck import assert_one_line_error

runner = CliRunner()
OPTION_KEYS = {
    "stage",
    "name",
    "offload",
    "label",
    "max_params",
    "max_params_with_headroom",
    "fits",
    "min_gpus",
}
MODEL_KEYS = {
    "gpu_bytes",
    "host_bytes_per_gpu",
    "host_bytes_per_node",
    "nvme_bytes_per_gpu",
    "nvme_bytes_per_node",
    "pcie",
    "comm_volume_elements",
    "comm_bytes_per_rank",
    "comm_time",
}


def run(*args):
    return runner.invoke(app, ["plan", *args])


def run_json(*args):
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.mark.parametrize(
    ("args", "printed"),
    [
        # ZeRO paper Table 2, "max theoretical" on 32 GB V100s (arXiv:1910.02054v3): MP = 1 and MP = 16 rows.
        (["--gpus", "64"], [2e9, 7.6e9, 14.4e9, 128e9]),
        (["--model-parallel", "16", "--gpus", "1024"], [32e9, 121.6e9, 230.4e9, 2e12]),
    ],
)
def test_table2_from_the_command_line(args, printed):
    d = run_json("--gpu-memory", "32GB", *args)
    got = [s["max_params"] for s in d["stages"]]
    assert got == pytest.approx(printed, rel=0.025)  # the paper's rounding, see test_plan_table2.tolerance
    assert d["recommendation"] is None and "no model given" in d["reason"]


def test_json_schema_with_a_model():
    d = run_json("--model", "llama2-70b", "--gpu", "h100-80gb", "--gpus", "64", "--grad-accum", "4",
                 "--checkpointing", "selective", "--headroom", "0.1")  # no peak model for selective: model states
    assert d["schema"] == "zeroplan.plan/1"
    assert d["inputs"]["params"] == 68_976_648_192 and d["inputs"]["nd"] == 64
    assert d["inputs"]["gpu_memory_bytes"] == 80 * 2**30
    assert d["inputs"]["budget_bytes"] == int(0.9 * 80 * 2**30)
    assert [s["stage"] for s in d["stages"]] == [0, 1, 2, 3]
    assert len(d["offload"]) == 6
    for option in d["stages"] + d["offload"]:
        assert OPTION_KEYS | MODEL_KEYS <= option.keys()
    assert set(d["stages"][3]["comm_time"]) >= {
        "link",
        "comm_s",
        "compute_s",
        "exposed_comm_s",
        "step_s",
        "collectives",
    }
    assert [c["calls_per_step"] for c in d["stages"][3]["comm_time"]["collectives"]] == [4, 4, 4]
    rec = d["recommendation"]
    assert rec["stage"] == 3 and rec["offload"] == {"optimizer": "none", "params": "none"}
    # the rows are the reference runtime's: no other engine's configuration (plan --engine deepspeed|fsdp2)
    assert rec["deepspeed"] is None and rec["fsdp2"] is None


def test_host_memory_per_node_scales_with_gpus_per_node():
    d8 = run_json("--params", "8e9", "--gpu", "h100-80gb", "--gpus", "64", "--gpus-per-node", "8")
    d4 = run_json("--params", "8e9", "--gpu", "h100-80gb", "--gpus", "64", "--gpus-per-node", "4")
    o8, o4 = d8["offload"][1], d4["offload"][1]  # stage 2 + optimizer->cpu
    assert o8["label"] == "2 + optimizer->cpu"
    assert o8["host_bytes_per_gpu"] == o4["host_bytes_per_gpu"] == 14 * 125_000_000  # (2 + 12)Ψ/N_d
    assert o8["host_bytes_per_node"] == 2 * o4["host_bytes_per_node"] == 8 * 14 * 125_000_000


def test_table_output_has_recommendation_and_no_other_engines_launcher():
    r = run("--model", "llama3-8b", "--gpu", "a100-80gb", "--gpus", "8")
    assert r.exit_code == 0, r.output
    assert "Recommendation: ZeRO stage 1:" in r.stdout
    assert "bf16 params 2 + bf16 grads 2 + fp32 master 4 + fp32 Adam m 4 + fp32 Adam v 4 = 16 (K = 12)" in r.stdout
    assert '"zero_optimization"' not in r.stdout and "fully_shard" not in r.stdout
    assert "Launchers: none printed" in r.stdout and "--engine deepspeed" in r.stdout
    assert "alpha-beta estimate" in r.stdout


def test_activations_line_and_json():
    # with a peak the fit counts the engine's activations; on model states alone they go against the headroom
    r = run("--model", "llama2-70b", "--gpu", "h100-80gb", "--gpus", "64")
    assert "activations ≈ 5.00 GiB per GPU (Korthikanti et al. 2022, full recomputation" in r.stdout
    assert "the fit counts the engine's own" in r.stdout
    r = run("--model", "gpt3-175b", "--gpu", "h100-80gb", "--gpus", "64", "--headroom", "0.1", "--checkpointing",
            "selective")  # fmt: skip
    assert "than the 8.00 GiB headroom" in r.stdout and "the fit counts" not in r.stdout
    d = run_json("--model", "gpt3-175b", "--gpu", "h100-80gb", "--gpus", "64", "--checkpointing", "none")
    assert d["activations"]["bytes"] == (34 * 2048 * 12288 + 5 * 96 * 2048**2) * 96
    assert d["activations"]["within_headroom"] is False


def test_offload_recommendation_when_allowed():
    d = run_json("--model", "llama2-7b", "--gpu", "a100-40gb", "--gpus", "4", "--offload", "cpu")
    assert d["recommendation"]["label"] == "1 + optimizer->cpu"
    rec = next(o for o in d["offload"] if o["label"] == "1 + optimizer->cpu")
    assert rec["fits"] and rec["peak_bytes"] <= d["inputs"]["budget_bytes"] < d["stages"][1]["peak_bytes"]
    assert rec["phases"]["init"] == d["stages"][1]["phases"]["init"]  # built as the runtime builds it


def test_overrides_win_over_presets():
    d = run_json(
        "--params",
        "7e9",
        "--gpu",
        "h100-80gb",
        "--gpu-memory",
        "40GB",
        "--bw",
        "100",
        "--inter-bw",
        "10",
        "--gpus",
        "16",
    )
    assert d["inputs"]["gpu_memory_bytes"] == 40 * 10**9
    assert d["inputs"]["links"]["intra"]["bandwidth_gbps"] == 100
    assert d["inputs"]["links"]["ring"]["bandwidth_gbps"] == 10  # 16 GPUs span two 8-GPU nodes


BAD = [
    (["--gpu", "h100-80gb", "--headroom", "1"], "headroom=1.0: must be a fraction in [0, 1)"),
    (["--gpu", "h100-80gb", "--headroom", "-0.2"], "headroom=-0.2"),
    (["--gpu", "h100-80gb", "--headroom", "nan"], "headroom=nan"),
    (["--gpu", "h100-80gb", "--bw", "-3"], "bw_gbps=-3: must be a positive finite number"),
    (["--gpu", "h100-80gb", "--inter-bw", "0"], "inter_bw_gbps=0"),
    (["--gpu", "h200"], "unknown gpu 'h200': known gpus are v100-32gb, a100-40gb"),
    (["--gpu", "h100-80gb", "--model", "llama-9"], "unknown model 'llama-9': known models are"),
    (["--gpu", "h100-80gb", "--interconnect", "nvlink9"], "unknown interconnect 'nvlink9'"),
    (["--gpu", "h100-80gb", "--model", "llama2-7b", "--params", "7e9"], "exclusive"),
    (["--gpu", "h100-80gb", "--offload", "disk"], "offload"),
    (["--gpu", "h100-80gb", "--gpus", "12", "--model-parallel", "8"], "does not divide gpus=12"),
    (["--gpu", "h100-80gb", "--gpus", "0"], "gpus=0: must be >= 1"),
    (["--gpu", "h100-80gb", "--grad-accum", "0"], "grad_accum=0: must be >= 1"),
    (["--gpu", "h100-80gb", "--mfu", "2"], "mfu=2.0"),
    (["--gpu-memory", "-3GB"], "must be a positive size"),
    (["--gpu", "h100-80gb", "--host-memory", "lots"], "host-memory='lots'"),
    (["--gpu", "h100-80gb", "--params", "abc"], "params='abc'"),
    (["--gpu", "h100-80gb", "--gpus", "two"], "Invalid value for '--gpus'"),
    (["--params", "7e9"], "give a GPU preset"),
    (["--gpu", "h100-80gb", "--checkpointing", "some"], "checkpointing"),
    (["--gpu", "h100-80gb", "--peak-tflops", "-1"], "peak_tflops=-1: must be a positive finite number"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_one_line_exit_2(args, message):
    assert_one_line_error(run(*args), message)


def test_plan_never_imports_heavy_modules():
    code = (
        "import sys\n"
        "from zeroplan.cli import main\n"
        "sys.argv = ['zeroplan', 'plan', '--model', 'llama2-70b', '--gpu', 'h100-80gb', '--json']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = ('torch', 'pandas', 'matplotlib', 'numpy')\n"
        "print(sorted(m for m in heavy if m in sys.modules), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["inputs"]["params"] == 68_976_648_192
    assert out.stderr.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("engine", [["--engine", "fsdp2"], ["--engine", "fsdp2", "--reshard-after-forward", "2"],
                                    ["--engine", "deepspeed", "--stage", "3"]])  # fmt: skip
def test_zero3_traffic_without_a_module_tree_is_modelled_as_layers_by_every_command(engine):
    """Issue 16: a bare Ψ was one tensor in FSDP2's root unit (never resharded) or one DeepSpeed module,
    so ZeRO-3 came out as 2Ψ under a footnote saying 3Ψ. Without a module tree estimate models it as layers
    (gathered for forward and again for backward, in the engine's dtypes: 3Ψ); plan and sweep refuse an
    engine without --model; a sharding without ZeRO-3 keeps the engine's own collectives."""
    import zeroplan
    from zeroplan.formulas.collectives import on_mesh, step_collectives

    psi, nd = 7 * 10**9, 8
    est = runner.invoke(app, ["estimate", "--params", "7e9", "--gpus", "8", *engine, "--json"])
    (row,) = json.loads(est.stdout)["stages"]
    assert row["stage"] == 3 and row["comm_volume_elements"] == 3 * psi
    dtypes = [c["dtype"] for c in row["collectives"]]
    assert row["collectives"] == [c.as_dict() for c in on_mesh(step_collectives(3, (psi,), nd, dtypes[0], dtypes[2]),
                                                               nd)]  # fmt: skip
    assert row["model_states_bytes"] > 0  # the engine's own model states are kept
    for command in (["plan", "--gpu", "h100-80gb"], ["sweep"]):
        r = runner.invoke(app, [*command, "--params", "7e9", "--gpus", "8", *engine[:2]])
        assert_one_line_error(r, "does not apply without --model")
    api = zeroplan.estimate(7e9, gpus=8, engine="fsdp2").stages[0]
    assert api.comm_volume_elements == 3 * psi and len(api.collectives) == 3
    assert zeroplan.estimate(7e9, gpus=1, engine="deepspeed", stage=3).stages[0].collectives == ()
    if "fsdp2" in engine:  # not resharded: the engine's own all-gather and reduce-scatter, 2Ψ
        two = runner.invoke(app, ["estimate", "--params", "7e9", "--gpus", "8", *engine[:2],
                                  "--reshard-after-forward", "false", "--json"])  # fmt: skip
        assert json.loads(two.stdout)["stages"][0]["comm_volume_elements"] == 2 * psi


def test_reference_engine_prints_the_papers_3psi_for_a_bare_psi_in_every_command():
    import zeroplan

    psi = 7 * 10**9
    est = runner.invoke(app, ["estimate", "--params", "7e9", "--gpus", "8", "--stage", "3", "--json"])
    assert json.loads(est.stdout)["stages"][0]["comm_volume_elements"] == 3 * psi
    assert run_json("--params", "7e9", "--gpu", "h100-80gb", "--gpus", "8")["stages"][3]["comm_volume_elements"] == 3 * psi
    rows = zeroplan.sweep(params=[7e9], gpus=[8], stages=[3])
    assert list(rows["comm_volume_elements"]) == [3 * psi]
