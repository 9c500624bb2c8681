"""What ``zeroplan validate`` runs: one matrix of stages x world sizes x model, real or simulated.

Every limit that needs no knowledge of the host is checked here, on construction, in the parent before
any rank starts; ``validate.checks`` adds what depends on the host (cores, memory, GPUs, output path).
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from zeroplan.types import Count, PositiveFinite, StageNumber, whole_up_to

DEFAULT_WORLD_SIZES = (2, 4)
"""N_d values of a real run: the smallest group that shards, and one that pads uneven tensors."""
DEFAULT_SIMULATED_WORLD_SIZES = (64,)
"""N_d of a simulated run: the ZeRO paper's Table 1 example (one process plays rank 0)."""


DEFAULT_MODEL = "gpt-tiny"
TP_MODEL = "llama-tiny"
"""The default model with ``tp``: torchtitan's llama plan holds llama module names only (validate/models.py)."""
DEEPSPEED_PEAK_TOLERANCE = 0.03
"""--engine deepspeed without --peak-tolerance: issue 11's target for every phase of real DeepSpeed."""
MAX_STEPS = 1000  # every step's global batch is made up front (the reference trains on the same ones)
MAX_BATCH_PER_RANK = 4096
MAX_GRAD_ACCUM = 64  # every micro-batch of every step is made up front, like the steps
# Every tensor is padded to a multiple of N_d, so a simulated full buffer holds at least
# (tensors x N_d) elements: the simulation's memory and time grow with N_d even for a tiny model.
MAX_SIMULATED_WORLD_SIZE = 65536


class ValidateConfig(BaseModel):
    """A validation matrix. Sizes are element counts, times are seconds."""

    @property
    def torch_dtype(self):
        """``param_dtype`` as a torch dtype (imports torch: ranks only)."""
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16}[self.param_dtype]

    model_config = ConfigDict(extra="forbid", frozen=True)

    stages: tuple[StageNumber, ...] = Field(
        (0, 1, 2, 3), min_length=1, description="ZeRO stages to run, each 0-3"
    )
    world_sizes: tuple[Count, ...] = Field(
        DEFAULT_WORLD_SIZES, min_length=1,
        description="N_d values; one process group each. Default 2 and 4; 64 when simulated",
    )  # fmt: skip
    model: Optional[str] = Field(
        None,
        description=f"preset of validate.models.PRESETS or zeroplan, or a config.json path (default "
        f"{DEFAULT_MODEL}); not with params",
    )
    params: PositiveFinite | None = Field(
        None,
        description="instead of model: a GPT-style model of about Ψ params (architectures.spec.gpt_for_params; "
        "below ~40M its vocabulary dominates, so it builds more: model_label and psi say what was built)",
    )
    simulated: bool = Field(False, description="one process plays rank 0 of the world on a fake group")
    fake_tensors: bool | None = Field(None, description="FakeTensorMode; default: on when simulated on CPU")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    steps: int = Field(
        3, description=f"training steps, 2-{MAX_STEPS}; >= 2 so a steady state is seen after Adam's lazy init"
    )
    batch_per_rank: whole_up_to(MAX_BATCH_PER_RANK) = Field(  # type: ignore[valid-type]
        2, description=f"sequences (or samples) per rank per step, 1-{MAX_BATCH_PER_RANK}"
    )
    grad_accum: whole_up_to(MAX_GRAD_ACCUM) = Field(  # type: ignore[valid-type]
        1, description=f"micro-steps per optimizer step, 1-{MAX_GRAD_ACCUM} (reference engine): each runs "
        "forward and backward on its own micro-batch, then one optimizer step"
    )
    checkpointing: Literal["none", "full"] = Field("none", description="full: every block recomputed in backward")
    foreach: bool | None = Field(None, description="Adam's foreach path; default: as torch chooses for the device")
    amsgrad: bool = Field(
        False, description="reference engine: Adam(amsgrad=True), a third fp32 state max_exp_avg_sq (the runtime's "
        "and the parity reference's Adam)",
    )  # fmt: skip
    peak_tolerance: PositiveFinite = Field(0.02, description="largest relative error of any phase's peak still ok")
    seq_len: Count | None = Field(
        None, description="tokens per sequence (transformers only), up to its positions; default: all positions"
    )
    engine: Literal["reference", "fsdp2", "deepspeed"] = Field(
        "reference", description="what trains: the bundled reference runtime, PyTorch FSDP2 or DeepSpeed"
    )
    param_dtype: Literal["bf16", "fp16", "fp32"] = Field(
        "bf16",
        description="dtype of the runtime's parameters, gradients and compute (the paper's 16-bit half of "
        "mixed precision); the fp32 master copy and Adam's m, v stay fp32. The planner is asked with the "
        "same param_dtype, and the parity tolerances follow its unit roundoff. fsdp2: "
        "MixedPrecisionPolicy.param_dtype (fp32: no mixed precision; the model is built in fp32)",
    )
    reduce_dtype: Optional[Literal["bf16", "fp16", "fp32"]] = Field(
        None, description="fsdp2 only: MixedPrecisionPolicy.reduce_dtype (default: the param dtype)"
    )
    fsdp2_init: Optional[Literal["materialized", "meta"]] = Field(
        None, description="fsdp2 only: how the model is built: materialized (whole on the device, then "
        "fully_shard; the default here) or meta (on the meta device, fully_shard, to_empty, then initialised "
        "shard by shard: FSDP2's pattern for large models)",
    )
    fsdp_wrap: Optional[Union[str, dict]] = Field(
        None, description="fsdp2 only: the fully_shard calls: blocks (default), torchtitan, or a wrapping's parsed "
        "JSON (zeroplan/engines/fsdp2/wrap.py)",
    )  # fmt: skip
    hf: Optional[bool] = Field(
        None, description="fsdp2 only: train transformers' own class of the config.json (default: "
        "validate/transformer.py's CausalLM)",
    )  # fmt: skip
    labels: Optional[bool] = Field(
        None, description="fsdp2 --hf only: the loss from forward(labels=...) inside the root's forward (default "
        "True, as the HF Trainer calls it); False: from the logits, outside it",
    )  # fmt: skip
    reshard_after_forward: Optional[Union[StrictBool, StrictInt]] = Field(
        None, description="fsdp2 only: on every block (default True; False keeps them gathered until "
        "backward; an int k reshards over k ranks)",
    )  # fmt: skip
    dp_replicate: Optional[StrictInt] = Field(
        None, ge=1, description="fsdp2 only: HSDP, replicas R of the 2-D mesh (R, N_d / R) fully_shard runs on "
        "(zeroplan/engines/fsdp2/mesh.py); must divide every world size",
    )  # fmt: skip
    tp: Optional[StrictInt] = Field(
        None, ge=2, description="fsdp2 only: tensor parallelism over the mesh's innermost 'tp' dimension of T ranks "
        "(torchtitan's llama plan, validate/engines/fsdp2_tp.py; zeroplan/engines/fsdp2/tp.py); must divide every "
        "world size; the model defaults to llama-tiny",
    )  # fmt: skip
    sequence_parallel: Optional[StrictBool] = Field(
        None, description="with tp: SequenceParallel norms and Shard(1) activations (default True)"
    )
    loss_parallel: Optional[StrictBool] = Field(
        None, description="with tp: the head's output Shard(-1) and loss_parallel() (default True); False: Replicate, "
        "the logits all-gathered (torchtitan's disable_loss_parallel)",
    )  # fmt: skip
    lr: PositiveFinite = Field(1e-3, description="Adam learning rate")
    tolerance: PositiveFinite = Field(0.01, description="largest relative error of model states still ok")
    timeout_s: PositiveFinite = Field(600.0, description="wall-clock limit of one world size, from its launch")
    nnodes: Count = Field(1, description="nodes of a real run (torchrun's --nnodes); each runs this command")
    node_rank: int = Field(0, description="this node's rank, 0 to nnodes-1 (torchrun's --node-rank)")
    master_addr: str = Field("127.0.0.1", description="address of node 0 (torchrun's --master-addr)")
    master_port: Optional[int] = Field(
        None, description="TCP port on node 0 (torchrun's --master-port); default: a free one (one node only)"
    )
    wire: bool = Field(
        False, description="also count loopback bytes in a private network namespace (Linux, gloo)"
    )
    deepspeed_config: Optional[dict] = Field(
        None, description="--engine deepspeed: a parsed ds_config.json run at every world size (its stage); "
        "None: built-in configs, one per --stage (1-3) at DeepSpeed's defaults and --param-dtype"
    )
    zero_init: bool = Field(
        False, description="--engine deepspeed, ZeRO-3 only: build the model under deepspeed.zero.Init("
        "config_dict_or_path=<the run's ds_config>) (each module partitioned as it is built: DeepSpeed's way "
        "for models larger than one device); False: built whole, partitioned by deepspeed.initialize",
    )

    @model_validator(mode="before")
    @classmethod
    def _deepspeed_stages(cls, data: object) -> object:
        """DeepSpeed has stages 1-3: no stages given -> 1, 2, 3, or the stage of the given config."""
        if isinstance(data, dict) and data.get("engine") == "deepspeed" and data.get("stages") is None:
            data = dict(data)
            ds = data.get("deepspeed_config")
            zero = ds.get("zero_optimization") if isinstance(ds, dict) else None
            data["stages"] = (zero.get("stage", 0),) if isinstance(zero, dict) else (1, 2, 3)
        if isinstance(data, dict) and data.get("engine") == "deepspeed" and data.get("peak_tolerance") is None:
            data = {**data, "peak_tolerance": DEEPSPEED_PEAK_TOLERANCE}
        return data

    @model_validator(mode="after")
    def _deepspeed(self) -> ValidateConfig:
        if self.engine != "deepspeed":
            if self.deepspeed_config is not None:
                raise ValueError("--deepspeed-config needs --engine deepspeed")
            if self.zero_init:
                raise ValueError("--zero-init: --engine deepspeed only (deepspeed.zero.Init)")
            return self
        if self.zero_init and self.stages != (3,):
            raise ValueError(f"--zero-init: deepspeed.zero.Init partitions parameters for ZeRO-3 only (stages "
                             f"{list(self.stages)}); give --stage 3 or a ds_config of stage 3")  # fmt: skip
        if self.simulated or self.wire or self.nnodes > 1 or self.params is not None:
            raise ValueError("--engine deepspeed runs real gloo ranks on one node: no --simulated, --wire, --nnodes "
                             "or --params")  # fmt: skip
        if 0 in self.stages:
            raise ValueError("--engine deepspeed: stages 1-3 (DeepSpeed's stage 0 is plain data parallelism)")
        if self.deepspeed_config is not None:
            from zeroplan.engines import get_engine

            engine = get_engine(self.engine)
            settings = engine.read_settings_file(self.deepspeed_config)  # one line naming a bad key
            if self.stages != (settings.stage,):
                raise ValueError(f"--stage {list(self.stages)} contradicts zero_optimization.stage={settings.stage}")
            for nd in self.world_sizes:  # DeepSpeed's batch rule, refused here rather than in a rank
                engine.batch(self.deepspeed_config, nd, None, None, ("micro_batch", "grad_accum"))
        return self

    @model_validator(mode="before")
    @classmethod
    def _default_world_sizes(cls, data: object) -> object:
        """No world sizes given: 64 when simulated, 2·T·R with ``tp`` (dp_shard 2), else the field's default."""
        if isinstance(data, dict) and data.get("world_sizes") is None:
            data = {k: v for k, v in data.items() if k != "world_sizes"}
            if data.get("simulated"):
                data["world_sizes"] = DEFAULT_SIMULATED_WORLD_SIZES
            elif isinstance(data.get("tp"), int) and isinstance(data.get("dp_replicate") or 1, int):
                data["world_sizes"] = (2 * data["tp"] * (data.get("dp_replicate") or 1),)  # dp_shard 2
        return data

    @field_validator("stages", "world_sizes")
    @classmethod
    def _sorted(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted(set(v)))

    @field_validator("steps")
    @classmethod
    def _steps(cls, v: int) -> int:
        if v < 2:
            raise ValueError(f"steps={v}: must be >= 2 (step 1 creates Adam's states)")
        if v > MAX_STEPS:
            raise ValueError(f"steps={v}: at most {MAX_STEPS} (every step's batch is made up front)")
        return v

    @model_validator(mode="after")
    def _engine_options(self) -> ValidateConfig:
        """Each engine's own options, and only those (an ignored option is an error)."""
        fsdp2_only = [n for n in ("reduce_dtype", "reshard_after_forward", "fsdp2_init", "fsdp_wrap", "hf", "labels",
                                  "dp_replicate", "tp")
                      if getattr(self, n) is not None]  # fmt: skip
        if self.engine != "reference" and self.grad_accum != 1:
            raise ValueError(f"grad-accum={self.grad_accum}: --engine reference only")
        if self.engine != "reference" and self.amsgrad:
            raise ValueError("--amsgrad: --engine reference only")
        if self.engine != "fsdp2" and fsdp2_only:
            raise ValueError(f"{', '.join(n.replace('_', '-') for n in fsdp2_only)}: --engine fsdp2 only")
        if self.engine == "reference" and self.param_dtype == "fp32":
            raise ValueError("param-dtype=fp32: the reference runtime trains 16-bit parameters (bf16 or fp16)")
        if self.engine == "fsdp2":
            if self.stages != type(self).model_fields["stages"].default:
                raise ValueError("--stage: FSDP2 has no stages; use --reshard-after-forward true|false|K")
            if self.wire:
                raise ValueError("--wire: --engine reference only")
            from validate.models import spec_for
            from zeroplan.architectures.spec import TransformerSpec

            if not isinstance(spec_for(self.model_name, self.params), TransformerSpec):
                raise ValueError(f"model {self.model_name}: --engine fsdp2 validates transformers only")
            if self.param_dtype == "fp16" or self.reduce_dtype == "fp16":
                raise ValueError("fp16: FSDP2 needs a gradient scaler for fp16 (not run); use bf16 or fp32")
            if 1 in self.world_sizes:
                raise ValueError("world-size=1: FSDP2 takes its world-size-1 path there (no collectives), which "
                                 "zeroplan does not model; use 2 or more")  # fmt: skip
            if self.labels is not None and not self.hf:
                raise ValueError("--labels/--no-labels: with --hf only (the validator's CausalLM takes its loss outside)")
            if self.hf and self.params is not None:  # meta init and checkpointing run (validate/engines/fsdp2.py)
                raise ValueError("--hf: a config.json --model, not --params (hf_builder)")
            if self.fsdp_wrap is not None:  # one line for a bad wrapping, by the engine's own check
                from zeroplan.engines import get_engine

                (check,) = (o.check for o in get_engine("fsdp2").own_options if o.name == "wrap")
                check(self.fsdp_wrap)
            rsf = self.reshard_after_forward
            bad = [n for n in self.world_sizes if not isinstance(rsf, bool) and rsf is not None and n % rsf]
            if bad:
                raise ValueError(f"reshard-after-forward={rsf}: must divide every world size (got {bad})")
            r = self.dp_replicate or 1
            if self.tp is None and any(n % r or n // r < 2 for n in self.world_sizes):
                raise ValueError(f"dp-replicate={r}: must divide every world size and leave dp_shard >= 2 "
                                 f"(got {list(self.world_sizes)})")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _tensor_parallel(self) -> ValidateConfig:
        """``tp``: what the TP runner (validate/engines/fsdp2_tp.py) runs, refused here before any rank starts."""
        if self.tp is None:
            for flag, value in (("--sp/--no-sp", self.sequence_parallel), ("--loss-parallel/--no-loss-parallel",
                                                                             self.loss_parallel)):
                if value is not None:
                    raise ValueError(f"{flag}: with --tp only")
            return self
        if self.engine != "fsdp2":
            raise ValueError("tp: --engine fsdp2 only")
        given = [flag for flag, on in (("--simulated", self.simulated), ("--params", self.params is not None),
                                       ("--hf", bool(self.hf)), ("--fsdp-wrap", self.fsdp_wrap is not None),
                                       ("--init materialized", self.fsdp2_init == "materialized"),
                                       ("--reshard-after-forward", self.reshard_after_forward not in (None, True)),
                                       ("--device cuda", self.device == "cuda"), ("--foreach", self.foreach is True),
                                       ("--nnodes", self.nnodes > 1),
                                       ("--reduce-dtype", self.reduce_dtype not in (None, self.param_dtype)))
                 if on]  # fmt: skip
        if given:
            raise ValueError(f"tp={self.tp}: the TP runner is real gloo ranks on CPU, meta init, blocks and root "
                             f"resharded, Adam for-loop, reduce dtype = param dtype: no {', '.join(given)}")
        from validate.engines.fsdp2_tp_check import check_tp_plan

        r = self.dp_replicate or 1
        for n in self.world_sizes:
            if n % (self.tp * r) or n // (self.tp * r) < 2:
                raise ValueError(f"tp={self.tp}, dp-replicate={r}: world size {n} must be R x S x T with dp_shard "
                                 f"S >= 2 (got {list(self.world_sizes)})")  # fmt: skip
        check_tp_plan(self.model_name, self.tp, self.world_sizes, self.seq_len, self.sequence_parallel is not False)
        return self

    @model_validator(mode="after")
    def _wire_needs_real(self) -> ValidateConfig:
        if self.wire and self.simulated:
            raise ValueError("--wire counts real traffic: it needs a real (not --simulated) run")
        return self

    @model_validator(mode="after")
    def _nodes(self) -> ValidateConfig:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"nnodes={self.nnodes}, node-rank={self.node_rank}: need 0 <= node-rank < nnodes")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ValueError(f"master-port={self.master_port}: must be 1-65535")
        if self.nnodes > 1:
            if self.simulated:
                raise ValueError("--nnodes applies to real runs; a simulated run is one process")
            if len(self.world_sizes) != 1 or self.world_sizes[0] % self.nnodes:
                raise ValueError(
                    f"nnodes={self.nnodes}: give one --world-size, a multiple of it (got {list(self.world_sizes)})"
                )
            if self.master_port is None:
                raise ValueError(f"nnodes={self.nnodes}: give --master-addr and --master-port of node 0")
        return self

    @model_validator(mode="after")
    def _simulated_world(self) -> ValidateConfig:
        too_big = [n for n in self.world_sizes if n > MAX_SIMULATED_WORLD_SIZE]
        if self.simulated and too_big:
            raise ValueError(
                f"world-size={too_big}: a simulated world is at most {MAX_SIMULATED_WORLD_SIZE} ranks "
                "(every tensor is padded to a multiple of N_d, so memory grows with N_d)"
            )
        return self

    @model_validator(mode="after")
    def _known_model(self) -> ValidateConfig:
        from validate.models import spec_for
        from validate.transformer import check_runtime_features
        from zeroplan.architectures.spec import TransformerSpec

        if self.model is not None and self.params is not None:
            raise ValueError("give --model or --params, not both (--params builds its own GPT-style model)")
        spec = spec_for(self.model_name, self.params)
        if isinstance(spec, TransformerSpec) and not self.hf:
            check_runtime_features(spec)  # the validator's own CausalLM would train another model
        positions = getattr(spec, "max_seq_len", None)
        if self.seq_len is not None and positions is None:
            raise ValueError(f"seq-len={self.seq_len}: model {self.model_name} is an MLP, it has no sequence")
        if self.seq_len is not None and self.seq_len > positions:
            raise ValueError(
                f"seq-len={self.seq_len}: model {self.model_label} has only {positions} positions"
            )
        return self

    @property
    def model_name(self) -> str:
        """The preset run when no ``params`` are given (with ``tp``: ``TP_MODEL``)."""
        return self.model or (TP_MODEL if self.tp is not None else DEFAULT_MODEL)

    @property
    def psi(self) -> int:
        """Parameters of the model that is built (exact, from the planner's shapes)."""
        from validate.models import expected_shapes, spec_for
        from zeroplan.architectures.spec import numels

        return sum(numels(expected_shapes(spec_for(self.model_name, self.params))))

    @property
    def model_label(self) -> str:
        """What was built, for the table: the preset, or the GPT-style spec chosen for ``params``."""
        if self.params is None:
            return self.model_name
        from validate.models import spec_for

        spec = spec_for(None, self.params)
        return f"gpt~{self.params:g} built as {spec.n_layer} x d{spec.d_model}, Ψ = {self.psi:,}"

