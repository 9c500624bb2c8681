"""ZeRO-2's tied-embedding backward (zeroplan/engines/deepspeed/zero12.py ``_tied_embedding_backward``) against
its recorded row: the 5.4M GPT, fp32, overlap_comm, checkpointed, 1e5-element buckets, N_d = 2
(tests/data/measured/deepspeed.json). Its prediction fields were recorded before the moment existed (9,424,904 B
short on rank 1), so ``test_measured_rows`` alone would not catch the moment's loss: this asserts the bound the
moment was made for (each rank within 1% over, at most 0.5% under its own prediction). Pure planner, milliseconds."""

from __future__ import annotations

import pytest

from tests.test_measured_rows import RECORDS, estimate_of

ROW = "deepspeed-z2-gpt-5m-fp32-buckets1e5-overlap-ckpt-nd2"


@pytest.mark.parametrize("rank", [0, 1])
def test_tied_embedding_backward_is_the_rows_backward_peak(rank):
    # each rank against its own prediction (its own grads_in_partition): 89,487,640 B measured on rank 0,
    # 90,444,056 B on rank 1
    (record,) = [r for r in RECORDS if r["name"] == ROW]
    row = estimate_of(record, rank)
    measured = record["ranks"][rank]["measured_peak_bytes_by_phase"]["backward"]
    backward = next(p for p in row.peak.phases if p.phase == "backward")
    assert backward.moment == "tied embedding backward"
    assert -0.005 * measured <= backward.bytes - measured <= 0.01 * measured, (backward.bytes, measured)
    tied = next(t for t in backward.terms if t.name.startswith("tied embedding gradients"))
    assert tied.bytes == 3 * 8192 * 256 * 4  # the head's gradient, the embedding's and their sum, fp32
