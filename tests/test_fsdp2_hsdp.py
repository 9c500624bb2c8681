"""FSDP2 on a 2-D mesh (HSDP, zeroplan/engines/fsdp2/mesh.py): the profile by hand, the options on the command
line, and the real ``fully_shard`` measured as a 2 x 2 mesh on 4 gloo ranks and as 8 x 128 and 16 x 256 on the fake
process group at 1,024 and 4,096 ranks (fake tensors), phase by phase and collective by collective with the group of
each.

Recorded (torch 2.13.0, CPU): gloo 2 x 2, gpt-tiny, bf16 parameters and bf16 reduce: every rank, every phase
+16 B over the prediction (the 16 B appear at init with the 2-D mesh; not modelled), collectives equal. Fake
1,024 = 8 x 128 and 4,096 = 16 x 256: forward and backward peaks exact; init and optimizer_step are FakeTensorMode
phases, reported not checked (``validate.engines.fsdp2_compare.FAKE_TENSOR_PHASES``)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from zeroplan.cli import app
from zeroplan.engines import fsdp2
from zeroplan.estimation.workload import model_workload
from zeroplan.presets import resolve_model

runner = CliRunner()
TORCH_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}
RECORDED_B = 16  # gloo 2 x 2: measured - predicted, every rank and phase (module docstring)
MARGIN_B = 64  # a few allocations of slack; the smallest modelled term here is 74 elements x 2 B


def llama_workload():
    return model_workload(resolve_model("llama3-8b"), 1024, 1, "none", 1, True)


def test_hsdp_is_the_flat_profile_at_s_plus_one_all_reduce_per_unit_over_r():
    w = llama_workload()
    (flat,) = fsdp2.estimate(w, 8, fsdp2.Settings(param_dtype="bf16"))
    (hsdp,) = fsdp2.estimate(w, 32, fsdp2.Settings(param_dtype="bf16", dp_shard=8))
    assert hsdp.memory == flat.memory  # shards sized by S = 8, not N_d = 32
    assert hsdp.label.endswith("HSDP mesh 4 x 8")
    shard = [c for c in hsdp.collectives if c.mesh_dim == "dp_shard"]
    assert [(c.op, c.elements, c.bytes_per_rank) for c in shard] == [
        (c.op, c.elements, c.bytes_per_rank) for c in flat.collectives]  # fmt: skip
    reduces = [c for c in hsdp.collectives if c.op == "reduce-scatter"]
    replicas = [c for c in hsdp.collectives if c.mesh_dim == "dp_replicate"]
    assert [c.op for c in replicas] == ["all-reduce"] * len(reduces) and {c.group_size for c in replicas} == {4}
    # each unit's reduce-scatter output, S_u = elements / S, in the reduce dtype, right after its reduce-scatter
    assert [c.elements for c in replicas] == [rs.elements // 8 for rs in reduces]
    assert [c.bytes_per_rank for c in replicas] == [2 * 3 * -(-c.elements // 4) * 2 for c in replicas]
    order = [c.op for c in hsdp.collectives if c.phase == "backward" and c.op != "all-gather"]
    assert order == ["reduce-scatter", "all-reduce"] * len(reduces)


def test_held_all_reduce_buffers_only_when_the_reduce_dtype_is_not_the_module_dtype():
    """bf16 reduce of fp32 shards: each reduced unit's bf16 all-reduce buffer stays until backward ends, so the
    root's reduce-scatter copy-in holds every block's S_u x 2 B; fp32 reduce: the buffer is the gradient."""
    from dataclasses import replace

    w = llama_workload()
    for reduce, per_element in (("bf16", 2), ("fp32", 0)):
        settings = fsdp2.Settings(param_dtype="bf16", reduce_dtype=reduce, dp_replicate=2, dp_shard=8)
        run = replace(fsdp2.fsdp2_run(w, 8, settings), replicate=2)
        (moment,) = [m for m in fsdp2.moments(run) if m.name == "root reduce-scatter copy-in"]
        held = [t for t in moment.terms if t.name.startswith("HSDP all-reduce")]
        blocks = sum(fsdp2.unit_shard_numel(u, 8) for u in run.units[1:])
        assert sum(t.bytes for t in held) == per_element * blocks
        first = [m for m in fsdp2.moments(run) if m.phase == "backward"][0]
        assert not any(t.name.startswith("HSDP") for t in first.terms)  # nothing reduced yet


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "fsdp2", "--dp-replicate", "3"], "dp_replicate=3: dp_replicate x dp_shard must equal N_d=16"),
        (["--engine", "fsdp2", "--dp-replicate", "2", "--dp-shard", "4"], "must equal N_d=16"),
        (["--engine", "fsdp2", "--dp-replicate", "0"], "dp_replicate=0: expected a whole number"),
        (["--dp-shard", "8"], "--dp-shard does not apply to --engine reference"),
        (["--engine", "fsdp2", "--dp-shard", "8", "--reshard-after-forward", "2"], "not modelled"),
        (["--engine", "fsdp2", "--dp-shard", "auto"], "dp_shard=auto: only plan searches the mesh"),
        (["--engine", "fsdp2", "--dp-shard", "eight"], "dp_shard='eight': expected a whole number"),
    ],
)  # fmt: skip
def test_bad_meshes_are_refused_in_one_line(args, message):
    r = runner.invoke(app, ["estimate", "--model", "llama3-8b", "--gpus", "16", *args])
    assert r.exit_code == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


@pytest.mark.parametrize(
    ("args", "replicate", "worlds"),
    [
        (["--dp-shard", "2", "--world-size", "8"], 4, (8,)),  # R = N_d / S
        (["--dp-shard", "4", "--dp-replicate", "2"], 2, (8,)),  # the world: R x S
        (["--dp-shard", "2", "--tp", "2"], None, (4,)),  # S x T, flat data-parallel (the TP runner's 2 x 2)
        (["--dp-shard", "2", "--tp", "2", "--world-size", "8"], 2, (8,)),  # the 3-D mesh 2 x 2 x 2
    ],
)  # fmt: skip
def test_validate_takes_dp_shard_as_the_mesh_it_runs(monkeypatch, args, replicate, worlds):
    """``validate --dp-shard S``: the replicas and world size handed to the run (stopped before any rank starts)."""
    import validate.api

    seen = []

    def run_validation(config):
        seen.append(config)
        raise KeyboardInterrupt  # the command's own stop: one line, exit 130

    monkeypatch.setattr(validate.api, "run_validation", run_validation)
    r = runner.invoke(app, ["validate", "--engine", "fsdp2", *args])
    assert r.exit_code == 130, r.output
    (config,) = seen
    assert (config.dp_replicate, config.world_sizes) == (replicate, worlds)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dp-shard", "2"], "--dp-shard: --engine fsdp2 only"),
        (["--engine", "fsdp2", "--dp-shard", "1"], "--dp-shard 1: must be >= 2"),
        (["--engine", "fsdp2", "--dp-shard", "2", "--world-size", "4", "--world-size", "8"], "give one world size"),
        (["--engine", "fsdp2", "--dp-shard", "2", "--dp-replicate", "2", "--world-size", "8"],
         "the mesh 2 x 2 must multiply to the world size 8"),
        (["--engine", "fsdp2", "--dp-shard", "2", "--tp", "2", "--world-size", "6"],
         "the mesh R x 2 x 2 must multiply to the world size 6"),
    ],
)  # fmt: skip
def test_validate_refuses_a_dp_shard_that_is_not_the_world_in_one_line(args, message):
    from tests.clicheck import assert_one_line_error

    assert_one_line_error(runner.invoke(app, ["validate", *args]), message)


def test_estimate_json_names_each_collectives_dimension_group_and_link():
    r = runner.invoke(app, ["estimate", "--engine", "fsdp2", "--model", "llama3-8b", "--gpus", "32", "--dp-shard",
                            "8", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    (stage,) = json.loads(r.stdout)["stages"]
    seen = {(c["op"], c["mesh_dim"], c["group_size"], c["link"]) for c in stage["collectives"]}
    # 4 x 8 on 8-GPU nodes: the shard group is one node (NVLink), the replicas are on four nodes
    assert seen == {("all-gather", "dp_shard", 8, "intra"), ("reduce-scatter", "dp_shard", 8, "intra"),
                    ("all-reduce", "dp_replicate", 4, "inter")}  # fmt: skip


@pytest.mark.parametrize("mesh", [["--dp-shard", "8"], ["--dp-replicate", "2", "--tp", "2"]], ids=["hsdp", "hsdp-tp"])
def test_sweep_takes_the_mesh_options_and_each_row_is_estimates(mesh):
    """``sweep --dp-shard`` / ``--dp-replicate`` / ``--tp``: each row is ``estimate``'s for its GPU count (the
    mesh in the name, model states, bytes sent, peak), R = N_d / S per row when only S is given."""
    step = ["--engine", "fsdp2", "--model", "llama3-8b", "--seq-len", "2048", "--checkpointing", "full", *mesh]
    swept = runner.invoke(app, ["sweep", "--gpus", "16,32", *step, "--json"])
    assert swept.exit_code == 0, swept.output
    rows = json.loads(swept.stdout)["rows"]
    assert [r["gpus"] for r in rows] == [16, 32]
    for row in rows:
        one = runner.invoke(app, ["estimate", "--gpus", str(row["gpus"]), *step, "--json"])
        assert one.exit_code == 0, one.output
        (stage,) = json.loads(one.stdout)["stages"]
        assert "HSDP mesh" in row["name"]
        for key in ("name", "model_states_bytes", "comm_bytes_per_rank", "peak_bytes"):
            assert row[key] == stage[key], (row["gpus"], key)


def test_estimate_gpus_per_node_places_each_dimension(tmp_path):
    """``estimate --gpus-per-node``: 16 GPUs as 2 x 8 keep the shard group in a node of 8 and not in a node of 4 (was
    read at 8 always); DeepSpeed qgZ's local all-to-all group is the node (``Settings.devices_per_node``)."""
    def links(*args):
        r = runner.invoke(app, ["estimate", "--gpus", "16", *args, "--json"])
        assert r.exit_code == 0, r.output
        (stage,) = json.loads(r.stdout)["stages"]
        return {(c["op"], c["mesh_dim"], c["group_size"], c["link"]) for c in stage["collectives"]}

    hsdp = ["--engine", "fsdp2", "--model", "llama3-8b", "--seq-len", "2048", "--dp-shard", "8"]
    assert ("all-gather", "dp_shard", 8, "intra") in links(*hsdp)
    assert ("all-gather", "dp_shard", 8, "inter") in links(*hsdp, "--gpus-per-node", "4")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                  "zero_optimization": {"stage": 3, "zero_quantized_gradients": True}}))
    qgz = ["--engine", "deepspeed", "--deepspeed-config", str(config), "--model", "llama2-7b", "--seq-len", "2048"]
    for node in (8, 4):
        got = {c for c in links(*qgz, "--gpus-per-node", str(node)) if c[0] == "all-to-all"}
        assert got == {("all-to-all", "dp_shard", node, "intra"), ("all-to-all", "dp_replicate", 16 // node, "inter")}


def test_plan_prints_exactly_the_mesh_predicted_and_times_it_per_link():
    r = runner.invoke(app, ["plan", "--engine", "fsdp2", "--model", "llama3-8b", "--gpus", "32", "--gpu",
                            "h100-80gb", "--dp-shard", "8", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    snippet = doc["recommendation"]["fsdp2"]
    assert 'init_device_mesh(\'cuda\', (4, 8), mesh_dim_names=("dp_replicate", "dp_shard"))' in snippet
    assert snippet.count("mesh=mesh") == 2
    for option in doc["stages"]:  # 4 x 8 on 8-GPU nodes: shard traffic on NVLink, the all-reduces across nodes
        assert {(c["mesh_dim"], c["link"]) for c in option["comm_time"]["collectives"]} == {
            ("dp_shard", "intra"), ("dp_replicate", "inter")}  # fmt: skip
        assert option["comm_time"]["link"] != "nvlink4"  # the slowest link a collective runs at: the network
    flat = runner.invoke(app, ["plan", "--engine", "fsdp2", "--model", "llama3-8b", "--gpus", "32", "--gpu",
                               "h100-80gb", "--tp", "1", "--json"])  # fmt: skip  (--tp 1: the flat group)
    for option in json.loads(flat.stdout)["stages"]:  # one flat group of 32: every call crosses nodes
        assert {c["link"] for c in option["comm_time"]["collectives"]} == {"inter"}
    hsdp_s = [o["comm_time"]["comm_s"] for o in doc["stages"]]
    flat_s = [o["comm_time"]["comm_s"] for o in json.loads(flat.stdout)["stages"]]
    assert all(h < f for h, f in zip(hsdp_s, flat_s, strict=True))  # same candidates, less time on the network


def test_shard_sizes_are_whole_nodes_and_the_bisection_finds_the_smallest_that_fits():
    from zeroplan.engines.fsdp2.mesh import shard_sizes, smallest_fitting

    assert shard_sizes(2048, 8) == (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    assert shard_sizes(192, 8) == (8, 16, 24, 32, 48, 64, 96, 192)
    assert shard_sizes(6, 8) == (6,) and shard_sizes(12, 8) == (12,)  # 12 ranks: no whole node divides them
    tried = []

    def at(s):
        tried.append(s)
        return s, s >= 96

    assert smallest_fitting(shard_sizes(192, 8), at) == 96 and len(tried) <= 4  # log2(8) + 1, not 8
    assert smallest_fitting((8, 16), lambda s: (s, False)) == 16  # none fits: the largest, flat


def test_plan_dp_shard_auto_picks_the_smallest_whole_node_shard_group_that_fits():
    """llama3-8b on 64 H100s: each candidate on the smallest S of 8, 16, 32, 64 whose predicted peak fits; the
    next smaller S of the same candidate does not fit, and the snippet is that mesh."""
    from zeroplan.engines.base import PlannerOptions

    w = model_workload(resolve_model("llama3-8b"), 8192, 1, "none", 1, True)
    budget = int(80 * 2**30 * 0.9)
    plan = fsdp2.planner_plan(w, 64, budget, PlannerOptions(param_dtype="bf16", own={"dp_shard": "auto"}))
    chosen = plan.candidates[plan.recommended]
    assert chosen.fits and "mesh 4 x 16" in chosen.label and "init_device_mesh('cuda', (4, 16)" in chosen.launcher
    settings = fsdp2.Settings(param_dtype="bf16", reshard_after_forward=True, dp_shard=8, foreach=True)
    (smaller,) = fsdp2.estimate(w, 64, settings)
    assert smaller.peak.peak_bytes > budget >= chosen.estimate.peak.peak_bytes
    assert [c.label.rsplit(", ", 1)[-1] for c in plan.candidates[2:]] == ["mesh 8 x 8"] * 2  # checkpointed: one node


# ---------------------------------------------------------------- measured: real fully_shard on 2-D meshes


def _calls(row: dict) -> list[list]:
    """The last step's calls, each with the size of the group it ran on."""
    return [[*c, g] for c, g in zip(row["calls_by_step"][-1], row["group_sizes_by_step"][-1], strict=True)]


def _predicted_calls(predicted) -> list[list]:
    return [[c.op, c.phase, TORCH_DTYPE[c.dtype], c.elements, c.group_size] for c in predicted.collectives]


@pytest.fixture(scope="module")
def gloo_2x2():
    from validate.engines.fsdp2_compare import Fsdp2Settings
    from validate.engines.fsdp2_rows import run_world

    settings = Fsdp2Settings(model="gpt-tiny", dp_replicate=2, param_dtype="bf16", reduce_dtype="bf16")
    return settings, run_world(settings, 4)


@pytest.mark.distributed
def test_gloo_2x2_every_rank_every_phase_within_the_recorded_error(gloo_2x2):
    from validate.engines.fsdp2_rows import predict

    settings, result = gloo_2x2
    assert len(result["rows"]) == 4
    for row in result["rows"]:
        predicted = predict(settings, result["meta"], row["rank"])[0]
        for phase, want in predicted.peak.by_phase().items():
            got = row["peak_bytes_by_phase"][phase]
            assert 0 <= got - want <= RECORDED_B + MARGIN_B, (row["rank"], phase, got, want)
        # the held all-reduce buffers are at the backward peak: without them the prediction would be short
        assert any(t.name.startswith("HSDP all-reduce") for t in predicted.peak.phases[2].terms)
        states = row["readings_bytes"]["after_backward"][-1]
        assert 0 <= states - predicted.memory.model_states_bytes <= RECORDED_B + MARGIN_B
        assert _calls(row) == _predicted_calls(predicted)  # in issue order, each with its group (2 and 2)


FAKE_MESHES = {1024: 8, 4096: 16}  # world -> dp_replicate R: 8 x 128 and 16 x 256 (the 1,024 and 4,096 ranks)


@pytest.fixture(scope="module", params=sorted(FAKE_MESHES), ids=lambda n: f"world{n}")
def fake_mesh(request):
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from validate.engines.fsdp2_compare import Fsdp2Settings

    world = request.param
    settings = Fsdp2Settings(model="gpt-tiny", dp_replicate=FAKE_MESHES[world], param_dtype="bf16",
                             reduce_dtype="bf16")
    with tempfile.TemporaryDirectory(prefix="zeroplan-hsdp-") as tmp:
        out = Path(tmp, "rows.json")
        from dataclasses import asdict

        done = subprocess.run([sys.executable, "-m", "validate.engines.fsdp2", "--simulated", "--world-size", str(world),
                               "--settings", json.dumps(asdict(settings)), "--out", str(out)],
                              capture_output=True, text=True, timeout=900)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return world, settings, json.loads(out.read_text())


@pytest.mark.distributed
def test_fake_group_2d_mesh_exact_per_phase_and_per_call(fake_mesh):
    """Rank 0 of 1,024 ranks as 8 x 128 and of 4,096 as 16 x 256 (about 4 and 7 CPU-s each)."""
    from validate.engines.fsdp2_rows import predict

    world, settings, result = fake_mesh
    replicate = FAKE_MESHES[world]
    (row,) = result["rows"]
    predicted = predict(settings, result["meta"], 0)[0]
    for phase in ("forward", "backward"):  # init and optimizer_step: FakeTensorMode phases, not checked
        assert row["peak_bytes_by_phase"][phase] == predicted.peak.by_phase()[phase]
    calls = _calls(row)
    assert calls == _predicted_calls(predicted)
    assert {c[4] for c in calls if c[0] != "all-reduce"} == {world // replicate}
    assert {c[4] for c in calls if c[0] == "all-reduce"} == {replicate}


@pytest.mark.distributed
def test_the_plans_snippet_builds_the_mesh_predicted(tmp_path):
    """The emitted code, run on a fake group of 8 (rank 0), builds a 2 x 4 HSDP mesh: FSDP2's own state shards over
    4 ranks and replicates over 2, and the shards hold the predicted bytes."""
    import subprocess
    import sys
    from pathlib import Path

    from zeroplan.architectures.spec import transformer_shapes
    from zeroplan.engines.base import Workload
    from validate.models import PRESETS
    from zeroplan.engines.fsdp2.mesh import resolve_mesh

    spec = PRESETS["gpt-tiny"]
    w = Workload(transformer_shapes(spec), spec, 16, 1, "none")
    settings = resolve_mesh(fsdp2.Settings(dp_shard=4, device="cpu", foreach=False), 8)
    (row,) = fsdp2.estimate(w, 8, settings)
    snippet = fsdp2.settings_snippet(settings)
    assert "(2, 4)" in snippet
    script = tmp_path / "snippet.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=8)\n"
        "from validate.models import build, PRESETS\n"
        "model = build(PRESETS['gpt-tiny'], torch.float32, 'meta')  # init='meta', as the snippet says\n"
        "model.layers, model.init_weights = model.blocks, model._init_weights\n"
        + snippet +
        "info = model._get_fsdp_state()._fsdp_param_group.mesh_info\n"
        "print(info.shard_mesh_size, info.replicate_mesh_size, sum(p.to_local().numel() for p in model.parameters()))\n"
    )  # fmt: skip
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False,
                          cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    shard, replicate, numel = map(int, done.stdout.split())
    assert (shard, replicate) == (4, 2)
    assert numel * 4 == row.memory.params_bytes  # fp32 padded shards, sized by S = 4
