"""Issue 16's speed-up of DeepSpeed's worst rank: where every rank is described, each family of per-rank
moments lists only the first rank whose moment is largest (``DSRun.first_largest``). ``peak_of`` takes a phase's
first largest moment, so the peak per phase, its named moment and its terms must equal those of every rank's
moment listed: checked against that listing (``first_largest`` patched to keep every rank), pure planner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines import deepspeed as D
from zeroplan.engines.base import Workload
import zeroplan.engines.deepspeed.run as run_module
from zeroplan.engines.deepspeed.run import DSRun
from zeroplan.formulas.peak import peak_of

CONFIGS = Path(__file__).resolve().parent / "data" / "hf_configs"


def _workload(name: str, grad_accum: int, checkpointing: str) -> Workload:
    spec = spec_from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()))
    return Workload(transformer_shapes(spec), spec, 16, 2, checkpointing=checkpointing, grad_accum=grad_accum,
                    transformers=True)  # fmt: skip


def _every_rank(self, extra_bytes, ranks=None):
    return tuple(self.ranks) if ranks is None else ranks


# (stage, overlap_comm, ds_config precision): the wrappers' per-rank families (ZeRO-1 after backward and from
# its hooks, ZeRO-2), and fp32 gradients under bf16 (a partition within one parameter is a view)
CASES = [(1, False, {}), (1, True, {}), (2, None, {}),
         (2, None, {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}})]  # fmt: skip


@pytest.mark.parametrize("model", ["tiny-mistral", "tiny-qwen2"])
@pytest.mark.parametrize("nd", [3, 7])
@pytest.mark.parametrize("grad_accum, checkpointing", [(1, "none"), (2, "full")])
@pytest.mark.parametrize("stage, overlap, precision", CASES)
def test_first_largest_keeps_every_phase_peak(monkeypatch, model, nd, grad_accum, checkpointing, stage, overlap,
                                              precision):  # fmt: skip
    w = _workload(model, grad_accum, checkpointing)
    zero = {"stage": stage, "reduce_bucket_size": 20_000, **({"overlap_comm": overlap} if overlap is not None else {})}
    settings = D.Settings.from_ds_config({**precision, "zero_optimization": zero})
    run = D.ds_run(settings, w, nd, stat_bytes=4)
    listed = D.moments(run)
    fast = peak_of(listed)
    monkeypatch.setattr(DSRun, "first_largest", _every_rank)
    monkeypatch.setattr(run_module, "_SHARED", {})  # the winners a layout's runs share (``shared_memo``): listed afresh
    every = D.moments(D.ds_run(settings, w, nd, stat_bytes=4))
    assert len(every) > len(listed)  # the families had several ranks each
    assert fast == peak_of(every)
