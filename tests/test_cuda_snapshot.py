"""validate.cuda_snapshot: live CUDA bytes by allocation site, from an allocator snapshot (the format of
``torch.cuda.memory._snapshot``: segments of blocks, each with its state, rounded size and the Python frames
of its allocation, innermost first). The recording itself needs a GPU (validate/gpu_check.sh, ONLY=snapshot)."""

from __future__ import annotations

import json
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


def _history() -> dict:
    """A compact whole-process history as ``write_history`` writes it (torch's trace entries, no stacks)."""
    mib, base = 1 << 20, 0x7F0000000000
    trace = [{"action": "segment_alloc", "addr": base, "size": 20 * mib, "stream": 0},
             {"action": "alloc", "addr": base, "size": 5 * mib, "stream": 0},  # 1-10 MiB: a 20 MiB segment
             {"action": "free_requested", "addr": base, "size": 5 * mib, "stream": 0},
             {"action": "free_completed", "addr": base, "size": 5 * mib, "stream": 0},
             {"action": "alloc", "addr": base, "size": 19 * mib + 1, "stream": 0}]  # fmt: skip
    segments = [{"address": base, "total_size": 20 * mib, "stream": 0, "segment_type": "large",
                 "blocks": [{"address": base, "size": 20 * mib, "requested_size": 19 * mib + 1,
                             "state": "active_allocated"}]}]  # fmt: skip
    stats = {"reserved_bytes.all.peak": 20 * mib, "allocated_bytes.all.peak": 20 * mib}
    meta = {"alloc_conf": "", "stats": stats, "device_used_bytes": 600 * mib, "reserved_bytes_at_exit": 20 * mib,
            "entries_cap": 100}  # fmt: skip
    return {"segments": segments, "device_traces": [trace], "meta": meta}


def test_a_recorded_process_history_replays_through_the_allocator_model(tmp_path):
    from validate.cuda_snapshot import replay_history, replay_report

    line = replay_history(_history())
    # 19 MiB + 1 B rounds to 19 MiB + 512: the 20 MiB block is handed out whole (under 1 MiB would remain)
    assert line.startswith("5 events, 1 segments: exact; reserved peak model 20,971,520 B, measured 20,971,520 B;")
    assert "allocated peak model 20,971,520 B, measured 20,971,520 B" in line
    assert "outside the allocator 608,174,080 B (derived" in line
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / "run_1.json").write_text(json.dumps(_history()))
    wrapped = _history()
    wrapped["meta"]["entries_cap"] = 5
    (tmp_path / "step" / "run_2.json").write_text(json.dumps(wrapped))
    lines = replay_report(tmp_path).splitlines()
    assert lines[0].startswith("step/run_1.json: 5 events, 1 segments: exact")
    assert lines[1] == "step/run_2.json: 5 events: the ring buffer wrapped, the history does not start at an empty allocator"


def test_a_history_the_model_disagrees_with_says_so():
    from validate.cuda_snapshot import replay_history

    data = _history()
    data["device_traces"][0].insert(4, {"action": "segment_alloc", "addr": 0x7F1000000000, "size": 20 * (1 << 20),
                                        "stream": 0})  # the GPU would have made a new segment: the model does not
    data["device_traces"][0][-1]["addr"] = 0x7F1000000000
    assert "1 segments: DIFFERS: 1 segment sizes, 1 addresses, 0 final segments" in replay_history(data)


def test_history_recording_is_inert_without_a_gpu_or_the_variable(monkeypatch):
    from validate import cuda_snapshot

    monkeypatch.delenv(cuda_snapshot.HISTORY_ENV, raising=False)
    assert cuda_snapshot.record_process_history() is False
    monkeypatch.setenv(cuda_snapshot.HISTORY_ENV, "/nonexistent")
    import torch

    assert cuda_snapshot.record_process_history() is torch.cuda.is_available()
    compile(cuda_snapshot.HOOK, "sitecustomize.py", "exec")  # the hook gpu_check.sh writes is valid Python


def test_gpu_check_is_valid_bash():
    import subprocess
    from pathlib import Path

    script = Path(__file__).parent.parent / "validate" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0


def test_write_history_writes_what_replay_reads(tmp_path, monkeypatch):
    """``write_history`` on CPU with torch.cuda's readers stubbed by what an H200 process would return: the file
    it writes replays exactly (the recording itself needs a GPU: validate/gpu_check.sh)."""
    import torch

    from validate import cuda_snapshot

    data = _history()
    snap = {"segments": [dict(s, device=0, is_expandable=False) for s in data["segments"]],
            "device_traces": [[dict(e, frames=[], time_us=1) for e in data["device_traces"][0]]]}  # fmt: skip
    stats = {"reserved_bytes.all.peak": 20 << 20, "allocated_bytes.all.peak": 20 << 20, "num_ooms": 0}
    for name, value in {"is_initialized": lambda: True, "synchronize": lambda: None, "memory_stats": lambda: stats,
                        "mem_get_info": lambda: (100 << 30, 141 << 30), "get_device_name": lambda _: "NVIDIA H200",
                        "get_device_capability": lambda _: (9, 0), "memory_reserved": lambda: 20 << 20}.items():  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: snap)
    monkeypatch.setenv(cuda_snapshot.LABEL_ENV, "fsdp2_sim_bf16")
    path = cuda_snapshot.write_history(tmp_path)
    assert path.name.startswith("fsdp2_sim_bf16_") and path.suffix == ".json"
    written = json.loads(path.read_text())
    assert written["meta"]["capability"] == [9, 0] and written["meta"]["stats"]["num_ooms"] == 0
    assert "frames" not in path.read_text()
    assert cuda_snapshot.replay_history(written).startswith("5 events, 1 segments: exact")


def test_replay_reads_the_probes_pickles_and_says_when_a_history_is_empty(tmp_path):
    from validate.cuda_snapshot import replay_report

    data = _history()
    del data["meta"]  # a ZEROPLAN_CUDA_SNAPSHOT pickle: torch's snapshot as is
    (tmp_path / "nd8_rank0_after_backward.pickle").write_bytes(pickle.dumps(data))
    (tmp_path / "stopped_1.json").write_text(json.dumps({"segments": [], "device_traces": [[]], "meta": {}}))
    lines = replay_report(tmp_path).splitlines()
    assert lines[0].startswith("nd8_rank0_after_backward.pickle: 5 events, 1 segments: exact")
    assert lines[1].startswith("stopped_1.json: no events")
