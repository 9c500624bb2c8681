"""FSDP2's declarations beside its functions (``ENGINE``): the launcher ``plan`` prints and the validator run's
own options (``zeroplan validate --engine fsdp2``; checked by ``validate/engines/fsdp2_run.py``)."""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import Field, StrictBool, StrictInt

from zeroplan.engines.declared import Launcher, RunOption

LAUNCHER = Launcher("fsdp2", "FSDP2 (exactly the configuration predicted):")
"""``plan --engine fsdp2``: the ``fully_shard`` snippet of the recommendation (``launcher.py settings_snippet``)."""

DTYPE = Optional[Literal["bf16", "fp16", "fp32"]]

RUN_OPTIONS: tuple[RunOption, ...] = (
    RunOption("reduce_dtype", DTYPE, help="MixedPrecisionPolicy.reduce_dtype (default: the param dtype)",
              planner="reduce_dtype"),
    RunOption("fsdp2_init", Optional[Literal["materialized", "meta"]],
              help="how the model is built: materialized (whole on the device, then fully_shard; the default "
              "here) or meta (on the meta device, fully_shard, to_empty, then initialised shard by shard: FSDP2's "
              "pattern for large models)", planner="init"),
    RunOption("fsdp_wrap", Optional[Union[str, dict]],
              help="the fully_shard calls: blocks (default), torchtitan, or a wrapping's parsed JSON "
              "(zeroplan/engines/fsdp2/wrap.py)", planner="wrap"),
    RunOption("hf", Optional[bool], help="train transformers' own class of the config.json (default: "
              "validate/transformer.py's CausalLM)"),
    RunOption("labels", Optional[bool], help="--hf only: the loss from forward(labels=...) inside the root's "
              "forward (default True, as the HF Trainer calls it); False: from the logits, outside it"),
    RunOption("reshard_after_forward", Optional[Union[StrictBool, StrictInt]],
              help="on every block (default True; False keeps them gathered until backward; an int k reshards "
              "over k ranks)", planner="reshard_after_forward"),
    RunOption("dp_replicate", Optional[Annotated[StrictInt, Field(ge=1)]],
              help="HSDP, replicas R of the 2-D mesh (R, N_d / R) fully_shard runs on "
              "(zeroplan/engines/fsdp2/mesh.py); must divide every world size", planner="dp_replicate"),
    RunOption("tp", Optional[Annotated[StrictInt, Field(ge=2)]],
              help="tensor parallelism over the mesh's innermost 'tp' dimension of T ranks (torchtitan's llama "
              "plan, validate/engines/fsdp2_tp.py; zeroplan/engines/fsdp2/tp.py); must divide every world size; "
              "the model defaults to llama-tiny", planner="tp"),
    RunOption("sequence_parallel", Optional[StrictBool], shown="--sp/--no-sp",
              help="with tp: SequenceParallel norms and Shard(1) activations (default True)",
              planner="sequence_parallel"),
    RunOption("loss_parallel", Optional[StrictBool], shown="--loss-parallel/--no-loss-parallel",
              help="with tp: the head's output Shard(-1) and loss_parallel() (default True); False: Replicate, the "
              "logits all-gathered (torchtitan's disable_loss_parallel)", planner="loss_parallel"),
    RunOption("tp_plan", Optional[Literal["torchtitan", "transformers"]], shown="--tp-plan",
              help="with tp: torchtitan (default) or transformers (the model's own tp_plan applied by transformers' "
              "apply_tensor_parallelism, accelerate's TP: no SP, the logits gathered; validate/engines/fsdp2_tp_hf.py)",
              planner="tp_plan"),
)  # fmt: skip
"""In ``ValidateConfig``'s former field order; ``planner``: the planner's own option of the same meaning."""
