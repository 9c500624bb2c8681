"""``plan --engine fsdp2`` searches the mesh by default (issue 20 row 25; engines/fsdp2/plan.py ``planner_plan``):
replicate x shard x tp when no mesh dimension is given, exactly the mesh given otherwise (``--tp 1``: the flat
group), a launcher file's own mesh; and the two-pass search (``tp_estimate.mesh_search``: a memo, the first pass
bounded by the earliest first fit) answers what planning every degree in full answers."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from clicheck import assert_one_line_error, run, run_json
from zeroplan.engines import fsdp2
from zeroplan.engines.base import PlannerOptions
from zeroplan.estimation.workload import model_workload
from zeroplan.presets import resolve_model

ISSUE_20 = ("plan", "--engine", "fsdp2", "--model", "llama3-405b", "--gpus", "2048", "--gpu", "h100-80gb")


def test_the_issue_20_command_answers_with_a_mesh_by_default():
    """As written (no mesh option), llama3-405b on 2,048 H100s: no flat candidate fits (each is also planned with
    ``--tp 1``); the default answers 16 x 16 x tp 8, and its snippet builds that mesh, TP plan first. Fails if
    the default reverts to the flat group."""
    got = run_json(*ISSUE_20)
    rec = got["recommendation"]
    assert rec is not None and rec["label"] == "reshard_after_forward=True, checkpointing full, mesh 16 x 16, tp 8"
    snippet = rec["fsdp2"]
    assert "init_device_mesh('cuda', (16, 16, 8), mesh_dim_names=('dp_replicate', 'dp_shard', 'tp'))" in snippet
    assert snippet.index("parallelize_module(model, mesh[\"tp\"]") < snippet.index("fully_shard(block, mesh=dp_mesh")
    assert "mesh searched" in got["reason"] and "chose tp 8" in got["reason"]
    assert got == run_json(*ISSUE_20, "--tp", "auto", "--dp-shard", "auto")  # the default is the search
    flat = run_json(*ISSUE_20, "--tp", "1")  # --tp 1: the flat group, as before the default
    assert flat["recommendation"] is None
    assert all("mesh" not in o["label"] and ", tp " not in o["label"] for o in flat["stages"])


@pytest.mark.parametrize("pin, label", [
    (("--tp", "1"), ""), (("--dp-replicate", "1"), ""), (("--tp", "2"), ", tp 2"),
    (("--dp-shard", "8"), ", mesh 4 x 8"), (("--dp-replicate", "2"), ", mesh 2 x 16"),
])  # fmt: skip
def test_a_given_mesh_dimension_pins_the_mesh(pin, label):
    """Any of --tp, --dp-shard, --dp-replicate given: exactly that mesh, tp 1 and the flat group where not given,
    nothing searched."""
    got = run_json("plan", "--engine", "fsdp2", "--model", "llama3-8b", "--gpus", "32", "--gpu", "h100-80gb", *pin,
                   )  # fmt: skip
    assert [o["label"].split("checkpointing ")[1][4:] for o in got["stages"]] == [label] * 4
    assert "mesh searched" not in got["reason"]


def test_a_launcher_file_pins_its_own_flat_mesh(tmp_path):
    """A torchtitan job without HSDP is the flat group (``dp_replicate`` 1 passed): the plan searches no mesh."""
    job = tmp_path / "job.toml"
    job.write_text('[training]\nlocal_batch_size = 2\nseq_len = 512\nglobal_batch_size = 32\n'
                   '[parallelism]\ndata_parallel_shard_degree = 8\n[activation_checkpoint]\nmode = "full"\n')  # fmt: skip
    got = run_json("plan", "--model", "llama2-7b", "--gpu", "h100-80gb", "--torchtitan-config", str(job))
    assert got["stages"] and all("mesh" not in o["label"] and ", tp " not in o["label"] for o in got["stages"])
    assert "mesh searched" not in got["reason"]


@pytest.mark.parametrize("args, message", [
    (("--tp", "0"), "tp=0: expected a whole number from 1 to 65536, or auto (plan)"),
    (("--tp", "3"), "tp=3: must divide the GPUs (32)"),
    (("--dp-shard", "auto", "--dp-replicate", "2"), "dp_shard=auto searches the mesh: give no dp_replicate with it"),
    (("--dp-replicate", "3"), "dp_replicate=3: dp_replicate x dp_shard must equal N_d=32"),
])  # fmt: skip
def test_bad_mesh_options_are_one_line_exit_2(args, message):
    assert_one_line_error(run("plan", "--engine", "fsdp2", "--model", "llama3-8b", "--gpus", "32", "--gpu",
                              "h100-80gb", *args), message)  # fmt: skip


def _exhaustive(w, nd: int, capacity: int):
    """The mesh search's rule without its shortcuts: every degree planned in full with ``--dp-shard auto`` (no
    memo, no bound), the winner by (first fit, bytes across nodes, T); and {T: its first fit}."""
    from zeroplan.engines.fsdp2.plan import mesh_plan
    from zeroplan.engines.fsdp2.tp import tp_sizes
    from zeroplan.engines.fsdp2.tp_estimate import at_degree, inter_node_bytes

    ranked, first = [], {}
    for t in tp_sizes(w.spec, nd, 8, w.seq_len):
        own = {**at_degree({}, t), "dp_shard": "auto", "gpus_per_node": 8}
        p = mesh_plan(w, nd, capacity, PlannerOptions(param_dtype="bf16", own=own))
        first[t] = p.recommended
        if p.recommended is not None:
            ranked.append(((p.recommended, inter_node_bytes(p.candidates[p.recommended].estimate.collectives, nd, 8),
                            t), p))  # fmt: skip
    return min(ranked, key=lambda x: x[0])[1], first


def _rows(p):
    return [(c.label, c.estimate.peak.peak_bytes, c.estimate.peak_rank, c.fits, c.launcher,
             sum(x.bytes_per_rank for x in c.estimate.collectives)) for c in p.candidates]  # fmt: skip


@pytest.mark.parametrize("model, nd, seq, gib", [
    ("llama2-70b", 64, 4096, 80),  # tp 8 fits first: the other degrees stop at candidate 1
    ("llama2-7b", 8, 4096, 40),  # one node: bytes across nodes tie at 0, the smaller T
    ("llama3-8b", 32, 8192, 80),  # every degree fits first: ranked on bytes across nodes
    ("llama3-8b", 16, 8192, 14),  # tp 4 and 8 tie at the third candidate (tp 8 first): both searched
])  # fmt: skip
def test_the_two_pass_search_answers_what_the_exhaustive_one_does(model, nd, seq, gib):
    """The same recommendation and rows, and every degree whose first fit ties the winner's is searched."""
    w = model_workload(resolve_model(model), seq, 1, "none", 1, True)
    capacity = gib * 2**30
    got = fsdp2.planner_plan(w, nd, capacity, PlannerOptions(param_dtype="bf16", own={"gpus_per_node": 8}))
    want, first = _exhaustive(w, nd, capacity)
    assert got.recommended == want.recommended and _rows(got) == _rows(want)
    for t, k in first.items():
        searched = k is not None and f"tp {t}: candidate {k + 1} on dp " in got.order
        assert searched == (k == want.recommended), (t, got.order)


@pytest.mark.parametrize("model, nd, s, own", [
    ("llama3-8b", 64, 8, {"param_dtype": "bf16", "dp_shard": 8}),  # HSDP 8 x 8
    ("llama3-8b", 64, 8, {"param_dtype": "bf16", "tp": 2, "dp_shard": 8}),  # TP-local shapes, 4 x 8 x 2
    ("llama2-7b", 16, 16, {"amsgrad": True, "reshard_after_forward": False}),  # fp32 compute, a third state
    ("llama3-8b", 16, 16, {"param_dtype": "bf16", "reduce_dtype": "fp32", "device": "cpu", "backend": "gloo"}),
    ("llama3-8b", 32, 32, {"param_dtype": "bf16", "module_dtype": "bf16"}),  # 2-byte shards and states
    ("llama3-8b", 16, 16, {"param_dtype": "bf16", "offload_policy": "cpu"}),  # states on the host: 0
])  # fmt: skip
def test_the_states_floor_is_a_lower_bound_on_the_predicted_peak(model, nd, s, own):
    """``mesh.states_floor`` (the shard groups ``plan_options`` skips) never exceeds rank 0's model states, nor
    so its predicted peak, and is within 1e-4 of the states (measured: 6e-7 at most, Adam's 8-byte step
    counters and padding; margin 1e-4): a term dropped from the floor, or one it does not have, fails."""
    from zeroplan.engines.fsdp2.mesh import states_floor
    from zeroplan.engines.fsdp2.tp_estimate import tp_workload

    w = model_workload(resolve_model(model), 2048, 1, "full", 1, True)
    settings = fsdp2.Settings(**own, foreach=True, rank=0)
    (row,) = fsdp2.estimate(w, nd, settings)
    local = tp_workload(w, settings.tp) if settings.tp else w
    floor = states_floor(sum(math.prod(sh) for _, sh in local.shapes), s, settings)
    states = row.memory.model_states_bytes
    assert floor <= row.peak.peak_bytes
    if settings.offload_policy == "cpu":
        assert floor == 0 == states
    else:
        assert (1 - 1e-4) * states <= floor <= states


@pytest.mark.parametrize("model, nd, ckpt, own", [
    ("llama3-8b", 64, "none", {"param_dtype": "bf16", "dp_shard": 8}),  # HSDP 8 x 8
    ("llama3-8b", 64, "full", {"param_dtype": "bf16", "tp": 2, "dp_shard": 8}),  # TP-local shapes
    ("llama2-7b", 16, "full", {"amsgrad": True}),  # fp32 compute: gathered in the module dtype
    ("llama3-8b", 16, "none", {"param_dtype": "bf16", "device": "cpu", "backend": "gloo"}),
    ("llama3-8b", 32, "full", {"param_dtype": "bf16", "module_dtype": "bf16"}),
    ("llama3-8b", 16, "full", {"param_dtype": "bf16", "offload_policy": "cpu"}),  # gathered on the GPU all the same
    ("llama3-8b", 64, "full", {"param_dtype": "bf16", "tp": 8}),
    ("llama3-8b", 56, "full", {"param_dtype": "bf16"}),  # padded shards (dim 0 of 4,096 over 56 ranks)
])  # fmt: skip
def test_the_gathered_floor_is_the_unsharded_parameters_the_loss_holds(model, nd, ckpt, own):
    """``mesh.gathered_floor`` (the candidates ``plan.first_fit`` skips unestimated) never exceeds the predicted
    peak with ``reshard_after_forward=False``, and is the forward peak's "unsharded parameters" terms (every unit
    gathered at the loss) less their padding: between the parameters' elements and their padded shards times S
    (``param.padded_shard_numel``) in the param dtype (no margin; equal where S divides dim 0). A floor counting
    another term, a unit the forward does not hold, or missing a unit, fails; 0 when the units reshard after
    forward."""
    from zeroplan.engines.fsdp2.mesh import gathered_floor, shard_groups
    from zeroplan.engines.fsdp2.param import padded_shard_numel
    from zeroplan.engines.fsdp2.tp_estimate import tp_workload
    from zeroplan.formulas.dtypes import dtype_bytes

    w = model_workload(resolve_model(model), 512, 1, ckpt, 1, True)
    settings = fsdp2.Settings(**own, foreach=True, reshard_after_forward=False)
    (row,) = fsdp2.estimate(w, nd, settings)
    local = tp_workload(w, settings.tp) if settings.tp else w
    numel = sum(math.prod(sh) for _, sh in local.shapes)
    floor = gathered_floor(numel, settings)
    (forward,) = (p for p in row.peak.phases if p.phase == "forward")
    gathered = sum(t.bytes for t in forward.terms if t.name.startswith("unsharded parameters"))
    s = shard_groups(settings, nd // (settings.tp or 1))[1]
    padded = sum(s * padded_shard_numel(sh, s) for _, sh in local.shapes) * dtype_bytes(settings.param)
    assert floor <= row.peak.peak_bytes
    padding = padded - numel * dtype_bytes(settings.param)  # what the shards add to the parameters
    assert gathered - padding <= floor <= gathered <= padded, (floor, gathered, padded)
    assert gathered_floor(numel, settings.model_copy(update={"reshard_after_forward": True})) == 0


@pytest.mark.parametrize("model, nd, own", [
    ("llama3-8b", 64, {"param_dtype": "bf16", "dp_shard": 8}),  # HSDP 8 x 8: held all-reduce buffers besides
    ("llama3-8b", 64, {"param_dtype": "bf16", "tp": 2, "dp_shard": 8}),  # TP-local activations (SP)
    ("llama3-8b", 64, {"param_dtype": "bf16", "tp": 4, "sequence_parallel": False}),  # whole residual stream
    ("llama2-7b", 16, {"amsgrad": True, "reshard_after_forward": False}),  # fp32 activations
    ("llama3-8b", 16, {"param_dtype": "bf16", "device": "cpu", "backend": "gloo"}),  # CPU: no block rounding
    ("llama3-8b", 56, {"param_dtype": "bf16", "selective_ac": 2}),  # no checkpointing: every layer's saved set
])  # fmt: skip
def test_the_saved_floor_is_the_activations_the_cross_entropy_backward_holds(model, nd, own):
    """``fit_floor.saved_floor`` (what settles a candidate without checkpointing before its moments, ``over_floor``)
    is the "saved activations of L blocks" term of the cross-entropy backward (``moments.backward_moments``) of the
    run the estimate trains, and never exceeds the predicted peak (its worst rank's); 0 with checkpointing, and not
    read under ``CPUOffloadPolicy``. A floor from another run (the full model's activations under TP, another dtype)
    fails."""
    from zeroplan.engines.fsdp2.fit_floor import over_floor, saved_floor
    from zeroplan.engines.fsdp2.moments import moments

    def run_of(w, settings):
        made: dict = {}
        (row,) = fsdp2.estimate(w, nd, settings, made)
        return row, made[0]

    w = model_workload(resolve_model(model), 2048, 1, "none", 1, True)
    settings = fsdp2.Settings(**own, foreach=True)
    row, run = run_of(w, settings)
    floor = saved_floor(run)
    (ce,) = (m for m in moments(run) if m.name == "cross-entropy backward")
    (saved,) = (t for t in ce.terms if t.name.startswith("saved activations of "))
    assert 0 < floor == saved.bytes <= row.peak.peak_bytes
    assert over_floor(run, floor - 1)
    assert saved_floor(run_of(replace(w, checkpointing="full"), settings)[1]) == 0
    assert not over_floor(run_of(w, settings.model_copy(update={"offload_policy": "cpu"}))[1], 0)


def test_a_module_tree_outside_the_tp_plan_is_searched_without_tp():
    """A parameter torchtitan's llama plan does not name (a live model's own module): the default search plans
    no TP degree (``tp_estimate._in_plan``) instead of failing; the shard groups are still searched."""
    from dataclasses import replace

    w = model_workload(resolve_model("llama3-8b"), 2048, 1, "none", 1, True)
    w = replace(w, shapes=(*w.shapes, ("adapter.weight", (8, 8))))
    p = fsdp2.planner_plan(w, 16, 80 * 2**30, PlannerOptions(param_dtype="bf16", own={"gpus_per_node": 8}))
    assert p.order.endswith("chose tp 1") and "tp 2" not in p.order


@pytest.mark.distributed
def test_the_default_plans_3d_snippet_runs_on_llama_for_causal_lm(tmp_path):
    """The default search's answer for a tiny Llama on 16 GPUs (nodes of 4, 300 KiB each) is a 3-D mesh,
    2 x 4 x tp 2; its printed snippet, run as rank 0 of a fake group of 16 on transformers' ``LlamaForCausalLM``
    (built on meta), builds that mesh, and rank 0's local shards hold the bytes ``estimate`` predicts for it."""
    from pathlib import Path

    from fake_llama import run_on_fake_llama

    config = Path(__file__).parent / "data" / "hf_configs" / "tiny-llama-qwz.json"
    args = ["--engine", "fsdp2", "--model", str(config), "--gpus", "16", "--seq-len", "32", "--device", "cpu"]
    plan = run_json("plan", *args, "--gpus-per-node", "4", "--gpu-memory", "300KiB")
    snippet = plan["recommendation"]["fsdp2"]
    assert "init_device_mesh('cpu', (2, 4, 2), mesh_dim_names=('dp_replicate', 'dp_shard', 'tp'))" in snippet
    (row,) = run_json("estimate", *args, "--tp", "2", "--dp-replicate", "2", "--dp-shard", "4")["stages"]
    local = run_on_fake_llama(tmp_path, config, snippet, 16,
                              "[[p.to_local().numel(), [repr(x) for x in p.placements]] for p in model.parameters()]")
    assert all(len(placements) == 3 for _, placements in local)  # (dp_replicate, dp_shard, tp)
    assert {p[0] for _, p in local} == {"Replicate()"}  # HSDP: replicated over dp_replicate, sharded on dim 0
    assert all("Shard(dim=0" in p[1] for _, p in local)  # _StridedShard where tp shards dim 0 too
    assert sum(numel for numel, _ in local) * 4 == row["params_bytes"]  # fp32 shards of the TP-local shapes


def test_the_largest_micro_batch_keeps_each_rows_mesh():
    """``--max-micro-batch`` plans every row again at other micro-batches on the mesh the search gave it
    (``Candidate.pins``): the default plan's rows get the brackets of the same mesh given, not of whatever mesh
    the search would choose at the other micro-batch (which dropped the checkpointed rows to 1)."""
    args = ("plan", "--engine", "fsdp2", "--model", "llama3-8b", "--gpus", "16", "--gpu", "h100-80gb",
            "--max-micro-batch", "8")  # fmt: skip
    got = run_json(*args)["largest_micro_batch"]["configurations"]
    pinned = run_json(*args, "--tp", "2", "--dp-shard", "4")["largest_micro_batch"]["configurations"]
    assert [c["label"] for c in got] == [c["label"] for c in pinned]
    assert [c["largest"] for c in got] == [c["largest"] for c in pinned] == [1, 1, 5, 5]
    assert [c["tried"] for c in got] == [c["tried"] for c in pinned]


@pytest.mark.parametrize("t, node", [(1, 8), (2, 8), (8, 8), (8, 4), (4, 2)])  # (8, 4), (4, 2): TP crosses nodes
def test_the_searchs_bytes_across_nodes_are_the_full_rows(t, node):
    """``tp_estimate.row_inter_node_bytes`` (the second pass's ranking, the TP rows built only where their group
    crosses a node) equals ``inter_node_bytes`` of the row with every collective (``plan.with_collectives``), to
    the byte, TP inside a node or across (a probe row misplacing the TP group, or TP rows dropped, fails)."""
    from zeroplan.engines.fsdp2.plan import with_collectives
    from zeroplan.engines.fsdp2.tp_estimate import inter_node_bytes, row_inter_node_bytes
    from zeroplan.formulas.collectives import on_mesh

    w = model_workload(resolve_model("llama3-8b"), 4096, 1, "full", 2, True)
    settings = fsdp2.Settings(param_dtype="bf16", foreach=True, tp=t if t > 1 else None, dp_shard=8 // t * 2)
    made: dict = {}
    (row,) = fsdp2.estimate(w, 64, settings, made, collectives=False)
    assert row.collectives == ()
    run = made[(row.peak_rank or 0) // t]
    full = with_collectives(row, w, settings, run)
    assert full == fsdp2.estimate(w, 64, settings)[0]  # the collectives estimate gives, added later
    want = inter_node_bytes(full.collectives, 64, node)
    assert row_inter_node_bytes(w, settings, run, 64, node) == want > 0
    placed = on_mesh(full.collectives, 64, 1, node)  # both branches met: the TP rows cross exactly when T > G
    assert any(c.link == "inter" for c in placed if c.mesh_dim == "tp") == (t > node)
