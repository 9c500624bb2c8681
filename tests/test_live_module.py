"""``zeroplan.estimate(model=module, optimizer=opt)``: dtypes and the optimizer read from live objects
(zeroplan/estimation/live.py, docs/python-api.md), equal to the call with the options written out, and
each refusal in one line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import zeroplan

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
TINY_LLAMA = ROOT / "tests" / "data" / "hf_configs" / "tiny-llama.json"
NUMELS = [200, 20, 60, 3]  # the two Linear layers of ``mlp``


def mlp(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 3)).to(dtype)


def llama(dtype=torch.float32) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(**__import__("json").loads(TINY_LLAMA.read_text()))
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)


def rows(e):
    return [(s.stage, s.memory, s.peak, s.collectives) for s in e.stages]


@pytest.mark.parametrize("dtype, make, name, policy", [
    ("bf16", lambda p: torch.optim.AdamW(p), "adamw", dict(optimizer_dtype="fp32")),  # the fp32 master's states
    ("fp16", lambda p: torch.optim.Adam(p, foreach=False), "adam", dict(foreach=False)),
    ("fp32", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "sgd-momentum", dict(optimizer_dtype="fp32")),
    ("fp32", lambda p: torch.optim.SGD(p, lr=0.1), "sgd", {}),
])  # fmt: skip
def test_reference_run_of_a_module_equals_the_explicit_call(dtype, make, name, policy):
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    module = mlp(torch_dtype)
    live = zeroplan.estimate(model=module, optimizer=make(module.parameters()), gpus=4)
    explicit = zeroplan.estimate(tensor_numels=NUMELS, gpus=4, param_dtype=dtype, optimizer=name, **policy)
    assert live.policy.resolved() == explicit.policy.resolved()
    assert live.policy.optimizer == name and live.policy.param_dtype == dtype
    assert rows(live) == rows(explicit)
    # 283 parameters: stage 0 holds all of them; bytes = 283 x (params + grads + K)
    per_param = {"bf16": 2 + 2 + 12, "fp16": 2 + 2 + 12, "fp32": 4 + 4 + (4 if name == "sgd-momentum" else 0)}
    assert live.stage(0).memory.model_states_bytes == 283 * per_param[dtype]


def test_transformers_module_on_meta_equals_its_config_file_under_every_engine():
    model = llama(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    assert all(p.is_meta for p in model.parameters())
    ref = zeroplan.estimate(model=model, optimizer=opt, gpus=2, seq_len=8)
    by_file = zeroplan.estimate(model=str(TINY_LLAMA), gpus=2, seq_len=8, param_dtype="bf16", optimizer="adamw")
    assert rows(ref) == rows(by_file) and ref.stage(3).peak is not None
    ds_config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    fp32 = llama()
    ds = zeroplan.estimate(model=fp32, optimizer=torch.optim.AdamW(fp32.parameters()), gpus=2, seq_len=8,
                           engine="deepspeed", ds_config=ds_config)  # an fp32 module: DeepSpeed casts it to bf16
    ds_file = zeroplan.estimate(model=str(TINY_LLAMA), gpus=2, seq_len=8, engine="deepspeed", ds_config=ds_config)
    assert rows(ds) == rows(ds_file)
    fsdp2_32 = zeroplan.estimate(model=fp32, optimizer=torch.optim.Adam(fp32.parameters()), gpus=2, seq_len=8,
                                 engine="fsdp2")  # fmt: skip
    assert rows(fsdp2_32) == rows(zeroplan.estimate(model=str(TINY_LLAMA), gpus=2, seq_len=8, engine="fsdp2"))
    fsdp2_16 = zeroplan.estimate(model=model, optimizer=opt, gpus=2, seq_len=8, engine="fsdp2")
    m16, m32 = fsdp2_16.stages[0].memory, fsdp2_32.stages[0].memory
    assert (2 * m16.params_bytes, 2 * m16.grads_bytes) == (m32.params_bytes, m32.grads_bytes)  # module_dtype bf16
    steps = 4 * sum(1 for _ in model.parameters())  # Adam's fp32 ``step`` per tensor (fsdp2 settings.STEP_BYTES)
    assert 2 * (m16.optimizer_bytes - steps) == m32.optimizer_bytes - steps  # m and v in bf16
    assert fsdp2_16.policy.param_dtype == "bf16" and fsdp2_16.stages[0].peak.peak_bytes < fsdp2_32.stages[0].peak.peak_bytes
    loop = zeroplan.estimate(model=fp32, optimizer=torch.optim.Adam(fp32.parameters(), foreach=False), gpus=2,
                             seq_len=8, engine="fsdp2")  # the per-tensor loop: no foreach temporaries
    assert rows(loop) == rows(zeroplan.estimate(model=str(TINY_LLAMA), gpus=2, seq_len=8, engine="fsdp2",
                                                foreach=False))  # fmt: skip
    step = lambda e: e.stages[0].peak.by_phase()["optimizer_step"]  # noqa: E731
    assert step(loop) < step(fsdp2_32)


def test_a_module_alone_gives_its_16_bit_dtype_and_keeps_the_policy_in_fp32():
    """Without an optimizer: a bf16 module trains in bf16 (the paper's mixed precision around it); an fp32
    module keeps the policy given (autocast may cast it), as ``model=<config path>``."""
    bf16 = zeroplan.estimate(model=mlp(torch.bfloat16), gpus=2)
    assert rows(bf16) == rows(zeroplan.estimate(tensor_numels=NUMELS, gpus=2, param_dtype="bf16"))
    assert bf16.policy.resolved()["master_dtype"] == "fp32"
    assert rows(zeroplan.estimate(model=mlp(), gpus=2)) == rows(zeroplan.estimate(tensor_numels=NUMELS, gpus=2))
    fsdp2 = zeroplan.estimate(model=mlp(torch.bfloat16), gpus=2, engine="fsdp2")
    # bf16 x each tensor's shard, FSDP2 padding dim 0 of the module's own shapes: (20, 10) -> 10 x 10, (20,) ->
    # 10, (3, 20) -> 2 x 20, (3,) -> 2 (the flat sizes would give 30, not 40, for the (3, 20) weight)
    assert fsdp2.stages[0].memory.params_bytes == 2 * (100 + 10 + 40 + 2)


def test_a_stepped_optimizer_states_are_read():
    module = mlp()
    opt = torch.optim.Adam(module.parameters(), foreach=False)
    module(torch.ones(2, 10)).sum().backward()
    opt.step()
    for state in opt.state.values():  # as a plain torch run that keeps its states in bf16 would hold them
        state["exp_avg"], state["exp_avg_sq"] = state["exp_avg"].bfloat16(), state["exp_avg_sq"].bfloat16()
    live = zeroplan.estimate(model=module, optimizer=opt, gpus=2)
    assert live.policy.optimizer_dtype == "bf16" and live.policy.master_dtype is None
    assert rows(live) == rows(zeroplan.estimate(tensor_numels=NUMELS, gpus=2, param_dtype="fp32", optimizer="adam",
                                                optimizer_dtype="bf16"))  # fmt: skip
    first = next(iter(opt.state.values()))
    first["exp_avg"] = first["exp_avg"].float()
    with pytest.raises(ValueError, match=r"optimizer states exp_avg of 0.weight \(fp32\) and exp_avg_sq of "
                                         r"0.weight \(bf16\) differ in dtype"):  # fmt: skip
        zeroplan.estimate(model=module, optimizer=opt, gpus=2)


def test_amsgrad_under_fsdp2_is_its_third_state_as_measured():
    """Adam(amsgrad=True) keeps ``max_exp_avg_sq`` like ``exp_avg_sq`` (``adam.py:Adam._init_group``) and its
    step allocates nothing more (``torch._foreach_maximum_`` in place, ``sqrt`` of the maximum instead of
    ``sqrt(v)``: ``_multi_tensor_adam``; ``torch.maximum(out=)``: ``_single_tensor_adam``). Measured, gloo N_d = 2,
    gpt-tiny fp32 (``torchrun --nproc-per-node 2 -m validate.engines.fsdp2 --settings '{"amsgrad": true,
    "foreach": true}' --out ...``), rank 0: peaks 177,336 / 595,536 / 645,080 / 436,432 B (init / forward /
    backward / optimizer step); foreach false: optimizer step 384,736 B; rank 1 every phase exact too;
    ``optimizer.state``: max_exp_avg_sq 72,720 B = exp_avg_sq's."""
    from zeroplan.engines.fsdp2 import Settings, estimate
    from tests.test_fsdp2_engine import _gpt_tiny_workload

    cpu = dict(device="cpu", backend="gloo", init="materialized")
    (ams,) = estimate(_gpt_tiny_workload(foreach=True), 2, Settings(amsgrad=True, **cpu))
    assert ams.peak.by_phase() == {"init": 177_336, "forward": 595_536, "backward": 645_080, "optimizer_step": 436_432}
    (loop,) = estimate(_gpt_tiny_workload(foreach=False), 2, Settings(amsgrad=True, **cpu))
    assert loop.peak.by_phase()["optimizer_step"] == 384_736
    (rank1,) = estimate(_gpt_tiny_workload(foreach=True), 2, Settings(amsgrad=True, rank=1, **cpu))
    assert rank1.peak.by_phase() == {"init": 177_336, "forward": 595_104, "backward": 644_648,
                                     "optimizer_step": 435_856}  # fmt: skip
    (plain,) = estimate(_gpt_tiny_workload(foreach=True), 2, Settings(**cpu))
    assert ams.memory.optimizer_bytes - plain.memory.optimizer_bytes == 72_720  # one fp32 shard (18,180 elements)
    (step,) = (p for p in ams.peak.phases if p.phase == "optimizer_step")
    assert any(t.name == "Adam exp_avg, exp_avg_sq, max_exp_avg_sq, step" for t in step.terms)  # the named term
    # the live object sets it: an fp32 module with Adam(amsgrad=True) is the estimate with the setting
    model = llama()
    live = zeroplan.estimate(model=model, optimizer=torch.optim.Adam(model.parameters(), amsgrad=True), gpus=2,
                             seq_len=8, engine="fsdp2")  # fmt: skip
    off = zeroplan.estimate(model=str(TINY_LLAMA), gpus=2, seq_len=8, engine="fsdp2")
    shard = sum(-(-p.numel() // 2) if p.dim() == 1 else -(-p.shape[0] // 2) * p[0].numel() for p in model.parameters())
    assert live.stages[0].memory.optimizer_bytes - off.stages[0].memory.optimizer_bytes == 4 * shard


def test_fused_adam_under_fsdp2_has_no_step_temporaries_as_measured():
    """Adam(fused=True): ``_fused_adam`` calls ``torch._fused_adam_``, which writes params and states in place.
    Measured on CPU (torch 2.13's CPU fused kernel), gloo N_d = 2, gpt-tiny fp32 (``--settings '{"fused": true}'``):
    the optimizer step's peak 290,992 B on rank 0 (290,704 on rank 1) = parameters + gradients + Adam's states,
    no temporary; with amsgrad 363,712 B; every other phase as without fused."""
    from zeroplan.engines.fsdp2 import Settings, estimate
    from tests.test_fsdp2_engine import _gpt_tiny_workload

    cpu = dict(device="cpu", backend="gloo", init="materialized")
    measured = {(False, 0): (572_360, 290_992), (False, 1): (572_072, 290_704), (True, 0): (645_080, 363_712),
                (True, 1): (644_648, 363_280)}  # (backward, optimizer step) peaks  # fmt: skip
    for (amsgrad, rank), (backward, step) in measured.items():
        (row,) = estimate(_gpt_tiny_workload(foreach=False), 2, Settings(fused=True, amsgrad=amsgrad, rank=rank, **cpu))
        assert (row.peak.by_phase()["backward"], row.peak.by_phase()["optimizer_step"]) == (backward, step)
    module = mlp()
    fused = zeroplan.estimate(model=module, optimizer=torch.optim.Adam(module.parameters(), fused=True), gpus=2,
                              engine="fsdp2")  # fmt: skip
    assert fused.stages[0].memory == zeroplan.estimate(model=module, gpus=2, engine="fsdp2").stages[0].memory


def _refusal(case: str):
    """(the call, the one line expected) of each refusal."""
    m = mlp()
    if case == "mixed dtypes":
        m[1].bias.data = m[1].bias.data.bfloat16()
        return lambda: zeroplan.estimate(model=m), r"^parameters 0.weight \(torch.float32\) and 1.bias \(torch.bfloat16\)"
    if case == "float64":
        m = m.double()
        return lambda: zeroplan.estimate(model=m), r"^parameter 0.weight is torch.float64: zeroplan models"
    if case == "frozen":
        m[0].bias.requires_grad_(False)
        return lambda: zeroplan.estimate(model=m), r"^parameter 0.bias is frozen \(requires_grad=False\)"
    if case == "not in the optimizer":
        opt = torch.optim.Adam(m[1].parameters())
        return lambda: zeroplan.estimate(model=m, optimizer=opt), r"^parameter 0.weight is not in the optimizer"
    if case == "a stranger":
        opt = torch.optim.Adam([*m.parameters(), torch.nn.Parameter(torch.zeros(7))])
        return lambda: zeroplan.estimate(model=m, optimizer=opt), r"tensor of shape \(7,\) that is not a parameter"
    if case == "amsgrad under deepspeed":
        opt = torch.optim.AdamW(m.parameters(), amsgrad=True)
        cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
        return lambda: zeroplan.estimate(model=m, optimizer=opt, engine="deepspeed", ds_config=cfg), \
            r"^amsgrad=True under engine=deepspeed"
    if case == "fused":
        opt = torch.optim.AdamW(m.parameters(), fused=True)
        return lambda: zeroplan.estimate(model=m, optimizer=opt), \
            r"^fused=True under engine=reference: the fused kernel"
    if case == "another class":
        opt = torch.optim.Adagrad(m.parameters())
        return lambda: zeroplan.estimate(model=m, optimizer=opt), r"^optimizer=torch.optim.adagrad.Adagrad: zeroplan reads"
    if case == "groups differ":
        opt = torch.optim.SGD([{"params": m[0].parameters(), "momentum": 0.9}, {"params": m[1].parameters()}], lr=1)
        return lambda: zeroplan.estimate(model=m, optimizer=opt), r"^SGD: param groups differ"
    opt = torch.optim.Adam(m.parameters())
    if case == "optimizer keyword":
        return lambda: zeroplan.estimate(model=m.bfloat16(), optimizer=opt, optimizer_dtype="bf16"), \
            r"^optimizer_dtype=bf16 contradicts the objects, which say fp32"
    if case == "param_dtype keyword":
        return lambda: zeroplan.estimate(model=m.bfloat16(), optimizer=opt, param_dtype="fp16"), \
            r"^param_dtype=fp16 contradicts the objects, which say bf16"
    if case == "foreach keyword":
        return lambda: zeroplan.estimate(model=m, optimizer=opt, foreach=False), \
            r"^foreach=False contradicts the optimizer, whose foreach is True"
    if case == "an object without a model":
        return lambda: zeroplan.estimate(1e6, optimizer=opt), r"^optimizer=Adam: an optimizer object needs model="
    if case == "sgd under fsdp2":
        sgd = torch.optim.SGD(m.parameters(), lr=0.1)
        return lambda: zeroplan.estimate(model=m, optimizer=sgd, engine="fsdp2"), r"^engine=fsdp2: the optimizer is sgd"
    if case == "deepspeed fp32 config, bf16 module":
        return lambda: zeroplan.estimate(model=m.bfloat16(), optimizer=opt, engine="deepspeed", stage=2), \
            r"^the module is bf16 but engine deepspeed would train fp32 parameters \(its options or ds_config\)"
    if case == "deepspeed bf16 config, fp16 module":
        cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
        return lambda: zeroplan.estimate(model=m.half(), optimizer=opt, engine="deepspeed", ds_config=cfg), \
            r"^the module is fp16 but engine deepspeed would train bf16 parameters"
    if case == "deepspeed offload with a torch optimizer":
        cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
        return lambda: zeroplan.estimate(model=m, optimizer=opt, engine="deepspeed", ds_config=cfg), \
            r"^ds_config offload_optimizer device cpu with a torch optimizer object: DeepSpeed 0.19.8 refuses"
    if case == "a bf16 module alone, param_dtype fp16":
        return lambda: zeroplan.estimate(model=m.bfloat16(), param_dtype="fp16"), \
            r"^the module is bf16 but engine reference would train fp16 parameters"
    if case == "deepspeed optimizer.type":
        cfg = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 1}}
        return lambda: zeroplan.estimate(model=m, optimizer=opt, engine="deepspeed", ds_config=cfg), \
            r"^ds_config optimizer.type='AdamW' contradicts the optimizer object \(adam\)"
    if case == "reference peak of a plain fp32 run":
        model = llama()
        return lambda: zeroplan.estimate(model=model, optimizer=torch.optim.Adam(model.parameters()), seq_len=8), \
            r"^the reference engine's peak models 16-bit params and grads, an fp32 master"
    raise AssertionError(case)


REFUSALS = ("mixed dtypes", "float64", "frozen", "not in the optimizer", "a stranger", "fused",
            "another class", "groups differ", "optimizer keyword", "param_dtype keyword", "foreach keyword",
            "an object without a model", "sgd under fsdp2", "deepspeed fp32 config, bf16 module",
            "deepspeed optimizer.type", "reference peak of a plain fp32 run", "deepspeed bf16 config, fp16 module",
            "a bf16 module alone, param_dtype fp16", "deepspeed offload with a torch optimizer",
            "amsgrad under deepspeed")  # fmt: skip


def test_the_settings_fields_a_live_run_sets_exist():
    """``live_settings`` sets fields by name (``model_copy`` would not check them): each is declared."""
    from zeroplan.engines.deepspeed.settings import Settings as DeepSpeedSettings
    from zeroplan.engines.fsdp2.settings import Settings as Fsdp2Settings

    assert "module_dtype" in Fsdp2Settings.model_fields and "optimizer" in DeepSpeedSettings.model_fields
    assert DeepSpeedSettings.model_fields["optimizer"].annotation.__args__ == ("adam", "adamw")


@pytest.mark.parametrize("case", REFUSALS)
def test_each_refusal_is_one_line(case):
    call, line = _refusal(case)
    with pytest.raises(ValueError) as err:
        call()
    assert re.search(line, str(err.value)) and "\n" not in str(err.value), str(err.value)


def test_docs_example_runs():
    """docs/python-api.md's example, as written (its asserts are part of it)."""
    code = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "python-api.md").read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "docs/python-api.md", "exec"), namespace)
    assert namespace["ds"].stages[0].peak is not None


def test_reading_a_live_model_never_imports_torch_itself():
    code = ("import sys, zeroplan, zeroplan.estimation.live, zeroplan.estimation.estimate\n"
            "zeroplan.estimate(1e6, gpus=2)\n"
            "print(sorted(m for m in ('torch', 'pandas', 'matplotlib') if m in sys.modules))\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
