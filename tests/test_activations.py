"""Activation estimate: Korthikanti et al. 2022 (arXiv:2205.05198), Table 2 per layer, times L."""

import pytest

import zeroplan
from zeroplan.formulas.activations import activation_bytes
from zeroplan.presets import get_model

GPT3 = get_model("gpt3-175b").spec  # s = 2048, h = 12288, a = 96, L = 96


def test_gpt3_without_recomputation_by_hand():
    # sbh(34 + 5as/h) per layer: 2048·12288·34 + 5·96·2048² = 855,638,016 + 2,013,265,920 bytes, x 96 layers.
    assert activation_bytes(GPT3, 2048, 1, "none") == (855_638_016 + 2_013_265_920) * 96


def test_tensor_and_sequence_parallel_divide_by_t():
    assert activation_bytes(GPT3, 2048, 1, "none", tp=8) == (855_638_016 + 2_013_265_920) * 96 // 8
    assert activation_bytes(GPT3, 2048, 2, "selective", tp=8) == 34 * 2048 * 2 * 12288 * 96 // 8


def test_full_recomputation_keeps_each_layer_input():
    # 2sbh per layer, any architecture: Llama 2 70B at s = 4096, b = 1: 2·4096·8192·80 = 5 GiB.
    assert activation_bytes(get_model("llama2-70b").spec, 4096, 1, "full") == 5 * 2**30


def test_llama_constants_are_not_published():
    assert activation_bytes(get_model("llama2-70b").spec, 4096, 1, "none") is None
    assert activation_bytes(get_model("llama2-70b").spec, 4096, 1, "selective") is None


def test_bad_checkpointing():
    with pytest.raises(ValueError, match="checkpointing='some'"):
        activation_bytes(GPT3, 2048, 1, "some")


def test_plan_reports_activations_against_the_headroom():
    p = zeroplan.plan("gpt3-175b", gpu="h100-80gb", gpus=1024, model_parallel=8, checkpointing="selective",
                      headroom=0.1)  # fits on model states: the headroom is what activations must fit in
    assert p.activation_bytes == 34 * 2048 * 12288 * 96 // 8
    assert p.headroom_bytes == 80 * 2**30 - int(0.9 * 80 * 2**30)
    assert p.activation_bytes > p.headroom_bytes
