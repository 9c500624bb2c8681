"""Readers of the configuration files users already have, turned into plain data (dicts, frozen records).

- ``hf_trainer``: a ds_config with ``"auto"`` resolved as the Hugging Face Trainer resolves it
  (``ds_auto``: the fill rule; ``accelerate_deepspeed``: accelerate's part of the same resolution);
- ``accelerate_config``: ``accelerate launch --config_file`` YAML (FSDP2 and DeepSpeed);
- ``torchtitan_config``: torchtitan's TOML job config (``--job.config_file``, torchtitan <= 0.2.2).

Pure readers: no torch, no transformers, accelerate or torchtitan; each names the version it was read
from. They never import an engine: the callers turn the data into an engine's settings (docs/integrations.md).
"""
