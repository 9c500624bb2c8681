"""What DeepSpeed 0.19.8 ZeRO 1-3 allocates and sends, as data: one rank, one parameter group, no offload.

Pure: numbers in, frozen records out (no torch, no deepspeed). Every term cites the DeepSpeed file and
function it was read from (paths relative to the installed ``deepspeed/`` package, version
``DEEPSPEED_VERSION``) and was checked against a real run (``validate/engines/deepspeed.py``,
``tests/test_deepspeed_runner.py``, numbers in ``docs/engines/deepspeed.md``).

Lifetimes (``DSTerm.live``):
- ``persistent``: allocated in ``deepspeed.initialize`` and alive at every step boundary;
- ``lazy``: created by the first ``optimizer_step`` (Adam's m and v) and alive from then on;
- ``backward``: allocated when backward starts and freed before it ends (ZeRO-1/2 reduce buckets).
Model states after init = persistent terms; after a step = persistent + lazy.

Mapping to the peak model's format (``zeroplan/formulas/peak.py``: ``Term(name, bytes, source,
tensors)`` inside ``Moment(phase, name, terms)``): ``DSTerm.bytes`` is ``Term.bytes``; persistent
terms are in every moment of every phase, lazy ones in every moment of steps after the first (and in
the first step's ``optimizer_step``), backward ones in the backward moments.
"""

from __future__ import annotations

from dataclasses import dataclass

DEEPSPEED_VERSION = "0.19.8"
DTYPE_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2, "int32": 4, "bool": 1}
PARAM_DTYPES = ("fp32", "bf16", "fp16")
LIVES = ("persistent", "lazy", "backward")
# stage_1_and_2.py / bf16_optimizer.py __init__: "4-byte alignment/sizeof(fp16) = 2"; the flat group
# is padded to a multiple of this times N_d.
NCCL_START_ALIGNMENT_FACTOR = 2
_DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "bf16": "bf16",
                "bfloat16": "bf16"}  # fmt: skip


@dataclass(frozen=True)
class DSZeroConfig:
    """The ds_config keys that change memory or traffic, with DeepSpeed 0.19.8's defaults.

    Defaults: ``runtime/zero/config.py`` ``DeepSpeedZeroConfig`` (reduce/allgather buckets 5e8
    elements, prefetch 5e7, persistence threshold 1e5, max live / reuse distance 1e9,
    ``contiguous_gradients`` True, ``reduce_scatter`` True, ``use_multi_rank_bucket_allreduce`` True,
    ``overlap_comm`` None -> ``stage == 3`` in ``overlap_comm_valid``); precision from ``fp16`` /
    ``bf16`` ``enabled`` (fp32 when neither), ``grad_accum_dtype`` defaulting to the model dtype
    (``runtime/engine.py`` ``DeepSpeedEngine.get_data_types``); ``optimizer.params.torch_adam``
    (False) and ``foreach`` (``DeepSpeedEngine.get_optimizer_configuration``).
    """

    stage: int
    dtype: str = "fp32"
    grad_accum_dtype: str | None = None
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    contiguous_gradients: bool = True
    overlap_comm: bool | None = None
    reduce_scatter: bool = True
    use_multi_rank_bucket_allreduce: bool = True
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    optimizer: str = "adam"
    adam_w_mode: bool = True
    torch_adam: bool = False
    foreach: bool | None = None

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"stage={self.stage}: this profile covers ZeRO stages 1, 2 and 3")
        for name in ("dtype", "grad_accum_dtype"):
            value = getattr(self, name)
            if value is not None and value not in PARAM_DTYPES:
                raise ValueError(f"{name}={value!r}: expected one of {', '.join(PARAM_DTYPES)}")
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1 (elements)")

    @property
    def grad_dtype(self) -> str:
        """The gradient accumulation dtype (engine.py get_data_types: the model dtype when absent)."""
        return self.grad_accum_dtype or self.dtype

    @property
    def overlaps(self) -> bool:
        """``overlap_comm`` as DeepSpeed resolves it (config.py overlap_comm_valid)."""
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    @classmethod
    def from_ds_config(cls, config: dict) -> DSZeroConfig:
        """Read a parsed ds_config.json; absent keys take DeepSpeed 0.19.8's defaults."""
        zero = config.get("zero_optimization") or {}
        fp16 = bool((config.get("fp16") or {}).get("enabled", False))
        bf16 = bool((config.get("bf16") or config.get("bfloat16") or {}).get("enabled", False))
        if fp16 and bf16:
            raise ValueError("deepspeed config: fp16.enabled and bf16.enabled are both true")
        grad = (config.get("data_types") or {}).get("grad_accum_dtype")
        if grad is not None and str(grad).lower() not in _DTYPE_NAMES:
            raise ValueError(f"deepspeed config: data_types.grad_accum_dtype={grad!r}: expected fp32, fp16 or bf16")
        optimizer = config.get("optimizer") or {}
        params = optimizer.get("params") or {}
        keys = {
            "reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size",
            "contiguous_gradients": "contiguous_gradients", "overlap_comm": "overlap_comm",
            "reduce_scatter": "reduce_scatter", "use_multi_rank_bucket_allreduce": "use_multi_rank_bucket_allreduce",
            "stage3_prefetch_bucket_size": "prefetch_bucket_size",
            "stage3_param_persistence_threshold": "param_persistence_threshold",
            "stage3_max_live_parameters": "max_live_parameters", "stage3_max_reuse_distance": "max_reuse_distance",
        }  # fmt: skip
        found = {field: int(zero[key]) if "size" in key or "threshold" in key or "max_" in key else zero[key]
                 for key, field in keys.items() if key in zero}  # fmt: skip
        return cls(
            stage=int(zero.get("stage", 0)),
            dtype="fp16" if fp16 else "bf16" if bf16 else "fp32",
            grad_accum_dtype=None if grad is None else _DTYPE_NAMES[str(grad).lower()],
            optimizer=str(optimizer.get("type", "adam")).lower(),
            adam_w_mode=bool(params.get("adam_w_mode", True)),
            torch_adam=bool(params.get("torch_adam", False)),
            foreach=params.get("foreach"),
            **found,
        )


@dataclass(frozen=True)
class DSTerm:
    """A buffer DeepSpeed allocates on each rank: ``numel`` elements of ``dtype``, alive per ``live``."""

    name: str
    live: str
    numel: int
    dtype: str
    source: str
    tensors: int = 1

    @property
    def bytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class DSCollective:
    """Collectives of one kind DeepSpeed issues per step: ``calls`` calls of ``elements`` in total.

    ``elements`` counts the full tensor of each call (an all-gather's output, an all-reduce's buffer,
    a reduce-scatter's input), as ``validate.probes.CommCounter`` records them.
    """

    op: str
    phase: str
    calls: int
    elements: int
    dtype: str
    source: str


def optimizer_class(cfg: DSZeroConfig) -> str:
    """The wrapper DeepSpeed builds (engine.py ``_do_optimizer_sanity_check`` then ``_configure_optimizer``)."""
    if cfg.stage == 1 and cfg.dtype == "bf16" and cfg.grad_dtype == "fp32":
        return "BF16_Optimizer"  # engine.py _configure_bf16_optimizer -> runtime/bf16_optimizer.py
    if cfg.stage == 3:
        return "DeepSpeedZeroOptimizer_Stage3"  # engine.py _configure_zero_optimizer -> zero/stage3.py
    return "DeepSpeedZeroOptimizer"  # engine.py _configure_zero_optimizer -> zero/stage_1_and_2.py


def inner_optimizer_class(cfg: DSZeroConfig) -> str:
    """The Adam inside (engine.py ``get_optimizer_configuration``): torch's with ``torch_adam``, else
    DeepSpeed's ``FusedAdam`` (ops/adam/fused_adam.py; on CPU a JIT-built C++ op, ``fused_adam``)."""
    if cfg.optimizer not in ("adam", "adamw"):
        raise ValueError(f"optimizer={cfg.optimizer!r}: this profile covers Adam and AdamW")
    if cfg.torch_adam:
        # engine.py _configure_basic_optimizer: type "Adam" runs AdamW unless adam_w_mode is false
        return "AdamW" if cfg.optimizer == "adamw" or cfg.adam_w_mode else "Adam"
    return "FusedAdam"


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def flat_padded_numel(numels: tuple[int, ...], nd: int) -> int:
    """ZeRO-1/2 and BF16_Optimizer: one flat group padded to 2·N_d (stage_1_and_2.py __init__,
    ``flatten_dense_tensors_aligned(..., alignment=nccl_start_alignment_factor * world_size)``)."""
    return _ceil_to(sum(numels), NCCL_START_ALIGNMENT_FACTOR * nd)


def stage3_partition_numel(numels: tuple[int, ...], nd: int) -> int:
    """ZeRO-3: each tensor padded to N_d and split (partition_parameters.py ``_padding_size``,
    ``_partition_param``); a rank holds the sum of ceil(n / N_d)."""
    return sum(-(-n // nd) for n in numels)


def terms(cfg: DSZeroConfig, numels: tuple[int, ...], nd: int) -> tuple[DSTerm, ...]:
    """Every buffer of model states and buckets on one rank, for parameters of ``numels`` elements
    (``model.named_parameters()`` order) at N_d = ``nd``."""
    p, g, inner = cfg.dtype, cfg.grad_dtype, inner_optimizer_class(cfg)
    kind = optimizer_class(cfg)
    out: list[DSTerm] = []
    if kind == "DeepSpeedZeroOptimizer_Stage3":
        part = stage3_partition_numel(numels, nd)
        persist = sum(n for n in numels if n <= cfg.param_persistence_threshold)
        out += [
            DSTerm("16-bit parameter partition", "persistent", part, p,
                   "runtime/zero/stage3.py DeepSpeedZeroOptimizer_Stage3._create_fp16_partitions_with_defragmentation (lp_param_buffer)"),
            DSTerm("fp32 master partition", "persistent", part, "fp32",
                   "runtime/zero/stage3.py _create_fp32_partitions (a clone, even when the model is fp32)"),
            DSTerm("gradient partition", "persistent", part, g,
                   "runtime/zero/stage3.py _setup_for_real_optimizer (grad_partitions_flat_buffer, grad_accum_dtype)"),
            DSTerm("reduce bucket (IPG)", "persistent", cfg.reduce_bucket_size if cfg.contiguous_gradients else 0, g,
                   "runtime/zero/stage3.py _setup_for_real_optimizer (ipg bucket, torch.empty(reduce_bucket_size))"),
            DSTerm("persistent parameters (gathered)", "lazy", persist, p,
                   "runtime/zero/parameter_offload.py mark_persistent_parameters (ds_numel <= stage3_param_persistence_threshold); "
                   "gathered in forward and kept"),
            DSTerm("inf/nan tracker", "persistent", 1, "bool", "runtime/zero/stage3.py __init__ (inf_or_nan_tracker)"),
            DSTerm("overflow buffer", "persistent", 1 if inner == "FusedAdam" else 0, "int32",
                   "ops/adam/fused_adam.py FusedAdam.__init__ (_dummy_overflow_buf)"),
            DSTerm("grad-norm scalar", "lazy", 1, "fp64", "runtime/zero/stage3.py step (fp64 global norm; measured 8 B)"),
        ]  # fmt: skip
    else:
        flat = flat_padded_numel(numels, nd)
        part = flat // nd
        out += [
            DSTerm("16-bit flat parameters (full, padded)", "persistent", flat, p,
                   f"runtime/{'bf16_optimizer.py BF16_Optimizer._setup_for_real_optimizer' if kind == 'BF16_Optimizer' else 'zero/stage_1_and_2.py DeepSpeedZeroOptimizer.__init__'} (bit16_groups_flat)"),
            DSTerm("fp32 master partition", "persistent", part, "fp32",
                   "runtime/zero/stage_1_and_2.py __init__ (single_partition_of_fp32_groups: .clone(), even in fp32)"
                   if kind != "BF16_Optimizer" else "runtime/bf16_optimizer.py _setup_for_real_optimizer (fp32_groups_flat_partition)"),
        ]  # fmt: skip
        if kind == "BF16_Optimizer":
            out.append(DSTerm("fp32 gradient accumulation buffer (full, padded)", "persistent", flat, g,
                              "runtime/bf16_optimizer.py _setup_for_real_optimizer (fp32_groups_gradients_flat)"))  # fmt: skip
        else:
            buffers = (2 if cfg.overlaps else 1) if cfg.contiguous_gradients else 0
            out.append(DSTerm("reduce bucket (IPG)" + (" x2 (overlap_comm)" if buffers == 2 else ""), "backward",
                              buffers * cfg.reduce_bucket_size, g,
                              "runtime/zero/stage_1_and_2.py setup_buckets (torch.empty(reduce_bucket_size) per comm "
                              "dtype, a second when overlap_comm), at backward start", tensors=max(buffers, 1)))  # fmt: skip
        out.append(DSTerm("overflow buffer", "persistent", 1 if inner == "FusedAdam" else 0, "int32",
                          "ops/adam/fused_adam.py FusedAdam.__init__ (_dummy_overflow_buf)"))  # fmt: skip
        out.append(DSTerm("step scalars", "lazy", 1 if inner == "FusedAdam" else 2, "fp32",
                          "the global grad norm kept by the optimizer (measured 4 B) and, with torch Adam, its "
                          "fp32 step tensor (torch/optim/adam.py _init_group)"))  # fmt: skip
    out.append(DSTerm(f"Adam m and v ({inner})", "lazy", 2 * part, "fp32",
                      "ops/adam/fused_adam.py FusedAdam.step (zeros_like exp_avg, exp_avg_sq) / torch.optim.Adam._init_group",
                      tensors=2))  # fmt: skip
    return tuple(out)


def model_state_bytes(all_terms: tuple[DSTerm, ...], after_step: bool) -> int:
    """Bytes alive at a step boundary: persistent terms, plus lazy ones once a step has run."""
    lives = ("persistent", "lazy") if after_step else ("persistent",)
    return sum(t.bytes for t in all_terms if t.live in lives)


def greedy_buckets(numels: tuple[int, ...], bucket: int) -> tuple[int, ...]:
    """Element counts of the buckets DeepSpeed reduces, tensors taken in order: a bucket is sent before
    a tensor that would overflow it (a tensor larger than the bucket goes alone)
    (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads``; stage3.py
    ``__reduce_and_partition_ipg_grads`` via ``reduce_independent_p_g_buckets_and_remove_grads``)."""
    out, current = [], 0
    for n in numels:
        if current and current + n > bucket:
            out.append(current)
            current = 0
        current += n
    if current:
        out.append(current)
    return tuple(out)


def collectives(cfg: DSZeroConfig, numels: tuple[int, ...], nd: int) -> tuple[DSCollective, ...]:
    """Per-step collectives as measured on gloo (CommCounter), ZeRO-1/2 and the BF16 optimizer.

    ``numels`` in the order gradients are reduced: parameter order at stage 1 (``reduce_gradients``
    after backward walks ``bit16_groups``), gradient-ready order at stage 2. Stage 3 is not listed here:
    its gathers follow the module trace (see docs/engines/deepspeed.md).
    """
    kind, p, g = optimizer_class(cfg), cfg.dtype, cfg.grad_dtype
    flat = flat_padded_numel(numels, nd)
    gather = DSCollective("all-gather", "optimizer_step", 1, flat, p,
                          "runtime/utils.py all_gather_dp_groups (all_gather_into_tensor of the padded flat group; "
                          "one call while the group fits allgather_bucket_size)")  # fmt: skip
    if kind == "BF16_Optimizer":
        return (
            DSCollective("all-reduce", "backward", 1, flat, p,
                         "runtime/bf16_optimizer.py BF16_Optimizer (engine.allreduce_gradients of the flat bf16 grads)"),
            gather,
        )  # fmt: skip
    buckets = greedy_buckets(numels, cfg.reduce_bucket_size)
    out = [
        DSCollective("all-reduce", "backward", len(buckets), sum(numels), g,
                     "runtime/zero/stage_1_and_2.py average_tensor -> allreduce_and_scatter -> allreduce_bucket "
                     "(use_multi_rank_bucket_allreduce: an all-reduce per bucket, not a reduce-scatter)"),
        DSCollective("all-reduce", "optimizer_step", 1, 1, "fp32",
                     "runtime/zero/stage_1_and_2.py get_grad_norm_direct (the global gradient norm)"),
    ]  # fmt: skip
    if p == "bf16" or p == "fp16":
        out.append(DSCollective("all-reduce", "optimizer_step", 1, 1, "uint8",
                                "runtime/zero/stage_1_and_2.py has_overflow (check_grad_overflow)"))  # fmt: skip
    out.append(gather)
    return tuple(out)


def ds_estimate_zero2_bytes(psi: int, nd: int) -> int:
    """DeepSpeed's own ZeRO-2 estimate per GPU, no offload: 2Ψ + 18Ψ/N_d (runtime/zero/stage_1_and_2.py
    ``estimate_zero2_model_states_mem_needs``); shown beside the prediction, never used for it."""
    return 2 * psi + int(18 * psi / nd)


def ds_estimate_zero3_bytes(psi: int, largest_layer_numel: int, nd: int) -> int:
    """DeepSpeed's own ZeRO-3 estimate per GPU, no offload: 4·largest layer + 18Ψ/N_d
    (runtime/zero/stage3.py ``estimate_zero3_model_states_mem_needs``)."""
    return 4 * largest_layer_numel + int(18 * psi / nd)
