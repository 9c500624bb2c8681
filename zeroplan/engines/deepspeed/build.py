"""How a ZeRO-3 run builds its model, in the user's words: the two options (``zero_init``, ``hf_zero3_build``)
and the build snippet a plan prints, which says exactly the build the profile predicted (``build_snippet``).

Two builds under ``deepspeed.zero.Init`` are modelled (``Settings.zero_init``, ``Settings.hf_zero3_build``;
docs/engines/deepspeed.md "ZeRO-3 built under zero.Init" and "zero.Init under transformers"):

- the script's own ``with deepspeed.zero.Init(config_dict_or_path=...)`` around its constructor, the weights
  initialised through ``Module.apply`` (DeepSpeed's ``apply_with_gather``: one module's parameters at a time);
- transformers' own (``from_config`` with an ``HfDeepSpeedConfig`` of the ds_config alive, which the HF Trainer
  creates from ``TrainingArguments(deepspeed=...)`` and accelerate's ``DeepSpeedPlugin`` from its ds_config):
  transformers opens ``zero.Init`` itself (modeling_utils.py ``_from_config``) and initialises the weights with
  ``initialize_weights_zero3``, each module gathered with its direct children (run.py ``_init_gathers``).
"""

from __future__ import annotations

from typing import Optional

from zeroplan.engines.deepspeed.settings import Settings


def check_zero_init(value: object) -> bool:
    """``--zero-init/--no-zero-init`` (``Settings.zero_init``): whether ZeRO-3 builds the model under
    ``deepspeed.zero.Init``."""
    if not isinstance(value, bool):
        raise ValueError(f"zero_init={value!r}: expected true or false")
    return value


def check_hf_build(value: object) -> bool:
    """``--hf-zero-init/--no-hf-zero-init`` (``Settings.hf_zero3_build``): whether transformers builds the model
    (an ``HfDeepSpeedConfig`` alive) rather than the script's own ``zero.Init``."""
    if not isinstance(value, bool):
        raise ValueError(f"hf_zero3_build={value!r}: expected true or false")
    return value


def build_update(own: dict) -> dict:
    """The ``Settings`` fields of the build options given in ``own`` (an engine's own options), for a plan whose
    ZeRO-3 rows take them (the lower stages build the model whole: ``at_stage``). One line for the pair that
    contradicts itself: transformers' build is under ``zero.Init``, so ``hf_zero3_build`` with ``zero_init`` false."""
    if own.get("hf_zero3_build") and own.get("zero_init") is False:
        raise ValueError("--hf-zero-init: transformers builds the model under deepspeed.zero.Init; it contradicts "
                         "--no-zero-init (drop one of them)")  # fmt: skip
    return {k: own[k] for k in ("zero_init", "hf_zero3_build") if own.get(k) is not None}


def at_stage(stage: int) -> dict:
    """The build fields of a plan's row at ``stage``: below ZeRO-3 the model is built whole (``zero.Init``
    partitions for ZeRO-3 only; transformers' ``is_deepspeed_zero3_enabled`` is false), whatever the base's."""
    return {} if stage == 3 else {"zero_init": None, "hf_zero3_build": False}


def build_snippet(s: Settings, config_path: str = "ds_config.json") -> Optional[str]:
    """How to build the model for ``s`` as the profile predicted it: under the script's own
    ``deepspeed.zero.Init`` (``Settings.zero_init``; as ``validate/engines/deepspeed.py`` ``build_model`` does),
    or by transformers (``Settings.hf_zero3_build``; as its ``hf_zero3_build`` does), or None where the model is
    built as usual (whole, then partitioned by ``deepspeed.initialize``)."""
    if not s.builds_partitioned:
        return None
    init = (f"engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),\n"
            f"                                               config={config_path!r})\n")  # fmt: skip
    if s.hf_zero3_build:
        return (
            "import deepspeed\n"
            "import torch\n"
            "from transformers import AutoConfig, AutoModelForCausalLM\n"
            "from transformers.integrations import HfDeepSpeedConfig\n\n"
            "# ZeRO-3 as predicted: transformers builds the model under its own zero.Init (modeling_utils.py\n"
            "# _from_config), then initialize_weights_zero3 gathers each module with its direct children's\n"
            "# parameters. The HF Trainer builds so when TrainingArguments(deepspeed=...) exists before the model.\n"
            f"dschf = HfDeepSpeedConfig({config_path!r})  # keep it alive: transformers holds a weak reference\n"
            "# created in fp32 (as measured: zero.Init converts each parameter to the ds_config's dtype)\n"
            "model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MODEL), dtype=torch.float32)\n"
            "# from_pretrained loads a checkpoint module by module instead (_load_state_dict_into_zero3_model):\n"
            "# a build not measured here.\n"
            f"{init}"
        )
    return (
        "import deepspeed\n\n"
        "# ZeRO-3 as predicted: each module is partitioned as it is built (partition_parameters.py Init), so no\n"
        "# rank holds the whole model; initialise weights through model.apply (each module gathered for it).\n"
        "# A transformers model built by transformers (HfDeepSpeedConfig, the HF Trainer) gathers more at once:\n"
        "# predict that build with --hf-zero-init.\n"
        f"with deepspeed.zero.Init(config_dict_or_path={config_path!r}):\n"
        "    model = build_model()  # your model's constructor\n"
        f"{init}"
    )
