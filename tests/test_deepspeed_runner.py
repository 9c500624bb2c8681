"""Real DeepSpeed ZeRO 1-3 (gloo, CPU) against the closed-form DeepSpeed profile: model states exact.

The session's one torchrun world of N_d = 2 (``tests/deepspeed_world.py``) trains gpt-tiny (Ψ = 36,324) for
three steps under every config below
(about 40 s on two shared cores once DeepSpeed's ``fused_adam`` op is built; its first JIT build
takes about 3 minutes and is cached in ~/.cache/torch_extensions). Small buckets keep runs cheap;
one config keeps DeepSpeed's 5e8-element default to show the bucket is allocated at its configured
size whatever the model's size. fp32 where the dtype does not matter, bf16 twice (ZeRO-2 and the
BF16_Optimizer path).
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "deepspeed", reason="DeepSpeed is an optional extra: pip install '.[deepspeed]' (with DS_BUILD_OPS=0)"
)

from zeroplan.engines import deepspeed as P  # noqa: E402

ND = 2
SMALL = {"reduce_bucket_size": 5000, "allgather_bucket_size": 5000, "stage3_param_persistence_threshold": 100}


def _configs() -> list[dict]:
    from validate.engines.deepspeed import ds_config

    return [
        ds_config(1, zero=SMALL),
        ds_config(2, zero=SMALL),
        ds_config(3, zero=SMALL),
        ds_config(2, "bf16", zero=SMALL),
        ds_config(1, "bf16", zero=SMALL, grad_accum_dtype="fp32"),
        ds_config(2, zero={"reduce_bucket_size": 5000}, optimizer_params={"torch_adam": True}),
        ds_config(3),  # DeepSpeed's defaults: the 5e8-element bucket
    ]


# the session's shared world of N_d = 2 (tests/deepspeed_world.py), 3 steps; six configs keep DeepSpeed's
# default Adam (FusedAdam): its fused_adam JIT op is built in the background from collection on
DEEPSPEED_JIT_OPS = ("FusedAdamBuilder",)
DEEPSPEED_WORLD = {ND: lambda: [(c, {}) for c in _configs()]}


@pytest.fixture(scope="module")
def runs(request, deepspeed_world):
    return _configs(), deepspeed_world.ranks(request.module, ND)


@pytest.fixture(scope="module")
def numels() -> tuple[int, ...]:
    import torch

    from validate.models import PRESETS, build

    return tuple(p.numel() for p in build(PRESETS["gpt-tiny"], torch.float32, "meta").parameters())


@pytest.mark.parametrize("i", range(7))
def test_optimizer_class_and_model_states_match_profile(runs, numels, i):
    configs, rows = runs
    cfg = P.Settings.from_ds_config(configs[i])
    terms = P.terms(cfg, numels, ND)
    for rank_rows in rows:
        row = rank_rows[i]
        assert row["optimizer_class"] == P.optimizer_class(cfg)
        assert row["inner_optimizer_class"] == P.inner_optimizer_class(cfg)
        # exact: every byte alive at a step boundary is a profile term
        assert row["boundary_bytes"]["init"] == P.model_state_bytes(terms, after_step=False)
        assert row["boundary_bytes"]["step0"] == P.model_state_bytes(terms, after_step=True)
        assert row["boundary_bytes"]["step1"] == P.model_state_bytes(terms, after_step=True)


def test_default_bucket_is_allocated_at_its_configured_size(runs, numels):
    """ZeRO-3 at defaults keeps a 5e8-element fp32 bucket for a 36k-parameter model (2 GB)."""
    configs, rows = runs
    default = P.Settings.from_ds_config(configs[6])
    assert default.reduce_bucket_size == 500_000_000
    for i in (2, 6):
        cfg = P.Settings.from_ds_config(configs[i])
        bucket = next(t for t in P.terms(cfg, numels, ND) if t.name.startswith("reduce bucket"))
        assert bucket.bytes == cfg.reduce_bucket_size * 4
        assert rows[0][i]["peak_bytes_by_phase"]["init"] >= bucket.bytes


def test_stage12_bucket_lives_in_backward_only(runs, numels):
    """ZeRO-1/2: the bucket is allocated when backward starts and gone at the step boundary."""
    configs, rows = runs
    for i in (0, 1):
        cfg = P.Settings.from_ds_config(configs[i])
        terms = P.terms(cfg, numels, ND)
        bucket = next(t for t in terms if t.live == "backward")
        row = rows[0][i]
        assert row["peak_bytes_by_phase"]["backward"] >= P.model_state_bytes(terms, True) + bucket.bytes
        assert row["boundary_bytes"]["step1"] == P.model_state_bytes(terms, True)


@pytest.mark.parametrize("i", [0, 1, 3, 4, 5])
def test_stage12_collectives_match_profile(runs, numels, i):
    """Per step: an all-reduce per gradient bucket (not a reduce-scatter), the norm, the all-gather."""
    configs, rows = runs
    cfg = P.Settings.from_ds_config(configs[i])
    want = P.collectives(cfg, numels, ND)
    for step in (0, 1):
        got = {k.split("|", 1)[1]: v for k, v in rows[0][i]["comm"].items() if k.startswith(f"{step}|")}
        assert len(got) == len(want), (got.keys(), want)
        for c in want:
            row = got[f"{c.op}|{c.phase}|{ {'fp32': 'float32', 'bf16': 'bfloat16'}.get(c.dtype, c.dtype) }"]
            assert row["elements"] == c.elements
            if c.phase == "backward" and cfg.stage == 2 and P.optimizer_class(cfg) != "BF16_Optimizer":
                # stage 2 reduces in gradient-ready order (autograd's), not parameter order: bounds
                assert len(P.greedy_buckets(numels, cfg.reduce_bucket_size)) - 2 <= row["calls"] <= len(numels)
                assert max(row["sizes"]) <= max(cfg.reduce_bucket_size, max(numels))
            else:
                assert row["calls"] == c.calls


def test_stage3_gathers(runs, numels):
    """Step 0 (trace being recorded): gathers in forward and again in backward. Step 1 (trace known,
    max_reuse_distance and max_live_parameters at 1e9): non-persistent parameters gathered once in
    forward (prefetched as one bucket) and kept through backward; persistent ones re-gathered after
    the optimizer step. Gradients reduce-scattered bucket by bucket."""
    configs, rows = runs
    psi = sum(numels)
    persistent = sum(n for n in numels if n <= SMALL["stage3_param_persistence_threshold"])
    by_step = [{k.split("|", 1)[1]: v for k, v in rows[0][2]["comm"].items() if k.startswith(f"{s}|")} for s in (0, 1)]
    assert by_step[0]["all-gather|backward|float32"]["elements"] == psi
    assert by_step[1]["all-gather|forward|float32"]["elements"] == psi - persistent
    assert "all-gather|backward|float32" not in by_step[1]
    for comm in by_step:
        assert comm["reduce-scatter|backward|float32"]["elements"] == psi
        assert comm["reduce-scatter|backward|float32"]["calls"] >= -(-psi // SMALL["reduce_bucket_size"])
        assert comm["all-gather|optimizer_step|float32"]["elements"] == persistent


@pytest.mark.parametrize("nd", [2, 4, 64])
def test_deepspeed_estimators_restated_exactly(nd):
    """The profile's copies of DeepSpeed's estimators return what DeepSpeed's functions return."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    psi, largest = 36_324, 5_184
    _, gpu2 = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=nd, cpu_offload=False)
    _, gpu3, _ = estimate_zero3_model_states_mem_needs(psi, largest, num_gpus_per_node=nd, cpu_offload=False,
                                                        cpu_offload_params=False)  # fmt: skip
    assert P.ds_estimate_zero2_bytes(psi, nd) == gpu2
    assert P.ds_estimate_zero3_bytes(psi, largest, nd) == gpu3


def test_loss_runs_the_model_through_the_forward_it_is_given():
    """The runner trains through the engine's forward (``model.loss(batch, forward=engine)``, issue 17): the
    callable given runs the model, once, on the tokens, and the loss is the one the module computes itself;
    transformers' model gets ``input_ids``/``labels`` and its own loss comes back."""
    import torch

    from validate.engines.deepspeed import hf_builder
    from validate.models import build, make_batch, spec_for

    spec = spec_for("gpt-tiny", None)
    model = build(spec, torch.float32, "cpu")
    batch = make_batch(spec, 2, torch.Generator().manual_seed(0), None)
    seen = []

    def forward(*args, **kwargs):
        seen.append((args, kwargs))
        return model(*args, **kwargs)

    assert model.loss(batch, forward=forward).item() == model.loss(batch).item()
    assert len(seen) == 1 and seen[0][0][0] is batch[0]
    hf = hf_builder("tests/data/hf_configs/tiny-llama.json")()
    seen.clear()

    def hf_forward(**kwargs):
        seen.append(kwargs)
        return hf(**kwargs)

    assert hf.loss(batch, forward=hf_forward).item() == hf.loss(batch).item()
    assert [sorted(k) for k in seen] == [["input_ids", "labels", "shift_labels", "use_cache"]]
