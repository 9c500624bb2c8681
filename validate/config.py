"""What ``zeroplan validate`` runs: one matrix of stages x world sizes x model, real or simulated.

Every limit that needs no knowledge of the host is checked here, on construction, in the parent before
any rank starts; ``validate.checks`` adds what depends on the host (cores, memory, GPUs, output path).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from zeroplan.engines import REGISTRY, EngineName, get_engine
from zeroplan.engines.base import Engine, EngineOption, RunOption
from zeroplan.types import Count, PositiveFinite, StageNumber, whole_up_to

DEFAULT_WORLD_SIZES = (2, 4)
"""N_d values of a real run: the smallest group that shards, and one that pads uneven tensors."""
DEFAULT_SIMULATED_WORLD_SIZES = (64,)
"""N_d of a simulated run: the ZeRO paper's Table 1 example (one process plays rank 0)."""


DEFAULT_MODEL = "gpt-tiny"
MAX_STEPS = 1000  # every step's global batch is made up front (the reference trains on the same ones)
MAX_BATCH_PER_RANK = 4096
# Every tensor is padded to a multiple of N_d, so a simulated full buffer holds at least
# (tensors x N_d) elements: the simulation's memory and time grow with N_d even for a tiny model.
MAX_SIMULATED_WORLD_SIZE = 65536


def runner_of(engine: Engine) -> Optional[ModuleType]:
    """The engine's validator runner (``Engine.runner``: ``run_defaults``, ``check_run``, ``default_model``); None:
    it declares none."""
    return None if engine.runner is None else importlib.import_module(engine.runner)


def run_option_value(option: RunOption, value: object, planner: Optional[EngineOption]) -> object:
    """A run option as given (None: its default), checked by its declared type, then by the planner's own option
    it is (``RunOption.planner``), in one line."""
    if value is None:
        return option.default
    try:
        value = TypeAdapter(option.annotation).validate_python(value)
    except ValidationError as exc:
        raise ValueError(f"{option.name}={value!r}: {exc.errors()[0]['msg']}") from None
    if value != option.default and planner is not None:
        planner.check(value)
    return value


def run_option_engines(name: str) -> list[str]:
    """The registered engines whose validator run reads the option ``name`` (``Engine.run_options``)."""
    return [engine for engine in REGISTRY if any(o.name == name for o in get_engine(engine).run_options)]


def refuse_others(extra: dict) -> None:
    """Options of another engine's run (``Engine.run_options``) given to this one: refused by name with the engine
    that reads them (at their default: as not given); a name no engine declares refused as unknown."""
    if not extra:
        return
    owners = {o.name: (name, o) for name in REGISTRY for o in get_engine(name).run_options}
    unknown = [k for k in extra if k not in owners]
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: no engine's validator run has this option")
    shown: dict[str, list[str]] = {}
    for name, value in extra.items():
        engine, option = owners[name]
        if value is not None and value != option.default:
            shown.setdefault(engine, []).append(option.show(value))
    if shown:
        raise ValueError("; ".join(f"{', '.join(names)}: --engine {engine} only" for engine, names in shown.items()))


class ValidateConfig(BaseModel):
    """A validation matrix. Sizes are element counts, times are seconds.

    The fields are every engine's; an engine's own run options (``Engine.run_options``, declared in its package:
    FSDP2's ``reshard_after_forward``, DeepSpeed's ``deepspeed_config``, the reference runtime's ``grad_accum``)
    are read from the registry, checked by their declared type and held as attributes of the same name (at their
    default where not given); another engine's option given is refused by name. The engine's validator runner
    (``Engine.runner``, under ``validate/engines/``) adds its defaults and its checks.
    """

    @property
    def torch_dtype(self):
        """``param_dtype`` as a torch dtype (imports torch: ranks only)."""
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16}[self.param_dtype]

    model_config = ConfigDict(extra="allow", frozen=True)  # extras: the engine's run options only

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
    checkpointing: Literal["none", "full"] = Field("none", description="full: every block recomputed in backward")
    foreach: bool | None = Field(None, description="Adam's foreach path; default: as torch chooses for the device")
    peak_tolerance: PositiveFinite = Field(0.02, description="largest relative error of any phase's peak still ok")
    seq_len: Count | None = Field(
        None, description="tokens per sequence (transformers only), up to its positions; default: all positions"
    )
    engine: EngineName = Field(
        "reference", description="what trains: a registered engine (the bundled reference runtime, PyTorch FSDP2 "
        "or DeepSpeed)",
    )  # fmt: skip
    param_dtype: Literal["bf16", "fp16", "fp32"] = Field(
        "bf16",
        description="dtype of the runtime's parameters, gradients and compute (the paper's 16-bit half of "
        "mixed precision); the fp32 master copy and Adam's m, v stay fp32. The planner is asked with the "
        "same param_dtype, and the parity tolerances follow its unit roundoff. fsdp2: "
        "MixedPrecisionPolicy.param_dtype (fp32: no mixed precision; the model is built in fp32)",
    )
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

    @model_validator(mode="before")
    @classmethod
    def _run_options(cls, data: object) -> object:
        """The engine's own run options from its record (``Engine.run_options``), each checked by its declared type
        and by the planner option it is (``RunOption.planner``), the missing ones at their default; another
        engine's given (not at its default) refused by name; then the defaults its runner adds (``run_defaults``)
        and the world sizes' default: 64 when simulated, else the field's."""
        if not isinstance(data, dict):
            return data
        engine = get_engine(data.get("engine", "reference"))  # one line for an unknown engine
        mine = {o.name: o for o in engine.run_options}
        refuse_others({k: v for k, v in data.items() if k not in cls.model_fields and k not in mine})
        planner = {o.name: o for o in engine.own_options}
        given = data
        data = {k: v for k, v in given.items() if k in cls.model_fields}
        for name, option in mine.items():  # after the fields: the report's config lists them last
            data[name] = run_option_value(option, given.get(name), planner.get(option.planner))
        data = getattr(runner_of(engine), "run_defaults", lambda d: d)(data)
        if data.get("world_sizes") is None:
            data = {k: v for k, v in data.items() if k != "world_sizes"}
            if data.get("simulated"):
                data["world_sizes"] = DEFAULT_SIMULATED_WORLD_SIZES
        return data

    @model_validator(mode="after")
    def _runner_checks(self) -> ValidateConfig:
        """What the engine's validator runner refuses before any rank starts (its ``check_run``)."""
        getattr(self.runner, "check_run", lambda config: None)(self)
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
        if isinstance(spec, TransformerSpec) and not getattr(self, "hf", None):  # a run option (fsdp2 --hf): HF's class
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
    def runner(self) -> Optional[ModuleType]:
        """The validator's runner of this config's engine (``Engine.runner``): ``run(config) -> report``,
        ``worker_module(config)`` (what its ranks run) and its optional hooks; None: the engine declares none."""
        return runner_of(get_engine(self.engine))

    @property
    def model_name(self) -> str:
        """The preset run when no ``params`` are given: the runner's ``default_model(config)`` where it has one and
        it answers (FSDP2 with ``tp``: llama-tiny), else ``DEFAULT_MODEL``."""
        default = getattr(self.runner, "default_model", lambda config: None)(self)
        return self.model or default or DEFAULT_MODEL

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

