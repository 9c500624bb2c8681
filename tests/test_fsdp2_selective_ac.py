"""torchtitan's selective activation checkpointing in the FSDP2 engine (``Settings.selective_ac``,
``zeroplan/engines/fsdp2/selective_ac.py``): the layers its layer policy checkpoints, its limits (k = 1 is full
checkpointing, k above the layer count is none), the sampled blocks still exact, what each layer keeps under its
per-op policy, and ``--torchtitan-config``'s mapping. The measured rows (gloo, N_d = 2, fp32, transformers'
LlamaForCausalLM and the validator's CausalLM; the per-op policy with torchtitan 0.3.0's own ``SelectiveAC``:
``benchmarks/record_layer_sac.py``) are predicted again by tests/test_measured_rows.py. Planner only (no torch)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines.base import Workload
from zeroplan.engines.fsdp2 import Settings, estimate, fsdp2_run, moments
from zeroplan.engines.fsdp2.leaders import phase_leaders, sampled_blocks
from zeroplan.engines.fsdp2.selective_ac import checkpointed, op_cache, op_forward_peak
from zeroplan.formulas.peak import peak_of

TORCHTITAN = Path(__file__).resolve().parent / "data" / "integrations" / "torchtitan"
HF = Path(__file__).resolve().parent / "data" / "hf_configs"
LLAMA = {"model_type": "llama", "hidden_size": 35, "intermediate_size": 67, "max_position_embeddings": 16,
         "num_attention_heads": 5, "num_hidden_layers": 7, "num_key_value_heads": 1, "vocab_size": 103}  # fmt: skip
GPT = {"model_type": "gpt2", "activation_function": "gelu", "n_layer": 7, "n_embd": 35, "n_head": 5,
       "vocab_size": 101, "n_positions": 16}  # fmt: skip


def _workload(config: dict, checkpointing: str, hf: bool = True, layers: int | None = None) -> Workload:
    if layers is not None:
        config = {**config, ("n_layer" if "n_layer" in config else "num_hidden_layers"): layers}
    spec = spec_from_hf_config(config, "test")
    return Workload(transformer_shapes(spec), spec, 16, 2, checkpointing, transformers=hf)


def test_the_layers_torchtitan_checkpoints():
    # _apply_layer_sac: the counter is incremented before the test, so the first layer is 1: k, 2k, ...
    assert [i for i in range(1, 9) if checkpointed("full", 2, i)] == [2, 4, 6, 8]
    assert [i for i in range(1, 9) if checkpointed("full", 3, i)] == [3, 6]
    assert [i for i in range(1, 4) if checkpointed("full", 1, i)] == [1, 2, 3]
    assert not any(checkpointed("none", 2, i) for i in range(1, 9))


@pytest.mark.parametrize("config,hf", [(LLAMA, True), (LLAMA, False), (GPT, False)])
@pytest.mark.parametrize("update", [{}, {"param_dtype": "bf16", "reshard_after_forward": False},
                                    {"device": "cpu", "backend": "gloo", "init": "materialized"}])
def test_every_layer_is_full_and_none_beyond_the_last(config, hf, update):
    """k = 1 checkpoints every layer (full); k above the layer count checkpoints none: the peaks, phase by phase."""
    s = Settings(**update)
    (full,) = estimate(_workload(config, "full", hf), 2, s)
    (none,) = estimate(_workload(config, "none", hf), 2, s)
    (one,) = estimate(_workload(config, "full", hf), 2, s.model_copy(update={"selective_ac": 1}))
    (beyond,) = estimate(_workload(config, "full", hf), 2, s.model_copy(update={"selective_ac": 8}))
    (two,) = estimate(_workload(config, "full", hf), 2, s.model_copy(update={"selective_ac": 2}))
    assert one.peak.by_phase() == full.peak.by_phase()
    assert beyond.peak.by_phase() == none.peak.by_phase()
    assert full.peak.by_phase()["backward"] < two.peak.by_phase()["backward"] <= none.peak.by_phase()["backward"]


@pytest.mark.parametrize("config,hf,k,update", [
    (LLAMA, True, 2, {"param_dtype": "bf16", "reduce_dtype": "fp32"}),
    (LLAMA, True, 3, {"reshard_after_forward": False, "device": "cpu", "backend": "gloo"}),
    (LLAMA, False, 5, {}),
    (GPT, False, 2, {"reshard_after_forward": 2, "param_dtype": "bf16"}),
    (GPT, True, 3, {"param_dtype": "bf16"}),
])  # fmt: skip
def test_sampled_blocks_keep_every_phase_leader(config, hf, k, update):
    """Each residue class of the layers mod k changes by the same bytes per k blocks: the interior's first and
    last k blocks (``leaders.sampled_blocks``) hold each phase's first largest moment."""
    run = fsdp2_run(_workload(config, "full", hf, layers=17), 4, Settings(selective_ac=k, **update))
    blocks = sampled_blocks(run)
    assert blocks is not None and len(blocks) < 17
    for block in (512, 1):
        assert peak_of(phase_leaders(moments(run, blocks), block), block) == peak_of(moments(run), block)


def test_a_checkpointed_layer_before_the_last_is_a_forward_moment():
    """A checkpointed layer's no-grad working set beside the layers before it can top the last layer's forward
    (not checkpointed): block L - 1's forward is a moment, and the peak where that working set is the largest."""
    run = fsdp2_run(_workload(LLAMA, "full"), 2, Settings(selective_ac=2))
    names = [m.name for m in moments(run) if m.phase == "forward"]
    assert "block 6 forward" in names and "block 7 forward" in names
    big = replace(run.acts, block=replace(run.acts.block, ckpt_forward_peak=10**9))
    forward = [p for p in peak_of(moments(replace(run, acts=big))).phases if p.phase == "forward"]
    assert forward[0].moment == "block 6 forward"
    assert "block 6 forward" not in [m.name for m in moments(fsdp2_run(_workload(LLAMA, "full", layers=8), 2,
                                                                          Settings(selective_ac=2)))]  # fmt: skip


def test_each_block_takes_its_own_modes_norm_and_rope_terms():
    """Per block, not per run: a layer not checkpointed keeps the fp32 input norm's N·4 row (norms.input_norm_backward),
    and RoPE's tables go after block 1's backward only when block 1 is not checkpointed (norms.rope_released). Not
    at a measured peak (the recorded rows peak at blocks 2 to 8 or the root): derived from the rules for none and full."""
    run = fsdp2_run(_workload(LLAMA, "full"), 2, Settings(selective_ac=2, device="cpu", backend="gloo"))
    norm = {m.name: t.bytes for m in moments(run) for t in m.terms if t.name.startswith("input norm saved and")}
    n = 2 * 16
    assert norm["block 3 gradients complete"] - norm["block 2 gradients complete"] == n * 4  # fp32, block 3 unwrapped
    rope = {m.name for m in moments(run) for t in m.terms if t.name == "embedding saved (position ids)"}
    full = fsdp2_run(_workload(LLAMA, "full"), 2, Settings(device="cpu", backend="gloo"))
    assert "block 1 gradients complete" not in rope
    assert "block 1 gradients complete" in {m.name for m in moments(full) for t in m.terms
                                            if t.name == "embedding saved (position ids)"}  # fmt: skip


def test_the_per_op_policy_keeps_q_v_gate_and_down():
    """Seven aten.mm per bias-free llama layer, every second recomputed: q, v, gate and down kept; CUDA's SDPA
    kernels are in the save set (output and fp32 logsumexp), the CPU's is not."""
    spec = spec_from_hf_config({**LLAMA, "intermediate_size": 96}, "test")
    n, b, s, a = 32, 2, 16, 4
    assert op_cache(spec, n, b, s, a, cuda=False) == n * a * (35 + 7 + 96 + 35)  # q 35, kv 7 (1 head of 7), f, d
    assert op_cache(spec, n, b, s, a, cuda=True) - op_cache(spec, n, b, s, a, cuda=False) == n * a * 35 + b * 5 * s * 4
    # the MLP's moment with gate's output kept beside SiLU's, up's and their product: 4f, over the no-grad 3f
    assert op_forward_peak(spec, n, b, s, a, False) == n * a * (2 * 35 + 4 * 96) + n * a * (35 + 7)


@pytest.mark.parametrize("update", [{}, {"param_dtype": "bf16", "reshard_after_forward": False},
                                    {"device": "cpu", "backend": "gloo", "init": "materialized"}])
def test_the_per_op_policy_lies_between_full_and_none(update):
    s = Settings(**update)
    (full,) = estimate(_workload(LLAMA, "full"), 2, s)
    (none,) = estimate(_workload(LLAMA, "none"), 2, s)
    (op,) = estimate(_workload(LLAMA, "full"), 2, s.model_copy(update={"selective_ac": "op"}))
    (op_off,) = estimate(_workload(LLAMA, "none"), 2, s.model_copy(update={"selective_ac": "op"}))
    assert op_off.peak.by_phase() == none.peak.by_phase()  # the policy of checkpointing none: nothing
    for phase in ("forward", "backward"):
        assert full.peak.by_phase()[phase] <= op.peak.by_phase()[phase] <= none.peak.by_phase()[phase]
    assert full.peak.by_phase()["forward"] < op.peak.by_phase()["forward"]


# ---- --torchtitan-config and --selective-ac ----


def test_layer_sac_of_a_job_config_is_ac_every_typed_out(tmp_path):
    """``selective_ac_option = "k"`` is ``--checkpointing full --selective-ac k``; "1" is full checkpointing; "op" is
    ``--selective-ac op``."""
    from clicheck import run_json

    model = ("--model", "llama2-7b")
    flags = ("--engine", "fsdp2", "--gpus", "8", "--fsdp-wrap", "torchtitan", "--param-dtype", "bf16",
             "--reduce-dtype", "fp32", "--init", "meta", "--micro-batch", "2", "--seq-len", "512")  # fmt: skip
    for option, typed in (("2", ("--selective-ac", "2")), ("3", ("--selective-ac", "3")), ("1", ()),
                          ("op", ("--selective-ac", "op"))):  # fmt: skip
        job = tmp_path / f"job{option}.toml"
        job.write_text('[training]\nlocal_batch_size = 2\nseq_len = 512\n[parallelism]\ndata_parallel_shard_degree = 8\n'
                       f'[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "{option}"\n')  # fmt: skip
        got = run_json("estimate", *model, "--torchtitan-config", str(job))
        assert got == run_json("estimate", *model, *flags, "--checkpointing", "full", *typed)
        label = "selective AC per op" if option == "op" else f"checkpoint every {option} layers"
        assert got["stages"][0]["name"].endswith(label if typed else "wrap torchtitan")
    full, every2, none = (run_json("estimate", *model, *flags, *more)["stages"][0]["phases"] for more in (
        ("--checkpointing", "full"), ("--checkpointing", "full", "--selective-ac", "2"), ()))  # fmt: skip
    for phase in ("forward", "backward"):
        assert full[phase] < every2[phase] < none[phase]


@pytest.mark.parametrize("preset,label", [("llama3_debug_model.toml", "wrap torchtitan, checkpoint every 2 layers"),
                                          ("llama3_8b.toml", "wrap torchtitan, selective AC per op")])
def test_torchtitans_presets_run(preset, label):
    # v0.2.2's llama3 presets: selective every 2nd layer (debug), selective per op (8B; issue 19 row 12)
    from clicheck import run

    out = run("estimate", "--model", "llama3-8b", "--torchtitan-config", str(TORCHTITAN / preset), "--gpus", "8")
    assert out.exit_code == 0, out.output
    assert label in out.stdout


@pytest.mark.parametrize("args, message", [
    (("--engine", "fsdp2", "--gpus", "8", "--checkpointing", "full", "--selective-ac", "op", "--model",
      str(HF / "qwen2-0.5b.json")),
     "selective_ac=op: torchtitan's per-op policy is modelled for a bias-free Llama layer, not projection biases"),
    (("--engine", "fsdp2", "--gpus", "8", "--selective-ac", "2"),
     "--selective-ac 2: selects what --checkpointing full recomputes; got --checkpointing none"),
    (("--engine", "fsdp2", "--gpus", "8", "--checkpointing", "full", "--selective-ac", "0"),
     "selective_ac=0: expected op or a whole number of layers >= 1"),
    (("--engine", "fsdp2", "--gpus", "8", "--tp", "2", "--checkpointing", "full", "--selective-ac", "op"),
     "selective_ac=op: selective checkpointing with tensor parallelism is not modelled"),
    (("--engine", "deepspeed", "--gpus", "8", "--checkpointing", "full", "--selective-ac", "2"),
     "--selective-ac"),
])  # fmt: skip
def test_refused_in_one_line(args, message):
    from clicheck import assert_one_line_error, run

    model = () if "--model" in args else ("--model", "llama3-8b")
    assert_one_line_error(run("estimate", *model, *args), message)


@pytest.mark.distributed
@pytest.mark.parametrize("selective_ac,param_dtype", [(2, "fp32"), ("op", "fp32"), ("op", "bf16")])
def test_live_every_phase_every_rank(tmp_path, selective_ac, param_dtype):
    """transformers' LlamaForCausalLM, 5 layers, on gloo N_d = 2 under each policy (the layer rule as torchtitan
    0.2.2 applies it; the per-op policy by torchtitan 0.3.0's own SelectiveAC, its cache in the param dtype): every
    phase of both ranks within the live margin of tests/test_measured_rows.py (0 B when run 2026-12-02)."""
    pytest.importorskip("transformers")
    pytest.importorskip("torchtitan")
    import json

    from tests.test_measured_rows import live_margin
    from validate.engines.fsdp2 import Fsdp2Settings
    from validate.engines.fsdp2_rows import predict, run_world

    path = tmp_path / "llama.json"
    path.write_text(json.dumps({**json.loads((HF / "tiny-llama.json").read_text()), "num_hidden_layers": 5}))
    settings = Fsdp2Settings(model=str(path), hf=True, checkpointing=True, selective_ac=selective_ac, steps=2,
                             param_dtype=param_dtype)
    result = run_world(settings, 2)
    for row in result["rows"]:
        predicted = predict(settings, result["meta"], row["rank"])[0].peak.by_phase()
        for phase, measured in row["peak_bytes_by_phase"].items():
            assert abs(measured - predicted[phase]) <= live_margin(measured), (row["rank"], phase, measured)
