"""FSDP2 with tensor parallelism (engines/fsdp2/tp.py): TP-local shapes, the TP collectives, the refusals, and
the prediction of every phase of every rank against real gloo runs at world size 4 as dp_shard 2 x tp 2
(validate/engines/fsdp2_tp.py, recorded in tests/data/measured/fsdp2_tp.json: with and without sequence
parallelism, without loss parallel: tests/test_fsdp2_tp_loss.py, and with transformers' own plan, the ``-hf`` rows:
``--tp-plan transformers``). One live run (a background job); the recorded
rows are re-made with ``torchrun --nproc-per-node 4 -m validate.engines.fsdp2_tp --tp 2 [--no-sp] [--no-loss-parallel]
--out F`` (~30 s CPU each)."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines.base import Workload
from zeroplan.engines.fsdp2 import Settings, estimate
from zeroplan.engines.fsdp2.param import shard_rows
from zeroplan.engines.fsdp2.tp import check_plan, local_shapes, local_spec
from zeroplan.engines.fsdp2.tp_loss import loss_parallel_backward, loss_parallel_log_softmax
from zeroplan.presets import resolve_model

RECORDED = json.loads((Path(__file__).parent / "data" / "measured" / "fsdp2_tp.json").read_text())
MISSED: dict = {}
"""Measured misses (measured - predicted bytes, every rank), by (run id, phase); asserted exactly, so a change that
closes or widens one shows here. None open.
Closed ones: bf16 with checkpointing and SP at 2 x 32 tokens, the forward peak (block 2's checkpointed forward at
down_proj's reduce-scatter) was over-predicted by 768 B on all four ranks until the no-grad peak was re-counted for
SP (``tp.sp_nograd_peak``; ``test_sp_nograd_peak``). At 2 x 16 tokens the bf16 backward was under by 10,144 B
without SP and 992 B with it until the post-attention RMSNorm's backward moment (``tp.post_norm_backward``). At
4 x 16 tokens in bf16 the backward with SP was under by 12,836 B and the forward without SP by 6,976 B until loss
parallel's two moments (``tp.loss_parallel_backward``, ``tp.loss_parallel_log_softmax``;
``test_loss_parallel_moments``)."""


def _workload(meta) -> Workload:
    spec = spec_from_hf_config(meta["hf_config"], "tests/data/measured/fsdp2_tp.json")
    return Workload(transformer_shapes(spec), spec, meta["seq_len"], meta["batch"], meta.get("checkpointing", "none"),
                    1, False)  # fmt: skip


def _predict(run: dict, rank: int):
    meta = run["meta"]
    replicate = meta.get("dp_replicate", 1)
    settings = Settings(tp=meta["tp"], sequence_parallel=meta["sequence_parallel"], device="cpu", backend="gloo",
                        loss_parallel=meta.get("loss_parallel", True), rank=rank, foreach=False, param_dtype=meta.get("param_dtype", "fp32"),
                        tp_plan=meta.get("tp_plan", "torchtitan"),
                        **({"dp_replicate": replicate} if replicate > 1 else {}))  # fmt: skip
    (row,) = estimate(_workload(meta), meta["world_size"], settings)
    return row


def _run_id(run: dict) -> str:
    meta = run["meta"]
    ckpt = "-ckpt" if meta.get("checkpointing", "none") != "none" else ""
    batch = f"-b{meta['batch']}" if meta["batch"] != 2 else ""
    hsdp = f"-hsdp{meta['dp_replicate']}" if meta.get("dp_replicate", 1) > 1 else ""
    seq = f"-s{meta['seq_len']}" if meta["seq_len"] != 16 else ""
    sp = "sp" if meta["sequence_parallel"] else "no-sp"
    lp = "" if meta.get("loss_parallel", True) else "-no-lp"
    hf = "-hf" if meta.get("tp_plan") == "transformers" else ""  # transformers' own tp_plan (accelerate's TP)
    return f"{meta.get('param_dtype', 'fp32')}-{sp}{lp}{hf}{ckpt}{batch}{seq}{hsdp}"


def _mesh(meta) -> tuple[int, int, int]:
    """(R, S, T) of a recorded run: world = R x S x T, tp innermost."""
    r, t = meta.get("dp_replicate", 1), meta["tp"]
    return r, meta["world_size"] // (r * t), t


def _groups(meta, rank: int) -> dict[str, list[int]]:
    """The ranks of ``rank``'s group of each mesh dimension: rank = (i·S + j)·T + k, row-major."""
    r, s, t = _mesh(meta)
    i, j, k = rank // (s * t), rank // t % s, rank % t
    return {"tp": [(i * s + j) * t + x for x in range(t)], "dp_shard": [(i * s + x) * t + k for x in range(s)],
            "dp_replicate": [(x * s + j) * t + k for x in range(r)]}  # fmt: skip


RUNS = [pytest.param(r, id=_run_id(r)) for r in RECORDED["runs"]]


def test_llama3_8b_local_shapes():
    """torchtitan's plan at T = 8: colwise q/k/v, gate/up and the head split dim 0, rowwise o/down dim 1."""
    spec = resolve_model("llama3-8b")
    local = dict(local_shapes(transformer_shapes(spec), 8))
    assert local["model.layers.0.self_attn.q_proj.weight"] == (512, 4096)
    assert local["model.layers.0.self_attn.k_proj.weight"] == (128, 4096)  # 8 KV heads: one per TP rank
    assert local["model.layers.0.self_attn.o_proj.weight"] == (4096, 512)
    assert local["model.layers.0.mlp.gate_proj.weight"] == (1792, 4096)
    assert local["model.layers.0.mlp.down_proj.weight"] == (4096, 1792)
    assert local["model.embed_tokens.weight"] == (16032, 4096)
    assert local["lm_head.weight"] == (16032, 4096)
    assert local["model.norm.weight"] == (4096,)


@pytest.mark.parametrize("run", RUNS)
def test_shards_per_rank(run):
    """Each rank's local piece of each parameter: the TP-local shape, its dim 0 split by FSDP2 over dp_shard
    (ceil rows per rank, the last rank the rest), as measured (``DTensor.to_local()``)."""
    meta = run["meta"]
    _, s, t = _mesh(meta)
    local = dict(local_shapes(_workload(meta).shapes, t))
    for row in run["rows"]:
        d = row["rank"] // t % s  # its place in its dp_shard group
        for name, shape in row["local_shapes"]:
            full = local[name.replace("_checkpoint_wrapped_module.", "")]
            c = shard_rows(full[0], s)
            assert tuple(shape) == (min(c, max(0, full[0] - d * c)), *full[1:]), (row["rank"], name)


@pytest.mark.parametrize("run", RUNS)
def test_every_phase_of_every_rank(run):
    """Peak per phase, model states and Adam's states: every rank against its own prediction (with ``device``
    cpu the 2-D mesh's int32 rank map is a term of every phase: ``tp_estimate.mesh_rank_map``)."""
    for row in run["rows"]:
        predicted = _predict(run, row["rank"])
        by_phase = predicted.peak.by_phase()
        for phase, measured in row["peak_bytes_by_phase"].items():
            assert measured - by_phase[phase] == MISSED.get((_run_id(run), phase), 0), (row["rank"], phase)
        assert predicted.memory.optimizer_bytes == sum(row["optimizer_state_bytes"].values())
        beside = sum(t.bytes for t in predicted.beside_states)  # the mesh's rank map: 4 B per rank of the world
        assert beside == 4 * run["meta"]["world_size"]
        assert row["readings_bytes"]["after_init"][0] == predicted.memory.params_bytes + beside


def test_loss_parallel_moments():
    """bf16, 4 x 16 tokens: the forward peak without SP is loss parallel's ``_log_softmax`` and the backward
    peak with SP its cross-entropy backward, each the measured peak (N = 64 tokens, V/T = 65 rows: 17,400 B
    and 18,756 B of loss-parallel terms); neither term exists at T = 1."""
    runs = {(r["meta"]["sequence_parallel"], r["meta"]["batch"], r["meta"].get("param_dtype")): r
            for r in RECORDED["runs"] if r["meta"].get("loss_parallel", True)}  # fmt: skip
    for sp, phase, moment, extra in ((False, "forward", "loss-parallel log-softmax", 2 * 64 * 65 * 4 + 3 * 64 * 4),
                                     (True, "backward", "cross-entropy backward", 64 * 65 * 4 + 3 * 64 * 8
                                      + 2 * 64 * 4 + 64 + 4)):  # fmt: skip
        run = runs[(sp, 4, "bf16")]
        peak = next(p for p in _predict(run, 0).peak.phases if p.phase == phase)
        assert peak.moment == moment and peak.bytes == run["rows"][0]["peak_bytes_by_phase"][phase]
        assert sum(t.bytes for t in peak.terms if t.name.startswith("loss parallel")) == extra
    acts = SimpleNamespace(batch=2 * 64 * 8, log_softmax=64 * 65 * 4)
    for t in (None, 1):
        run = SimpleNamespace(settings=SimpleNamespace(tp=t), acts=acts)
        assert loss_parallel_log_softmax(run) == () and loss_parallel_backward(run) == ()


def test_sp_nograd_peak():
    """bf16, checkpointing, SP, 2 x 32 tokens (N = 64, d = 48, f/T = 51, T = 2): the forward peak is block 2's
    checkpointed forward at down_proj's reduce-scatter, as MemTracker's live storages there showed: the block's
    input, x1, the n/T norm output and the reduce-scatter's output (4 x 3,072 B), the gathered norm output,
    down's Partial output and funcol's copy of it (3 x 6,144 B) and act(gate)·up (6,528 B): 37,248 B, 768 B
    under the unsharded count (input whole, x1 and the norm output whole beside three f-wide tensors)."""
    from zeroplan.engines.fsdp2.tp import sp_nograd_peak

    run = next(r for r in RECORDED["runs"] if _run_id(r) == "bf16-sp-ckpt-s32")
    spec = local_spec(_workload(run["meta"]).spec, 2)
    assert sp_nograd_peak(spec, 2, 64, 32, 2, True) == 4 * 3072 + 3 * 6144 + 64 * 51 * 2 == 37248
    peak = next(p for p in _predict(run, 0).peak.phases if p.phase == "forward")
    assert peak.moment == "block 2 forward" and peak.bytes == run["rows"][0]["peak_bytes_by_phase"]["forward"]
    assert sum(t.bytes for t in peak.terms if "working set (no grad)" in t.name) == 37248


TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def _calls(run, row, dim_group):
    return Counter((c["op"], c["phase"], c["elements"], c["dtype"]) for c in row["calls"] if c["step"] == 1
                   and c["group"] == dim_group)  # fmt: skip


@pytest.mark.parametrize("run", RUNS)
def test_collectives_call_by_call(run):
    """One step's collectives per process group: the TP ones (mesh_dim tp) over the rank's tp group, FSDP2's
    over its dp_shard group and, on the 3-D mesh, HSDP's gradient all-reduces over its dp_replicate group,
    each (op, phase, elements, dtype) as many times as predicted; every call ran on one of those groups."""
    meta = run["meta"]
    for row in run["rows"]:
        r = row["rank"]
        predicted = _predict(run, r).collectives
        groups = _groups(meta, r)
        assert all(c.group_size == len(groups[c.mesh_dim]) for c in predicted)
        assert all(c["group"] in groups.values() for c in row["calls"] if c["step"] == 1)
        for dim, group in groups.items():
            want = Counter((c.op, c.phase, c.elements, TORCH_DTYPE[c.dtype]) for c in predicted if c.mesh_dim == dim)
            assert _calls(run, row, group) == want, (r, dim)
            if "dim" in row["calls"][0]:  # the runner's own label of the group
                assert all(c["dim"] == dim for c in row["calls"] if c["group"] == group)


def test_hsdp_tp_world_8():
    """HSDP x TP on torchtitan's 3-D mesh (2, 2, 2) at world 8, fp32 and bf16 (recorded: ~62 CPU-s each, too slow
    for CI): every phase of every rank exact (test_every_phase_of_every_rank), and per optimizer step 3 gradient
    all-reduces over dp_replicate (one per unit: 2 blocks and the root, S_u elements in the reduce dtype, after the
    reduce-scatters over dp_shard), 5 all-gathers and 3 reduce-scatters over dp_shard, 28 TP calls over tp; in bf16 the
    all-reduce buffers are held until backward ends (a backward term)."""
    runs = [r for r in RECORDED["runs"] if r["meta"].get("dp_replicate", 1) == 2 and "tp_plan" not in r["meta"]]
    assert sorted(r["meta"]["param_dtype"] for r in runs) == ["bf16", "fp32"]
    for run in runs:
        assert run["meta"]["world_size"] == 8 and _mesh(run["meta"]) == (2, 2, 2)
        predicted = _predict(run, 0)
        dims = Counter((c.mesh_dim, c.op) for c in predicted.collectives)
        assert dims == {("dp_replicate", "all-reduce"): 3, ("dp_shard", "all-gather"): 5,
                        ("dp_shard", "reduce-scatter"): 3, ("tp", "all-gather"): 10, ("tp", "reduce-scatter"): 10,
                        ("tp", "all-reduce"): 3 + 5}  # fmt: skip
        ar = [c for c in predicted.collectives if c.mesh_dim == "dp_replicate"]
        rs = [c for c in predicted.collectives if c.mesh_dim == "dp_shard" and c.op == "reduce-scatter"]
        assert [c.elements for c in ar] == [-(-c.elements // 2) for c in rs]  # S_u = the unit's padded shard
        held = [t for p in predicted.peak.phases for t in p.terms if t.name.startswith("HSDP all-reduce buffers")]
        assert bool(held) == (run["meta"]["param_dtype"] == "bf16")
        for row in run["rows"]:
            assert row["peak_bytes_by_phase"] == _predict(run, row["rank"]).peak.by_phase()


def test_transformers_tp_plan():
    """transformers' own plan (``tp_plan`` transformers, accelerate's TP; validate/engines/fsdp2_tp_hf.py runs
    transformers 5.24's ``apply_tensor_parallelism``): recorded fp32 at world 4 (2 x 2) and 8 (HSDP 2 x 2 x 2) and
    bf16 at world 4, every phase of every rank exact (test_every_phase_of_every_rank). Its placements are
    torchtitan's without SP or loss parallel, so the peaks are those of ``sequence_parallel`` and
    ``loss_parallel`` false; only the backward's TP all-reduces differ: each of q/k/v and gate/up all-reduces
    its own input gradient, 5 per block where torchtitan's ``PrepareModuleInput`` sends 2 (measured: 11 = 2 x 5
    + the head's, against 5)."""
    runs = [r for r in RECORDED["runs"] if r["meta"].get("tp_plan") == "transformers"]
    assert sorted((r["meta"]["world_size"], r["meta"]["param_dtype"]) for r in runs) == [(4, "bf16"), (4, "fp32"),
                                                                                         (8, "fp32")]  # fmt: skip
    for run in runs:
        meta = run["meta"]
        hf, titan = _predict(run, 0), _predict({**run, "meta": {**meta, "tp_plan": "torchtitan"}}, 0)
        assert hf.peak.by_phase() == titan.peak.by_phase()
        back = Counter((c.op, c.phase) for c in hf.collectives if c.mesh_dim == "tp")
        assert back[("all-reduce", "backward")] == 2 * 5 + 1
        assert Counter((c.op, c.phase) for c in titan.collectives if c.mesh_dim == "tp")[("all-reduce", "backward")] == 5
    with pytest.raises(ValueError, match="tp_plan=transformers: its plan has no sequence parallelism"):
        Settings(tp=2, tp_plan="transformers", loss_parallel=False)


def test_tp_traffic_llama3_8b():
    """The TP rows of llama3-8b at T = 4 with SP, 1 x 2048 tokens, bf16: per block 2 all-gathers and 2
    reduce-scatters of b·s·d in each of forward and backward, the embedding's and the head's, loss parallel's
    three all-reduces of b·s, and SP's norm-gradient all-reduces (2 per block and the final norm, d each)."""
    spec = resolve_model("llama3-8b")
    w = Workload(transformer_shapes(spec), spec, 2048, 1, "none", 1, True)
    (row,) = estimate(w, 16, Settings(tp=4, param_dtype="bf16", rank=0))
    tp = [c for c in row.collectives if c.mesh_dim == "tp"]
    n, d, layers = 2048 * 4096, 4096, 32
    counts = Counter((c.op, c.phase, c.elements) for c in tp)
    assert counts[("all-gather", "forward", n)] == 2 * layers + 1
    assert counts[("reduce-scatter", "forward", n)] == 2 * layers + 1
    assert counts[("all-gather", "backward", n)] == 2 * layers + 1
    assert counts[("reduce-scatter", "backward", n)] == 2 * layers + 1
    assert counts[("all-reduce", "forward", 2048)] == 3
    assert counts[("all-reduce", "backward", d)] == 2 * layers + 1
    assert not [t for t in row.beside_states if "rank map" in t.name]  # CUDA: the host rank map is not counted
    ag = next(c for c in tp if c.op == "all-gather")
    assert ag.bytes_per_rank == 3 * math.ceil(n / 4) * 2  # ring: (T-1)·ceil(n/T)·2 bytes
    # FSDP2 shards the TP-local model over N_d / T = 4 ranks: the padded shard of Ψ/T
    assert row.memory.params_bytes == pytest.approx(spec_params(spec) / 4 / 4 * 4, rel=1e-3)


def spec_params(spec) -> int:
    return sum(math.prod(s) for _, s in transformer_shapes(spec))


@pytest.mark.parametrize("model, t, nd, why", [
    ("llama3-8b", 3, 12, "n_head=32 is not divisible by 3"),
    ("llama3-8b", 16, 16, "n_kv_head=8 is not divisible by 16"),
    ("llama3-8b", 4, 6, "must divide the GPUs (6)"),
    ("gpt2-xl", 2, 4, "torchtitan's llama plan holds only"),
])  # fmt: skip
def test_refusals(model, t, nd, why):
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        check_plan(resolve_model(model), t, nd, 2048, True)


def test_cli(capsys):
    """``--tp`` on estimate; refused in one line with the reference engine and where the plan cannot hold."""
    from zeroplan.cli import app
    from typer.testing import CliRunner

    runner = CliRunner()
    ok = runner.invoke(app, ["estimate", "--engine", "fsdp2", "--model", "llama3-8b", "--gpus", "16", "--tp", "4",
                             "--seq-len", "2048", "--micro-batch", "1"])  # fmt: skip
    assert ok.exit_code == 0, ok.output
    assert "tp 4" in ok.output
    assert "(N_d = 4 data-parallel x tp 4 x N_m = 1 model-parallel;" in ok.output  # the head: GPUs / T
    for args in (["--engine", "reference", "--tp", "2"], ["--engine", "fsdp2", "--tp", "3"]):
        bad = runner.invoke(app, ["estimate", "--model", "llama3-8b", "--gpus", "12", "--seq-len", "2048", *args])
        assert bad.exit_code == 2, bad.output
        assert "Traceback" not in bad.output


def test_plan_snippet_names_the_mesh():
    """``plan --tp 2`` on 8 GPUs: the 2-D mesh (4, 2), parallelize_module before fully_shard on dp_mesh."""
    from typer.testing import CliRunner
    from zeroplan.cli import app

    out = CliRunner().invoke(app, ["plan", "--engine", "fsdp2", "--model", "llama3-8b", "--gpus", "8", "--tp", "2",
                                   "--gpu-memory", "80GB", "--param-dtype", "bf16", "--seq-len", "4096"])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "init_device_mesh('cuda', (4, 2), mesh_dim_names=('dp_shard', 'tp'))" in out.output
    assert 'parallelize_module(model, mesh["tp"]' in out.output
    assert "fully_shard(model, mesh=dp_mesh, mp_policy=policy)" in out.output


@pytest.mark.distributed
@pytest.mark.parametrize("loss_parallel", [[], ["--no-loss-parallel"]], ids=["lp", "no-lp"])
def test_the_plans_tp_snippet_runs_on_llama_for_causal_lm(tmp_path, loss_parallel):
    """The printed ``plan --tp 2`` snippet (with and without ``--no-loss-parallel``), run on transformers' ``LlamaForCausalLM`` (tiny, built on meta) as rank 0
    of a fake group of 8: the 3-D layout it makes is torchtitan's (colwise ``Shard(0)``, rowwise ``Shard(1)``, SP
    norms replicated over tp), and rank 0's local shards hold ``estimate``'s parameter bytes. ``model.layers`` is
    aliased to ``model.model.layers`` and ``init_weights`` is a no-op, as the snippet's comments tell the user."""
    from fake_llama import run_on_fake_llama
    from typer.testing import CliRunner
    from zeroplan.cli import app

    config = Path(__file__).parent / "data" / "hf_configs" / "tiny-llama-qwz.json"
    args = ["--engine", "fsdp2", "--model", str(config), "--gpus", "8", "--tp", "2", "--seq-len", "32", "--json",
            *loss_parallel]
    plan = CliRunner().invoke(app, ["plan", "--gpu", "h100-80gb", *args])
    assert plan.exit_code == 0, plan.output
    snippet = json.loads(plan.stdout)["recommendation"]["fsdp2"]
    assert "init_device_mesh('cuda', (4, 2)" in snippet
    (row,) = json.loads(CliRunner().invoke(app, ["estimate", *args]).stdout)["stages"]
    local = run_on_fake_llama(tmp_path, config, snippet.replace("'cuda'", "'cpu'"), 8,
                              "{n: [p.to_local().numel(), repr(p.placements[-1])] for n, p in model.named_parameters()}")
    tp_placement = {name: placement for name, (_, placement) in local.items()}
    want = {"q_proj": "Shard(dim=0)", "k_proj": "Shard(dim=0)", "v_proj": "Shard(dim=0)", "gate_proj": "Shard(dim=0)",
            "up_proj": "Shard(dim=0)", "o_proj": "Shard(dim=1)", "down_proj": "Shard(dim=1)",
            "layernorm": "Replicate()", "norm": "Replicate()", "embed_tokens": "Shard(dim=0)", "lm_head": "Shard(dim=0)"}
    for name, placement in tp_placement.items():
        key = next(k for k in want if k in name.split(".")[-2])
        assert placement == want[key], (name, placement)
    assert sum(numel for numel, _ in local.values()) * 4 == row["params_bytes"]  # fp32 shards of the TP-local shapes


@pytest.mark.distributed
def test_the_transformers_plan_snippet_runs_on_llama_for_causal_lm(tmp_path):
    """``plan --accelerate-config tp_hsdp.yaml`` (accelerate's TP: transformers' own plan): the printed snippet,
    run on transformers' ``LlamaForCausalLM`` (tiny, on meta) as rank 0 of a fake group of 8, makes the placements
    of ``tp.py``'s plan (colwise ``Shard(0)``, rowwise ``Shard(1)``, the embedding and head vocabulary-split, the
    norms plain tensors) and rank 0's local shards hold ``estimate``'s parameter bytes."""
    from fake_llama import run_on_fake_llama
    from typer.testing import CliRunner
    from zeroplan.cli import app

    config = Path(__file__).parent / "data" / "hf_configs" / "tiny-llama-qwz.json"
    accelerate = Path(__file__).parent / "data" / "integrations" / "accelerate" / "tp_hsdp.yaml"
    args = ["--model", str(config), "--seq-len", "32", "--accelerate-config", str(accelerate), "--json"]
    plan = CliRunner().invoke(app, ["plan", "--gpu", "h100-80gb", *args])
    assert plan.exit_code == 0, plan.output
    snippet = json.loads(plan.stdout)["recommendation"]["fsdp2"]
    assert "apply_tensor_parallelism(model, mesh[\"tp\"]" in snippet and "parallelize_module" not in snippet
    (row,) = json.loads(CliRunner().invoke(app, ["estimate", *args]).stdout)["stages"]
    assert "transformers' tp_plan" in row["name"]
    local = run_on_fake_llama(tmp_path, config, snippet.replace("'cuda'", "'cpu'"), 8,
                              "{n: [p.to_local().numel(), [repr(x) for x in p.placements]] "
                              "for n, p in model.named_parameters()}")
    want = {"q_proj": "Shard(dim=0)", "k_proj": "Shard(dim=0)", "v_proj": "Shard(dim=0)", "gate_proj": "Shard(dim=0)",
            "up_proj": "Shard(dim=0)", "o_proj": "Shard(dim=1)", "down_proj": "Shard(dim=1)",
            "embed_tokens": "Shard(dim=0)", "lm_head": "Shard(dim=0)"}  # fmt: skip
    for name, (_, placements) in local.items():  # (dp_replicate, dp_shard[, tp]): the norms are not on tp
        key = next((k for k in want if k in name.split(".")[-2]), None)
        assert placements[2:] == ([want[key]] if key else []) and placements[0] == "Replicate()", (name, placements)
    assert sum(numel for numel, _ in local.values()) * 4 == row["params_bytes"]  # fp32 shards of the TP-local shapes


def test_plan_compute_time_is_split_over_the_tp_group():
    """A data-parallel rank's b·s tokens are computed by its T GPUs, 6·Ψ·b·s / T FLOPs each
    (``commtime.compute_time_s``): a ``--tp 2`` row's compute time is half the flat row's, so its exposed
    communication is what its own compute does not hide (it was charged the whole rank's 6·Ψ·b·s before)."""
    from typer.testing import CliRunner
    from zeroplan.cli import app

    def compute_s(*tp):
        out = CliRunner().invoke(app, ["plan", "--engine", "fsdp2", "--model", "llama3-8b", "--gpus", "8", *tp,
                                       "--gpu", "h100-80gb", "--seq-len", "4096", "--json"])  # fmt: skip
        assert out.exit_code == 0, out.output
        got = {s["comm_time"]["compute_s"] for s in json.loads(out.output)["stages"]}
        assert len(got) == 1  # one step's compute, whatever the candidate
        return got.pop()

    flat = compute_s("--tp", "1")  # the flat group (the default searches the mesh)
    assert flat == pytest.approx(6 * 8_030_261_248 * 4096 / (989.4e12 * 0.4), rel=1e-3)  # llama3-8b's Ψ, H100 bf16
    assert compute_s("--tp", "2") == pytest.approx(flat / 2, rel=1e-9)


def test_tp_auto_takes_the_smallest_degree_that_fits():
    """``plan --tp auto``: 1, 2, 4 within the node (8 GPUs: 8 would leave one data-parallel rank), smallest
    first, stopping at the first plan that recommends a candidate."""
    from types import SimpleNamespace

    from zeroplan.engines.fsdp2.tp_estimate import tp_search

    spec = resolve_model("llama3-8b")
    w = Workload(transformer_shapes(spec), spec, 4096, 1)
    tried = []

    def plan(workload, nd, capacity, options):
        tried.append(options.own.get("tp"))
        return SimpleNamespace(recommended=0 if options.own.get("tp") == 4 else None)

    @dataclass(frozen=True)
    class Options:  # PlannerOptions' one field tp_search reads (and replaces)
        own: dict

    tp_search(w, 8, 0, Options({"tp": "auto"}), plan)
    assert tried == [None, 2, 4]
    tried.clear()
    tp_search(w, 16, 0, Options({"tp": "auto", "gpus_per_node": 4}), plan)
    assert tried == [None, 2, 4]  # 8 is past a node of 4


@pytest.mark.parametrize("args, message", [
    (["--engine", "reference", "--tp", "2"], "--engine fsdp2 only"),
    (["--engine", "fsdp2", "--no-sp"], "--sp/--no-sp: with --tp only"),
    (["--engine", "fsdp2", "--tp", "2", "--simulated"], "no --simulated"),
    (["--engine", "fsdp2", "--tp", "2", "--init", "materialized", "--fsdp-wrap", "torchtitan"],
     "no --fsdp-wrap, --init materialized"),
    (["--engine", "fsdp2", "--tp", "2", "--param-dtype", "fp32", "--reduce-dtype", "bf16"], "no --reduce-dtype"),
    (["--engine", "fsdp2", "--tp", "2", "--world-size", "2"], "world size 2 must be R x S x T with dp_shard S >= 2"),
    (["--engine", "fsdp2", "--tp", "2", "--dp-replicate", "2", "--world-size", "4"], "dp_shard S >= 2"),
    (["--engine", "fsdp2", "--tp", "3", "--world-size", "6"], "n_head=4 is not divisible by 3"),
    (["--engine", "fsdp2", "--tp", "2", "--model", "gpt-tiny"], "torchtitan's llama plan holds only"),
    (["--engine", "fsdp2", "--tp", "1"], "greater than or equal to 2"),
    (["--engine", "fsdp2", "--tp-plan", "transformers"], "--tp-plan: with --tp only"),
    (["--engine", "fsdp2", "--tp", "2", "--tp-plan", "transformers", "--sp"], "--tp-plan transformers: its plan has no"),
    (["--engine", "fsdp2", "--tp", "2", "--tp-plan", "megatron"], "tp_plan"),
])  # fmt: skip
def test_validate_tp_refusals(args, message):
    """``validate --tp``: what the TP runner cannot run is refused in one line before any rank starts."""
    pytest.importorskip("torch")
    from typer.testing import CliRunner

    from tests.clicheck import assert_one_line_error
    from zeroplan.cli import app

    assert_one_line_error(CliRunner().invoke(app, ["validate", *args]), message)


# The module's one run, a background job of the session (tests/background.py: started at collection, niced, while
# the other tests run; this module runs last), its launcher forked (validate/harness.py fork_launchers).
BACKGROUND_CLI = {"tp4": ["--engine", "fsdp2", "--tp", "2", "--world-size", "4", "--param-dtype", "fp32", "--steps", "2"]}


@pytest.mark.distributed
def test_validate_tp_world_4(request, background):
    """``zeroplan validate --engine fsdp2 --tp 2`` at world 4 (dp_shard 2 x tp 2, llama-tiny, fp32, SP; ~27 CPU-s):
    the TP runner through the validator's harness and report, every rank's phases against its own prediction,
    collectives keyed per mesh dimension and matched call by call at every step."""
    from background import validate_json

    _, report = validate_json(background, request.module, "tp4")
    (row,) = report["rows"]
    assert row["ok"] and row["checks"]["collectives_match"] and row["engine_label"].endswith("tp 2")
    assert row["peak_rel_error_by_phase"] == {p: 0.0 for p in ("init", "forward", "backward", "optimizer_step")}
    assert row["model_states_rel_error"] == 0.0
    keys = set(row["measured_collectives"])
    assert {"all-gather|forward [dp_shard]|fp32", "reduce-scatter|backward [dp_shard]|fp32",
            "all-gather|forward [tp]|fp32", "all-reduce|backward [tp]|fp32"} <= keys  # fmt: skip
    assert row["measured_collectives"]["all-reduce|forward [tp]|fp32"]["calls"] == 3  # loss parallel


def test_mesh_search_replicate_shard_tp():
    """``plan --tp auto --dp-shard auto``: llama3-8b on 32 H100s (4 nodes of 8), bf16, 8192 tokens. Every TP
    degree within a node is planned with the shard search (S in whole nodes of G / T data-parallel ranks); all
    four fit with the first candidate (blocks kept gathered), so bytes across nodes rank them: flat at T = 1
    (every all-gather and reduce-scatter crosses nodes) loses to a node-sized shard group at T = 2 (only the
    gradient all-reduce over dp_replicate crosses), which ties with T = 4 and 8 and is the smaller T."""
    from zeroplan.engines import fsdp2
    from zeroplan.engines.base import PlannerOptions
    from zeroplan.engines.fsdp2.tp_estimate import inter_node_bytes
    from zeroplan.estimation.workload import model_workload

    w = model_workload(resolve_model("llama3-8b"), 8192, 1, "none", 1, True)
    options = PlannerOptions(param_dtype="bf16", own={"dp_shard": "auto", "tp": "auto"})
    plan = fsdp2.planner_plan(w, 32, int(80 * 2**30), options)
    chosen = plan.candidates[plan.recommended]
    assert plan.recommended == 0 and len(plan.candidates) == 4  # the winner in full
    assert "init_device_mesh('cuda', (4, 4, 2), mesh_dim_names=('dp_replicate', 'dp_shard', 'tp'))" in chosen.launcher
    assert 'dp_mesh = mesh["dp_replicate", "dp_shard"]' in chosen.launcher
    assert "fully_shard(model, mesh=dp_mesh, mp_policy=policy)" in chosen.launcher
    rows = chosen.estimate.collectives
    inter = inter_node_bytes(rows, 32, 8)
    assert inter == sum(c.bytes_per_rank for c in rows if c.mesh_dim == "dp_replicate") > 0
    assert "tp 1: candidate 1 on dp 32, 31.1 GB/rank" in plan.order and "tp 8: candidate 1 on dp 2 x 2" in plan.order
    assert f"tp 2: candidate 1 on dp 4 x 4, {inter / 1e9:.3g} GB/rank" in plan.order and "chose tp 2" in plan.order
    flat = fsdp2.planner_plan(w, 32, int(80 * 2**30), PlannerOptions(param_dtype="bf16", own={"dp_shard": 32}))
    assert inter_node_bytes(flat.candidates[0].estimate.collectives, 32, 8) == pytest.approx(31.1e9, rel=2e-3)
