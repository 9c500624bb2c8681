"""FSDP2 on transformers' own classes (issue 17), against measurements recorded from real runs: the profile
(``zeroplan.engines.fsdp2``, ``Workload.transformers``; the terms in ``hf_tree``) predicts every phase of every
rank of each row within its recorded error plus ``MARGIN``, and each mechanism's term is in the peak it
explains and larger than that bound, so dropping any of them fails here.

Recorded 2026-12-01 on this project's CPU machine (2 shared cores), torch 2.13.0, transformers 5.24,
gloo, MemTracker (``validate/engines/fsdp2.py``), 2 steps, micro-batch 2, seq 64 unless said, fp32 params
unless bf16 (``MixedPrecisionPolicy(param_dtype=bf16)``), reshard_after_forward=True unless ``keep``,
``forward(labels=...)`` unless ``nolabels``; the model is transformers' class of the config below
(``validate.engines.deepspeed.hf_builder``, materialized), by::

    from validate.engines.fsdp2 import Fsdp2Settings
    from validate.engines.fsdp2_rows import run_world
    run_world(Fsdp2Settings(model=CONFIG_JSON, hf=True, seq_len=64, steps=2, ...), N_d)

Errors before this profile (issue 17's gap), worst rank: up to +7.45% backward (mistral-untied: the
head's gradient at the root's reduce-scatter), +9.15% forward (gpt2-small-tied-bf16: the last block's
all-gather output and the bf16 logits through the loss), +30.9% init (a tied model's lm_head before
tie_weights); after: every phase exact but the residuals named in ``RESIDUAL`` (docs/engines/fsdp2.md).
"""

from __future__ import annotations

import json

import pytest

from zeroplan.formulas.peak import PHASES

MARGIN = 0.0005  # 0.05% of the phase's peak: above MemTracker's run-to-run spread (0 B on these rows, 2 runs of
# qwen2-untied), below the smallest term asserted to bite (``BITES``: 1.3% and up)

CONFIGS = {
    'gpt2-small-tied': {"model_type": "gpt2", "n_embd": 136, "n_inner": 520, "n_head": 4, "n_layer": 3, "vocab_size": 6007, "n_positions": 64, "tie_word_embeddings": True, "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "activation_function": "gelu_new", "bos_token_id": 0, "eos_token_id": 0},
    'gpt2-tied': {"model_type": "gpt2", "n_embd": 344, "n_inner": 1288, "n_head": 8, "n_layer": 5, "vocab_size": 8009, "n_positions": 64, "tie_word_embeddings": True, "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "activation_function": "gelu_new", "bos_token_id": 0, "eos_token_id": 0},
    'gpt2-untied': {"model_type": "gpt2", "n_embd": 344, "n_inner": 1288, "n_head": 8, "n_layer": 5, "vocab_size": 8009, "n_positions": 64, "tie_word_embeddings": False, "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "activation_function": "gelu_new", "bos_token_id": 0, "eos_token_id": 0},
    'llama-longseq-tied': {"model_type": "llama", "hidden_size": 256, "intermediate_size": 1000, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 4001, "max_position_embeddings": 512, "tie_word_embeddings": True},
    'llama-untied': {"model_type": "llama", "hidden_size": 336, "intermediate_size": 904, "num_attention_heads": 6, "num_key_value_heads": 2, "num_hidden_layers": 5, "vocab_size": 6007, "max_position_embeddings": 64, "tie_word_embeddings": False},
    'mistral-untied': {"model_type": "mistral", "hidden_size": 360, "intermediate_size": 1000, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 5, "vocab_size": 9001, "max_position_embeddings": 64, "tie_word_embeddings": False, "sliding_window": None, "rope_theta": 1000000.0},
    'qwen2-small-untied': {"model_type": "qwen2", "hidden_size": 136, "intermediate_size": 360, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 6007, "max_position_embeddings": 64, "tie_word_embeddings": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0},
    'qwen2-tied': {"model_type": "qwen2", "hidden_size": 392, "intermediate_size": 1064, "num_attention_heads": 7, "num_key_value_heads": 1, "num_hidden_layers": 6, "vocab_size": 7919, "max_position_embeddings": 64, "tie_word_embeddings": True, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0},
    'qwen2-untied': {"model_type": "qwen2", "hidden_size": 392, "intermediate_size": 1064, "num_attention_heads": 7, "num_key_value_heads": 1, "num_hidden_layers": 6, "vocab_size": 7919, "max_position_embeddings": 64, "tie_word_embeddings": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0},
    't-mistral-untied': {"model_type": "mistral", "hidden_size": 112, "intermediate_size": 296, "num_attention_heads": 7, "num_key_value_heads": 1, "num_hidden_layers": 3, "vocab_size": 2503, "max_position_embeddings": 64, "tie_word_embeddings": False, "sliding_window": None},
    'qwen2-wide-untied': {"model_type": "qwen2", "hidden_size": 256, "intermediate_size": 700, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 503, "max_position_embeddings": 128, "tie_word_embeddings": False},
    't-qwen2-untied': {"model_type": "qwen2", "hidden_size": 120, "intermediate_size": 328, "num_attention_heads": 5, "num_key_value_heads": 1, "num_hidden_layers": 3, "vocab_size": 3001, "max_position_embeddings": 64, "tie_word_embeddings": False},
}

# name: (config, N_d, settings beyond the defaults above, measured peak bytes [init, forward, backward,
# optimizer_step] per rank)
RECORDED = {
    'gpt2-small-tied-bf16': ('gpt2-small-tied', 2, {'param_dtype': 'bf16'}, [[9177536, 21555304, 23093096, 15089056], [9177536, 21554216, 23092008, 15086880]]),
    'gpt2-tied-nolabels': ('gpt2-tied', 2, {'labels': False}, [[49409024, 104356992, 120946088, 87802048], [49409024, 104354240, 120943336, 87796544]]),
    'gpt2-tied': ('gpt2-tied', 2, {}, [[49409024, 106272648, 120946088, 87802048], [49409024, 106269896, 120943336, 87796544]]),
    'gpt2-untied-nolabels': ('gpt2-untied', 2, {'labels': False}, [[52136768, 131911396, 154114924, 109846260], [52136768, 131905892, 154109420, 109838004]]),
    'gpt2-untied': ('gpt2-untied', 2, {}, [[52136768, 133827052, 154114924, 109846260], [52136768, 133821548, 154109420, 109838004]]),
    'llama-longseq-tied': ('llama-longseq-tied', 2, {'seq_len': 512}, [[15916288, 113586008, 129974104, 27738448], [15916288, 113583960, 129972056, 27734352]]),
    'llama-untied': ('llama-untied', 2, {}, [[42833504, 105048840, 121197672, 88895936], [42833504, 105043464, 121192296, 88887872]]),
    'mistral-untied-keep': ('mistral-untied', 2, {'reshard_after_forward': False}, [[57303520, 169888024, 173725448, 121871152], [57303520, 169882264, 173719688, 121862512]]),
    'mistral-untied': ('mistral-untied', 2, {}, [[57303520, 145153072, 173725448, 121871152], [57303520, 145147312, 173719688, 121862512]]),
    'qwen2-small-untied-bf16-nolabels': ('qwen2-small-untied', 2, {'param_dtype': 'bf16', 'labels': False}, [[11022392, 25292972, 28368556, 21213300], [11022392, 25290796, 28366380, 21210036]]),
    'qwen2-small-untied-bf16': ('qwen2-small-untied', 2, {'param_dtype': 'bf16'}, [[11022392, 27236588, 28774380, 21213300], [11022392, 27234412, 28772204, 21210036]]),
    'qwen2-tied': ('qwen2-tied', 2, {}, [[63326592, 127497688, 151702208, 114240968], [63326592, 127494552, 151699072, 114234696]]),
    'qwen2-untied-nolabels': ('qwen2-untied', 2, {'labels': False}, [[66534160, 158544092, 188755956, 139078876], [66534160, 158537820, 188749684, 139069468]]),
    'qwen2-untied-keep': ('qwen2-untied', 2, {'reshard_after_forward': False}, [[66534160, 196561764, 199831828, 139078876], [66534160, 196555492, 199825556, 139069468]]),
    'qwen2-untied': ('qwen2-untied', 2, {}, [[66534160, 158544092, 188755956, 139078876], [66534160, 158537820, 188749684, 139069468]]),
    'qwen2-untied-4': ('qwen2-untied', 4, {}, [[64930376, 111046964, 128840964, 69539700], [64930376, 111046964, 128840964, 69539700], [64930376, 111046964, 128840964, 69539700], [64930376, 111040692, 128834692, 69530292]]),
    't-mistral-untied-4': ('t-mistral-untied', 4, {'reshard_after_forward': False, 'labels': False}, [[3911776, 12626352, 13907888, 4345448], [3911776, 12626352, 13907888, 4345448], [3911776, 12626352, 13907888, 4345448], [3911776, 12624560, 13906096, 4342760]]),
    # recorded 2026-12-01 (autojson): seq 128; bf16 forward +0.49% (131,072 B) before hf_tree.inputs_embeds_held
    'qwen2-wide-untied-bf16': ('qwen2-wide-untied', 2, {'param_dtype': 'bf16', 'seq_len': 128}, [[10864000, 26655260, 27463204, 19997980], [10864000, 26651164, 27459108, 19993884]]),
    'qwen2-wide-untied': ('qwen2-wide-untied', 2, {'seq_len': 128}, [[10864000, 36723228, 39126564, 19997980], [10864000, 36719132, 39122468, 19993884]]),
    't-qwen2-untied': ('t-qwen2-untied', 2, {}, [[5241024, 17419780, 18956292, 10879404], [5241024, 17417860, 18954372, 10876524]]),
    # recorded 2026-12-02 (fsdp2ln, issue 17's block backward beyond fp32 llama): bf16 peaking at a block's input
    # norm backward, GPT-2 (LayerNorm) at a block's backward, checkpointed blocks (each 26-58 CPU-s on gloo)
    'llama-untied-4-bf16': ('llama-untied', 4, {'param_dtype': 'bf16'}, [[41620544, 58095704, 60013880, 44448176], [41620544, 58095704, 60013880, 44448176], [41620544, 58095704, 60013880, 44448176], [41620544, 58090328, 60008504, 44440112]]),
    'gpt2-untied-4': ('gpt2-untied', 4, {}, [[50772896, 96777852, 110077596, 54930140], [50772896, 96777852, 110077596, 54930140], [50772896, 96777852, 110077596, 54930140], [50772896, 96761340, 110061084, 54905372]]),
    'qwen2-untied-ckpt': ('qwen2-untied', 2, {'checkpointing': True}, [[66534160, 157734364, 188755956, 139078876], [66534160, 157728092, 188749684, 139069468]]),
    'qwen2-wide-untied-ckpt': ('qwen2-wide-untied', 2, {'seq_len': 128, 'checkpointing': True}, [[10864000, 24477724, 33392420, 19997980], [10864000, 24473628, 33388324, 19993884]]),
}

# (phase): measured error (measured - predicted) / measured at the worst rank, where it is not 0
RESIDUAL = {
    # gpt2 without labels read 264,192 B (+0.25%, +0.20%) under in forward: the last block's forward moment, inside
    # GPT-2's body, without its locals inputs_embeds and position_embeds (hf_tree.gpt2_body_embeds); now exact
}
# qwen2-untied-4's backward read 201,760 B over (-0.157%): the peak is a block's q projection backward (every weight
# gradient but the input norm's: norms.input_projections_backward), where "block i gradients complete" counted the fp32
# input norm's h and output beside its backward temporaries (2·N·d·4 too many); now 512 B under

# Beyond fp32 llama (benchmarks/fsdp2_backward_trace.py, each block's windows against the profile's moments, rank 0):
# llama-untied-4-bf16's backward read 512 B over (-0.0009%, every rank) at a block's input norm backward, as did
# blocks 2-3 of qwen2-small-untied-bf16 and 1-3 of qwen2-untied+ckpt (N·4, norms.input_norm_backward); now exact.
# GPT-2 (gpt2-untied, gpt2-untied-4): every block's backward window as predicted. Checkpointed: RoPE's cos and sin
# stay alive to the end (32,768 B, rope_released), blocks' q projection backward 512 B under (not attributed).
# qwen2-untied-keep's backward was 1,568 B under (+0.001%): a decoder layer's last parameter's gradient
# (post_attention_layernorm.weight, d·4), held by foreach_reduce's loop variable (terms.last_grad_held); now exact.
# name: (phase, the moment that peaks, the hf_tree term it holds)
BITES = {
    "mistral-untied": [("backward", "root reduce-scatter", "unsharded gradient of the last parameter (root, foreach_reduce's loop variable)"),
                       ("forward", "block 1 copy-out", "all-gather output (root, the root's, freed when this copy-out returns)")],
    "qwen2-untied-nolabels": [("backward", "root reduce-scatter", "unsharded gradient of the last parameter (root, foreach_reduce's loop variable)")],
    "gpt2-tied": [("forward", "cross-entropy", "all-gather output (block 5, kept until the root's post-forward, after the loss)"),
                  ("init", "build: lm_head before tie_weights", "lm_head weight before tie_weights")],
    "qwen2-small-untied-bf16": [("forward", "cross-entropy", "16-bit logits (kept by the forward while its loss runs)")],
    "qwen2-wide-untied-bf16": [("forward", "block 3 forward", "inputs_embeds (the body's local, 16-bit; fp32 saves it in block 1's norm)")],
    "llama-longseq-tied": [("backward", "cross-entropy backward", "all-gather output (block 2, backward prefetch)")],
    "qwen2-wide-untied-ckpt": [("backward", "block 2 backward", "recomputed block's saved activations")],
    "gpt2-untied-4": [("backward", "block 4 backward", "block backward working set")],
    "qwen2-untied-4": [("backward", "block 5 attention input projections' backward",
                        "norm output gradients in flight (k's and v's sum, q's, their sum)")],
}  # fmt: skip


def _predicted(name: str, rank: int, tmp_path) -> tuple:
    pytest.importorskip("torch")
    from validate.engines.fsdp2 import Fsdp2Settings
    from validate.engines.fsdp2_rows import predict

    config, nd, kw, _ = RECORDED[name]
    path = tmp_path / f"{config}.json"
    path.write_text(json.dumps(CONFIGS[config]))
    settings = Fsdp2Settings(model=str(path), hf=True, seq_len=kw.get("seq_len", 64),
                             **{k: v for k, v in kw.items() if k != "seq_len"})  # fmt: skip
    return predict(settings, {"device": "cpu", "backend": "gloo", "world_size": nd}, rank)[0].peak


@pytest.mark.parametrize("name", RECORDED)
def test_every_phase_of_every_rank_within_its_recorded_error(name, tmp_path):
    peaks = RECORDED[name][3]
    for rank, measured in enumerate(peaks):
        predicted = _predicted(name, rank, tmp_path).by_phase()
        for phase, got in zip(PHASES, measured):
            err = (got - predicted[phase]) / got
            want = RESIDUAL.get(name, {}).get(phase, 0.0)
            assert abs(err - want) <= MARGIN, (name, rank, phase, err, want)
            assert err <= 0.005, (name, rank, phase, err)  # issue 17: no under-prediction beyond 0.5%


@pytest.mark.parametrize("name", BITES)
def test_each_mechanism_is_in_the_peak_it_explains(name, tmp_path):
    peak = _predicted(name, 0, tmp_path)
    measured = dict(zip(PHASES, RECORDED[name][3][0]))
    for phase, moment, term in BITES[name]:
        (at,) = (p for p in peak.phases if p.phase == phase)
        assert at.moment == moment, (name, phase, at.moment)
        (held,) = (t for t in at.terms if t.name == term)
        bound = abs(RESIDUAL.get(name, {}).get(phase, 0.0)) + MARGIN
        assert held.bytes > 2 * bound * measured[phase], (name, term, held.bytes)  # dropping it fails above


def test_bf16_input_norm_backward_to_the_byte(tmp_path):
    """llama-untied-4-bf16's backward peaks at the last block's input norm backward, where rsqrt's N·4 (512 B) is
    gone (norms.input_norm_backward): exact on every rank (MemTracker's spread is 0 B), 512 B over with it."""
    for rank, measured in enumerate(RECORDED["llama-untied-4-bf16"][3]):
        peak = _predicted("llama-untied-4-bf16", rank, tmp_path)
        (at,) = (p for p in peak.phases if p.phase == "backward")
        assert (at.moment, peak.by_phase()["backward"]) == ("block 4 gradients complete", measured[2]), rank
