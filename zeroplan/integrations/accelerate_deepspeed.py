"""What accelerate 1.15.0 does to a ds_config before DeepSpeed reads it (its ``"auto"`` and the keys it adds).

Three steps, in the order a run takes them (file paths relative to the installed ``accelerate/``):

1. ``utils/dataclasses.py`` ``DeepSpeedPlugin.__post_init__`` (built by ``accelerate launch`` from the
   accelerate config, or by the HF Trainer from its ``TrainingArguments``): adds
   ``gradient_accumulation_steps: 1`` when absent, refuses a config without ``zero_optimization``, and fills
   ``"auto"`` (never checking plain values) from the plugin's fields: ``plugin_fill``;
2. ``utils/dataclasses.py`` ``DeepSpeedPlugin.set_mixed_precision`` (``state.py`` ``AcceleratorState``):
   adds the ``fp16``/``bf16`` sections and fills their ``enabled`` from the run's mixed precision:
   ``mixed_precision_fill``;
3. ``accelerator.py`` ``Accelerator._prepare_deepspeed``: what is still ``"auto"`` among gradient clipping
   (1.0), ``stage3_gather_16bit_weights_on_model_save`` (false) and the three hidden-size keys (filled at
   every stage here, where the Trainer fills the two ``stage3_*`` keys at ZeRO-3 only): ``prepare_fill``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from zeroplan.integrations.ds_auto import AUTO, AutoFill, Filled

ACCELERATE_VERSION = "1.15.0"
_PLUGIN = "accelerate utils/dataclasses.py DeepSpeedPlugin.__post_init__"
_MP = "accelerate utils/dataclasses.py DeepSpeedPlugin.set_mixed_precision"
_PREPARE = "accelerate accelerator.py Accelerator._prepare_deepspeed"

MixedPrecision = Literal["no", "fp16", "bf16"]


@dataclass(frozen=True)
class PluginFields:
    """The ``DeepSpeedPlugin`` fields that fill a ds_config's ``"auto"``, with the defaults ``__post_init__``
    takes when neither the accelerate config nor the environment sets them (``ACCELERATE_*`` unset)."""

    gradient_accumulation_steps: object = AUTO
    """``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, else ``"auto"`` (left for the Trainer or ``prepare``)."""
    gradient_clipping: object = AUTO
    zero_stage: int = 2
    """``ACCELERATE_DEEPSPEED_ZERO_STAGE``, default 2."""
    offload_optimizer_device: str = "none"
    offload_param_device: str = "none"
    offload_optimizer_nvme_path: str = "none"
    offload_param_nvme_path: str = "none"
    zero3_save_16bit_model: bool = False

    def ds_values(self) -> dict[str, object]:
        """``plugin_to_config_mapping``: ds_config key -> the plugin's value."""
        return {
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "gradient_clipping": self.gradient_clipping,
            "zero_optimization.stage": self.zero_stage,
            "zero_optimization.offload_optimizer.device": self.offload_optimizer_device,
            "zero_optimization.offload_param.device": self.offload_param_device,
            "zero_optimization.offload_param.nvme_path": self.offload_param_nvme_path,
            "zero_optimization.offload_optimizer.nvme_path": self.offload_optimizer_nvme_path,
            "zero_optimization.stage3_gather_16bit_weights_on_model_save": self.zero3_save_16bit_model,
        }


def plugin_fill(fill: AutoFill, plugin: PluginFields = PluginFields()) -> None:
    """Step 1 (module docstring)."""
    config = fill.config
    if "gradient_accumulation_steps" not in config:
        config["gradient_accumulation_steps"] = 1
        fill.filled.append(Filled("gradient_accumulation_steps", 1, f"{_PLUGIN} (absent: added)"))
    if "zero_optimization" not in config:
        raise ValueError("deepspeed config: no zero_optimization section: accelerate's DeepSpeedPlugin refuses it "
                         "(\"Please specify the ZeRO optimization config\")")  # fmt: skip
    for key, value in plugin.ds_values().items():
        if value != AUTO:  # filling "auto" with "auto" changes nothing
            fill.fill(key, value, _PLUGIN)


def mixed_precision_fill(fill: AutoFill, mixed_precision: MixedPrecision) -> None:
    """Step 2 (module docstring). ValueError where accelerate refuses a section for the other 16-bit type."""
    config = fill.config
    if mixed_precision == "fp16" and "fp16" not in config:
        config["fp16"] = {"enabled": True, "auto_cast": True}
        fill.filled.append(Filled("fp16", config["fp16"], f"{_MP} (absent: added)"))
    elif mixed_precision == "bf16" and "bf16" not in config:
        config["bf16"] = {"enabled": True}
        fill.filled.append(Filled("bf16", config["bf16"], f"{_MP} (absent: added)"))
    if mixed_precision != "no":
        other = "bf16" if mixed_precision == "fp16" else "fp16"
        section = config.get(other)
        if isinstance(section, dict) and str(section.get("enabled", "False")).lower() == "true":
            raise ValueError(f"deepspeed config: {other}.enabled is true and the run's mixed precision is "
                             f"{mixed_precision}: accelerate refuses the pair")  # fmt: skip
    for dtype in ("fp16", "bf16"):
        if dtype not in config:
            config[dtype] = {"enabled": False}
    fill.fill("fp16.enabled", mixed_precision == "fp16", _MP)
    fill.fill("bf16.enabled", mixed_precision == "bf16", _MP)


HIDDEN_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
               "zero_optimization.stage3_param_persistence_threshold")  # fmt: skip


def hidden_values(hidden_size: int) -> dict[str, int]:
    """hidden², int(0.9·hidden²) (Python's int: truncation toward zero) and 10·hidden: the same three
    expressions in transformers' ``trainer_config_finalize`` and accelerate's ``_prepare_deepspeed``."""
    return dict(zip(HIDDEN_KEYS, (hidden_size * hidden_size, int(0.9 * hidden_size * hidden_size), 10 * hidden_size)))


def need_hidden(fill: AutoFill, hidden_size: Optional[int], who: str) -> int:
    """``hidden_size``, or the one-line refusal both libraries make when a hidden-size key is "auto" and the
    model's config has no hidden size (here: no ``--model``)."""
    if hidden_size is None:
        keys = [k for k in HIDDEN_KEYS if fill.is_auto(k)]
        raise ValueError(f"deepspeed config: {keys[0]}='auto': {who} fills it from the model's hidden_size; "
                         "give the model (--model) or a number")  # fmt: skip
    return hidden_size


def prepare_fill(fill: AutoFill, hidden_size: Optional[int]) -> None:
    """Step 3 (module docstring)."""
    fill.fill("gradient_clipping", 1.0, _PREPARE)
    fill.fill("zero_optimization.stage3_gather_16bit_weights_on_model_save", False, _PREPARE)
    if any(fill.is_auto(k) for k in HIDDEN_KEYS):
        h = need_hidden(fill, hidden_size, "accelerate's Accelerator.prepare")
        for key, value in hidden_values(h).items():
            fill.fill(key, value, f"{_PREPARE} (hidden_size {h})")
