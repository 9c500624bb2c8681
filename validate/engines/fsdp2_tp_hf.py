"""transformers' own tensor parallelism on the validator's llama ``CausalLM`` (``validate.engines.fsdp2_tp``,
``--tp-plan transformers``): what ``from_pretrained(..., tp_plan="auto")`` applies, and accelerate's TP uses
(accelerate 1.16 ``accelerator.py``: ``parallelism_config.tp_size`` must equal ``get_model_tp_size(model)``).

transformers 5.24: the plan is the model class's own (``distributed/mixin.py`` ``init_parallel_plans``: the head's
``_tp_plan`` ``lm_head: colwise_gather_output``, the config's ``base_model_tp_plan`` under ``model.``, and
``model.embed_tokens: embedding_rowwise`` added for the base model's ``nn.Embedding``), its ``*`` expanded on the
module tree by ``_expand_parallel_plan`` and applied by ``distributed/tensor_parallel.py``
``apply_tensor_parallelism`` (each style's ``shard_param`` on the meta parameters, ``install_forward`` on the
modules), as ``maybe_distribute_model`` does; FSDP2 then shards the result (``fsdp2_tp.build_tp``). Both functions
run here on ``CausalLM``, whose module names are transformers' llama ones; the plan is read from a meta instance of
transformers' class of the same ``model_type``."""

from __future__ import annotations

import torch


def transformers_plan(model_type: str) -> dict[str, str]:
    """The ``tp_plan`` transformers' causal-LM class of ``model_type`` carries (``PreTrainedModel.tp_plan``), read
    from a 1-layer meta instance (the plan's names do not depend on the sizes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                  num_key_value_heads=2, num_hidden_layers=1, vocab_size=32)  # fmt: skip
    with torch.device("meta"):
        return dict(AutoModelForCausalLM.from_config(config).tp_plan)


def apply_transformers_plan(model, spec, tp_mesh) -> None:
    """``apply_tensor_parallelism`` of transformers with its own plan for ``spec.model_type``, expanded on
    ``model`` (a meta ``CausalLM``) by ``PreTrainedModel._expand_parallel_plan``."""
    from transformers import PreTrainedModel
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    plan = PreTrainedModel._expand_parallel_plan(model, transformers_plan(spec.model_type))
    apply_tensor_parallelism(model, tp_mesh, plan)
