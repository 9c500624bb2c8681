"""The randomized differential matrix's fixed-seed slice (validate/engines/differential.py; the sweep is
benchmarks/differential.py, its result in docs/benchmarks.md).

- the generator: seeded, the same draws everywhere, 5-60M parameters, every family, and every DeepSpeed
  threshold drawn on both sides of its boundary within the first draws (pure Python, no torch);
- every recorded draw (tests/data/measured/differential.json: what the real engines measured, rank by rank,
  with the draw that produced it and the prediction made when it was recorded) predicted again by today's
  profiles, every phase of every rank within the issue's targets (1%, and at most 0.5% under) and at its own
  recorded error, the engine rows' rule (``draw_misses``): each miss the sweep found stays a test case here;
- one live draw (``distributed``): the smallest FSDP2 draw of seed 1 trained again on 2 gloo ranks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.test_measured_rows import _within
from validate.engines.differential import FAMILIES, PSI_RANGE, TARGET_UNDER, TARGET_WITHIN, draw, replay, run_draw

RECORDED = Path(__file__).resolve().parent / "data" / "measured" / "differential.json"
# generator 3's bf16 draws (meta init, checkpointing), recorded apart so that the shared file stays as it was
RECORDED_BF16 = RECORDED.with_name("fsdp2_differential_bf16.json")
# generator 4 on seed 3, a seed no profile was tuned on (both engines; DeepSpeed's checkpointing and bf16 drawn)
RECORDED_SEED3 = RECORDED.with_name("differential_seed3.json")
# generator 4 on seed 4, unseen too (recorded as measured: a miss not fixed yet is a strict xfail, ``open``)
RECORDED_SEED4 = RECORDED.with_name("differential_seed4.json")
RECORDED_FAMILIES_SEED4 = RECORDED.with_name("differential_seed4_families.json")  # generator 5 on seed 4
# seed 5, unseen too, both generators (recorded as measured; docs/benchmarks.md, the differential section)
RECORDED_SEED5 = RECORDED.with_name("differential_seed5.json")
RECORDED_FAMILIES_SEED5 = RECORDED.with_name("differential_seed5_families.json")
# seed 6, unseen too, both generators (first contact recorded as measured, the profiles fixed since; docs/benchmarks.md)
RECORDED_SEED6 = RECORDED.with_name("differential_seed6.json")
RECORDED_FAMILIES_SEED6 = RECORDED.with_name("differential_seed6_families.json")
# seed 7, unseen, generator 4 (first contact recorded by the issue 17 audit: every draw within the targets as measured)
RECORDED_SEED7 = RECORDED.with_name("differential_seed7.json")
# FSDP2 with the token embedding as its own unit, built by hand beside draw 3-5 (benchmarks/fsdp2_embedding_unit_cases.py)
RECORDED_EMBEDDING_UNIT = RECORDED.with_name("fsdp2_embedding_unit.json")
# generator 5: the newer families (issue 19; validate/engines/differential_families.py), seed 1 and unseen seeds 4-6
RECORDED_FAMILIES = RECORDED.with_name("differential_families.json")
DRAW_FILES = (RECORDED, RECORDED_BF16, RECORDED_SEED3, RECORDED_SEED4, RECORDED_SEED5, RECORDED_SEED6, RECORDED_SEED7)
FAMILY_FILES = (RECORDED_FAMILIES, RECORDED_FAMILIES_SEED4, RECORDED_FAMILIES_SEED5, RECORDED_FAMILIES_SEED6)
# every file of recorded draws ("results", and RECORDED's "cases"): benchmarks/tighten_measured.py re-records their predictions
RECORDED_FILES = DRAW_FILES + FAMILY_FILES + (RECORDED_EMBEDDING_UNIT,)
SLICE = range(40)


def draw_misses(record: dict, got) -> list[str]:
    """Every (rank, phase) of a recorded draw that today's prediction (``got``: ``replay(record)``) puts outside
    the issue's targets or further from the measurement than the ``predicted`` recorded beside it, at the engine
    rows' rule and margin (tests/test_measured_rows.py ``_within``: |measured - predicted| <= |measured -
    recorded| + RECORDED_MARGIN_BYTES = 0 B; the measurement on disk does not move, the prediction is pure, so a
    term dropped from a draw's peak moment fails here however small; a prediction that came closer passes and is
    re-recorded by benchmarks/tighten_measured.py). Empty: ok; benchmarks/term_removal.py runs this function."""
    misses = []
    for rank, errors in got.errors().items():
        where = f"{record['name']} rank {rank}"
        misses += [f"{where} {p}: {e:+.3%} outside the targets" for p, e in errors.items()
                   if not -TARGET_UNDER <= e <= TARGET_WITHIN]  # fmt: skip
        for phase, measured in got.measured[rank].items():
            misses += _within(f"{where} {phase}", measured, got.predicted[rank][phase],
                              record["predicted"][str(rank)][phase])  # fmt: skip
    return misses


def test_draws_are_seeded_and_sized():
    a, b = draw(1, 7), draw(1, 7)
    assert a == b and a != draw(2, 7)
    draws = [draw(1, i) for i in SLICE]
    assert {d.config["model_type"] for d in draws} == set(FAMILIES)
    assert {d.nd for d in draws} == {2, 3, 4} and {d.engine for d in draws} == {"fsdp2", "deepspeed"}
    assert all(PSI_RANGE[0] <= d.psi <= PSI_RANGE[1] for d in draws)
    assert {d.config["tie_word_embeddings"] for d in draws} == {True, False}


def test_deepspeed_thresholds_are_drawn_on_both_sides():
    draws = [draw(1, i, "deepspeed") for i in SLICE]
    zero = [(d, d.ds_config["zero_optimization"]) for d in draws]
    assert {z["stage"] for _, z in zero} == {1, 2, 3}
    assert any(z["reduce_bucket_size"] >= d.psi for d, z in zero)  # one bucket
    numels = {d.index: max(_numels(d.config)) for d, _ in zero}
    assert any(z["reduce_bucket_size"] < numels[d.index] for d, z in zero)  # smaller than a tensor
    z3 = [(d, z) for d, z in zero if z["stage"] == 3]
    assert {z["stage3_param_persistence_threshold"] == 0 for _, z in z3} == {True, False}
    assert {z["stage3_prefetch_bucket_size"] for _, z in z3} >= {0, 50_000_000}
    assert {d.zero_init for d, _ in z3} == {True, False}
    assert {z["overlap_comm"] for _, z in zero} == {True, False}
    assert {d.ds_config["gradient_accumulation_steps"] for d in draws} == {1, 2}


def test_generator_2_adds_fsdp2_wrappings_and_keeps_the_rest():
    from zeroplan.engines.fsdp2.wrap import parse_wrapping

    draws = [(draw(1, i, "fsdp2"), draw(1, i, "fsdp2", generator=2)) for i in SLICE]
    for one, two in draws:  # the model, the step, the world and the dtypes are generator 1's
        assert (one.config, one.nd, one.seq_len, one.micro_batch) == (two.config, two.nd, two.seq_len, two.micro_batch)
        rest = {k: v for k, v in one.fsdp2.items() if k != "reshard_after_forward"}
        assert {k: v for k, v in two.fsdp2.items() if k not in ("wrap", "reshard_after_forward")} == rest
    wraps = [two.fsdp2["wrap"] for _, two in draws]
    assert {"blocks", "torchtitan"} <= {w for w in wraps if isinstance(w, str)}
    files = [parse_wrapping(w) for w in wraps if isinstance(w, dict)]
    assert {f.units[-1].reshard_after_forward for f in files} == {None, True}  # the root: FSDP2's default, True
    assert {e.reshard_after_forward for f in files for e in f.units if e.modules[0].endswith(".*")} == {True, False, 2}
    assert any(len(f.units) == 4 for f in files) and any(e.group for f in files for e in f.units)
    assert {two.fsdp2["reshard_after_forward"] for _, two in draws} == {True, False, 2}
    assert draw(1, 5, "deepspeed", generator=2).ds_config == draw(1, 5, "deepspeed").ds_config


def test_generator_3_adds_meta_init_and_checkpointing_and_keeps_generator_2():
    draws = [(draw(1, i, "fsdp2", generator=2), draw(1, i, "fsdp2", generator=3)) for i in SLICE]
    for two, three in draws:  # everything generator 2 draws, its wrapping included, is drawn the same
        step = (three.config, three.nd, three.seq_len, three.micro_batch)
        assert (two.config, two.nd, two.seq_len, two.micro_batch) == step
        assert {k: v for k, v in three.fsdp2.items() if k not in ("init", "checkpointing")} == two.fsdp2
        assert "init" not in two.fsdp2 and "checkpointing" not in two.fsdp2
    assert {(t.fsdp2["init"], t.fsdp2["checkpointing"]) for _, t in draws} == {
        (i, c) for i in ("materialized", "meta") for c in (False, True)}
    assert draw(1, 9, "fsdp2", generator=3).name.endswith("init=meta ckpt")
    assert draw(1, 5, "deepspeed", generator=3).ds_config == draw(1, 5, "deepspeed").ds_config
    with pytest.raises(ValueError, match="generator=0"):
        draw(1, 0, generator=0)


def test_generator_4_adds_deepspeed_checkpointing_and_bf16_and_keeps_generator_3():
    from validate.engines.differential_deepspeed import BF16_CHEAP_PSI

    pairs = [(draw(s, i, e, generator=3), draw(s, i, e, generator=4)) for s in (1, 3) for i in SLICE
             for e in ("fsdp2", "deepspeed")]  # fmt: skip
    for three, four in pairs:  # the model, the step, the world, FSDP2's settings: generator 3's
        assert (three.config, three.nd, three.seq_len, three.micro_batch, three.fsdp2, three.zero_init) == (
            four.config, four.nd, four.seq_len, four.micro_batch, four.fsdp2, four.zero_init)
        if four.engine == "fsdp2":
            assert (four.ds_config, four.checkpointing) == (None, "none")
            continue
        rest = {k: v for k, v in four.ds_config.items() if k != "bf16"}
        assert rest == {k: v for k, v in three.ds_config.items() if k != "bf16"}
        assert "bf16" not in three.ds_config or "bf16" in four.ds_config  # generator 1's bf16 stays
        if "bf16" in four.ds_config and "bf16" not in three.ds_config:
            assert four.psi <= BF16_CHEAP_PSI  # more bf16 only where cheap
    ds = [four for _, four in pairs if four.engine == "deepspeed"]
    assert 0.4 < sum(d.checkpointing == "full" for d in ds) / len(ds) < 0.6  # 80 draws: 43 checkpointed
    small = [d for d in ds if d.psi <= BF16_CHEAP_PSI]
    assert 0.2 < sum("bf16" in d.ds_config for d in small) / len(small) < 0.45  # 0.325 expected
    assert draw(3, 7, generator=4).name.endswith("z2 fp32 rb=2e+06 ov=0 ga=1 ckpt")
    assert draw(3, 20, generator=4).ds_config["bf16"] == {"enabled": True}  # 9.2M: fp32 by generator 1
    assert "bf16" not in draw(3, 20, generator=3).ds_config


def _numels(config: dict) -> tuple[int, ...]:
    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.architectures.spec import transformer_shapes

    return tuple(math.prod(s) for _, s in transformer_shapes(spec_from_hf_config(config)))


def _records() -> list[dict]:
    return [r for f in DRAW_FILES if f.exists() for r in json.loads(f.read_text())["results"]]


def _cases() -> list[dict]:
    """Configurations built by hand (each says why), measured by the same ``run_draw``."""
    return json.loads(RECORDED.read_text()).get("cases", []) if RECORDED.exists() else []


def _params(records: list[dict]) -> list:
    """Each record as a case; one the matrix found and the profile does not explain yet (``open``: why) is a
    strict xfail, which fails the day the profile gets it right (then drop its ``open``)."""
    return [pytest.param(r, id=r["name"], marks=[pytest.mark.xfail(strict=True, reason=r["open"])] if "open" in r else [])
            for r in records]  # fmt: skip


def test_recorded_draws_are_drawn_again_by_their_generator():
    """Every recorded draw (generators 1-4, both files) is what its generator draws today: a new generator
    never changes an earlier one's draws (pure Python, no torch)."""
    from validate.engines.differential import Draw

    records = [r["draw"] for r in _records()]
    assert {d.get("generator", 1) for d in records} >= {1, 2, 3}
    for r in records:
        d = Draw(**r)
        assert d in (draw(d.seed, d.index, generator=d.generator), draw(d.seed, d.index, d.engine, d.generator)), d.name


@pytest.mark.parametrize("record", _params(_records()))
def test_recorded_draw_within_targets(record, tmp_path):
    got = replay(record, tmp_path)
    d = got.draw
    # the generator (its version) still draws what was measured
    assert d in (draw(d.seed, d.index, generator=d.generator), draw(d.seed, d.index, d.engine, d.generator))
    assert draw_misses(record, got) == []


def test_a_draw_moved_away_within_the_targets_fails_its_recorded_error(tmp_path):
    """The recorded-error rule can fail where the targets cannot: one phase of one rank of draw 1-0 moved 0.1% of its
    peak away from the measurement (a term of that size dropped or added) stays within the targets and fails."""
    record = _records()[0]
    got = replay(record, tmp_path)
    assert draw_misses(record, got) == []
    measured, predicted = got.measured[0]["backward"], got.predicted[0]["backward"]
    got.predicted[0]["backward"] = predicted + (1 if predicted >= measured else -1) * measured // 1000
    assert all(-TARGET_UNDER <= e <= TARGET_WITHIN for es in got.errors().values() for e in es.values())
    assert [m.split(":")[0] for m in draw_misses(record, got)] == [f"{record['name']} rank 0 backward"]


@pytest.mark.parametrize("record", _cases(), ids=[r["name"] for r in _cases()])
def test_recorded_case_within_targets(record, tmp_path):
    """Issue 17's ZeRO-1 row at N_d = 3 (its rank 2 held 5% more than rank 0; here rank 1 holds 17% more): every rank held a 5.1M-element gradient more than predicted (the
    embedding's, reduced in place and kept: ``zero12.py _stage1_reduce``), rank 2 (the head's partition) two;
    ranks 0 and 2, whose slices lie within one parameter, held that parameter's whole gradient at the update
    (``_within_one_parameter``). Before: backward -11.1%, -9.5%, -16.2%; optimizer step -1.97% on ranks 0 and 2."""
    from validate.engines.differential import Draw, predict_draw

    got = replay(record, tmp_path)
    measured = {r: max(m.values()) for r, m in got.measured.items()}
    # the worst GPU is rank 1 (its slice overlaps every parameter: its grads_in_partition is the whole model),
    # 17% over rank 0: the planner's row is rank 1's and names it
    assert max(measured, key=measured.get) == 1 and measured[1] > 1.17 * measured[0]
    d = Draw(**record["draw"])
    path = tmp_path / "case.json"
    path.write_text(json.dumps(d.config))
    worst = predict_draw(d, str(path), None)
    assert worst == got.predicted[1]
    assert draw_misses(record, got) == []


def test_recorded_draws_exist_with_provenance():
    for f in (RECORDED, RECORDED_BF16, RECORDED_SEED3):
        data = json.loads(f.read_text())
        assert data["results"] and {"recorded", "torch", "deepspeed", "transformers", "command"} <= set(data)
    bf16 = [r["draw"] for r in json.loads(RECORDED_BF16.read_text())["results"]]
    assert all(d["fsdp2"]["param_dtype"] == "bf16" and d["generator"] == 3 for d in bf16)
    assert any(d["fsdp2"]["init"] == "meta" for d in bf16)  # the meta init of a 16-bit model, with and without
    assert {d["fsdp2"]["checkpointing"] for d in bf16} == {True, False}
    seed3 = [r["draw"] for r in json.loads(RECORDED_SEED3.read_text())["results"]]
    assert {(d["seed"], d["generator"]) for d in seed3} == {(3, 4)} and {d["engine"] for d in seed3} == {"fsdp2", "deepspeed"}
    ds = [d for d in seed3 if d["engine"] == "deepspeed"]  # generator 4's DeepSpeed settings, each side measured
    assert {d["checkpointing"] for d in ds} == {"none", "full"} and {"bf16" in d["ds_config"] for d in ds} == {True, False}
    unseen = ((RECORDED_SEED4, 4, 4), (RECORDED_FAMILIES_SEED4, 4, 5), (RECORDED_SEED5, 5, 4), (RECORDED_FAMILIES_SEED5, 5, 5),
              (RECORDED_SEED6, 6, 4), (RECORDED_FAMILIES_SEED6, 6, 5), (RECORDED_SEED7, 7, 4))
    for f, seed, generator in unseen:  # seeds 4-7: unseen, both engines
        data = json.loads(f.read_text())
        assert {"recorded", "torch", "deepspeed", "transformers", "command"} <= set(data)
        assert {(r["draw"]["seed"], r["draw"]["generator"]) for r in data["results"]} == {(seed, generator)}
        assert {r["draw"]["engine"] for r in data["results"]} == {"fsdp2", "deepspeed"}


@pytest.mark.distributed
def test_live_draw_every_phase_every_rank(tmp_path):
    pytest.importorskip("transformers")
    d = draw(1, 81, "fsdp2")  # mistral 6.6M untied, labels=, N_d = 2, micro-batch 2, seq 128, resharded
    got = run_draw(d, tmp_path)
    assert sorted(got.measured) == [0, 1]
    for rank, errors in got.errors().items():
        for phase, e in errors.items():
            assert -TARGET_UNDER <= e <= TARGET_WITHIN, (rank, phase, f"{e:+.3%}")


def test_meta_init_of_transformers_model_recomputes_its_rotary_tables():
    """Generator 3's meta init (``validate.engines.fsdp2.init_hf_weights``, unsharded here): ``to_empty`` leaves
    every tensor uninitialised; transformers' ``init_weights`` must fill the weights (std 0.02, norms 1) and
    recompute the non-persistent rotary tables, or the run trains on garbage of the right size."""
    pytest.importorskip("transformers")
    import torch

    from validate.engines.deepspeed import hf_builder
    from validate.engines.fsdp2 import init_hf_weights

    path = str(Path(__file__).resolve().parent / "data" / "hf_configs" / "tiny-qwen2.json")
    materialized = hf_builder(path)()
    with torch.device("meta"):
        model = hf_builder(path)()
    model.to_empty(device="cpu")
    for t in model.buffers():
        t.fill_(float("nan"))
    for p in model.parameters():
        p.data.fill_(float("nan"))
    init_hf_weights(model)
    assert torch.equal(model.model.rotary_emb.inv_freq, materialized.model.rotary_emb.inv_freq)
    assert all(torch.isfinite(t).all() for t in [*model.parameters(), *model.buffers()])
    assert abs(float(model.model.embed_tokens.weight.std()) - 0.02) < 0.002
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))


# ---- generator 5: the newer families (issue 19; validate/engines/differential_families.py) ----


def _family_draws() -> list:
    return [draw(1, i, generator=5) for i in range(120)]


def test_generator_5_draws_every_newer_family_under_both_engines():
    from validate.engines.differential_families import FAMILIES as NEWER
    from validate.engines.differential_families import PSI_RANGE as NEWER_PSI

    draws = _family_draws()
    assert draws[7] == draw(1, 7, generator=5) and draws[7] != draw(2, 7, generator=5)
    assert draw(1, 7, "fsdp2", generator=5).config == draw(1, 7, "deepspeed", generator=5).config
    assert {(d.engine, d.config["model_type"]) for d in draws} == {(e, f) for e in ("fsdp2", "deepspeed") for f in NEWER}
    assert all(NEWER_PSI[0] <= d.psi <= NEWER_PSI[1] and d.generator == 5 for d in draws)
    assert {d.nd for d in draws} == {2, 3, 4} and draw(1, 7) == draw(1, 7, generator=1)  # generator 1 untouched
    c = [d.config for d in draws]
    decoupled = [x for x in c if "head_dim" in x]
    assert {x["head_dim"] * x["num_attention_heads"] == x["hidden_size"] for x in decoupled} == {True, False}
    assert {x["num_key_value_heads"] < x["num_attention_heads"] for x in c} == {True, False}
    assert {x["tie_word_embeddings"] for x in c if x["model_type"] != "mixtral"} == {True, False}
    gemma2 = [d for d in draws if d.config["model_type"] == "gemma2"]
    assert {d.config["sliding_window"] < d.seq_len for d in gemma2} == {True, False}
    assert {d.config["attn_logit_softcapping"] for d in gemma2} == {None, 50.0}
    ds = [x for x in c if x["model_type"] == "deepseek_v3"]
    assert {x["q_lora_rank"] is None for x in ds} == {True, False} and {x["first_k_dense_replace"] > 0 for x in ds} == {True, False}
    assert any(x["n_group"] > 1 for x in ds) and all(x["qk_nope_head_dim"] + x["qk_rope_head_dim"] != x["v_head_dim"] for x in ds)
    qwen_moe = [x for x in c if x["model_type"] in ("qwen2_moe", "qwen3_moe")]
    assert any(x["mlp_only_layers"] for x in qwen_moe) and {x["decoder_sparse_step"] for x in qwen_moe} == {1, 2}
    experts = [(d.nd, d.config.get("num_local_experts") or d.config.get("num_experts") or d.config.get("n_routed_experts"))
               for d in draws if d.engine == "fsdp2" and d.config["model_type"] in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")]
    assert {e % nd == 0 for nd, e in experts} == {True, False}  # FSDP2's dim-0 padding of the experts, both ways


def test_generator_5_draws_deepspeed_moe_where_modelled_only():
    """A sparse model under DeepSpeed: ZeRO-3, or ZeRO-2 with a bucket of at least one expert tensor (``moe_limit``)."""
    from validate.engines.differential_families import SPARSE, expert_tensor

    ds = [d for i in range(200) if (d := draw(1, i, "deepspeed", generator=5)).config["model_type"] in SPARSE]
    zero = [(d, d.ds_config["zero_optimization"]) for d in ds]
    assert {z["stage"] for _, z in zero} == {2, 3}
    assert all(z["reduce_bucket_size"] >= expert_tensor(d.config) for d, z in zero if z["stage"] == 2)
    assert {d.zero_init for d, z in zero if z["stage"] == 3} == {True, False}


def test_a_refused_family_draw_is_not_run_and_says_why():
    """A draw the profile refuses (experts whose activation is not SiLU, ``activation_limit``) says why in one line,
    counted by reason; Gemma 3's window is drawn on both sides of the sequence and both are run (refused above it
    before its sliding and full layers got their own blocks, 2026-12-02)."""
    from dataclasses import replace

    from validate.engines.differential_families import refusal, refusals, rule

    gemma3 = [d for d in _family_draws() if d.config["model_type"] == "gemma3_text"]
    short = next(d for d in gemma3 if d.config["sliding_window"] <= d.seq_len)
    assert refusal(short) is None and refusal(next(d for d in gemma3 if d.config["sliding_window"] > d.seq_len)) is None
    assert refusals(1, [short.index, 1]) == {}
    mixtral = next(d for d in _family_draws() if d.config["model_type"] == "mixtral")
    why = refusal(replace(mixtral, config={**mixtral.config, "hidden_act": "gelu"}))
    assert why.startswith("model_type 'mixtral': its activation peak is not modelled yet (experts with hidden_act 'gelu'")
    assert "\n" not in why and rule(f"{why} 1,024 x") == f"{rule(why)} N x"


def _family_records() -> list[dict]:
    return [r for f in FAMILY_FILES if f.exists() for r in json.loads(f.read_text())["results"]]


def test_recorded_family_draws_cover_every_family_under_both_engines():
    from validate.engines.differential_families import FAMILIES as NEWER

    data = json.loads(RECORDED_FAMILIES.read_text())
    assert {"recorded", "torch", "deepspeed", "transformers", "command"} <= set(data)
    got = {(r["draw"]["engine"], r["draw"]["config"]["model_type"]) for r in data["results"] if "refused" not in r}
    assert got == {(e, f) for e in ("fsdp2", "deepspeed") for f in NEWER}


@pytest.mark.parametrize("record", _params(_family_records()))
def test_recorded_family_draw_within_targets(record, tmp_path):
    """Every recorded draw of generator 5 (its measurement on disk) predicted again: every phase of every rank."""
    from validate.engines.differential_families import refusal

    got = replay(record, tmp_path)
    d = got.draw
    assert d in (draw(d.seed, d.index, generator=5), draw(d.seed, d.index, d.engine, 5))
    # measured before a limit refused it (DeepSpeed's multi-bucket ZeRO-2 on experts, engines/deepspeed/moe12.py):
    # kept, still refused (when the limit moves, look at it again), and the profile's number within the targets
    assert refusal(d) == record.get("refused")
    assert draw_misses(record, got) == []


def _embedding_unit_records() -> list[dict]:
    return json.loads(RECORDED_EMBEDDING_UNIT.read_text())["results"]


@pytest.mark.parametrize("record", _params(_embedding_unit_records()))
def test_embedding_unit_case_within_its_margin(record, tmp_path):
    """3-5's shape (the embedding its own unit, resharded after forward; untied and a tied group; the root resharded
    and not; the blocks resharded and kept; N_d 2 and 4), measured once and predicted again: every phase of every
    rank within the record's stated margin (its measured error, rounded up), the issue's targets and its recorded
    error. Cases 1 and 2 were +3.55% and +4.73% over in backward with the embeddings' prefetch counted at block 1's copy-out
    (``side.with_embedding_prefetch``); case 3 (the tied ``[embed_tokens, lm_head]`` group) -11.35% in forward
    and -4.43% in backward (case 5, no labels: -14.49% in forward) before the group counted as spanning the layers,
    prefetched by the root and kept to the final callback (``wrap._resolve``, ``side.spanning_resharded``)."""
    got = replay(record, tmp_path)
    margin = record["margin"]
    for rank, errors in got.errors().items():
        for phase, e in errors.items():
            assert -min(margin, TARGET_UNDER) <= e <= min(margin, TARGET_WITHIN), (rank, phase, f"{e:+.3%}")
    assert draw_misses(record, got) == []


#: generator 5's draw 1-177 (Phi-3 8.0M tied, DeepSpeed ZeRO-3, N_d = 2) with transformers' gradient checkpointing,
#: measured 2026-12-02 on this machine (``run_draw(replace(draw(1, 177, "deepspeed", 5), checkpointing="full"))``,
#: gloo, two steps; both ranks alike): its estimate raised ``KeyError: 'block 0 MLP input'`` before, because the
#: ZeRO-3 trace knew Llama's ``up_proj`` as the MLP input projection, not Phi-3's fused ``gate_up_proj``
#: (engines/deepspeed/trace.py). Now within 640 B (-0.0003 %) on every phase.
PHI3_CHECKPOINTED = {"init": 135890049, "forward": 208564117, "backward": 241392285, "optimizer_step": 191317157}


def test_phi3_checkpointed_zero3_is_predicted_as_measured(tmp_path):
    from dataclasses import replace

    from validate.engines.differential import predict_draw

    d = replace(draw(1, 177, "deepspeed", 5), checkpointing="full")
    path = tmp_path / "phi3.json"
    path.write_text(json.dumps(d.config))
    for rank in (0, 1):
        predicted = predict_draw(d, str(path), rank)
        for phase, measured in PHI3_CHECKPOINTED.items():
            assert 0 <= measured - predicted[phase] <= 640, (rank, phase, predicted[phase])
