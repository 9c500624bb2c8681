"""The peak on the planner's side (issue 8): `estimate`, `plan`, `sweep` and `zeroplan.estimate(model=...)`
print what `zeroplan.engines.reference.estimate` predicts, and refuse bad input in one line.

Expected values come from the engine (or from `reference_run`/`predict_peak` themselves), never typed in:
these tests pin the plumbing (options -> Workload and Settings -> rows -> output), the peak's own numbers
are pinned by tests/test_peak.py and the validator.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import zeroplan
from clicheck import assert_one_line_error, run, run_json
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines import get_engine, reference
from zeroplan.engines.base import Workload
from zeroplan.formulas.cuda_workspaces import library_workspaces
from zeroplan.formulas.peak import CUDA_BLOCK_BYTES
from zeroplan.planning.offload_peak import offload_peak
from zeroplan.presets import read_hf_config, resolve_model

DATA = Path(__file__).parent / "data"
TINY_GPT2 = str(DATA / "hf_configs" / "tiny-gpt2.json")  # dropout 0, 16 positions
TINY_LLAMA = str(DATA / "hf_configs" / "tiny-llama.json")
GPT2 = str(DATA / "golden" / "inputs" / "gpt2-no-dropout.json")


def engine_rows(model: str, nd: int, seq_len: int, micro_batch=1, checkpointing="none", foreach=True,
                cuda_capability=(9, 0), **policy):
    spec = resolve_model(model)
    workload = Workload(transformer_shapes(spec), spec, seq_len, micro_batch, checkpointing, 1, foreach)
    settings = reference.Settings(policy=zeroplan.PrecisionPolicy(**policy), cuda_capability=cuda_capability)
    return reference.estimate(workload, nd, settings)


def engine_reserved(model: str, nd: int, seq_len: int, micro_batch=1, checkpointing="none", foreach=True,
                    cuda_capability=(9, 0), **policy) -> dict[int, int]:
    """{stage: reserved bytes} of the reference engine's allocation traces (zeroplan.allocator.reserved)."""
    from zeroplan.allocator.reserved import reserved_of
    from zeroplan.engines.reference.alloc_trace import alloc_traces

    spec = resolve_model(model)
    workload = Workload(transformer_shapes(spec), spec, seq_len, micro_batch, checkpointing, 1, foreach)
    settings = reference.Settings(policy=zeroplan.PrecisionPolicy(**policy), cuda_capability=cuda_capability)
    return {s: reserved_of(t).reserved_bytes for s, t in zip(settings.stages, alloc_traces(workload, nd, settings))}


def test_registry_maps_every_engine_to_its_module_and_refuses_unknown_ones_in_one_line():
    from zeroplan.engines import REGISTRY, deepspeed, fsdp2

    for name, module in (("reference", reference), ("fsdp2", fsdp2), ("deepspeed", deepspeed)):
        engine = get_engine(name)
        assert engine is module.ENGINE and engine.name == name  # the package declares it, the registry loads it
        assert (engine.estimate, engine.settings) == (module.estimate, module.Settings)
        assert engine.planner_settings is module.planner_settings and engine.options == module.PLANNER_OPTIONS
    assert list(REGISTRY) == ["reference", "deepspeed", "fsdp2"]
    with pytest.raises(ValueError, match="unknown engine 'fsdp9': known engines are reference, deepspeed, fsdp2"):
        get_engine("fsdp9")


def test_reference_estimate_rows_model_states_from_estimation_and_peak_from_predict_peak():
    spec = read_hf_config(TINY_LLAMA)
    workload = Workload(transformer_shapes(spec), spec, 8, 2, "full", 1, False)
    rows = reference.estimate(workload, 3, reference.Settings())
    plain = zeroplan.estimate(tensor_numels=[math.prod(s) for _, s in transformer_shapes(spec)], gpus=3)
    assert [r.stage for r in rows] == [0, 1, 2, 3]
    for r, s in zip(rows, plain.stages):
        assert r.memory == s.memory and r.collectives == s.collectives
        run_ = reference.reference_run(spec, 3, r.stage, 2, 8, "full", False, stat_bytes=4)
        workspaces = (library_workspaces((9, 0), spec.biased_linear),)  # the planner's GPU: compute capability 9.0
        assert r.peak == reference.predict_peak(run_, block_bytes=CUDA_BLOCK_BYTES, resident=workspaces)
    # without an architecture: the same model states, no peak
    bare = reference.estimate(Workload(workload.shapes), 3, reference.Settings())
    assert [b.memory for b in bare] == [r.memory for r in rows] and {b.peak for b in bare} == {None}


def test_block_rounding_is_applied_and_overhead_is_a_separate_zero_term():
    spec = read_hf_config(TINY_GPT2)
    workload = Workload(transformer_shapes(spec), spec, 16, 1)
    (gpu,) = reference.estimate(workload, 2, reference.Settings(stages=(3,)))
    (raw,) = reference.estimate(workload, 2, reference.Settings(stages=(3,), block_bytes=1))
    assert gpu.peak.peak_bytes > raw.peak.peak_bytes  # tiny tensors: rounding to 512 bytes shows
    (more,) = reference.estimate(workload, 2, reference.Settings(stages=(3,), allocator_overhead_bytes=1000))
    assert more.peak.by_phase() == {k: v + 1000 for k, v in gpu.peak.by_phase().items()}


@pytest.mark.parametrize(
    ("model", "args", "expect"),
    [
        ("llama2-7b", [], dict(seq_len=4096)),  # the preset's context, defaults: micro-batch 1, none, foreach
        (TINY_GPT2, ["--seq-len", "12", "--micro-batch", "3", "--checkpointing", "full", "--no-foreach"],
         dict(seq_len=12, micro_batch=3, checkpointing="full", foreach=False)),
        (TINY_LLAMA, ["--stage", "2"], dict(seq_len=read_hf_config(TINY_LLAMA).max_seq_len)),
    ],
)  # fmt: skip
def test_estimate_json_equals_the_engine(model, args, expect):
    d = run_json("estimate", "--model", model, "--gpus", "4", *args)
    rows = engine_rows(model, 4, **expect)
    if "--stage" in args:
        rows = [r for r in rows if r.stage == 2]
    assert d["inputs"]["engine"] == "reference" and d["inputs"]["model"] == model
    step = d["inputs"]["step"]
    assert step["seq_len"] == expect["seq_len"] and step["block_bytes"] == 512
    assert step["alloc_conf"] == ""
    assert len(d["stages"]) == len(rows)
    reserved = engine_reserved(model, 4, **expect)
    for out, r in zip(d["stages"], rows):
        assert out["reserved_bytes"] == reserved[r.stage] >= out["peak_bytes"]
        assert out["reserved_phases"]["backward"] <= out["reserved_bytes"]
        assert out["model_states_bytes"] == r.model_states_bytes
        assert out["peak_bytes"] == r.peak.peak_bytes and out["peak_phase"] == r.peak.peak_phase
        assert out["phases"] == r.peak.by_phase()
        assert out["peak_terms"] == [{"name": t.name, "bytes": t.bytes, "source": t.source} for t in r.peak.peak_terms]


def test_estimate_without_a_model_has_null_peaks_and_says_what_is_needed():
    d = run_json("estimate", "--params", "7e9", "--gpus", "8")
    assert d["inputs"]["step"] is None and d["inputs"]["model"] is None
    assert {(s["peak_bytes"], s["phases"], s["peak_terms"]) for s in d["stages"]} == {(None, None, None)}
    text = run("estimate", "--params", "7e9", "--gpus", "8").stdout
    assert "peak/GPU: needs --model" in text and "peak phase" not in text


def test_estimate_table_prints_peak_and_phase_and_fits_on_reserved():
    (row,) = [r for r in engine_rows("llama2-7b", 8, 4096) if r.stage == 3]
    reserved = engine_reserved("llama2-7b", 8, 4096)[3]
    out = run("estimate", "--model", "llama2-7b", "--gpus", "8", "--stage", "3", "--gpu-memory", "80GiB").stdout
    line = out.splitlines()[6]
    assert line.split()[0] == "3" and f"{row.peak.peak_bytes / 1e9:.3g} GB" in line
    assert f"{reserved / 1e9:.3g} GB" in line
    assert row.peak.peak_phase in line and line.split()[-1] == ("yes" if reserved <= 80 * 2**30 else "no")
    assert "512-byte CUDA blocks" in out and "fits: reserved/GPU <= GPU memory" in out


def test_api_accepts_a_preset_a_config_path_and_a_module():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    by_path = zeroplan.estimate(model=TINY_LLAMA, gpus=2, seq_len=8)
    assert [s.peak for s in by_path.stages] == [r.peak for r in engine_rows(TINY_LLAMA, 2, 8)]
    cfg = json.loads(Path(TINY_LLAMA).read_text())
    with torch.device("meta"):
        module = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    by_module = zeroplan.estimate(model=module, gpus=2, seq_len=8)  # a transformers model: its config is read
    assert [s.peak for s in by_module.stages] == [s.peak for s in by_path.stages]
    assert [s.memory for s in by_module.stages] == [s.memory for s in by_path.stages]
    plain = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 3))
    shapes_only = zeroplan.estimate(model=plain, gpus=2)
    assert {s.peak for s in shapes_only.stages} == {None}
    assert shapes_only.stages == zeroplan.estimate(tensor_numels=[200, 20, 60, 3], gpus=2).stages
    with pytest.raises(ValueError, match="seq_len describes a training step"):
        zeroplan.estimate(model=plain, gpus=2, seq_len=8)


def test_plan_fits_on_the_peak_and_names_a_term_to_cut():
    p = zeroplan.plan(GPT2, gpu="a100-40gb", gpus=4, checkpointing="none", micro_batch=8)
    # an A100 (compute capability 8.0): its cuBLAS workspaces (formulas/cuda_workspaces.py capability_of)
    rows = {r.stage: r for r in engine_rows(GPT2, 4, 1024, micro_batch=8, cuda_capability=(8, 0), param_dtype="bf16")}
    reserved = engine_reserved(GPT2, 4, 1024, micro_batch=8, cuda_capability=(8, 0), param_dtype="bf16")
    assert "fits on the allocator's reserved bytes" in p.fit_basis
    for o in p.stages:
        assert o.peak == rows[o.stage].peak
        assert o.fits == (o.reserved.reserved_bytes <= p.budget_bytes) and o.reserved.reserved_bytes == reserved[o.stage]
    for o in p.offload_options:  # the stage's peak with the offloaded terms on the host (planning/offload_peak.py)
        assert o.peak == offload_peak(rows[o.stage].peak, o.stage, o.offload, 512) and o.reserved is None
        assert o.fits == (o.peak.peak_bytes <= p.budget_bytes)
    # GPT-2 at 8 x 1024 tokens: activations (saved by blocks, or the fp32 loss's) are the largest terms
    target = p.recommendation if p.recommendation is not None else min(p.stages, key=lambda o: o.peak.peak_bytes)
    assert p.cut_first.split(" ")[0] in ("checkpointing", "micro-batch")
    assert any(f"{t.name}, " in p.cut_first for t in target.peak.peak_terms)

    d = run_json("plan", "--model", GPT2, "--gpu", "a100-40gb", "--gpus", "4", "--checkpointing", "none",
                 "--micro-batch", "8")  # fmt: skip
    assert [s["peak_bytes"] for s in d["stages"]] == [o.peak.peak_bytes for o in p.stages]
    assert d["cut_first"] == p.cut_first and d["fit_basis"] == p.fit_basis


@pytest.mark.parametrize(
    ("checkpointing", "micro_batch", "stage", "lever", "term"),
    [
        ("none", 1, 1, "checkpointing", "saved activations of 12 blocks"),  # the largest term, cut by full
        ("full", 4, 1, "micro-batch", "saved activations of 12 blocks"),
        ("full", 1, 1, "sequence", "saved activations of 12 blocks"),
        ("full", 1, 2, "stage", "fp32 master"),  # the model as built is cut by nothing: skipped
        ("full", 1, 3, "gpus", "fp32 master"),  # no stage above 3: more N_d
    ],
)
def test_cut_first_picks_the_largest_term_a_lever_cuts(checkpointing, micro_batch, stage, lever, term):
    from zeroplan.formulas.peak import PeakEstimate, PhasePeak, Term
    from zeroplan.planning.plan import cut_first

    gib = 2**30
    act = "zeroplan/formulas/activation_terms.py"
    built = Term("model as built", 6 * gib, "validate/models.py:build")

    def peak(master_gib: int, saved: bool = True) -> PeakEstimate:
        terms = (built, Term("fp32 master", master_gib * gib, "validate/runtime.py:Runtime.__init__"))
        if saved:
            terms = (Term("saved activations of 12 blocks", 7 * gib, act, 12), *terms)
        return PeakEstimate((PhasePeak("backward", 0, "m", terms),), 0, "backward", terms)

    config = zeroplan.PlanConfig(model=GPT2, gpu_memory_bytes=10**9, checkpointing=checkpointing,
                                 micro_batch=micro_batch)  # fmt: skip
    now = peak(4, saved=lever in ("checkpointing", "micro-batch", "sequence"))
    nxt = None if stage == 3 else peak(2)
    advice = cut_first(now, stage, config, next_stage=nxt, more_gpus=peak(1))
    assert advice.split(" ")[0] == lever and f"{term}, " in advice and "backward peak" in advice
    stuck = cut_first(peak(4, saved=False), stage, config, next_stage=peak(4), more_gpus=peak(4))
    assert stuck.startswith("no lever cuts") and "model as built" in stuck


def test_plan_says_why_it_fits_on_model_states():
    assert "needs an architecture" in zeroplan.plan(params=7e9, gpu="h100-80gb").fit_basis
    tp = zeroplan.plan("llama2-7b", gpu="h100-80gb", gpus=8, model_parallel=2)
    assert "without tensor parallelism" in tp.fit_basis and {o.peak for o in tp.options} == {None}
    fp32 = zeroplan.plan("llama2-7b", gpu="h100-80gb", policy=zeroplan.PrecisionPolicy(param_dtype="fp32"))
    assert "16-bit params" in fp32.fit_basis and fp32.cut_first is None


def test_sweep_peak_columns_equal_the_engine():
    frame = zeroplan.sweep(model=TINY_LLAMA, gpus=[2, 4], model_parallel=[1, 2], micro_batch=[1, 3],
                           stages=[1, 3], offload=["none", "cpu"], checkpointing="none", seq_len=8,
                           gpu_memory_bytes=10**6)  # fmt: skip
    checked = 0
    for row in frame.to_dict(orient="records"):
        if row["offload"] != "none" or row["model_parallel"] != 1:
            assert pd.isna(row["peak_bytes"]) and row["peak_phase"] == "" and pd.isna(row["peak_fits"])
            continue
        (r,) = [r for r in engine_rows(TINY_LLAMA, row["nd"], 8, micro_batch=row["micro_batch"]) if r.stage == row["stage"]]
        assert (row["peak_bytes"], row["peak_phase"]) == (r.peak.peak_bytes, r.peak.peak_phase)
        assert row["peak_fits"] == (r.peak.peak_bytes <= 10**6)
        checked += 1
    assert checked == 2 * 2 * 2


BAD = [
    (["estimate", "--model", "llama2-7b", "--seq-len", "4097"], "seq_len=4097: above the model's maximum positions (4096)"),
    (["estimate", "--model", "llama2-7b", "--seq-len", "0"], "seq_len=0: must be >= 1"),
    (["estimate", "--model", "llama2-7b", "--micro-batch", "-2"], "micro_batch=-2: must be >= 1"),
    (["estimate", "--model", "llama2-7b", "--grad-accum", "0"], "grad_accum=0: must be >= 1"),
    (["estimate", "--model", "llama2-7b", "--checkpointing", "selective"], "checkpointing='selective'"),
    (["estimate", "--model", "nope.json"], "config 'nope.json'"),
    (["estimate", "--model", str(DATA / "golden" / "inputs" / "shapes.json")], "model_type: missing"),
    (["estimate", "--model", str(DATA / "README.md")], "not valid JSON"),
    (["estimate", "--params", "7e9", "--seq-len", "128"], "--seq-len does not apply without --model"),
    (["estimate", "--shapes", str(DATA / "golden" / "inputs" / "shapes.json"), "--no-foreach"],
     "--foreach does not apply without --model"),
    (["estimate", "--model", "llama2-7b", "--gpus", "8", "--model-parallel", "2"], "--model-parallel does not apply"),
    (["estimate", "--model", "llama2-7b", "--params", "7e9"], "exactly one of --params, --shapes and --model"),
    (["estimate", "--model", "llama2-7b", "--engine", "fsdp9"], "unknown engine 'fsdp9'"),
    (["estimate", "--model", str(DATA / "hf_configs" / "gpt2.json")], "counts no dropout masks"),
    (["estimate", "--model", "llama2-7b", "--param-dtype", "fp32"], "peak models 16-bit params"),
    (["plan", "--model", "llama2-7b", "--gpu", "h100-80gb", "--seq-len", "5000"], "above the model's maximum positions"),
    (["plan", "--params", "7e9", "--gpu", "h100-80gb", "--no-foreach"], "--foreach does not apply without --model"),
    (["plan", "--model", TINY_GPT2 + ".missing.json", "--gpu", "h100-80gb"], "No such file"),
    (["sweep", "--model", TINY_GPT2, "--seq-len", "17"], "seq_len=17: above the model's maximum positions (16)"),
    (["sweep", "--params", "7e9", "--engine", "reference"], "--engine does not apply without --model"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a[:4]) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2(args, message, tmp_path):
    assert_one_line_error(run(*args), message)


def test_a_config_that_is_not_json_is_one_line(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert_one_line_error(run("estimate", "--model", str(bad)), "config")
    lacking = tmp_path / "lacking.json"
    lacking.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert_one_line_error(run("estimate", "--model", str(lacking)), "missing")


def test_estimate_with_a_model_imports_no_torch_pandas_matplotlib():
    code = (
        "import sys\n"
        "from zeroplan.cli import main\n"
        f"sys.argv = ['zeroplan', 'estimate', '--model', {GPT2!r}, '--gpus', '8', '--json']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'pandas', 'matplotlib', 'numpy') if m in sys.modules), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["stages"][3]["peak_bytes"] == engine_rows(GPT2, 8, 1024)[3].peak.peak_bytes
    assert out.stderr.strip().splitlines()[-1] == "[]"
