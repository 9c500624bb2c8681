"""What autograd saves in one training forward of transformers' own class (saved-tensor hooks, the module's
parameters excluded), and what the activation terms predict for it: the one measurement the families' saved-tensor
tests share (tests/test_activations.py, test_families.py, test_moe_peaks.py, test_deepseek.py), and the check of
their recorded real-FSDP2 rows."""

from __future__ import annotations

import pytest

from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.formulas.activation_terms import TOKEN_BYTES, model_activations

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def hf_saved_bytes(cfg: dict, b: int, s: int, dtype: str = "float32", attn: str = "sdpa"):
    """(bytes of the distinct storages autograd saved in one forward with ``labels=`` of transformers' class of
    ``cfg`` at micro-batch ``b``, sequence ``s`` and still holds at its end, parameters excluded; the model; its
    output). Only what is alive counts: a tensor saved for a node no loss reaches (DeepSeek's router saves some for
    its group ``topk``s, which feed only integer indices) is freed when its module returns, and a freed storage's
    address may be given to a later one. Seeded: the same model and tokens every call."""
    import weakref

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                          attn_implementation=attn, dtype=getattr(torch, dtype))  # fmt: skip
    owned = {p.untyped_storage().data_ptr() for p in model.train().parameters()}
    packed = []

    def pack(t):
        packed.append((weakref.ref(t), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    ids = torch.randint(0, cfg["vocab_size"], (b, s))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids, shift_labels=ids, use_cache=False)
    alive = {ptr: n for ref, ptr, n in packed if ref() is not None and ptr not in owned}
    return sum(alive.values()), model, out


def predicted_saved_bytes(cfg: dict, b: int, s: int, dtype: str = "float32") -> int:
    """``saved_total`` of the activation terms (no checkpointing) plus the int64 targets cross-entropy saves."""
    a = DTYPE_BYTES[dtype]
    acts = model_activations(spec_from_hf_config(cfg), b, s, act_bytes=a, stat_bytes=a)
    return acts.saved_total("none") + b * s * TOKEN_BYTES


def check_fsdp2_recorded(name: str, cfg: dict, dtype: str, measured: list, residual: dict, margin: float,
                         tmp_path, seq: int = 64, **extra) -> None:
    """Every phase of every rank of a recorded real-FSDP2 run of transformers' class of ``cfg`` (gloo, N_d 2,
    ``hf=True``, ``seq`` tokens, 2 steps, ``extra`` Fsdp2Settings; ``measured``: one row of phase peaks per rank) within ``margin`` of its
    prediction, after the recorded ``residual`` of (name, phase); margin 0 and no residual: exact. The check the
    families', MoE and DeepSeek rows share."""
    pytest.importorskip("torch")
    import json

    from validate.engines.fsdp2 import Fsdp2Settings
    from validate.engines.fsdp2_rows import predict
    from zeroplan.formulas.peak import PHASES

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    settings = Fsdp2Settings(model=str(path), hf=True, seq_len=seq, steps=2, param_dtype=dtype, **extra)
    meta = {"world_size": 2, "backend": "gloo", "device": "cpu"}
    for rank, row in enumerate(measured):
        predicted = predict(settings, meta, rank)[0].peak.by_phase()
        for phase, value in zip(PHASES, row):
            err = (value - predicted[phase]) / value
            assert abs(err - residual.get((name, phase), 0.0)) <= margin, (name, rank, phase, value, predicted[phase])


#: 5,000-element DeepSpeed buckets (and a persistence threshold of 100), below the families' widest weights and the
#: MoE expert tensors (131,072 and 262,144): buckets and thresholds that bite on ~1M-parameter models.
DS_SMALL = {"reduce_bucket_size": 5000, "allgather_bucket_size": 5000, "stage3_prefetch_bucket_size": 5000,
            "stage3_param_persistence_threshold": 100}  # fmt: skip


def check_deepspeed_recorded(name: str, cfg: dict, stage: int, measured: list, residual: dict, margin: float,
                             tmp_path, small: bool = True, micro_batch: int = 1, seq: int | None = 64,
                             checkpointing: str = "none", dtype: str = "fp32") -> None:
    """Every phase of the largest rank of a recorded real-DeepSpeed run of transformers' class of ``cfg`` (gloo,
    N_d 2, ``ds_config(stage, dtype, micro_batch, DS_SMALL or DeepSpeed's buckets, torch_adam)``; ``measured``: the
    phase peaks [init, forward, backward, optimizer_step]) within ``margin`` of its prediction, after the recorded
    ``residual`` of each phase ({phase: error}). The check the families', MoE and DeepSeek rows share."""
    pytest.importorskip("torch")
    import json

    from validate.engines.deepspeed_compare import ds_config, workload_for
    from zeroplan.engines import deepspeed as D
    from zeroplan.formulas.peak import PHASES

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    config = ds_config(stage, dtype, micro_batch=micro_batch, zero=DS_SMALL if small else {},
                       optimizer_params={"torch_adam": True})  # fmt: skip
    workload = workload_for(str(path), micro_batch, seq, 1, checkpointing, hf=True)
    (est,) = D.estimate(workload, 2, D.Settings.from_ds_config(config, zero_init=False), stat_bytes=4)
    predicted = est.peak.by_phase()
    for phase, value in zip(PHASES, measured):
        err = (value - predicted[phase]) / value
        assert abs(err - residual.get(phase, 0.0)) <= margin, (name, stage, phase, value, predicted[phase])
