"""`plan --engine deepspeed` past one node tries ZeRO++ hpZ (issue 20): at ZeRO-3, `zero_hpz_partition_size` = the
GPUs per node beside 1 (off), ranked by the bytes each rank sends across nodes, and the ds_config printed is the
one predicted (read back by `estimate --deepspeed-config`, the same peak). Pure math: tiny GPT-2, no torch."""

import json
from pathlib import Path

from clicheck import assert_one_line_error, run, run_json

from zeroplan.engines import deepspeed
from zeroplan.estimation.workload import model_workload
from zeroplan.formulas.collectives import on_mesh
from zeroplan.presets import resolve_model

TINY = str(Path(__file__).parent / "data" / "hf_configs" / "tiny-gpt2.json")  # 2 layers, d = 36, 16 positions
# gpt-tiny's matrices gathered (threshold 100: tests/test_deepspeed_zeropp.py), released after use (reuse distance 0,
# no prefetch), so backward gathers them again: in the node's secondary group with hpZ
LOW = {"stage3_param_persistence_threshold": 100, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
NODE = ["--gpus", "4", "--gpus-per-node", "2", "--gpu", "h100-80gb"]  # two nodes of two GPUs


def plan(tmp_path, zero: dict, *args: str) -> dict:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": zero}))
    return run_json("plan", "--engine", "deepspeed", "--model", TINY, "--deepspeed-config", str(cfg), *args)


def inter_node_bytes(settings: deepspeed.Settings) -> tuple[int, int]:
    """(bytes across nodes, bytes inside a node) per rank per step of ``settings`` on 2 x 2 GPUs, from the engine."""
    w = model_workload(resolve_model(TINY), 16, 1, "none", 1, False)
    (est,) = deepspeed.estimate(w, 4, settings)
    placed = on_mesh(est.collectives, 4, 1, 2)
    return (sum(c.bytes_per_rank for c in placed if c.link == "inter"),
            sum(c.bytes_per_rank for c in placed if c.link == "intra"))  # fmt: skip


def test_hpz_rows_ranked_by_bytes_across_nodes_and_the_ds_config_reads_back_to_the_same_peak(tmp_path):
    d = plan(tmp_path, LOW, *NODE, "--gpu-memory", "100MiB")
    rows = {s["label"]: s for s in d["stages"]}
    hpz = [s for s in d["stages"] if s["label"].endswith(", hpZ 2")]
    assert [s["label"] for s in hpz] == [f"ZeRO-3, buckets {b}, hpZ 2" for b in ("5e8", "2e8", "5e7", "5e6")]
    base = deepspeed.Settings.from_ds_config({"zero_optimization": {"stage": 3, **LOW}})
    with_hpz = base.model_copy(update={"hpz_partition_size": 2})
    (plain_inter, plain_intra), (hpz_inter, hpz_intra) = inter_node_bytes(base), inter_node_bytes(with_hpz)
    # backward's all-gathers move into the node: fewer bytes cross it, some stay inside (the engine's numbers)
    assert hpz_inter < plain_inter and hpz_intra > 0 == plain_intra
    for b in ("5e8", "2e8", "5e7", "5e6"):  # each hpZ row ranks before its bucket's row without hpZ
        labels = [s["label"] for s in d["stages"]]
        assert labels.index(f"ZeRO-3, buckets {b}, hpZ 2") < labels.index(f"ZeRO-3, buckets {b}")
        assert rows[f"ZeRO-3, buckets {b}, hpZ 2"]["comm_bytes_per_rank"] == hpz_inter + hpz_intra
        assert rows[f"ZeRO-3, buckets {b}"]["comm_bytes_per_rank"] == plain_inter + plain_intra
    rec = d["recommendation"]
    assert rec["label"] == "ZeRO-3, buckets 5e6, hpZ 2"  # the first that fits 100 MiB (the 5e7 bucket: 200 MB)
    assert rec["deepspeed"]["zero_optimization"]["zero_hpz_partition_size"] == 2
    assert "the fewest bytes sent across nodes" in d["reason"]
    cfg = tmp_path / "chosen.json"
    cfg.write_text(json.dumps(rec["deepspeed"]))
    e = run_json("estimate", "--engine", "deepspeed", "--model", TINY, "--deepspeed-config", str(cfg), "--gpus", "4",
                 "--gpu", "h100-80gb", "--checkpointing", "full")  # plan's default checkpointing  # fmt: skip
    (row,) = e["stages"]
    assert row["peak_bytes"] == rows[rec["label"]]["peak_bytes"] > rows["ZeRO-3, buckets 5e6"]["peak_bytes"]
    assert row["comm_bytes_per_rank"] == hpz_inter + hpz_intra
    assert {c["group_size"] for c in row["collectives"]} == {4, 2}  # every rank, and the secondary group


def test_hpz_not_tried_where_it_does_not_apply(tmp_path):
    # N_d within one node, and N_d not a multiple of the node (DeepSpeed asserts that H divides the world)
    for nodes in (["--gpus", "4", "--gpus-per-node", "4"], ["--gpus", "6", "--gpus-per-node", "4"]):
        d = plan(tmp_path, LOW, *nodes, "--gpu", "h100-80gb")
        assert len(d["stages"]) == 16 and not any("hpZ" in s["label"] for s in d["stages"])
        assert "across nodes" not in d["reason"]


def test_a_ds_config_that_sets_hpz_fixes_it(tmp_path):
    # 1 (off) is kept: no hpZ rows; 2: every ZeRO-3 row and its ds_config have it, ZeRO-1/2's do not
    off = plan(tmp_path, {**LOW, "zero_hpz_partition_size": 1}, *NODE)
    assert len(off["stages"]) == 16 and not any("hpZ" in s["label"] for s in off["stages"])
    on = plan(tmp_path, {**LOW, "zero_hpz_partition_size": 2}, *NODE, "--gpu-memory", "100MiB")
    assert len(on["stages"]) == 16
    assert on["recommendation"]["deepspeed"]["zero_optimization"]["zero_hpz_partition_size"] == 2
    with_hpz = {s["label"]: s["comm_bytes_per_rank"] for s in on["stages"]}
    assert with_hpz["ZeRO-3, buckets 5e6"] == sum(inter_node_bytes(deepspeed.Settings.from_ds_config(
        {"zero_optimization": {"stage": 3, **LOW, "zero_hpz_partition_size": 2}})))  # fmt: skip


def test_hpz_at_a_stage_below_3_is_refused_in_one_line(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}}))
    assert_one_line_error(run("plan", "--engine", "deepspeed", "--model", TINY, "--deepspeed-config", str(cfg), *NODE),
                          "zero_hpz_partition_size at stage 2: ZeRO++ partitions ZeRO-3's parameters")  # fmt: skip


def test_hpz_rows_only_where_the_secondary_partitions_alone_fit(tmp_path):
    # every parameter's secondary partition is alive from deepspeed.initialize on (zeropp.py): tiny GPT-2's
    # 36,324 fp32 elements, padded to N_d = 4 per tensor, over H = 2: 72,648 B; one byte less and no hpZ row
    # can fit, so none is estimated (nothing fits either way: the offload rows are listed too)
    rows = {memory: plan(tmp_path, LOW, *NODE, "--gpu-memory", f"{memory}B")["stages"] for memory in (72_647, 72_648)}
    assert not any("hpZ" in s["label"] for s in rows[72_647])
    assert sum("hpZ" in s["label"] for s in rows[72_648]) == 4 and not any(s["fits"] for s in rows[72_648])
