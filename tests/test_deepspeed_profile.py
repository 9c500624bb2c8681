"""The DeepSpeed engine profile without DeepSpeed: strict ds_config reading, DeepSpeed 0.19.8's defaults,
the optimizer class it builds, emitted configs that read back as predicted, and the planning hook.
(Against the real engine: tests/test_deepspeed_engine.py and tests/test_deepspeed_runner.py.)"""

from __future__ import annotations

import pytest

from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines import ENGINES
from zeroplan.engines import deepspeed as D
from zeroplan.engines.base import Workload


def _workload(micro_batch: int = 2, seq: int = 16) -> Workload:
    from zeroplan.architectures.hf_config import spec_from_hf_config

    spec = spec_from_hf_config({"model_type": "gpt2", "activation_function": "gelu", "n_layer": 2, "n_embd": 36,
                                "n_head": 3, "vocab_size": 101, "n_positions": 16}, "gpt-tiny")  # fmt: skip
    return Workload(tuple(transformer_shapes(spec)), spec, seq, micro_batch)


def test_defaults_are_deepspeed_0_19_8s():
    s = D.Settings.from_ds_config({"zero_optimization": {"stage": 2}})
    assert (s.reduce_bucket_size, s.allgather_bucket_size, s.prefetch_bucket_size) == (
        500_000_000,
        500_000_000,
        50_000_000,
    )
    assert (s.param_persistence_threshold, s.max_live_parameters, s.max_reuse_distance) == (
        100_000,
        10**9,
        10**9,
    )
    assert s.contiguous_gradients and s.use_multi_rank_bucket_allreduce and not s.overlaps
    assert D.Settings.from_ds_config({"zero_optimization": {"stage": 3}}).overlaps  # overlap_comm_valid
    assert s.dtype == "fp32" and s.grad_dtype == "fp32" and not s.torch_adam


def test_keys_change_the_settings():
    s = D.Settings.from_ds_config({
        "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
        "optimizer": {"type": "AdamW", "params": {"torch_adam": True, "foreach": False}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e3, "overlap_comm": True},
    })  # fmt: skip
    assert (s.dtype, s.grad_dtype, s.reduce_bucket_size, s.overlaps) == ("bf16", "fp32", 5000, True)
    assert (D.optimizer_class(s), D.inner_optimizer_class(s)) == ("BF16_Optimizer", "AdamW")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "5e8"}}, "reduce_bucket_size='5e8'"),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1.5}}, "whole number"),
        ({"zero_optimization": {"stage": 2, "overlap_comm": "true"}}, "overlap_comm='true'"),
        ({"zero_optimization": {"stage": 0}}, "covers 1-3"),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD"}}, "Adam and AdamW"),
        (
            {"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam", "params": {"torch_adam": 1}}},
            "torch_adam=1",
        ),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "offload"),
    ],
)
def test_bad_keys_are_one_line_naming_the_key(config, message):
    with pytest.raises(ValueError, match="deepspeed config") as err:
        D.Settings.from_ds_config(config)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_stage_option_fills_in_or_contradicts():
    assert D.Settings.from_ds_config({}, stage=3).stage == 3
    with pytest.raises(ValueError, match="contradicts"):
        D.Settings.from_ds_config({"zero_optimization": {"stage": 2}}, stage=3)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_emitted_config_reads_back_as_predicted(stage, dtype):
    s = D.Settings(
        stage=stage, dtype=dtype, reduce_bucket_size=5000, torch_adam=True, foreach=False, overlap_comm=True
    )
    assert D.Settings.from_ds_config(D.to_ds_config(s)) == s
    assert D.Settings.from_ds_config(D.to_ds_config(D.Settings(stage=stage))) == D.Settings(stage=stage)


def test_bucket_is_allocated_at_its_configured_size_whatever_the_model():
    """Issue 11: ZeRO-2 at defaults peaks at the 5e8-element bucket (2 GB in fp32) for a 36k-parameter
    model."""
    w = _workload()
    (big,) = D.estimate(w, 2, D.Settings(stage=2))
    (small,) = D.estimate(w, 2, D.Settings(stage=2, reduce_bucket_size=5000))
    assert big.peak.peak_phase == "backward"
    bucket = next(t for t in big.peak.peak_terms if t.name.startswith("reduce bucket"))
    assert bucket.bytes == 500_000_000 * 4
    assert 0 < big.peak.peak_bytes - bucket.bytes < small.peak.peak_bytes  # the rest: the model and a step
    assert big.model_states_bytes == small.model_states_bytes  # ZeRO-1/2 buckets live in backward only
    assert (
        D.ds_estimate_bytes(D.Settings(stage=2), tuple(n for n in (3636, 576)), 2)
        == 2 * 4212 + 18 * 4212 // 2
    )


def test_registry_and_no_torch():
    """The profile is pure: ``--engine deepspeed`` in ``zeroplan estimate`` must not import torch."""
    import ast
    import inspect

    assert ENGINES["deepspeed"] is D.estimate
    tree = ast.parse(inspect.getsource(D))
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not ({"torch", "deepspeed", "pandas", "matplotlib"} & names)


def test_recommend_lowest_stage_then_largest_bucket_that_fits():
    w = _workload()
    r = D.recommend(w, 4, 30 * 10**6, D.Settings(stage=1))
    assert (r.settings.stage, r.settings.reduce_bucket_size) == (1, 5_000_000)
    assert [t[1] for t in r.tried] == list(D.BUCKET_CHOICES)
    assert r.estimate.peak.peak_bytes <= 30 * 10**6
    assert D.Settings.from_ds_config(r.ds_config) == r.settings  # the JSON is the predicted configuration
    assert D.recommend(w, 4, 10**6, D.Settings(stage=1)) is None  # no bucket choice fits 1 MB
