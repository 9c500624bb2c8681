"""validate.cuda_snapshot: live CUDA bytes by allocation site, from an allocator snapshot (the format of
``torch.cuda.memory._snapshot``: segments of blocks, each with its state, rounded size and the Python frames
of its allocation, innermost first). The recording itself needs a GPU (validate/gpu_check.sh, ONLY=snapshot)."""

from __future__ import annotations

import pickle

from validate.cuda_snapshot import live_by_site, report, slack_bytes

FSDP = {"filename": "/x/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "line": 412,
        "name": "foreach_reduce"}  # fmt: skip
ADAM = {"filename": "/x/site-packages/torch/optim/adam.py", "line": 120, "name": "_init_group"}
PLUMBING = {"filename": "/x/site-packages/torch/utils/_python_dispatch.py", "line": 9, "name": "__torch_dispatch__"}
RUNNER = {"filename": "/repo/validate/engines/fsdp2.py", "line": 260, "name": "measure"}


def _block(state: str, size: int, *frames: dict) -> dict:
    return {"state": state, "size": size, "requested_size": size - 3, "frames": list(frames)}


SNAPSHOT = {"segments": [
    {"blocks": [_block("active_allocated", 16_384, PLUMBING, FSDP, RUNNER), _block("inactive", 1 << 20),
                _block("active_allocated", 512, ADAM, RUNNER)]},
    {"blocks": [_block("active_allocated", 16_896, FSDP, RUNNER), _block("active_pending_free", 4096, FSDP),
                _block("active_allocated", 1024)]},
]}  # fmt: skip


def test_live_bytes_grouped_by_the_code_that_allocated_them():
    sites = live_by_site(SNAPSHOT)
    assert sites == [
        ("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:412 foreach_reduce <- validate/engines/fsdp2.py:260"
         " measure", 33_280, 2),
        ("(no Python frame recorded)", 1024, 1),
        ("torch/optim/adam.py:120 _init_group <- validate/engines/fsdp2.py:260 measure", 512, 1),
    ]  # inactive and pending-free blocks are not live; the dispatch frame says nothing about who allocated
    assert sum(b for _, b, _ in sites) == 16_384 + 512 + 16_896 + 1024


def test_report_reads_every_snapshot_of_a_run(tmp_path):
    for name in ("nd8_rank0_boundary", "nd8_rank0_after_init"):
        (tmp_path / f"{name}.pickle").write_bytes(pickle.dumps(SNAPSHOT))
    lines = report(tmp_path, top=1).splitlines()
    assert lines[0] == ("nd8_rank0_after_init: 34,816 B live in 4 blocks; 0 B of them beyond the requests' "
                        "512-B rounding, in 0 blocks")
    assert lines[1].split() [:3] == ["33,280", "B", "2"] and lines[2].startswith("nd8_rank0_boundary")


def test_slack_is_what_no_request_asked_for():
    """A block handed out whole (a cached 16,896-B block for a 16,381-B request: 16,384 after rounding) carries
    512 B no tensor asked for; a request rounded up to 512 B carries none."""
    whole = {"segments": [{"blocks": [
        {"state": "active_allocated", "size": 16_896, "requested_size": 16_381},
        {"state": "active_allocated", "size": 512, "requested_size": 100},
        {"state": "inactive", "size": 1 << 20, "requested_size": 0}]}]}  # fmt: skip
    assert slack_bytes(whole) == (512, 1)
    assert slack_bytes(SNAPSHOT) == (0, 0)  # every request there is 3 B under its 512-B multiple
