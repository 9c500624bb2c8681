"""A run's parallelism as a mesh: named dimensions, each a group of ranks on a link class.

A mesh is a tuple of named dimensions, outermost first, laid out row-major over the ranks as
``torch.distributed.device_mesh.init_device_mesh(device, sizes, mesh_dim_names=names)`` lays them out
(``DeviceMesh``: ``torch.arange(world).view(sizes)``): the innermost dimension's groups are consecutive
ranks, and a dimension's neighbours are ``stride`` = the product of the inner sizes apart. Ranks fill nodes
in order (rank r on node r // gpus_per_node), as torchrun numbers them.

A collective over one dimension runs inside a node when every group of that dimension lies in one node:
the world fits in one node, or the block of ``stride·size`` consecutive ranks that holds a group divides
the node (blocks are aligned to their size, so they tile nodes exactly); else some group crosses a node
boundary and its ring runs at the slowest link it crosses (``zeroplan.formulas.commtime``).

Dimensions (torchtitan's names, ``torchtitan/distributed/parallel_dims.py``): ``dp_replicate`` (HSDP's
replicas, gradients all-reduced across them), ``dp_shard`` (FSDP's sharding group; a flat run's whole
data-parallel group N_d), ``tp`` (the model-parallel degree N_m, placed innermost: inside a node first, as
Megatron-LM and torchtitan place tensor parallelism). DeepSpeed's ZeRO++ hpZ groups are placed here by their
``group_size`` (``engines/deepspeed/zeropp.py``), qgZ's all-to-alls as ``dp_shard`` (a node's L ranks) and
``dp_replicate`` (ranks L apart; ``engines/deepspeed/zeropp_qgz.py``); MiCS is refused as DeepSpeed 0.19.8
itself refuses it (removed keys).
"""

import math
from dataclasses import dataclass

MESH_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp")
"""The dimensions a mesh may name, in the order they nest (outermost first)."""
LINK_CLASSES: tuple[str, ...] = ("intra", "inter")
"""intra: every group of the dimension inside one node (NVLink); inter: some group crosses nodes (network)."""
DEFAULT_GPUS_PER_NODE = 8
"""GPUs per node when none is given: DGX/HGX H100 and H200 nodes (``--gpus-per-node``)."""


@dataclass(frozen=True)
class Mesh:
    """Named dimensions (outermost first) and the node size that maps each to a link class."""

    dims: tuple[tuple[str, int], ...]
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE

    def __post_init__(self) -> None:
        names = [n for n, _ in self.dims]
        if any(n not in MESH_DIMS for n in names) or len(set(names)) != len(names):
            raise ValueError(f"mesh dims {names}: each one of {', '.join(MESH_DIMS)}, at most once")
        if names != sorted(names, key=MESH_DIMS.index):
            raise ValueError(f"mesh dims {names}: must nest as {', '.join(MESH_DIMS)} (outermost first)")
        for name, size in self.dims:
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"mesh dim {name}={size!r}: must be a whole number >= 1")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={self.gpus_per_node}: must be >= 1")

    @property
    def world(self) -> int:
        return math.prod(size for _, size in self.dims)

    def size(self, dim: str) -> int:
        """Ranks in one group of ``dim`` (1 for a dimension the mesh does not name)."""
        return dict(self.dims).get(dim, 1)

    def stride(self, dim: str) -> int:
        """Ranks between neighbours of a ``dim`` group: the product of the sizes of the dims inside it."""
        inner = MESH_DIMS[MESH_DIMS.index(dim) + 1 :]
        return math.prod(self.size(d) for d in inner)

    def link(self, dim: str) -> str:
        """``intra`` when every group of ``dim`` lies inside one node, else ``inter`` (module docstring)."""
        return link_class(self.size(dim), self.stride(dim), self.world, self.gpus_per_node)

    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.dims)

    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.dims)


def link_class(size: int, stride: int, world: int, gpus_per_node: int) -> str:
    """``intra`` when every group of ``size`` ranks ``stride`` apart lies in one node of ``gpus_per_node``."""
    return "intra" if size == 1 or world <= gpus_per_node or gpus_per_node % (stride * size) == 0 else "inter"


def data_parallel_mesh(nd: int, replicate: int = 1, nm: int = 1, gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> Mesh:
    """The mesh of N_d data-parallel ranks, ``replicate`` replicas of N_d/replicate-way shards (HSDP; 1: a
    flat run, one ``dp_shard`` group of N_d), each rank N_m model-parallel GPUs (innermost)."""
    if replicate < 1 or nd % replicate:
        raise ValueError(f"dp_replicate={replicate}: must divide N_d={nd}")
    dims = (("dp_replicate", replicate),) if replicate > 1 else ()
    dims += (("dp_shard", nd // replicate),)
    dims += (("tp", nm),) if nm > 1 else ()
    return Mesh(dims, gpus_per_node)
