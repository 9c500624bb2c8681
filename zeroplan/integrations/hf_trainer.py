"""A ds_config with ``"auto"``, resolved as the Hugging Face Trainer resolves it (transformers **5.24.0**).

The Trainer fills ``"auto"`` in two steps of ``transformers/integrations/deepspeed.py``
``HfTrainerDeepSpeedConfig`` and hands the rest to accelerate; a run goes through them in this order
(``resolve_trainer_auto``):

1. ``trainer_config_process`` (``TrainingArguments.__post_init__``): the batch keys from
   ``per_device_train_batch_size``, ``gradient_accumulation_steps`` and ``world_size`` (``train_batch_size`` =
   world_size x micro-batch x accumulation; here world_size = N_d, pure data parallelism),
   ``gradient_clipping`` from ``max_grad_norm``, ``optimizer.params`` lr/betas/eps/weight_decay and
   ``scheduler.params`` warmup_min_lr (0) / warmup_max_lr (lr), ``fp16.enabled`` / ``bf16.enabled`` from
   ``--fp16`` / ``--bf16`` (the run's dtype);
2. accelerate's ``DeepSpeedPlugin`` and ``set_mixed_precision`` (``accelerate_deepspeed.py``, steps 1-2):
   the stage (2 unless accelerate's config or environment says), offload devices, and the 16-bit sections;
3. ``trainer_config_finalize`` (``deepspeed_init``, at ``train()``): ``reduce_bucket_size`` = hidden²;
   at ZeRO-3 only ``stage3_prefetch_bucket_size`` = int(0.9·hidden²) (Python's ``int``: truncated) and
   ``stage3_param_persistence_threshold`` = 10·hidden; ``scheduler.params.total_num_steps`` and
   ``warmup_num_steps`` (max(1, warmup steps)) from the number of training steps;
4. accelerate's ``Accelerator.prepare`` (``accelerate_deepspeed.py`` step 3): what is left of gradient
   clipping, ``stage3_gather_16bit_weights_on_model_save`` and the hidden-size keys.

Where a value is not stated (a ``TrainerRun`` field left None), ``"auto"`` takes ``TrainingArguments``'
default (``TRAINER_DEFAULTS``) and a plain value in the file stands; a stated value is checked against a
plain one as the Trainer does (``fill_match``: refused when they differ). A deliberate deviation: the
Trainer also checks plain values against its defaults when the user did not pass an argument; zeroplan
cannot know the script's arguments, so it checks only what it is told.
Left ``"auto"`` (``AutoResolution.unresolved``): the two scheduler step counts when the number of training
steps is not given: the Trainer knows them only at ``train()``, and they change no memory or traffic.
Anything else still ``"auto"`` is refused in one line: DeepSpeed would receive the string.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from zeroplan.integrations.accelerate_deepspeed import (HIDDEN_KEYS, MixedPrecision, PluginFields, hidden_values,
                                                        mixed_precision_fill, need_hidden, plugin_fill, prepare_fill)
from zeroplan.integrations.ds_auto import SCHEDULER_STEPS, AutoFill, AutoResolution, Filled, finish

TRANSFORMERS_VERSION = "5.24.0"
_PROCESS = "transformers integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_process"
_FINALIZE = "transformers integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_finalize"
_OPTIM = "transformers integrations/deepspeed.py deepspeed_optim_sched"

TRAINER_DEFAULTS: dict[str, object] = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "learning_rate": 5e-5,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "warmup_steps": 0,
    "fp16": False,
    "bf16": False,
}
"""``TrainingArguments``' defaults for the fields ``"auto"`` reads (transformers 5.24.0 ``training_args.py``)."""


@dataclass(frozen=True)
class TrainerRun:
    """The run the Trainer fills ``"auto"`` from, in zeroplan's words; None: not stated (module docstring)."""

    nd: int = 1
    """data-parallel ranks: the Trainer's ``args.world_size``."""
    micro_batch: Optional[int] = None
    """``per_device_train_batch_size``."""
    grad_accum: Optional[int] = None
    dtype: Optional[Literal["fp32", "fp16", "bf16"]] = None
    """the run's precision: fp16 / bf16 are ``--fp16`` / ``--bf16`` (mixed precision), fp32 neither."""
    hidden_size: Optional[int] = None
    """the model's ``config.hidden_size`` (``text_config.hidden_size`` for a multimodal config)."""
    num_training_steps: Optional[int] = None
    learning_rate: Optional[float] = None
    adam_beta1: Optional[float] = None
    adam_beta2: Optional[float] = None
    adam_epsilon: Optional[float] = None
    weight_decay: Optional[float] = None
    max_grad_norm: Optional[float] = None
    warmup_steps: Optional[float] = None
    plugin: PluginFields = PluginFields()
    """accelerate's DeepSpeedPlugin fields (an accelerate config read by ``accelerate_config.py``, or the
    defaults of a plain ``torchrun``/``deepspeed`` launch)."""

    def arg(self, name: str) -> tuple[object, bool]:
        """(the value, whether it was stated): a TrainingArguments field, its default where None."""
        own = {"per_device_train_batch_size": self.micro_batch, "gradient_accumulation_steps": self.grad_accum}
        value = own[name] if name in own else getattr(self, name, None)
        return (TRAINER_DEFAULTS[name], False) if value is None else (value, True)

    @property
    def mixed_precision(self) -> MixedPrecision:
        """``TrainingArguments.mixed_precision``: fp16 if ``--fp16``, bf16 if ``--bf16``, else no."""
        return "fp16" if self.dtype == "fp16" else "bf16" if self.dtype == "bf16" else "no"


def trainer_config_process(fill: AutoFill, run: TrainerRun) -> None:
    """Step 1 (module docstring)."""
    mb, mb_given = run.arg("per_device_train_batch_size")
    ga, ga_given = run.arg("gradient_accumulation_steps")
    fill.fill("train_micro_batch_size_per_gpu", mb, _PROCESS, mb_given, "per_device_train_batch_size")
    fill.fill("gradient_accumulation_steps", ga, _PROCESS, ga_given, "gradient_accumulation_steps")
    fill.fill("train_batch_size", run.nd * mb * ga, _PROCESS, mb_given and ga_given, "train_batch_size (N_d x mb x ga)")
    for key, name in (("gradient_clipping", "max_grad_norm"), ("optimizer.params.lr", "learning_rate"),
                      ("optimizer.params.eps", "adam_epsilon"), ("optimizer.params.weight_decay", "weight_decay")):
        value, given = run.arg(name)
        fill.fill(key, value, _PROCESS, given, name)
    (b1, g1), (b2, g2) = run.arg("adam_beta1"), run.arg("adam_beta2")
    fill.fill("optimizer.params.betas", [b1, b2], _PROCESS, g1 and g2, "adam_beta1+adam_beta2")
    fill.fill("scheduler.params.warmup_min_lr", 0, _PROCESS)
    lr, lr_given = run.arg("learning_rate")
    fill.fill("scheduler.params.warmup_max_lr", lr, _PROCESS, lr_given, "learning_rate")
    given = run.dtype is not None
    fill.fill("fp16.enabled", run.dtype == "fp16", _PROCESS, given, "--fp16")
    fill.fill("bf16.enabled", run.dtype == "bf16", _PROCESS, given, "--bf16")


def trainer_config_finalize(fill: AutoFill, run: TrainerRun) -> None:
    """Step 3 (module docstring). ``is_zero3`` reads the stage after accelerate's plugin filled it."""
    if any(fill.is_auto(k) for k in HIDDEN_KEYS):
        h = need_hidden(fill, run.hidden_size, "the HF Trainer")
        values = hidden_values(h)
        fill.fill(HIDDEN_KEYS[0], values[HIDDEN_KEYS[0]], f"{_FINALIZE} (hidden_size {h})")
        if fill.get("zero_optimization.stage", -1) == 3:
            for key in HIDDEN_KEYS[1:]:
                fill.fill(key, values[key], f"{_FINALIZE} (hidden_size {h}, ZeRO-3)")
    if run.num_training_steps is not None:
        n = run.num_training_steps
        warmup, _ = run.arg("warmup_steps")
        steps = int(warmup) if warmup >= 1 else math.ceil(n * warmup)  # TrainingArguments.get_warmup_steps
        fill.fill(SCHEDULER_STEPS[0], n, _FINALIZE, True, "num_training_steps")
        fill.fill(SCHEDULER_STEPS[1], max(1, steps), _FINALIZE, run.warmup_steps is not None, "warmup_steps")
    fill.refuse_mismatches()


def resolve_trainer_auto(config: object, run: TrainerRun = TrainerRun()) -> AutoResolution:
    """``config`` (a parsed ds_config.json) as DeepSpeed receives it from ``Trainer.train()`` for ``run``:
    module docstring. ValueError (one line) where the Trainer or accelerate refuses the file, or where a key
    would reach DeepSpeed still ``"auto"``."""
    fill = AutoFill.of(config)
    trainer_config_process(fill, run)
    plugin_fill(fill, run.plugin)
    mixed_precision_fill(fill, run.mixed_precision)
    trainer_config_finalize(fill, run)
    if "optimizer" not in fill.config:  # the Trainer builds its own optimizer (TrainingArguments.optim)
        fill.config["zero_allow_untested_optimizer"] = True
        fill.filled.append(Filled("zero_allow_untested_optimizer", True, f"{_OPTIM} (no optimizer section: the "
                                  "Trainer's own, adamw_torch_fused by default)"))  # fmt: skip
    prepare_fill(fill, run.hidden_size)
    return finish(fill, f"neither the HF Trainer (transformers {TRANSFORMERS_VERSION}) nor accelerate fills it "
                        "(Accelerator.prepare refuses it: 'not found in kwargs')")
