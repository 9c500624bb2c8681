"""DeepSpeed's declarations beside its functions (``ENGINE``): the launcher ``plan`` prints and the validator run's
own options (``zeroplan validate --engine deepspeed``; checked by ``validate/engines/deepspeed_run.py``)."""

from __future__ import annotations

from typing import Optional

from zeroplan.engines.declared import Launcher, RunOption

LAUNCHER = Launcher("deepspeed", "DeepSpeed config (exactly the one predicted):",
                    "Build the model as predicted (with that file as ds_config.json):")
"""``plan --engine deepspeed``: the recommendation's ds_config (``config.py to_ds_config``) and, at ZeRO-3 under
``deepspeed.zero.Init``, how the model is built (``Candidate.build``)."""

RUN_OPTIONS: tuple[RunOption, ...] = (
    RunOption("deepspeed_config", Optional[dict], shown="--deepspeed-config", planner="ds_config",
              help="a parsed ds_config.json run at every world size (its stage); None: built-in configs, one per "
              "--stage (1-3) at DeepSpeed's defaults and --param-dtype"),
    RunOption("zero_init", bool, False, shown="--zero-init", planner="zero_init",
              help="ZeRO-3 only: build the model under deepspeed.zero.Init(config_dict_or_path=<the run's "
              "ds_config>) (each module partitioned as it is built: DeepSpeed's way for models larger than one "
              "device); False: built whole, partitioned by deepspeed.initialize"),
)  # fmt: skip
"""``ValidateConfig``'s options of a DeepSpeed run; ``planner``: the planner's own option of the same meaning."""
