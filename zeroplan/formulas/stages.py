"""ZeRO stages as data: what each stage shards (ZeRO paper, section 5.1 and Figure 1).

Formulas ask this table instead of testing stage numbers. DeepSpeed's ``zero_optimization.stage``
and FSDP's sharding strategies map onto the same four rows.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    number: int
    name: str  # the paper's name
    shards_optimizer: bool
    shards_gradients: bool
    shards_parameters: bool
    fsdp_equivalent: str


STAGES: tuple[Stage, ...] = (
    Stage(0, "DP", False, False, False, "DDP (no sharding)"),
    Stage(1, "P_os", True, False, False, "no FSDP equivalent (DeepSpeed stage 1)"),
    Stage(2, "P_os+g", True, True, False, "SHARD_GRAD_OP / fully_shard(reshard_after_forward=False)"),
    Stage(3, "P_os+g+p", True, True, True, "FULL_SHARD / fully_shard(reshard_after_forward=True)"),
)


def get_stage(number: int, what: str = "stage") -> Stage:
    """The stage row for a stage number 0-3; ValueError naming ``what`` otherwise. The one stage check."""
    if isinstance(number, bool) or not hasattr(number, "__index__") or number not in range(len(STAGES)):
        raise ValueError(f"{what}={number!r}: must be one of 0, 1, 2, 3")
    return STAGES[number]
