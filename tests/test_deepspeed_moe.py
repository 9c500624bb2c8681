"""DeepSpeed ZeRO-3 on transformers' mixture-of-experts classes (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3): the
module trace DeepSpeed 0.19.8 runs on them (its default ZeRO-3 leaf sparse MLPs, the routers called before the experts) against
the all-gathers it issued, call for call, and real runs against ``engines/deepspeed/moe.py``, every phase
(docs/engines/deepspeed.md "ZeRO-3 and mixture-of-experts")."""

from __future__ import annotations

import json

import pytest

from tests.test_deepseek import DEEPSEEK_WIDE
from tests.hf_saved import DS_SMALL, check_deepspeed_recorded
from tests.test_moe_peaks import MIXTRAL, QWEN3_MOE, RECORDED as FSDP2_RECORDED

CONFIGS = {"mixtral-wide": MIXTRAL, "qwen3-moe-wide": QWEN3_MOE, "deepseek-wide": DEEPSEEK_WIDE,
           "qwen2-moe-wide": FSDP2_RECORDED["qwen2-moe-wide"][0]}

#: DeepSpeed 0.19.8, ZeRO-3, on transformers' classes (validate.engines.deepspeed_compare.run_world(configs, 2,
#: model=a 64-position tiny-llama config, steps=2, seq_len=64, runs=[{"model": CONFIG_JSON, "hf": True}]),
#: ds_config(3, micro_batch=1, zero=ZERO, optimizer_params={"torch_adam": True}), fp32, gloo, N_d = 2,
#: DS_ACCELERATOR=cpu), recorded 2026-12-02 on this project's CPU machine (torch 2.13, transformers 5.24): peak bytes
#: [init, forward, backward, optimizer_step], the same on both ranks. ZERO "small": tests/hf_saved.py DS_SMALL
#: (5,000-element buckets, below every expert tensor); "default": DeepSpeed's own (5e8-element buckets, persistence
#: threshold 1e5). The Mixtral and Qwen3-MoE "small" rows are tests/test_moe_peaks.py's.
RECORDED = {
    ("mixtral-wide", "small"): [9671073, 23324877, 24669661, 22960837],
    ("qwen3-moe-wide", "small"): [7792673, 19784589, 20467821, 18650821],
    ("deepseek-wide", "small"): [3574241, 10231821, 10392605, 8799877],
    ("qwen2-moe-wide", "small"): [9152545, 24228461, 24748125, 22976197],
    ("mixtral-wide", "default"): [2009651073, 2026972333, 2026824601, 2022940837],
    ("qwen3-moe-wide", "default"): [2007772673, 2021063485, 2023257625, 2018630821],
}
#: measured - predicted beyond MARGIN: none. Before (a live-storage trace at each phase's peak, gloo N_d = 2):
#: Qwen2-MoE's forward 4,224 B under (transformers' unused sliding-window mask, ``activation_terms.unused_sliding_mask``);
#: at DeepSpeed's default buckets the backward 2.57 MB (Mixtral, 0.13 %) and 2.94 MB (Qwen3-MoE, 0.15 %) under (the
#: last bucket's reduce-scatter after backward, every gradient: its padded flat buffer and gloo's copy,
#: ``zero3._epilogue_reduce_scatter``); now every phase within 132 B (the rotary buffers, 128 B, not modelled).
RESIDUAL: dict = {}
#: the largest measured error otherwise: 320 B of 10.2 MB (0.0031 %, DeepSeek's forward); Mixtral's forward 384 B of
#: 23.3 MB (the post-attention norm's own moment, taken as its saved tensors). Before engines/deepspeed/moe.py:
#: Mixtral's forward -3.4 %, backward +2.6 %; Qwen3-MoE's -2.7 % / +1.9 %.
MARGIN = 0.00004

#: the all-gathers of the second step's forward (its trace complete: prefetching), elements per call, as the
#: runs above issued them (CommCounter, "small"; rank 0 and 1 alike); the first step's gathers a leaf's router and
#: expert tensors in one call (Mixtral: 393,728 = 512 + 262,144 + 131,072).
FORWARD_GATHERS = {
    "mixtral-wide": [64384, *[16512, 8192, 16384, 262784, 131072] * 3, 64512],
    "qwen3-moe-wide": [64384, 16512, 8192, 8192, 16384, 196736, 98304, 17280, 8192, 8192, 16384, 196736, 98304,
                       17280, 8192, 8192, 16384, 196736, 98304, 65280],
    "deepseek-wide": [64384, 7296, 5120, 12288, 32896, 32768, 32768, *[7296, 5120, 12288, 66176, 32768, 8192, 8192,
                                                                        8192] * 2, 64512],
    "qwen2-moe-wide": [64384, 16512, 8320, 16384, 131712, *[65536] * 4,
                       *[16640, 8320, 16384, 131712, *[65536] * 4] * 2, 64640],
}  # fmt: skip


def _run(name: str, buckets: str, tmp_path):
    from validate.engines.deepspeed_compare import ds_config, workload_for
    from zeroplan.engines import deepspeed as D
    from zeroplan.engines.deepspeed.wrapper import ds_run

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(CONFIGS[name]))
    config = ds_config(3, micro_batch=1, zero=DS_SMALL if buckets == "small" else {},
                       optimizer_params={"torch_adam": True})  # fmt: skip
    workload = workload_for(str(path), 1, 64, 1, "none", hf=True)
    settings = D.Settings.from_ds_config(config, zero_init=False)
    return D, workload, settings, ds_run(settings, workload, 2, 4)


@pytest.mark.parametrize("name", sorted(FORWARD_GATHERS))
def test_replayed_coordinator_issues_the_measured_all_gathers(name, tmp_path):
    """The coordinator replayed over the module trace issues DeepSpeed's all-gathers call for call. Without the
    leaf (each of gate and experts hooked, in registration order) Qwen3-MoE's router weight would be gathered with
    the expert tensors (197,504 instead of 196,736, then 16,512 instead of 17,280): it fails here."""
    D, workload, settings, run = _run(name, "small", tmp_path)
    s = settings
    sched = D.stage3_schedule(run.trace, run.numels, 2, s.param_persistence_threshold, s.prefetch_bucket_size,
                              s.max_live_parameters, s.max_reuse_distance)  # fmt: skip
    forward = [g.elements for g in sched.gathers if not run.trace.events[g.issued].backward_phase]
    assert forward == FORWARD_GATHERS[name]
    assert sched.backward_calls == 0  # the default reuse distance keeps every gathered parameter to backward


@pytest.mark.parametrize(("name", "buckets"), sorted(RECORDED))
def test_zero3_peaks_of_transformers_moe_classes_every_phase(name, buckets, tmp_path):
    from zeroplan.formulas.peak import PHASES

    D, workload, settings, _ = _run(name, buckets, tmp_path)
    (est,) = D.estimate(workload, 2, settings, stat_bytes=4)
    predicted = est.peak.by_phase()
    for phase, value in zip(PHASES, RECORDED[(name, buckets)]):
        err = (value - predicted[phase]) / value
        assert abs(err - RESIDUAL.get((name, buckets, phase), 0.0)) <= MARGIN, (name, buckets, phase, value,
                                                                                 predicted[phase])  # fmt: skip


#: transformers' gradient checkpointing (``model.gradient_checkpointing_enable()``: every decoder layer a
#: ``GradientCheckpointingLayer``, torch.utils.checkpoint non-reentrant) on DeepseekV3ForCausalLM, DeepSpeed 0.19.8,
#: fp32, gloo, N_d = 2, micro-batch 1, seq 64, two steps: each rank ran validate.engines.deepspeed.measure(build,
#: ds_config(stage, micro_batch=1, zero=ZERO, optimizer_params={"torch_adam": True}), batches of
#: _model_and_batches(CONFIG_JSON, 2, rank, 1, 2, 64, hf=True)) with ``build`` hf_builder's model with checkpointing
#: enabled, recorded 2026-12-02 on this project's CPU machine (ZeRO-2 row reproduced to the byte on both ranks through
#: the runner itself since: ``deepspeed_compare.run_world([ds_config(2, micro_batch=1, zero={}, optimizer_params=
#: {"torch_adam": True})], 2, model=<tiny-llama with 64 positions>, steps=2, seq_len=64, runs=[{"model": CONFIG_JSON,
#: "hf": True, "checkpointing": "full"}])``, hf_builder's ``checkpointing="full"``, 16 s of wall time): peak bytes
#: [init, forward, backward, optimizer_step], the same on both ranks; predicted as ``checkpointing="full"``.
CHECKPOINTED = {
    ("deepseek-wide", 2, "default"): [4389440, 5946320, 2007682004, 8779344],
    ("deepseek-wide", 3, "small"): [3574241, 8194029, 8489741, 8799877],
}
#: measured - predicted beyond 0.01 %: none. The ZeRO-3 checkpointed backward is 584 B under (0.0069 %: the
#: checkpointed layer's position ids, 512 B, and the rotary and router buffers); 196,024 B (2.3 %) over before
#: ``moe.routed_experts_backward`` (a live-storage trace at the peak, the recomputed routed experts' gate-up backward:
#: the shared experts' parameters released and their gradients sent, 2 x 98,304 B, which the dense path's moment
#: kept). The forward, within 64 B, peaks in the last layer's no-grad attention (``moe.sparse_forward_moments``: 2.6 %
#: over with the dense path's moment).
CHECKPOINTED_RESIDUAL: dict = {}


@pytest.mark.parametrize(("name", "stage", "buckets"), sorted(CHECKPOINTED))
def test_hf_gradient_checkpointing_peaks_every_phase(name, stage, buckets, tmp_path):
    residual = {p: e for (n, st, bk, p), e in CHECKPOINTED_RESIDUAL.items() if (n, st, bk) == (name, stage, buckets)}
    check_deepspeed_recorded(name, CONFIGS[name], stage, CHECKPOINTED[(name, stage, buckets)], residual, 0.0001,
                             tmp_path, small=buckets == "small", checkpointing="full")  # fmt: skip


#: DeepSeek-V3 wide in bf16 (``ds_config(stage, "bf16", micro_batch=1, zero=ZERO, optimizer_params={"torch_adam":
#: True})``, otherwise as ``RECORDED``; each rank ran validate.engines.deepspeed.measure under a live-storage tracer, the
#: peaks MemTracker's, recorded 2026-12-02 on this project's CPU machine): peak bytes [init, forward, backward,
#: optimizer_step], the same on both ranks.
BF16 = {
    ("deepseek-wide", 3, "small"): [2743425, 7341189, 7405581, 7692533],
    ("deepseek-wide", 2, "default"): [3292096, 6233328, 1006057592, 7682000],
}
#: measured - predicted, traced at each peak (docs/engines/deepspeed.md "ZeRO-3 and mixture-of-experts"). The routers'
#: fp32 weight copies F.linear saves (DeepSpeed casts the router to bf16, ``self.weight.type(torch.float32)`` copies
#: it: 2 x 2,048 B, ``deepseek_activations.router_weight_copy_bytes`` in ``run.router_copies``) and the fp32
#: ``e_score_correction_bias`` buffers (32 B, ``router_bias_bytes`` in ``run._fp32_buffers``) are terms now: before,
#: ZeRO-3's forward 4,160 B and backward 4,168 B under, ZeRO-2's forward 3,648 B under. Left: the rotary buffers (32
#: B, not modelled) at ZeRO-3 (forward 32 B, backward 40 B under; its init 64 B under: its peak moment, zero3.py's
#: "fp32 master: converted and cloned", takes two of ``_states`` by name), and at ZeRO-2 the forward 480 B over
#: (ZeRO-1/2's bf16 forward holds 512 B more than measured, Mixtral's rows too: test_deepspeed_moe12.py ``BF16``) and
#: the backward 49,624 B over (0.0049 %, dsmoe12's ZeRO-1/2 MoE profile). The bf16 logits beside their fp32 upcast at
#: the loss (N·V·2 = 64,384 B), traced here too, are a term since the differential matrix's seed 3 draws 4 and 20
#: (``phases.forward_moments``).
BF16_RESIDUAL = {("deepseek-wide", 3, "small", "forward"): 32 / 7341189,
                 ("deepseek-wide", 3, "small", "backward"): 40 / 7405581,
                 ("deepseek-wide", 2, "default", "forward"): -480 / 6233328,
                 ("deepseek-wide", 2, "default", "backward"): -49624 / 1006057592}


@pytest.mark.parametrize(("name", "stage", "buckets"), sorted(BF16))
def test_bf16_deepseek_peaks_every_phase(name, stage, buckets, tmp_path):
    residual = {p: e for (n, st, bk, p), e in BF16_RESIDUAL.items() if (n, st, bk) == (name, stage, buckets)}
    check_deepspeed_recorded(name, CONFIGS[name], stage, BF16[(name, stage, buckets)], residual, 0.0001, tmp_path,
                             small=buckets == "small", dtype="bf16")  # fmt: skip


def test_trace_calls_the_sparse_mlp_as_deepspeed_hooks_it():
    """Mixtral's and Qwen3-MoE's sparse MLPs are ZeRO-3 leaves (DeepSpeed 0.19.8's default ``leaf_module``
    classes): one module owning the router and both expert tensors, no hooks below it; DeepSeek-V3's is not: its
    router is fetched before the experts (registered after them), its shared experts last."""
    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.architectures.spec import transformer_shapes
    from zeroplan.engines.deepspeed.trace import stage3_trace

    def names(cfg, tied=False):
        shapes = tuple(transformer_shapes(spec_from_hf_config(cfg)))
        trace = stage3_trace(shapes, "llama", tied, True)
        fetched = [trace.names[e.module] for e in trace.events if e.op == "fetch" and e.forward]
        return shapes, trace, [n for n in fetched if ".layers.1." in n]

    shapes, trace, fetched = names(QWEN3_MOE)
    assert fetched[-1] == "model.layers.1.mlp"  # no gate or experts module of its own
    leaf = trace.modules[trace.names.index("model.layers.1.mlp")]
    assert [shapes[i][0].rpartition("mlp.")[2] for i in leaf] == ["experts.gate_up_proj", "experts.down_proj",
                                                                   "gate.weight"]  # fmt: skip
    _, _, fetched = names(DEEPSEEK_WIDE)
    assert [n.rpartition("mlp.")[2] for n in fetched if ".mlp." in n] == [
        "gate", "experts", "shared_experts", "shared_experts.gate_proj", "shared_experts.up_proj",
        "shared_experts.down_proj"]  # fmt: skip


@pytest.mark.parametrize(("cfg", "zero", "refused"), [
    ("tiny-mixtral.json", {"stage": 3}, None),
    ("tiny-qwen3-moe.json", {"stage": 3}, None),
    ("tiny-deepseek-v3.json", {"stage": 3}, None),
    ("tiny-qwen2-moe.json", {"stage": 3}, None),
    ("tiny-mixtral.json", {"stage": 3, "offload_param": {"device": "cpu"}}, None),  # test_deepspeed_moe_fp16_nvme
    ("tiny-qwen3-moe.json", {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}, None),
    ("tiny-mixtral.json", {"stage": 3, "zero_hpz_partition_size": 2}, "ZeRO++ (zero_hpz_partition_size)"),
    ("tiny-mixtral.json", {"stage": 3, "leaf_module": {"classes": []}}, "leaf_module"),
    ("tiny-mixtral.json", {"stage": 2, "reduce_bucket_size": 5000}, None),  # fp32: test_deepspeed_moe12.py FROM_HOOKS
])  # fmt: skip
def test_zero3_moe_refusal_names_what_is_not_measured(cfg, zero, refused):
    from pathlib import Path

    from zeroplan.architectures.hf_config import read_hf_config
    from zeroplan.engines.base import PlannerOptions
    from zeroplan.engines.deepspeed.plan import moe_limit

    spec = read_hf_config(Path(__file__).parent / "data" / "hf_configs" / cfg)
    why = moe_limit(PlannerOptions(ds_config={"zero_optimization": zero}), spec)
    if refused is None:
        assert why is None
    else:
        assert why is not None and refused in why and "\n" not in why


def test_hf_builder_turns_on_transformers_gradient_checkpointing(tmp_path):
    """The DeepSpeed runner's transformers model (``hf_builder``) with ``checkpointing="full"``: transformers' own
    gradient checkpointing on every decoder layer, as the recorded ``CHECKPOINTED`` rows ran; none: off; any other
    mode refused in one line."""
    pytest.importorskip("transformers")
    from validate.engines.deepspeed import hf_builder

    path = tmp_path / "deepseek-wide.json"
    path.write_text(json.dumps(DEEPSEEK_WIDE))
    assert hf_builder(str(path), "full")().is_gradient_checkpointing
    assert not hf_builder(str(path))().is_gradient_checkpointing
    with pytest.raises(ValueError, match="checkpointing 'selective': none or full"):
        hf_builder(str(path), "selective")
