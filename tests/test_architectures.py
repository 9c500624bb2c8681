"""Architectures from Hugging Face config files: exact shapes against transformers, presets, bad input.

The reference is the transformers model of the same config built on the meta device (no memory, no
download). Configs live in tests/data/hf_configs/ with their sources in its README.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest

from zeroplan.presets import model_presets, resolve_model
from zeroplan.architectures.hf_config import read_hf_config, spec_from_hf_config
from zeroplan.architectures.spec import TransformerSpec, gpt_for_params, numels, param_count, transformer_shapes

CONFIGS = Path(__file__).parent / "data" / "hf_configs"
NAMES = sorted(p.stem for p in CONFIGS.glob("*.json"))
REAL = [n for n in NAMES if not n.startswith("tiny-")]
#: the families validate/transformer.py builds (its parity tests below run only these)
BUILT = {"gpt2", "llama", "mistral", "qwen2"}


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def hf():
    """transformers' config and model classes; the shape tests need them, the planner never does."""
    pytest.importorskip("torch", reason="the transformers reference needs torch (pip install zeroplan[test])")
    transformers = pytest.importorskip(
        "transformers", reason="the shape reference is transformers (pip install zeroplan[test])"
    )
    transformers.logging.set_verbosity_error()
    return transformers


@functools.lru_cache(maxsize=None)
def _meta_model(text: str):
    """(named shapes, sum of numel) of the transformers causal LM of a config, built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads(text)
    if cfg["model_type"] == "gemma3":  # zeroplan plans its text decoder: Gemma3ForCausalLM of text_config
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    shapes = tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
    return shapes, sum(p.numel() for p in model.parameters())


def meta_model(cfg: dict):
    return _meta_model(json.dumps(cfg, sort_keys=True))


@pytest.mark.parametrize("name", NAMES)
def test_shapes_and_count_match_transformers(hf, name):
    shapes, total = meta_model(config(name))
    spec = read_hf_config(CONFIGS / f"{name}.json")
    assert transformer_shapes(spec) == shapes  # names, shapes and order of named_parameters()
    assert param_count(spec) == total


@pytest.mark.parametrize(
    ("name", "published"),
    [  # the parameter counts the Hugging Face hub shows for each model (safetensors metadata)
        ("gpt2", 124_439_808),  # openai-community/gpt2
        ("gpt2-medium", 354_823_168),  # openai-community/gpt2-medium
        ("llama-2-7b", 6_738_415_616),  # meta-llama/Llama-2-7b-hf
        ("llama-3-8b", 8_030_261_248),  # meta-llama/Meta-Llama-3-8B
        ("llama-3.2-1b", 1_235_814_400),  # meta-llama/Llama-3.2-1B (tied embeddings)
        ("mistral-7b-v0.1", 7_241_732_096),  # mistralai/Mistral-7B-v0.1
        ("qwen2-0.5b", 494_032_768),  # Qwen/Qwen2-0.5B (tied embeddings)
        ("qwen2-7b", 7_615_616_512),  # Qwen/Qwen2-7B
        ("qwen3-8b", 8_190_735_360),  # Qwen/Qwen3-8B
        ("gemma-2-2b", 2_614_341_888),  # google/gemma-2-2b (tied embeddings)
        ("gemma-3-1b", 999_885_952),  # google/gemma-3-1b-pt (tied embeddings)
        ("phi-3-mini-4k", 3_821_079_552),  # microsoft/Phi-3-mini-4k-instruct
        ("mixtral-8x7b-v0.1", 46_702_792_704),  # mistralai/Mixtral-8x7B-v0.1
        ("qwen1.5-moe-a2.7b", 14_315_784_192),  # Qwen/Qwen1.5-MoE-A2.7B
        ("qwen3-30b-a3b", 30_532_122_624),  # Qwen/Qwen3-30B-A3B
    ],
)
def test_published_parameter_counts(name, published):
    assert param_count(read_hf_config(CONFIGS / f"{name}.json")) == published


#: real configs whose hub count is of more than transformers' causal LM (checked against the meta model only)
NOT_COMPARABLE = {
    "gemma-3-4b": "the hub's 4.3B includes the SigLIP vision tower; zeroplan plans the text decoder",
    "deepseek-v3": "the hub's 685B includes the multi-token-prediction layer transformers does not build",
}


def test_every_real_config_has_a_published_count():
    counted = {"gpt2", "gpt2-medium", "llama-2-7b", "llama-3-8b", "llama-3.2-1b", "mistral-7b-v0.1",
               "qwen2-0.5b", "qwen2-7b", "qwen3-8b", "gemma-2-2b", "gemma-3-1b", "phi-3-mini-4k",
               "mixtral-8x7b-v0.1", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b"}  # fmt: skip
    assert set(REAL) == counted | set(NOT_COMPARABLE)


def test_deepseek_v3_and_gemma_3_4b_counts():
    # DeepSeek-V3 report (arXiv:2412.19437): 671B total parameters without the MTP module
    assert param_count(read_hf_config(CONFIGS / "deepseek-v3.json")) == 671_026_404_352
    # gemma-3-4b's text decoder: 34 layers of 2560, vocabulary 262208 (Gemma3TextConfig's default)
    assert param_count(read_hf_config(CONFIGS / "gemma-3-4b.json")) == 3_880_263_168


@pytest.mark.parametrize("name", sorted(model_presets()))
def test_presets_match_transformers(hf, name):
    preset = model_presets()[name]
    shapes, total = meta_model(preset.hf_config)
    assert transformer_shapes(preset.spec) == shapes
    assert preset.params == total


def test_family_features_read_from_config():
    llama3 = read_hf_config(CONFIGS / "llama-3-8b.json")
    assert (llama3.n_kv_head, llama3.kv_dim, llama3.rope_theta, llama3.tied) == (8, 1024, 500000.0, False)
    tied = read_hf_config(CONFIGS / "llama-3.2-1b.json")
    assert (tied.tied, tied.head_dim, tied.rope_type) == (True, 64, "llama3")
    assert "lm_head.weight" not in dict(transformer_shapes(tied))
    qwen = read_hf_config(CONFIGS / "qwen2-0.5b.json")
    assert (qwen.qkv_bias, qwen.o_bias, qwen.mlp_bias, qwen.sliding_window) == (True, False, False, None)
    mistral = read_hf_config(CONFIGS / "mistral-7b-v0.1.json")
    assert (mistral.sliding_window, mistral.qkv_bias) == (4096, False)
    gpt2 = read_hf_config(CONFIGS / "gpt2.json")
    assert (gpt2.hidden_act, gpt2.attn_pdrop, gpt2.norm_eps) == ("gelu_new", 0.1, 1e-5)
    assert gpt2.max_seq_len == 1024


@pytest.mark.parametrize(
    ("cfg", "field", "expected"),
    [  # absent keys take the transformers 5.24 config class's default
        ({"model_type": "mistral"}, "n_kv_head", 8),  # MistralConfig.num_key_value_heads = 8
        ({"model_type": "mistral"}, "sliding_window", 4096),  # MistralConfig.sliding_window = 4096
        ({"model_type": "mistral", "sliding_window": None}, "sliding_window", None),
        ({"model_type": "qwen2"}, "n_kv_head", 32),  # Qwen2Config.num_key_value_heads = 32
        ({"model_type": "qwen2", "sliding_window": 64}, "sliding_window", None),  # use_sliding_window False
        ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 0, "sliding_window": 64},
         "sliding_window", 64),
        ({"model_type": "llama"}, "n_kv_head", 32),  # LlamaConfig: None -> num_attention_heads
        ({"model_type": "llama"}, "max_seq_len", 2048),  # LlamaConfig.max_position_embeddings
        ({"model_type": "llama"}, "norm_eps", 1e-6),  # LlamaConfig.rms_norm_eps
        ({"model_type": "llama"}, "rope_theta", 10000.0),  # RotaryEmbeddingConfigMixin.default_theta
        ({"model_type": "llama", "rope_theta": 5e5, "rope_parameters": {"rope_theta": 1e6}},
         "rope_theta", 1e6),
        ({"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type", "linear"),
        ({"model_type": "llama", "attention_bias": True}, "o_bias", True),
        ({"model_type": "llama"}, "tie_word_embeddings", False),
        ({"model_type": "gpt2"}, "tie_word_embeddings", True),  # GPT2Config.tie_word_embeddings = True
        ({"model_type": "gpt2"}, "resid_pdrop", 0.1),  # GPT2Config.resid_pdrop = 0.1
        ({"model_type": "gpt2"}, "ffn", 4 * 32),  # GPT2Block: n_inner None -> 4 * hidden_size
    ],
)
def test_defaults_of_absent_keys(cfg, field, expected):
    dims = {"gpt2": {"n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 8, "vocab_size": 50},
            "llama": {"hidden_size": 64, "num_attention_heads": 32, "num_hidden_layers": 2,
                      "intermediate_size": 96, "vocab_size": 50}}  # fmt: skip
    family = "gpt2" if cfg["model_type"] == "gpt2" else "llama"
    assert getattr(spec_from_hf_config({**dims[family], **cfg}), field) == expected


def test_gpt2_aliases_are_accepted():
    aliased = {"model_type": "gpt2", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
               "max_position_embeddings": 8, "vocab_size": 50}  # fmt: skip
    assert spec_from_hf_config(aliased).d_model == 32


def test_planner_layouts_keep_their_numels():
    # gpt-tiny, gpt-1b-wide and gpt_for_params keep the element counts (and order) they had before the
    # GPT-2 names: V·d, T·d, per layer (d, d, 3d·d, 3d, d·d, d, d, d, 4d·d, 4d, 4d·d, d), then d, d.
    def old(v: int, t: int, layers: int, d: int) -> tuple[int, ...]:
        block = (d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d)
        return (v * d, t * d) + block * layers + (d, d)

    tiny = TransformerSpec(n_layer=2, d_model=36, n_head=3, vocab_size=101, max_seq_len=16)
    assert numels(transformer_shapes(tiny)) == old(101, 16, 2, 36)
    big = gpt_for_params(7.5e9)
    assert numels(transformer_shapes(big)) == old(50304, 1024, big.n_layer, big.d_model)


def test_resolve_model_takes_a_preset_or_a_path():
    assert resolve_model("llama2-7b") == model_presets()["llama2-7b"].spec
    assert resolve_model(str(CONFIGS / "qwen2-7b.json")) == read_hf_config(CONFIGS / "qwen2-7b.json")
    message = r"^unknown model 'llama9': known models are gpt2-xl, .*config\.json\)$"
    with pytest.raises(ValueError, match=message):
        resolve_model("llama9")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"model_type": "bert", "hidden_size": 8}',
         r"model_type: 'bert' is not supported \(expected one of gpt2"),
        ('{"hidden_size": 8}', r"model_type: missing"),
        ('{"model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 8, '
         '"vocab_size": 10}', r"hidden_size: missing"),
        ('{"model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 2, "vocab_size": 10}',
         r"n_positions: missing"),
        ('{"model_type": "qwen2", "hidden_size": 8.5, "num_attention_heads": 2, "num_hidden_layers": 2}',
         r"hidden_size: 8.5 is not a whole number"),
        ('{"model_type": "gpt2", "n_embd": 8, "hidden_size": 16, "vocab_size": 10}',
         r"n_embd: 8 disagrees with its alias hidden_size=16"),
        ('{"model_type": "llama", "hidden_size": 10, "num_attention_heads": 4, "num_hidden_layers": 2, '
         '"intermediate_size": 8, "vocab_size": 10}', r"d_model=10 is not divisible by n_head=4"),
        ('{"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 2, '
         '"intermediate_size": 8, "vocab_size": 10, "hidden_act": "tanh"}',
         r"hidden_act: 'tanh' is not one of"),
        ('{"model_type": "gpt2", "add_cross_attention": true}',
         r"add_cross_attention: True is not supported"),
        ("[1, 2]", r"not a JSON object"),
        ("{not json", r"not valid JSON"),
    ],
)
def test_bad_configs_are_one_line(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        read_hf_config(path)
    assert str(info.value).startswith(f"config {str(path)!r}: ") and "\n" not in str(info.value)


def test_module_shapes_count_a_tied_head_once(hf):
    import torch

    from zeroplan.architectures.module_shapes import module_shapes

    cfg = config("qwen2-0.5b")
    with torch.device("meta"):
        model = hf.AutoModelForCausalLM.from_config(hf.AutoConfig.for_model(**cfg))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one tensor, two names
    shapes = module_shapes(model)
    assert shapes == transformer_shapes(read_hf_config(CONFIGS / "qwen2-0.5b.json"))
    assert sum(numels(shapes)) == 494_032_768 == sum(math.prod(s) for _, s in shapes)


def test_module_shapes_refuses_what_is_not_a_module():
    pytest.importorskip("torch")
    from zeroplan.architectures.module_shapes import module_shapes

    with pytest.raises(TypeError, match="expected a torch.nn.Module, got dict"):
        module_shapes({})


# --- the reference runtime's model (validate/transformer.py) against transformers, fp32 on CPU ---

TINY = [n for n in NAMES if n.startswith("tiny-") and config(n)["model_type"] in BUILT]


@functools.lru_cache(maxsize=None)
def _parity(name: str, checkpointing: bool):
    """(ours, theirs, tokens): our model carrying the transformers model's weights, and one batch."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from validate.transformer import CausalLM

    cfg = config(name)
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), attn_implementation="sdpa")
    ours = CausalLM(read_hf_config(CONFIGS / f"{name}.json"), checkpointing=checkpointing)
    state = theirs.state_dict()
    mine = ours.state_dict()
    assert set(state) - set(mine) <= {"lm_head.weight"}  # a tied head is the embedding
    ours.load_state_dict({k: state[k] for k in mine})
    seq = min(12, ours.spec.max_seq_len)  # longer than tiny-mistral's window of 5
    tokens = torch.randint(0, ours.spec.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    return ours, theirs, tokens


@pytest.mark.parametrize("name", TINY)
def test_reference_model_matches_transformers(hf, name):
    import torch
    import torch.nn.functional as F

    ours, theirs, tokens = _parity(name, False)
    assert tuple((n, tuple(p.shape)) for n, p in ours.named_parameters()) == transformer_shapes(ours.spec)
    out = theirs(input_ids=tokens, labels=tokens)  # transformers shifts the labels itself
    targets = F.pad(tokens[:, 1:], (0, 1), value=-100)  # the same targets, shifted here
    logits = ours(tokens)
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.loss((tokens, targets)), out.loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-mistral"])
def test_checkpointed_blocks_give_the_same_gradients(hf, name):
    import torch

    plain, _, tokens = _parity(name, False)
    ckpt, _, _ = _parity(name, True)
    batch = (tokens, tokens.roll(-1, dims=1))
    grads = []
    for model in (plain, ckpt):
        model.zero_grad()
        model.loss(batch).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def _ops(model, batch) -> set[str]:
    """Names of the aten ops one training-mode loss dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    seen: set[str] = set()
    with Record():
        model.loss(batch)
    return seen


def test_dropout_runs_only_where_the_config_asks(hf):
    import torch

    from validate.transformer import CausalLM

    tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(2))
    batch = (tokens, tokens.roll(-1, dims=1))
    quiet = CausalLM(read_hf_config(CONFIGS / "tiny-gpt2.json")).train()  # dropout 0 in the file
    assert not {op for op in _ops(quiet, batch) if "dropout" in op or "bernoulli" in op}
    noisy_cfg = {**config("tiny-gpt2"), "resid_pdrop": 0.5, "embd_pdrop": 0.5}
    noisy = CausalLM(spec_from_hf_config(noisy_cfg))
    noisy.load_state_dict(quiet.state_dict())
    assert {op for op in _ops(noisy.train(), batch) if "dropout" in op or "bernoulli" in op}
    with torch.no_grad():
        torch.testing.assert_close(noisy.eval().loss(batch), quiet.eval().loss(batch))  # eval: no dropout
        assert not torch.equal(noisy.train().loss(batch), quiet.loss(batch))


def test_reference_model_refuses_rope_it_does_not_build():
    pytest.importorskip("torch")
    from validate.transformer import CausalLM

    with pytest.raises(ValueError, match="rope_type='llama3': the reference runtime builds only 'default'"):
        CausalLM(read_hf_config(CONFIGS / "llama-3.2-1b.json"), device="meta")


# The module's one run, a background job of the session (tests/background.py: started at collection, niced, while
# the other tests run; this module runs last), in-process (a child process imported torch and the validator again,
# ~4-5 CPU-s: issue 16, the suite's time budget): a Qwen2 config through the reference runtime on real gloo.
BACKGROUND_CLI = {"qwen2": ["--model", str(CONFIGS / "tiny-qwen2.json"), "--world-size", "2", "--stage", "0",
                            "--stage", "3", "--steps", "2", "--seq-len", "12"]}  # fmt: skip


@pytest.mark.distributed
def test_validate_runs_a_config_file(request, background):
    # A Qwen2 config (tied head, q/k/v biases, 5 query heads on 1 key/value head) through the reference
    # runtime on real gloo: model states within 1% and collectives exact, as for the built-in presets.
    pytest.importorskip("torch")
    from background import cli_job, key

    out = background.result(key(request.module, "qwen2"), cli_job(BACKGROUND_CLI["qwen2"]))
    assert out["returncode"] == 0, out["stderr"]
    rows = out["report"]["rows"]
    assert [(r["stage"], r["world_size"]) for r in rows] == [(0, 2), (3, 2)]
    assert all(r["ok"] and r["checks"]["collectives_match"] and r["psi"] == 27_632 for r in rows)


def test_validate_refuses_what_the_runtime_cannot_build():
    pytest.importorskip("torch")
    from validate.models import spec_for

    with pytest.raises(ValueError, match="rope_type='llama3'"):
        spec_for(str(CONFIGS / "llama-3.2-1b.json"), None)
    with pytest.raises(ValueError, match=r"^model='nope': expected one of gpt-tiny, mlp-tiny, gpt-1b-wide"):
        spec_for("nope", None)
