"""Meshes as data (zeroplan/formulas/mesh.py): each dimension's link class by node size, collectives placed on
the mesh they name (group size, link), time per link (commtime ``Links``), and an FSDP2 estimate on the 3-D
mesh end to end. No torch."""

from __future__ import annotations

import pytest

from zeroplan.formulas.collectives import Collective, on_mesh, ring_bytes_per_rank, step_collectives
from zeroplan.formulas.commtime import Links, alpha_beta_time_s, engine_step_time, ring_link, step_time
from zeroplan.formulas.mesh import Mesh, data_parallel_mesh, link_class
from zeroplan.presets import LinkSpec

NVLINK = LinkSpec(name="nv", scope="intra", bandwidth_gbps=100, alpha_s=5e-6)
NIC = LinkSpec(name="nic", scope="inter", bandwidth_gbps=25, alpha_s=10e-6)


@pytest.mark.parametrize(
    ("r", "s", "nm", "gpn", "links"),
    [
        (1, 8, 1, 8, {"dp_shard": "intra"}),  # one node
        (1, 16, 1, 8, {"dp_shard": "inter"}),  # a flat group of two nodes
        (2, 8, 1, 8, {"dp_replicate": "inter", "dp_shard": "intra"}),  # HSDP: shard inside, replicate across
        (4, 2, 1, 8, {"dp_replicate": "intra", "dp_shard": "intra"}),  # the whole mesh in one node
        (128, 8, 1, 8, {"dp_replicate": "inter", "dp_shard": "intra"}),  # 1,024 GPUs, node-sized shards
        (64, 16, 1, 8, {"dp_replicate": "inter", "dp_shard": "inter"}),  # shards of two nodes
        (4, 3, 1, 8, {"dp_replicate": "inter", "dp_shard": "inter"}),  # 3-rank groups straddle nodes: 6,7 | 8
        (2, 2, 4, 8, {"dp_replicate": "inter", "dp_shard": "intra", "tp": "intra"}),  # 16 GPUs: tp x dp_shard fill a node
        (2, 2, 4, 4, {"dp_replicate": "inter", "dp_shard": "inter", "tp": "intra"}),  # tp fills the 4-GPU node
    ],
)  # fmt: skip
def test_each_dimension_is_intra_or_inter_by_node_size(r, s, nm, gpn, links):
    mesh = data_parallel_mesh(r * s, r, nm, gpn)
    assert mesh.world == r * s * nm and mesh.shape() == tuple(v for v in (r, s, nm) if v > 1)
    assert {d: mesh.link(d) for d in mesh.names()} == links
    assert mesh.stride("dp_shard") == nm and mesh.stride("dp_replicate") == s * nm  # init_device_mesh's row-major


def test_a_flat_run_gets_the_same_link_as_the_ring_rule_everywhere():
    """One rule: the mesh's dp_shard link on a flat run is exactly ``ring_link``'s choice (N_m innermost)."""
    for gpn in (1, 2, 4, 8, 16):
        for nm in (1, 2, 4, 8):
            for nd in (1, 2, 3, 4, 6, 8, 16, 32):
                intra = ring_link(nd, nm, gpn, NVLINK, NIC) is NVLINK
                assert (data_parallel_mesh(nd, 1, nm, gpn).link("dp_shard") == "intra") == intra, (nd, nm, gpn)


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        ((("dp_shard", 4), ("dp_replicate", 2)), "must nest"),
        ((("dp_shard", 4), ("dp_shard", 2)), "at most once"),
        ((("pp", 4),), "each one of"),
        ((("dp_shard", 0),), "whole number >= 1"),
    ],
)
def test_a_bad_mesh_is_refused_in_one_line(dims, message):
    with pytest.raises(ValueError, match=message):
        Mesh(dims)
    with pytest.raises(ValueError, match="must divide N_d=8"):
        data_parallel_mesh(8, 3)


def test_flat_collectives_are_placed_on_dp_shard_with_the_whole_group():
    placed = on_mesh(step_collectives(3, (10_000,), 16, "bf16", "bf16"), 16, 1, 8)
    assert [(c.mesh_dim, c.group_size, c.link) for c in placed] == [("dp_shard", 16, "inter")] * 3
    assert set(placed[0].as_dict()) == {"op", "phase", "elements", "dtype", "bytes_per_rank", "mesh_dim",
                                        "group_size", "link"}  # fmt: skip
    # a post-forward group of k = 2 consecutive ranks (FSDP2's int reshard_after_forward) stays in the node
    k2 = Collective("all-gather", "backward", 100, "bf16", 100, group_size=2)
    assert on_mesh((k2,), 16, 1, 8)[0].link == "intra"
    assert link_class(2, 1, 16, 8) == "intra" and link_class(16, 1, 16, 8) == "inter"


def hsdp_collectives(r: int, s: int, shard_numel: int = 1_000_000):
    """One unit under HSDP: all-gather and reduce-scatter over S, the all-reduce of S_u over R."""
    full = s * shard_numel
    return (
        Collective("all-gather", "forward", full, "bf16", ring_bytes_per_rank("all-gather", full, s, 2), group_size=s),
        Collective("reduce-scatter", "backward", full, "fp32", ring_bytes_per_rank("reduce-scatter", full, s, 4),
                   group_size=s),
        Collective("all-reduce", "backward", shard_numel, "fp32",
                   ring_bytes_per_rank("all-reduce", shard_numel, r, 4), mesh_dim="dp_replicate", group_size=r),
    )  # fmt: skip


def test_time_per_link_charges_each_collective_to_its_own_link_and_group():
    """HSDP 4 x 8 on 8-GPU nodes: the dp_shard calls on NVLink over 8 ranks, the all-reduce over 4 replicas at
    the slowest link it crosses (25 GB/s, α 10 us); the flat model charged all three to the crossing ring."""
    r, s = 4, 8
    colls = hsdp_collectives(r, s)
    t = engine_step_time(colls, r * s, Links(NVLINK, NIC, 8))
    ag, rs, ar = colls
    expected = [alpha_beta_time_s("all-gather", ag.elements * 2, s, 1e11, 5e-6),
                alpha_beta_time_s("reduce-scatter", rs.elements * 4, s, 1e11, 5e-6),
                alpha_beta_time_s("all-reduce", ar.elements * 4, r, 25e9, 10e-6)]  # fmt: skip
    assert [c.seconds_per_call for c in t.collectives] == pytest.approx(expected)
    assert [c.collective.link for c in t.collectives] == ["intra", "intra", "inter"]
    assert t.link == "nv + nic"  # the slowest link any collective runs at
    flat = engine_step_time(colls, r * s, ring_link(r * s, 1, 8, NVLINK, NIC))
    # the one ring of the flat model: the shard traffic too at 25 GB/s and α 10 us
    assert flat.collectives[0].seconds_per_call == pytest.approx(
        alpha_beta_time_s("all-gather", ag.elements * 2, s, 25e9, 10e-6))  # fmt: skip
    assert flat.comm_s > t.comm_s


def test_links_leave_a_flat_run_as_the_ring_had_it():
    """One node or many, a flat run's collectives all sit on one class: the same seconds as the one ring."""
    for nd in (8, 64):
        colls = step_collectives(3, (8_000_000,), nd, "bf16", "bf16")
        ring = ring_link(nd, 1, 8, NVLINK, NIC)
        by_link = step_time(3, colls, nd, Links(NVLINK, NIC, 8), grad_accum=2)
        by_ring = step_time(3, colls, nd, ring, grad_accum=2)
        assert [c.seconds for c in by_link.collectives] == pytest.approx([c.seconds for c in by_ring.collectives])
        assert by_link.link == ring.name


@pytest.mark.parametrize(("dp_shard", "links"), [
    (4, {"tp": "intra", "dp_shard": "intra", "dp_replicate": "inter"}),  # tp 2 x dp_shard 4 fill a node of 8
    (8, {"tp": "intra", "dp_shard": "inter", "dp_replicate": "inter"}),  # dp_shard spans 16 GPUs: two nodes
])  # fmt: skip
def test_fsdp2_hsdp_tp_json_places_every_collective_on_the_3d_mesh(dp_shard, links):
    """``estimate --engine fsdp2 --tp 2 --dp-shard S`` on 32 GPUs (R = 16 / S): torchtitan's 3-D mesh (R, S, 2),
    tp innermost; every JSON collective names its mesh dimension, its group (T, S or R) and its link."""
    import json

    from typer.testing import CliRunner

    from zeroplan.cli import app

    out = CliRunner().invoke(app, ["estimate", "--engine", "fsdp2", "--model", "llama3-8b", "--gpus", "32",
                                   "--tp", "2", "--dp-shard", str(dp_shard), "--seq-len", "2048",
                                   "--micro-batch", "1", "--json"])  # fmt: skip
    assert out.exit_code == 0, out.output
    (stage,) = json.loads(out.stdout)["stages"]
    rows = stage["collectives"]
    groups = {"tp": 2, "dp_shard": dp_shard, "dp_replicate": 16 // dp_shard}
    assert {c["mesh_dim"] for c in rows} == set(links)
    assert all((c["group_size"], c["link"]) == (groups[c["mesh_dim"]], links[c["mesh_dim"]]) for c in rows)
