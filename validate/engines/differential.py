"""The randomized differential matrix (issue 17): seeded configurations trained by the real engines, every
phase of every rank against that rank's own prediction.

An engine profile is an implementation of the engine's memory behaviour; like an operator checked against a
reference over generated samples, it is checked here against the real engine over drawn configurations:
``draw(seed, index)`` picks a transformers family (gpt2, llama, mistral, qwen2), its sizes (hidden, layers,
heads and KV heads, intermediate, vocabulary, tied or not; 5-60M parameters, so that DeepSpeed's thresholds
bite), a step (sequence, micro-batch), N_d in 2-4 and the engine's settings, each threshold drawn on both
sides of its boundary (DeepSpeed: stage 1-3, reduce and all-gather buckets larger than the model or smaller
than one tensor, persistence threshold below and above the norms and the matrices, prefetch bucket smaller
than a block or DeepSpeed's default, max live parameters, overlap, accumulation, zero.Init; FSDP2:
reshard_after_forward True, False or an int, labels inside or outside the root's forward, bf16 sparingly:
about 20x slower on CPU). ``run_draw`` trains transformers' own class of the drawn config.json with its own
loss on N_d gloo ranks (``validate.engines.fsdp2_rows.run_world``, ``validate.engines.deepspeed.run_world``)
and predicts every rank (``Settings.rank``). The benchmark ``benchmarks/differential.py`` runs a sweep; the
test ``tests/test_differential.py`` runs a fixed-seed slice.

Generator 2 (``draw(..., generator=2)``) draws the same model, step, world and settings as generator 1 (so a
recorded draw stays reproducible), then for FSDP2 a wrapping from a second stream of the same seed: the presets
``blocks`` and ``torchtitan``, or a FILE (``_WRAPPINGS``: the root True, the embeddings apart, accelerate's
order), with the decoder layers' ``reshard_after_forward`` True, False or an int and the root's and the head
group's own values.

Generator 3 (``generator=3``) draws generator 2's draw, wrapping included, then from a third stream FSDP2's
``init`` (materialized or meta: built under ``torch.device("meta")``, sharded, ``to_empty``, transformers'
``init_weights``; ``validate.engines.fsdp2.build_sharded``) and activation checkpointing (``checkpoint_wrapper``
on every decoder layer before ``fully_shard``, non-reentrant: torchtitan's and accelerate's
``fsdp_activation_checkpointing`` order; ``validate.engines.fsdp2.shard``).

Generator 4 (``generator=4``) draws generator 3's draw, then for DeepSpeed from a fourth stream transformers'
gradient checkpointing (about half the draws) and bf16 on about a third of the draws of at most 12M parameters
(``validate.engines.differential_deepspeed``).

Not drawn: dropout (the configs set every ``*pdrop`` to 0: no profile counts dropout masks).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

from validate.engines.differential_deepspeed import generator_4

FAMILIES = ("gpt2", "llama", "mistral", "qwen2")
PSI_RANGE = (5_000_000, 60_000_000)
"""parameters of a drawn model (DeepSpeed's 1e5-element persistence threshold and buckets bite)."""
BF16_SHARE = 0.1
"""the share of draws in bf16: ~20x slower than fp32 on CPU."""
TARGET_WITHIN = 0.01
"""issue 17's target: every phase of every rank within 1% of its prediction..."""
TARGET_UNDER = 0.005
"""...and no prediction under the measurement by more than 0.5% of it."""
WORLD_MODEL = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
               "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 256}  # fmt: skip
"""The DeepSpeed world's placeholder model (``_run_deepspeed``): positions for every drawn sequence."""


@dataclass(frozen=True)
class Draw:
    """One configuration of the matrix: the model's config.json, the step, the world and one engine's settings."""

    seed: int
    index: int
    engine: str
    """fsdp2 or deepspeed."""
    config: dict
    """the transformers config.json (``AutoConfig.for_model`` keys)."""
    nd: int
    seq_len: int
    micro_batch: int
    fsdp2: Optional[dict] = None
    """``validate.engines.fsdp2_compare.Fsdp2Settings`` fields beyond the model and the step."""
    ds_config: Optional[dict] = None
    zero_init: bool = False
    psi: int = 0
    generator: int = 1
    """the generator's version: 2 adds FSDP2's wrapping, 3 its init and checkpointing, 4 DeepSpeed's
    checkpointing and more bf16 (module docstring); each earlier version's draws are unchanged."""
    checkpointing: str = "none"
    """DeepSpeed: transformers' gradient checkpointing, "none" or "full" (generator 4)."""

    @property
    def name(self) -> str:
        c = self.config
        tied = "tied" if c.get("tie_word_embeddings") else "untied"
        if self.engine == "fsdp2":
            s = self.fsdp2
            what = f"rsf={s['reshard_after_forward']} {s['param_dtype']}{'' if s['labels'] else ' no-labels'}"
            wrap = s.get("wrap", "blocks")
            what += "" if wrap == "blocks" else f" wrap={wrap if isinstance(wrap, str) else _wrap_label(wrap)}"
            what += " init=meta" if s.get("init") == "meta" else ""
            what += " ckpt" if s.get("checkpointing") else ""
        else:
            z = self.ds_config["zero_optimization"]
            dtype = "bf16" if "bf16" in self.ds_config else "fp32"
            what = (f"z{z['stage']} {dtype} rb={z['reduce_bucket_size']:.0e} ov={int(bool(z.get('overlap_comm')))}"
                    f" ga={self.ds_config['gradient_accumulation_steps']}"
                    + (f" pt={z['stage3_param_persistence_threshold']:.0e} pf={z['stage3_prefetch_bucket_size']:.0e}"
                       f"{' zinit' if self.zero_init else ''}" if z["stage"] == 3 else "")
                    + (" ckpt" if self.checkpointing != "none" else ""))  # fmt: skip
        return (f"{self.seed}-{self.index} {self.engine} {c['model_type']} {self.psi / 1e6:.1f}M {tied} "
                f"N_d={self.nd} b={self.micro_batch} s={self.seq_len} {what}")


# ---- the generator ----


def _model(rng: random.Random, family: str) -> dict:
    """A config.json of ``family``: odd sizes on purpose (vocabularies and intermediates not multiples of 64)."""
    head_dim = rng.choice((32, 64))
    heads = rng.choice((4, 5, 6, 8))
    hidden = head_dim * heads
    layers = rng.randint(2, 6)
    vocab = rng.randint(5_000, 32_000)
    tied = rng.random() < 0.5
    positions = 256
    if family == "gpt2":
        return {"model_type": "gpt2", "n_embd": hidden, "n_layer": layers, "n_head": heads, "vocab_size": vocab,
                "n_positions": positions, "n_inner": rng.choice((4 * hidden, 3 * hidden + 8)),
                "tie_word_embeddings": tied, "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0}  # fmt: skip
    kv = rng.choice([k for k in range(1, heads + 1) if heads % k == 0])
    return {"model_type": family, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "intermediate_size": 16 * rng.randint(hidden // 8, hidden // 4) + rng.choice((0, 8)),
            "vocab_size": vocab, "max_position_embeddings": positions, "tie_word_embeddings": tied,
            "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "attention_dropout": 0.0,
            **({"sliding_window": None} if family == "mistral" else {})}  # fmt: skip


def _numels(config: dict) -> tuple[int, ...]:
    """Every parameter's elements, in transformers' ``named_parameters`` order (zeroplan's reading)."""
    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.architectures.spec import transformer_shapes

    return tuple(math.prod(s) for _, s in transformer_shapes(spec_from_hf_config(config)))


def _ds_config(rng: random.Random, numels: tuple[int, ...], hidden: int, block: int, micro: int) -> tuple[dict, bool]:
    """A ds_config with every threshold on one side of its boundary, drawn (and zero.Init at stage 3)."""
    psi, largest = sum(numels), max(numels)
    stage = rng.choice((1, 2, 3))
    zero = {"stage": stage,
            # larger than the model (one bucket), between (several), smaller than the largest tensor
            "reduce_bucket_size": rng.choice((2 * psi, psi // 4, largest // 2)),
            "allgather_bucket_size": rng.choice((2 * psi, largest // 2)),
            "overlap_comm": rng.random() < 0.5}  # fmt: skip
    if stage == 3:
        # persistence: nothing, the norms and biases (<= hidden), and some matrices (<= 1.5 hidden^2)
        zero["stage3_param_persistence_threshold"] = rng.choice((0, hidden, 3 * hidden * hidden // 2))
        # prefetch: none, smaller than a block, DeepSpeed's default 5e7 (larger than the model)
        zero["stage3_prefetch_bucket_size"] = rng.choice((0, block // 2, 50_000_000))
        zero["stage3_max_live_parameters"] = rng.choice((1_000_000_000, block))
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": rng.choice((1, 1, 2)),
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": zero, "steps_per_print": 10**9}  # fmt: skip
    if rng.random() < BF16_SHARE:
        config["bf16"] = {"enabled": True}
    return config, stage == 3 and rng.random() < 0.5


def _fsdp2(rng: random.Random, nd: int) -> dict:
    rsf = rng.choice([True, False, *([2] if nd == 4 else [])])
    bf16 = rng.random() < BF16_SHARE
    return {"reshard_after_forward": rsf, "param_dtype": "bf16" if bf16 else "fp32",
            "reduce_dtype": "fp32" if bf16 and rng.random() < 0.5 else None, "labels": rng.random() < 0.7}  # fmt: skip


def _names(family: str) -> tuple[str, str, str]:
    """transformers' (decoder layers, token embedding, final norm) module names of ``family``."""
    if family == "gpt2":
        return "transformer.h.*", "transformer.wte", "transformer.ln_f"
    return "model.layers.*", "model.embed_tokens", "model.norm"


def _wrap_label(wrap: dict) -> str:
    return "[" + "; ".join(("+".join(e["modules"]) or "root") + ("" if e.get("reshard_after_forward") is None
                           else f"={e['reshard_after_forward']}") for e in wrap["units"]) + "]"  # fmt: skip


def _wrapping(rng: random.Random, d: Draw) -> dict:
    """Generator 2's FSDP2 wrapping of ``d``: a preset or a FILE, every unit's reshard_after_forward drawn
    (the layers' True, False or an int dividing N_d; the root's None or True; the head group's None,
    False or True). A tied head shares the embedding's weight: the FILEs that keep it apart are not drawn."""
    layers, embed, norm = _names(d.config["model_type"])
    tied = d.config["tie_word_embeddings"]
    rsf = rng.choice([True, False, *([2] if d.nd == 4 else [])])
    kinds = ["blocks", "root-true", "head-group"] + ([] if tied else ["torchtitan", "embed-apart", "accelerate"])
    kind = rng.choice(kinds)
    if kind in ("blocks", "torchtitan"):
        return {"wrap": kind, "reshard_after_forward": rsf}
    head = [norm, embed, "lm_head"] if tied else [norm, "lm_head"]
    units = {"root-true": [{"modules": [layers]}, {"modules": head, "group": True}],
             "head-group": [{"modules": [layers]}, {"modules": head, "group": True,
                                                     "reshard_after_forward": rng.choice((None, False, True))}],
             "embed-apart": [{"modules": [embed]}, {"modules": [layers]}],
             "accelerate": [{"modules": [layers]}, {"modules": [embed]},
                            {"modules": head, "group": True, "reshard_after_forward": False}]}[kind]  # fmt: skip
    units[[u["modules"] for u in units].index([layers])]["reshard_after_forward"] = rsf
    root = {"modules": [""]} if kind in ("head-group", "accelerate") else {"modules": [""], "reshard_after_forward": True}
    if kind not in ("root-true", "embed-apart") and rng.random() < 0.5:
        root["reshard_after_forward"] = True
    return {"wrap": {"units": [*units, root]}, "reshard_after_forward": rsf}


def draw(seed: int, index: int, engine: Optional[str] = None, generator: int = 1) -> Draw:
    """The ``index``-th configuration of the matrix of ``seed`` (the same on every machine: ``random.Random``
    of a string seed); ``engine``: that engine for this draw (None: the drawn one; the model, the step and
    the world are the same either way); ``generator`` n > 1: generator n - 1's draw, then its own stream
    (``_LATER``), so that everything an earlier generator draws is drawn the same; 5: the newer families."""
    if generator == 5:  # the newer families (issue 19): validate/engines/differential_families.py
        return __import__("validate.engines.differential_families", fromlist=["_"]).family_draw(seed, index, engine)
    if generator != 1 and generator not in _LATER:
        raise ValueError(f"generator={generator}: expected 1, 5 or one of {sorted(_LATER)}")
    d = _draw(seed, index, engine)
    for g in range(2, generator + 1):
        d = _LATER[g](d)
    return replace(d, generator=generator)


def _generator_2(d: Draw) -> Draw:
    """FSDP2's wrapping, from a second stream (module docstring)."""
    if d.engine != "fsdp2":
        return d
    rng = random.Random(f"zeroplan-differential-{d.seed}-{d.index}-generator-2")
    return replace(d, fsdp2={**d.fsdp2, **_wrapping(rng, d)})


def _generator_3(d: Draw) -> Draw:
    """FSDP2's init and activation checkpointing, from a third stream (module docstring)."""
    if d.engine != "fsdp2":
        return d
    rng = random.Random(f"zeroplan-differential-{d.seed}-{d.index}-generator-3")
    return replace(d, fsdp2={**d.fsdp2, "init": rng.choice(("materialized", "meta")), "checkpointing": rng.random() < 0.5})


def _draw(seed: int, index: int, engine: Optional[str] = None) -> Draw:
    """Generator 1's draw (``draw``)."""
    rng = random.Random(f"zeroplan-differential-{seed}-{index}")
    drawn = rng.choice(("fsdp2", "deepspeed"))  # drawn whatever ``engine`` says: the rest of the draw is the same
    engine = engine or drawn
    family = rng.choice(FAMILIES)
    while True:
        config = _model(rng, family)
        numels = _numels(config)
        if PSI_RANGE[0] <= sum(numels) <= PSI_RANGE[1]:
            break
    nd, seq, micro = rng.choice((2, 3, 4)), rng.choice((32, 64, 128)), rng.choice((1, 2))
    hidden = config.get("hidden_size", config.get("n_embd"))
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    block = (sum(numels) - numels[0] * (2 if not config["tie_word_embeddings"] else 1)) // layers
    if engine == "deepspeed":
        ds, zero_init = _ds_config(rng, numels, hidden, block, micro)
        return Draw(seed, index, engine, config, nd, seq, micro, ds_config=ds, zero_init=zero_init, psi=sum(numels))
    return Draw(seed, index, engine, config, nd, seq, micro, fsdp2=_fsdp2(rng, nd), psi=sum(numels))


# generator n: what it adds to generator n - 1's draw (one line each)
_LATER = {
    2: _generator_2,
    3: _generator_3,
    4: generator_4,  # DeepSpeed's checkpointing and bf16 (differential_deepspeed.py)
}


# ---- running one draw: the real engine, every rank predicted ----


@dataclass
class DrawResult:
    """What one draw measured and predicted, per rank and phase (bytes), and the errors."""

    draw: Draw
    measured: dict[int, dict[str, int]] = field(default_factory=dict)
    predicted: dict[int, dict[str, int]] = field(default_factory=dict)

    def errors(self) -> dict[int, dict[str, float]]:
        """(predicted - measured) / measured per rank and phase: negative is an under-prediction."""
        return {r: {p: (self.predicted[r][p] - m) / m for p, m in phases.items() if m}
                for r, phases in self.measured.items()}  # fmt: skip

    def worst(self) -> tuple[float, float]:
        """(most under, most over) over every rank and phase."""
        every = [e for r in self.errors().values() for e in r.values()]
        return min(every), max(every)

    def ok(self) -> bool:
        under, over = self.worst()
        return under >= -TARGET_UNDER and max(-under, over) <= TARGET_WITHIN

    def as_json(self) -> dict:
        return {"name": self.draw.name, "draw": asdict(self.draw), "measured": self.measured,
                "predicted": self.predicted}  # fmt: skip


def run_draw(d: Draw, workdir: Path, steps: int = 2, timeout_s: float = 1800.0) -> DrawResult:
    """Train ``d`` on its N_d gloo ranks and predict each rank: the config.json is written to ``workdir``."""
    path = Path(workdir) / f"differential-{d.seed}-{d.index}.json"
    path.write_text(json.dumps(d.config))
    return (_run_fsdp2 if d.engine == "fsdp2" else _run_deepspeed)(d, str(path), steps, timeout_s)


def _fsdp2_settings(d: Draw, path: str, steps: int = 2):
    from validate.engines.fsdp2_rows import Fsdp2Settings

    return Fsdp2Settings(model=path, hf=True, seq_len=d.seq_len, batch_per_rank=d.micro_batch, steps=steps, **d.fsdp2)


def predict_draw(d: Draw, path: str, rank: Optional[int]) -> dict[str, int]:
    """The profile's peak per phase of ``rank`` of the draw (its config.json at ``path``; None: the worst
    rank's, the planner's row), as the runners predict it: a CPU run on gloo (LayerNorm statistics in the
    activations' dtype, no CUDA rounding)."""
    if d.engine == "fsdp2":
        from validate.engines.fsdp2_rows import predict

        meta = {"device": "cpu", "backend": "gloo", "world_size": d.nd}
        return predict(_fsdp2_settings(d, path), meta, rank)[0].peak.by_phase()  # fmt: skip
    from validate.engines.deepspeed_compare import workload_for
    from zeroplan.engines import get_engine
    from zeroplan.formulas.dtypes import BYTES_PER_ELEMENT

    ds, engine = d.ds_config, get_engine("deepspeed")
    workload = workload_for(path, d.micro_batch, d.seq_len, ds["gradient_accumulation_steps"], d.checkpointing, hf=True)
    settings = engine.settings.from_ds_config(ds, zero_init=d.zero_init)  # zero.Init: the runner's hf_zero3_build
    settings = settings.model_copy(update={"rank": rank, "hf_zero3_build": settings.builds_partitioned})
    # MemTracker on CPU: LayerNorm's statistics in the activations' dtype (deepspeed_compare.compare_row)
    (est,) = engine.estimate(workload, d.nd, settings, stat_bytes=BYTES_PER_ELEMENT[settings.dtype])
    return est.peak.by_phase()


def replay(record: dict, workdir: Path) -> DrawResult:
    """A recorded draw (``DrawResult.as_json``) predicted again by today's profile: the measurement on disk."""
    d = Draw(**record["draw"])
    path = Path(workdir) / f"differential-{d.seed}-{d.index}.json"
    path.write_text(json.dumps(d.config))
    out = DrawResult(d, {int(r): m for r, m in record["measured"].items()})
    out.predicted = {r: predict_draw(d, str(path), r) for r in out.measured}
    return out


def _run_fsdp2(d: Draw, path: str, steps: int, timeout_s: float) -> DrawResult:
    from validate.engines.fsdp2_rows import run_world

    result = run_world(_fsdp2_settings(d, path, steps), d.nd, timeout_s)
    out = DrawResult(d)
    for row in result["rows"]:
        out.measured[row["rank"]] = dict(row["peak_bytes_by_phase"])
        out.predicted[row["rank"]] = predict_draw(d, path, row["rank"])
    return out


def _run_deepspeed(d: Draw, path: str, steps: int, timeout_s: float) -> DrawResult:
    from validate.engines.deepspeed import run_world
    from validate.engines.deepspeed_compare import refuse_skipped_steps

    # the world's model is only checked (ValidateConfig: one the reference runtime builds); the run trains
    # transformers' class of ``path`` (``runs``), so a family that runtime cannot build (experts, q/k norms) trains too
    world = Path(path).with_name("world-llama.json")
    world.write_text(json.dumps(WORLD_MODEL))
    ranks = run_world([d.ds_config], d.nd, model=str(world), steps=steps, timeout_s=timeout_s, seq_len=d.seq_len,
                      runs=[{"model": path, "hf": True, "zero_init": d.zero_init, "checkpointing": d.checkpointing}])  # fmt: skip
    refuse_skipped_steps(d.ds_config, [row for (row,) in ranks])  # a skipped step: the draw fails with the reason
    out = DrawResult(d)
    for (row,) in ranks:
        out.measured[row["rank"]] = dict(row["peak_bytes_by_phase"])
        out.predicted[row["rank"]] = predict_draw(d, path, row["rank"])
    return out


def summary(results: list[DrawResult]) -> dict:
    """N of N within the targets, the worst under- and over-prediction and the draws that miss."""
    worst = [r.worst() for r in results]
    return {"draws": len(results), "within_target": sum(r.ok() for r in results),
            "worst_under": min((w[0] for w in worst), default=0.0), "worst_over": max((w[1] for w in worst), default=0.0),
            "misses": [r.draw.name for r in results if not r.ok()]}  # fmt: skip
