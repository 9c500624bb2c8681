"""Presets are validated data files; reference models have their published parameter counts."""

import pytest
from pydantic import ValidationError

from zeroplan.presets import (
    GpuSpec,
    LinkSpec,
    get_gpu,
    get_interconnect,
    get_model,
    gpu_presets,
    interconnect_presets,
    model_presets,
)  # fmt: skip


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("llama2-7b", 6_738_415_616),  # Hugging Face meta-llama/Llama-2-7b-hf: 6,738,415,616 parameters
        ("llama2-13b", 13_015_864_320),  # meta-llama/Llama-2-13b-hf
        ("llama2-70b", 68_976_648_192),  # meta-llama/Llama-2-70b-hf
        ("llama3-8b", 8_030_261_248),  # meta-llama/Meta-Llama-3-8B
        ("llama3-70b", 70_553_706_496),  # meta-llama/Meta-Llama-3-70B
        ("llama3-405b", 405_853_388_800),  # meta-llama/Llama-3.1-405B
        ("gpt2-xl", 1_557_611_200),  # Hugging Face gpt2-xl (tied head)
    ],
)
def test_reference_model_param_counts(name, params):
    assert get_model(name).params == params


def test_gpt3_is_175b():
    # Brown et al. 2020 Table 2.1 calls it 175B; the architecture gives 174.6B.
    assert get_model("gpt3-175b").params == pytest.approx(175e9, rel=0.003)


@pytest.mark.parametrize(
    ("name", "memory_bytes", "peak_flops"),
    [
        ("v100-32gb", 32 * 2**30, 125e12),
        ("a100-40gb", 40 * 2**30, 312e12),
        ("a100-80gb", 80 * 2**30, 312e12),
        ("h100-80gb", 80 * 2**30, 989.4e12),
        ("h200-141gb", 141 * 2**30, 989.4e12),
        ("b200", 180 * 2**30, 2.25e15),
        ("mi300x", 192 * 2**30, 1307.4e12),
    ],
)
def test_gpu_presets(name, memory_bytes, peak_flops):
    gpu = get_gpu(name)
    assert (gpu.memory_bytes, gpu.peak_flops) == (memory_bytes, peak_flops)
    assert gpu.source


@pytest.mark.parametrize(
    ("name", "gbps"),
    [("nvlink3", 300), ("nvlink4", 450), ("nvlink5", 900), ("pcie4", 31.5), ("pcie5", 63.0),
     ("ib-hdr", 25), ("ib-ndr", 50)],
)  # fmt: skip
def test_interconnect_bandwidths(name, gbps):
    assert get_interconnect(name).bandwidth_gbps == gbps


def test_every_preset_links_to_known_interconnects():
    for gpu in gpu_presets().values():
        assert get_interconnect(gpu.intra_node).scope == "intra"
        assert get_interconnect(gpu.host_link).scope == "intra"
    assert all(link.source for link in interconnect_presets().values())
    assert all(m.source for m in model_presets().values())


def test_lookup_is_case_insensitive():
    assert get_gpu(" H100-80GB ").name == "h100-80gb"


@pytest.mark.parametrize("getter", [get_gpu, get_interconnect, get_model])
def test_unknown_preset_lists_known_names(getter):
    with pytest.raises(ValueError, match="known .*s are .*,"):
        getter("no-such-thing")


def test_bad_values_are_rejected():
    with pytest.raises(ValidationError, match="bandwidth_gbps=-1: must be a positive finite number"):
        LinkSpec(name="x", scope="intra", bandwidth_gbps=-1, alpha_s=0)
    with pytest.raises(ValidationError, match="memory_bytes=0"):
        GpuSpec(name="x", description="", memory_bytes=0, peak_flops=1, peak_flops_dtype="bf16",
                intra_node="nvlink4", host_link="pcie5", source="")  # fmt: skip
    with pytest.raises(ValidationError, match="extra"):
        LinkSpec(name="x", scope="intra", bandwidth_gbps=1, alpha_s=0, latency=3)
