"""DeepSpeed's NVMe optimizer offload at ZeRO-3 (issue 21, ZeRO-Infinity): the host terms and NVMe bytes from
DeepSpeed 0.19.8's source (nvme.py; unmeasured: ``async_io`` cannot be built here), asserted by hand.

gpt-tiny (validate/models.py): Ψ = 36,324; ZeRO-3 at N_d = 2 holds a partition of 18,162 elements, 72,648 fp32
bytes, below the 1 MiB swap threshold: DeepSpeed keeps it as with cpu offload and allocates the pool anyway.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zeroplan.engines import deepspeed as D
from zeroplan.engines.deepspeed import nvme
from zeroplan.engines.deepspeed.offload import host_memory, nvme_host_terms
from zeroplan.engines.deepspeed.wrapper import ds_run

PART = 36_324 // 2
ALIGNED = 18_176  # 18,162 rounded up to 256 fp32 elements (AIO_ALIGNED_BYTES 1024 / 4)


def _nvme(stage: int = 3, **extra) -> dict:
    return {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", **extra}},
            "bf16": {"enabled": True}}  # fmt: skip


def test_read_and_written_back():
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
        "fp32 gradient of the master partition (pinned)": PART * 4, "Adam m and v (DeepSpeedCPUAdam)": PART * 8}  # fmt: skip
    assert h.offload.label == "optimizer->nvme" and nvme.nvme_traffic(PART) == (0, 0)


def test_swapped_partition_lives_in_the_pool():
    """A partition of 10M elements (40 MB fp32, swapped): the pool and the gradient partition only."""
    s = D.Settings.from_ds_config(_nvme())
    terms = nvme_host_terms(SimpleNamespace(settings=s), 10_000_000)
    aligned = 10_000_128  # 10,000,000 rounded up to 256
    assert [(t.name, t.bytes) for t in terms] == [
        ("optimizer NVMe swap buffers (from source, unmeasured) (pinned)", 4 * aligned * 4),
        ("gradient partition (pinned)", 10_000_000 * 2)]  # fmt: skip
    # read: master, m, v at the aligned length + the fp32 gradient; write the same
    assert nvme.nvme_traffic(10_000_000) == (3 * aligned * 4 + 40_000_000,) * 2


def test_swap_threshold_and_alignment():
    assert nvme.swappable(262_144) and not nvme.swappable(262_143)  # 1 MiB of fp32 (MIN_AIO_BYTES, block_size)
    assert (nvme.io_aligned_numel(256), nvme.io_aligned_numel(257)) == (256, 512)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (_nvme(stage=2), "nvme' at ZeRO-2: not modelled"),
        (_nvme(buffer_count=3), "buffer_count=3: Adam's swap-in needs 4"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/n"}}},
         "parameter swapping is not modelled"),
    ],
)  # fmt: skip
def test_refusals_one_line(cfg, message):
    with pytest.raises(ValueError, match="deepspeed config") as err:
        D.Settings.from_ds_config(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)
