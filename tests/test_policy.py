"""Precision and optimizer policies: K and the bytes per parameter follow from the dtypes."""

import pytest
from pydantic import ValidationError

import zeroplan

PSI = 1_000_000_000


@pytest.mark.parametrize(
    "policy, bytes_per_param, k",
    [
        # ZeRO sec. 3.1: mixed-precision Adam, 2 + 2 + K with K = 12 (master 4, m 4, v 4).
        ({}, 16, 12),
        ({"param_dtype": "bf16"}, 16, 12),
        ({"param_dtype": "torch.bfloat16", "optimizer": "adamw"}, 16, 12),
        # fp32 Adam: no separate master copy; params 4 + grads 4 + m 4 + v 4.
        ({"param_dtype": "fp32"}, 16, 8),
        # SGD without momentum in mixed precision keeps only the fp32 master: K = 4.
        ({"optimizer": "sgd"}, 8, 4),
        ({"optimizer": "sgd-momentum"}, 12, 8),
        ({"optimizer": "sgd", "param_dtype": "fp32"}, 8, 0),
        # LAMB keeps Adam's m and v; Lion one momentum (You et al. 2020; Chen et al. 2023).
        ({"optimizer": "lamb"}, 16, 12),
        ({"optimizer": "lion"}, 12, 8),
        # Adafactor (beta1=None): factored second moments are not counted per parameter.
        ({"optimizer": "adafactor"}, 8, 4),
        # bf16 Adam states (e.g. optimizer_dtype=bf16): m 2 + v 2.
        ({"optimizer_dtype": "bf16"}, 12, 8),
        ({"master_weights": False, "param_dtype": "bf16", "optimizer_dtype": "bf16"}, 8, 4),
        # fp32 grads with bf16 params (e.g. FSDP MixedPrecisionPolicy reduce_dtype=fp32).
        ({"param_dtype": "bf16", "grad_dtype": "fp32"}, 18, 12),
    ],
)
def test_bytes_per_param(policy, bytes_per_param, k):
    e = zeroplan.estimate(PSI, gpus=1, stage=0, **policy)
    assert e.stage(0).memory.model_states_bytes == bytes_per_param * PSI
    assert e.k == k


def test_adam8bit_counts_blockwise_scales():
    # bitsandbytes: int8 m and v plus one fp32 absmax per 2048 elements of each (Dettmers et al. 2022).
    e = zeroplan.estimate(PSI, gpus=1, stage=0, optimizer="adam8bit")
    scales = 2 * -(-PSI // 2048) * 4
    assert e.stage(0).memory.optimizer_bytes == PSI * 4 + PSI * 2 + scales
    assert e.k == pytest.approx(6 + 8 / 2048)


def test_gradients_reduce_in_their_own_dtype():
    s = zeroplan.estimate(PSI, gpus=8, stage=2, param_dtype="bf16", grad_dtype="fp32").stage(2)
    assert [(c.op, c.dtype, c.bytes_per_rank) for c in s.collectives] == [
        ("reduce-scatter", "fp32", 7 * (PSI // 8) * 4),
        ("all-gather", "bf16", 7 * (PSI // 8) * 2),
    ]


def test_model_parallel_divides_model_states():
    # Sec. 5 / Table 2: with N_m-way model parallelism each rank holds Ψ/N_m of the model.
    e = zeroplan.estimate(128e9, gpus=1024, model_parallel=16)
    assert (e.nd, e.nm, e.psi) == (64, 16, 8_000_000_000)
    assert e.stage(3).memory.model_states_bytes == 16 * 8e9 / 64


def test_tensor_sizes_pad_each_tensor_to_a_multiple_of_nd():
    # Tensors of 10 and 7 elements on 4 ranks: shards of 3 + 2 = 5 elements, padded full buffer 20.
    e = zeroplan.estimate(tensor_numels=[10, 7], gpus=4)
    s1, s3 = e.stage(1), e.stage(3)
    assert s1.memory.params_bytes == 20 * 2 and s1.memory.optimizer_bytes == 5 * 12
    assert s3.memory.model_states_bytes == 5 * 16
    assert e.stage(0).memory.model_states_bytes == 17 * 16
    assert [c.elements for c in s3.collectives] == [20, 20, 20]
    assert s3.comm_bytes_per_rank == 3 * 3 * 5 * 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"params": 0}, "params=0.0: must be a positive"),
        ({"params": -1e9}, "must be a positive"),
        ({"params": float("nan")}, "must be a positive finite"),
        ({"params": float("inf")}, "must be a positive finite"),
        ({"params": 1.5}, "whole number"),
        ({"params": 1e9, "gpus": 0}, "gpus=0: must be >= 1"),
        ({"params": 1e9, "gpus": 2.5}, "gpus=2.5: must be a whole number"),
        ({"params": 1e9, "gpus": 6, "model_parallel": 4}, "does not divide"),
        ({"params": 1e9, "stage": 4}, "stage=4"),
        ({"params": 1e9, "optimizer": "rmsprop"}, "unknown optimizer 'rmsprop'"),
        ({"params": 1e9, "param_dtype": "fp4"}, "unknown dtype 'fp4'"),
        ({"params": 1e9, "tensor_numels": [3]}, "exactly one of params, tensor_numels and model"),
        ({"tensor_numels": [3, 0]}, "tensor_numels=0: must be >= 1"),
    ],
)
def test_bad_input_is_rejected_with_the_value(kwargs, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace("+", r"\+")):
        zeroplan.estimate(**kwargs)
