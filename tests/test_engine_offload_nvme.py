"""DeepSpeed's NVMe optimizer offload at ZeRO-3 (issue 21, ZeRO-Infinity): the host terms and NVMe bytes from
DeepSpeed 0.19.8's source (nvme.py; unmeasured: ``async_io`` cannot be built here), asserted by hand.

gpt-tiny (validate/models.py): Ψ = 36,324; ZeRO-3 at N_d = 2 holds a partition of 18,162 elements, 72,648 fp32
bytes, below the 1 MiB swap threshold: DeepSpeed keeps it as with cpu offload and allocates the pool anyway.

The swapped case was also run (``_standin``, ZEROPLAN_FULL_MATRICES=1): DeepSpeed 0.19.8 itself, ZeRO-3 on the CPU at
world size 1, with a Python stand-in for the ``async_io`` op (synchronous file reads and writes, its "locked"
tensors plain host tensors): the pool, the fp32 master's storage and the bytes each step moves are DeepSpeed's
own; the stand-in only replaces libaio. Recorded in ``STANDIN``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from zeroplan.engines import deepspeed as D
from zeroplan.engines.deepspeed import nvme
from zeroplan.engines.deepspeed.offload import host_memory, nvme_host_terms
from zeroplan.engines.deepspeed.wrapper import ds_run, wrapper_for

PART = 36_324 // 2
ALIGNED = 18_176  # 18,162 rounded up to 256 fp32 elements (AIO_ALIGNED_BYTES 1024 / 4)


def _nvme(stage: int = 3, **extra) -> dict:
    target = {"device": "nvme", "nvme_path": "/nvme", **extra}
    return {"zero_optimization": {"stage": stage, "offload_optimizer": target},
            "bf16": {"enabled": True}}  # fmt: skip


def test_read_and_written_back():
    assert D.Settings.from_ds_config({**_nvme(), "aio": {"block_size": 1_048_576, "intra_op_parallelism": 1}})
    s = D.Settings.from_ds_config(_nvme(buffer_count=6))
    assert (s.offload_optimizer.device, s.offload_optimizer.buffer_count) == ("nvme", 6)
    assert D.Settings.from_ds_config(D.to_ds_config(s)) == s


@pytest.mark.parametrize("count", [None, 6])
def test_small_partition_keeps_cpu_terms_beside_the_pool(count):
    from validate.engines.deepspeed_compare import workload_for

    s = D.Settings.from_ds_config(_nvme(**({} if count is None else {"buffer_count": count})))
    h = host_memory(ds_run(s, workload_for("gpt-tiny", 2, None), 2))
    n = 4 if count is None else count  # offload_config.py buffer_count default 4
    assert {t.name: t.bytes for t in h.terms} == {
        "optimizer NVMe swap buffers (from source, unmeasured) (pinned)": n * ALIGNED * 4,
        "gradient partition (pinned)": PART * 2, "fp32 master partition": PART * 4,
        "fp32 gradient of the master partition (pinned)": PART * 4,
        "Adam m and v (DeepSpeedCPUAdam)": PART * 8}  # fmt: skip
    assert h.offload.label == "optimizer->nvme" and nvme.nvme_traffic(PART, (PART,)) == (0, 0)


def test_swapped_partition_lives_in_the_pool():
    """A partition of 10M elements (40 MB fp32, swapped): the pool and the gradient partition only."""
    s = D.Settings.from_ds_config(_nvme())
    terms = nvme_host_terms(SimpleNamespace(settings=s), 10_000_000)
    aligned = 10_000_128  # 10,000,000 rounded up to 256
    assert [(t.name, t.bytes) for t in terms] == [
        ("optimizer NVMe swap buffers (from source, unmeasured) (pinned)", 4 * aligned * 4),
        ("gradient partition (pinned)", 10_000_000 * 2)]  # fmt: skip
    # read: master, m, v at the aligned length + the swapped fp32 gradient slices; write the same
    slices = (9_000_100, 999_900)  # each cut down to a multiple of 256 (the remainder stays on the host)
    grads = (9_000_100 // 256 * 256 + 999_900 // 256 * 256) * 4
    assert nvme.nvme_traffic(10_000_000, slices) == (3 * aligned * 4 + grads,) * 2
    assert nvme.nvme_traffic(10_000_000, slices, first_step=True) == (aligned * 4 + grads, 3 * aligned * 4 + grads)
    assert nvme.gradient_swap_bytes((262_143, 1_000)) == 0  # below 1 MiB: kept on the host (unswapped_gradients)


def test_swap_threshold_and_alignment():
    assert nvme.swappable(262_144) and not nvme.swappable(262_143)  # 1 MiB of fp32 (MIN_AIO_BYTES, block_size)
    assert (nvme.io_aligned_numel(256), nvme.io_aligned_numel(257)) == (256, 512)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (_nvme(stage=2), "nvme' at ZeRO-2: not modelled"),
        (_nvme(buffer_count=3), "buffer_count=3: Adam's swap-in needs 4"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "offload_param.nvme_path"),
        ({**_nvme(), "aio": {"block_size": 262144}}, "aio.block_size=262144: the NVMe terms are modelled at"),
        ({**_nvme(), "aio": {"intra_op_parallelism": 4}}, "aio.intra_op_parallelism=4"),
        ({**_nvme(), "aio": [1]}, "aio=[1]: expected an object"),
    ],
)  # fmt: skip
def test_refusals_one_line(cfg, message):
    """Each refusal names its key in one line; an ``aio`` section that moves the defaults the NVMe terms use is refused
    rather than silently predicted with the defaults (the section's default values are accepted)."""
    with pytest.raises(ValueError, match="deepspeed config") as err:
        D.Settings.from_ds_config(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


STANDIN_WIDTH = 1024
STANDIN = {"pool": 33_587_200, "fp32_master_numel": 0, "grad_partition": 4_198_400,
           "step1": [16_785_408, 33_579_008], "step2": [33_579_008, 33_579_008]}  # fmt: skip
"""Measured by ``_standin`` (two bf16 Linear(1024, 1024), N_d = 1, DeepSpeed's defaults, AdamW)."""


def test_prediction_matches_the_standin_run():
    """The swapped partition: 2 x (1,048,576 + 1,024) = 2,099,200 elements (a multiple of 256); the biases' 4-KiB
    gradients stay on the host, the weights' go to the NVMe; step 1 reads no m, v (made by that step)."""
    part, slices = 2 * (STANDIN_WIDTH**2 + STANDIN_WIDTH), (STANDIN_WIDTH**2, STANDIN_WIDTH) * 2
    s = D.Settings.from_ds_config(_nvme())
    terms = {t.name: t.bytes for t in nvme_host_terms(SimpleNamespace(settings=s), part)}
    assert terms == {"optimizer NVMe swap buffers (from source, unmeasured) (pinned)": STANDIN["pool"],
                     "gradient partition (pinned)": STANDIN["grad_partition"]}  # fmt: skip
    assert list(nvme.nvme_traffic(part, slices, first_step=True)) == STANDIN["step1"]
    assert list(nvme.nvme_traffic(part, slices)) == STANDIN["step2"]


def test_host_memory_carries_the_standin_step_bytes():
    """``host_memory`` of the stand-in's run (N_d = 1: each parameter's slice is the whole parameter) carries the
    steady step's NVMe bytes as measured (``STANDIN["step2"]``); the small gpt-tiny partition swaps nothing (0, 0);
    cpu offload has no NVMe bytes (None)."""
    from validate.engines.deepspeed_compare import workload_for

    s = D.Settings.from_ds_config(_nvme())
    run = SimpleNamespace(settings=s, numels=(STANDIN_WIDTH**2, STANDIN_WIDTH) * 2, nd=1, grad_accum=1,
                          wrapper=wrapper_for(s))
    h = host_memory(run)
    assert [h.nvme_read_bytes, h.nvme_write_bytes] == STANDIN["step2"]
    tiny = host_memory(ds_run(s, workload_for("gpt-tiny", 2, None), 2))
    assert (tiny.nvme_read_bytes, tiny.nvme_write_bytes) == (0, 0)
    cpu = D.Settings.from_ds_config({**_nvme(), "zero_optimization": {"stage": 3,
                                                                      "offload_optimizer": {"device": "cpu"}}})
    h_cpu = host_memory(ds_run(cpu, workload_for("gpt-tiny", 2, None), 2))
    assert (h_cpu.nvme_read_bytes, h_cpu.nvme_write_bytes) == (None, None) and h_cpu.d2h_bytes > 0


def test_estimate_prints_the_nvme_bytes(tmp_path):
    """llama2-7b at N_d = 8, ZeRO-3 nvme, by hand: slices (ceil(n/8)) of the embedding and LM head 16,384,000, each
    attention matrix 2,097,152, each MLP matrix 5,636,096 (all multiples of 256: G = 4 x 842,268,672 B); the 65
    norms' 512-element slices stay on the host; P = 842,268,672 + 65 x 512 = 842,301,952 = A. Read = write =
    12A + G = 13,476,698,112 B, in ``estimate --json`` and under the table; null with cpu offload, absent without."""
    from tests.clicheck import run, run_json

    grads = 4 * (2 * 16_384_000 + 32 * (4 * 2_097_152 + 3 * 5_636_096))
    step = 12 * (842_268_672 + 65 * 512) + grads
    assert (grads, step) == (3_369_074_688, 13_476_698_112)
    args = ("estimate", "--engine", "deepspeed", "--model", "llama2-7b", "--gpus", "8", "--deepspeed-config")
    rows = {}
    for device in ("nvme", "cpu", "none"):
        cfg = tmp_path / f"{device}.json"
        cfg.write_text(json.dumps({**_nvme(), "zero_optimization": {"stage": 3, "offload_optimizer": {
            "device": device, **({"nvme_path": "/nvme"} if device == "nvme" else {})}}}))
        (rows[device],) = run_json(*args, str(cfg))["stages"]
    keys = ("nvme_read_bytes_per_step", "nvme_write_bytes_per_step")
    assert [rows["nvme"][k] for k in keys] == [step, step]
    assert [rows["cpu"][k] for k in keys] == [None, None] and not set(keys) & set(rows["none"])
    table = run(*args, str(tmp_path / "nvme.json")).stdout
    assert "NVMe, stage 3: 13.5 GB read, 13.5 GB written per rank per steady optimizer step" in table
    assert "NVMe, stage" not in run(*args, str(tmp_path / "cpu.json")).stdout


FULL = os.environ.get("ZEROPLAN_FULL_MATRICES") == "1"


@pytest.mark.skipif(not FULL, reason="full matrices only (ZEROPLAN_FULL_MATRICES=1)")
def test_standin_run_is_recorded(tmp_path):
    out = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"}, check=True).stdout  # fmt: skip
    assert json.loads(out.strip().splitlines()[-1]) == STANDIN


def _install_standin(stats: dict) -> None:
    """Replace DeepSpeed's ``async_io`` op by synchronous file reads and writes (its "locked" tensors plain host
    tensors), counting into ``stats``: "locked" (bytes of each locked buffer, a list), "read" and "write" bytes."""
    import types

    import torch
    from deepspeed.ops import op_builder

    pinned = set()

    class Handle:
        def __init__(self, *a, **k):
            self.n = 0

        def new_cpu_locked_tensor(self, n, example):
            t = torch.zeros(int(n), dtype=example.dtype)
            stats["locked"].append(t.numel() * t.element_size())
            pinned.add(t.untyped_storage().data_ptr())
            return t

        def free_cpu_locked_tensor(self, t):
            pinned.discard(t.untyped_storage().data_ptr())

        def is_pinned(self, t):
            return t.untyped_storage().data_ptr() in pinned

        def async_pwrite(self, t, path, offset):
            data = t.contiguous().view(torch.uint8).numpy().tobytes()
            stats["write"] += len(data)
            with open(path, "wb") as f:
                f.write(data)
            self.n += 1
            return 0

        def async_pread(self, t, path, offset):
            nbytes = t.numel() * t.element_size()
            with open(path, "rb") as f:
                data = f.read(nbytes).ljust(nbytes, b"\0")
            t.view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            stats["read"] += nbytes
            self.n += 1
            return 0

        def wait(self):
            n, self.n = self.n, 0
            return n

    op_builder.AsyncIOBuilder.load = lambda self, verbose=True: types.SimpleNamespace(aio_handle=Handle)


def _standin(folder: str) -> dict:
    """DeepSpeed 0.19.8 ZeRO-3 + ``offload_optimizer: nvme`` on the CPU, its ``async_io`` op replaced by files."""
    import torch

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    import deepspeed

    stats = {"locked": [], "read": 0, "write": 0}
    _install_standin(stats)
    torch.manual_seed(0)
    w = STANDIN_WIDTH
    model = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.Linear(w, w))
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": folder}}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    opt, x, steps = engine.optimizer, torch.randn(2, w, dtype=torch.bfloat16), []
    for _ in range(2):
        before = dict(stats)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        steps.append([stats["read"] - before["read"], stats["write"] - before["write"]])
    g = opt.grad_partitions_flat_buffer
    return {"pool": sum(stats["locked"]), "fp32_master_numel": sum(t.numel() for t in opt.fp32_partitioned_groups_flat),
            "grad_partition": g.numel() * g.element_size(), "step1": steps[0], "step2": steps[1]}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(_standin(sys.argv[1])))
