"""``zeroplan.plan(model=<nn.Module>, optimizer=<torch.optim.Optimizer>)``: the module and optimizer read as
``estimate(model=...)`` reads them (zeroplan/planning/live.py), the plan equal to the one of the same model
named by its config file with the options written out, and each refusal in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import zeroplan

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY_LLAMA = Path(__file__).resolve().parent / "data" / "hf_configs" / "tiny-llama.json"
GPU = dict(gpu="h100-80gb", gpus=2)


def llama(dtype=torch.float32) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(**json.loads(TINY_LLAMA.read_text()))
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 3))


def rows(plan):
    return [(o.stage, o.offload, o.candidate, o.states, o.peak, o.fits, o.min_gpus, o.time) for o in plan.options]


def test_a_transformers_module_plans_as_its_config_file():
    model = llama(torch.bfloat16)
    live = zeroplan.plan(model=model, optimizer=torch.optim.AdamW(model.parameters()), **GPU)
    by_file = zeroplan.plan(model=str(TINY_LLAMA), policy=zeroplan.PrecisionPolicy(param_dtype="bf16",
                            optimizer="adamw"), **GPU)  # fmt: skip
    assert live.config.policy.resolved() == by_file.config.policy.resolved()
    assert rows(live) == rows(by_file) and live.options[0].peak is not None  # the family's activations: a peak
    assert live.config.sequence_length == 32  # the config's max_position_embeddings, as for the file
    assert (live.recommendation.stage, live.recommendation.offload) == (0, by_file.recommendation.offload)
    # a bf16 module with an fp32 master: 2 + 2 + 12 bytes per parameter at stage 0
    assert live.options[0].states.gpu.model_states_bytes == 16 * sum(p.numel() for p in model.parameters())


def test_fsdp2_plans_an_fp32_module_as_its_config_file():
    model = llama()
    live = zeroplan.plan(model=model, optimizer=torch.optim.Adam(model.parameters()), engine="fsdp2", **GPU)
    by_file = zeroplan.plan(model=str(TINY_LLAMA), engine="fsdp2", **GPU)
    assert len(live.options) > 1 and rows(live) == rows(by_file)


def test_a_plain_module_plans_its_flattened_tensors():
    m = mlp()
    plan = zeroplan.plan(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                         gpu_memory_bytes=10**9, gpus=4)  # fmt: skip
    assert plan.params == 283 and plan.config.policy.optimizer == "sgd-momentum"
    states = [o.states.gpu.model_states_bytes for o in plan.options[:4]]
    # fp32 params 4 + grads 4 + momentum 4 = 12 bytes: stage 0 all 283 exactly; stages 1-3 each tensor padded
    # to N_d = 4 (3 -> 4: 284 in full buffers, 284 / 4 = 71 a shard); stage 1 shards the momentum, 2 the grads
    assert states == [283 * 12, 284 * 8 + 71 * 4, 284 * 4 + 71 * 8, 71 * 12]
    assert plan.options[0].peak is None  # a module without an architecture: model states only


def _refusal(case: str):
    m = mlp()
    opt = torch.optim.Adam(m.parameters())
    if case == "a policy contradicting the objects":
        policy = zeroplan.PrecisionPolicy(param_dtype="bf16", optimizer="sgd")
        return lambda: zeroplan.plan(model=m.bfloat16(), optimizer=opt, policy=policy, **GPU), \
            r"^optimizer=sgd contradicts the objects, which say adam"
    if case == "fsdp2's search of a bf16 module":
        model = llama(torch.bfloat16)
        return lambda: zeroplan.plan(model=model, optimizer=torch.optim.Adam(model.parameters()), engine="fsdp2",
                                     **GPU), r"^plan\(engine=fsdp2\) plans module_dtype=fp32 .* the objects say bf16"
    if case == "amsgrad under fsdp2's search":
        model = llama()
        ams = torch.optim.Adam(model.parameters(), amsgrad=True)
        return lambda: zeroplan.plan(model=model, optimizer=ams, engine="fsdp2", **GPU), \
            r"^plan\(engine=fsdp2\) plans amsgrad=False .* the objects say True"
    if case == "fsdp2's search of a plain module":
        return lambda: zeroplan.plan(model=m, engine="fsdp2", **GPU), \
            r"^plan\(engine=fsdp2\) searches by predicted peak, which needs an architecture: Sequential has no"
    if case == "a frozen parameter":
        m[0].bias.requires_grad_(False)
        return lambda: zeroplan.plan(model=m, **GPU), r"^parameter 0.bias is frozen"
    if case == "an object without a model":
        return lambda: zeroplan.plan(params=1e6, optimizer=opt, **GPU), r"^optimizer=Adam: an optimizer object needs"
    if case == "params and a module":
        return lambda: zeroplan.plan(model=m, params=1e6, **GPU), r"^give one of params and model"
    if case == "fused":
        fused = torch.optim.AdamW(m.parameters(), fused=True)
        return lambda: zeroplan.plan(model=m, optimizer=fused, **GPU), r"^fused=True under engine=reference"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["a policy contradicting the objects", "fsdp2's search of a bf16 module",
                                  "amsgrad under fsdp2's search", "fsdp2's search of a plain module",
                                  "a frozen parameter", "an object without a model", "params and a module",
                                  "fused"])  # fmt: skip
def test_each_refusal_is_one_line(case):
    call, line = _refusal(case)
    with pytest.raises(ValueError) as err:
        call()
    assert re.search(line, str(err.value)) and "\n" not in str(err.value), str(err.value)


def test_docs_plan_example_runs():
    """docs/python-api.md's plan example (its second python block), as written (its asserts are part of it)."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "python-api.md").read_text()
    code = re.findall(r"```python\n(.*?)```", docs, re.S)[1]
    assert "zeroplan.plan(model=model, optimizer=optimizer" in code
    namespace: dict = {}
    exec(compile(code, "docs/python-api.md", "exec"), namespace)
    assert namespace["p"].recommendation.peak is not None
