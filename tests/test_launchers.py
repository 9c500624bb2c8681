"""Launcher configs: DeepSpeed keys as DeepSpeed spells them, and an FSDP2 snippet that runs."""

import json
import subprocess
import sys

import pytest

from zeroplan.engines.deepspeed import deepspeed_config
from zeroplan.engines.fsdp2 import fsdp2_snippet
from zeroplan.formulas.offload import Offload

# Keys of DeepSpeed's zero_optimization section (deepspeed.ai/docs/config-json, "ZeRO Optimizations for
# FP16 Training" and "Parameter/Optimizer offloading").
ZERO_KEYS = {
    "stage", "allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter",
    "reduce_bucket_size", "contiguous_gradients", "offload_param", "offload_optimizer",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save",
    "sub_group_size", "elastic_checkpoint", "round_robin_gradients",
}  # fmt: skip
OFFLOAD_KEYS = {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "fast_init",
                "pipeline_read", "pipeline_write", "ratio"}  # fmt: skip


@pytest.mark.parametrize(
    ("stage", "offload"),
    [(0, Offload()), (1, Offload()), (2, Offload()), (3, Offload()), (1, Offload("cpu")), (2, Offload("cpu")),
     (3, Offload("cpu", "cpu")), (3, Offload("nvme", "nvme"))],
)  # fmt: skip
def test_deepspeed_keys(stage, offload):
    config = deepspeed_config(stage, offload, micro_batch=2, grad_accum=8)
    assert set(config) == {
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "bf16",
        "zero_optimization",
    }
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (2, 8)
    assert config["bf16"] == {"enabled": True}
    zero = config["zero_optimization"]
    assert zero["stage"] == stage and set(zero) <= ZERO_KEYS
    for key, device in (("offload_optimizer", offload.optimizer), ("offload_param", offload.params)):
        if device == "none":
            assert key not in zero
        else:
            assert zero[key]["device"] == device and set(zero[key]) <= OFFLOAD_KEYS
    json.dumps(config)  # serialisable as the user's ds_config.json


def test_deepspeed_rejects_what_it_does_not_support():
    with pytest.raises(ValueError, match="NVMe needs ZeRO stage 3"):
        deepspeed_config(2, Offload("nvme"))


def test_fp16_policy_enables_fp16_section():
    from zeroplan.policy import PrecisionPolicy

    config = deepspeed_config(2, policy=PrecisionPolicy(param_dtype="fp16"))
    assert config["fp16"] == {"enabled": True} and "bf16" not in config


def test_fsdp2_equivalents():
    assert "reshard_after_forward=True" in fsdp2_snippet(3)
    assert "reshard_after_forward=False" in fsdp2_snippet(2)
    assert "no stage-1 equivalent" in fsdp2_snippet(1)
    assert "DistributedDataParallel" in fsdp2_snippet(0)
    assert "CPUOffloadPolicy(pin_memory=True)" in fsdp2_snippet(3, Offload("cpu", "cpu"))
    assert "no equivalent" in fsdp2_snippet(3, Offload("nvme"))


SNIPPET_RUN = """
import sys, torch, torch.distributed as dist
from zeroplan.engines.fsdp2 import fsdp2_snippet
from zeroplan.formulas.offload import Offload
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
for stage, offload in [(2, Offload()), (3, Offload()), (3, Offload("cpu", "cpu"))]:
    model = Net()
    # Pinned memory needs an accelerator; the snippet's other arguments run as printed.
    code = fsdp2_snippet(stage, offload).replace("pin_memory=True", "pin_memory=torch.cuda.is_available()")
    exec(code, {"model": model})
    model(torch.randn(4, 8)).float().sum().backward()
    print(stage, type(model).__name__, type(next(model.parameters())).__name__)
dist.destroy_process_group()
"""


def test_fsdp2_snippet_runs_under_torch(tmp_path):
    # One gloo process on CPU: the printed code imports, shards and runs forward and backward.
    out = subprocess.run([sys.executable, "-c", SNIPPET_RUN, str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [
        "2",
        "FSDPNet",
        "DTensor",
        "3",
        "FSDPNet",
        "DTensor",
        "3",
        "FSDPNet",
        "DTensor",
    ]
