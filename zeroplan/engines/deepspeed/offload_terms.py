"""What DeepSpeed's offload leaves of the wrappers' model-state terms on the GPU (``on_gpu``) and how it changes
their collectives (``offload_collectives``), DeepSpeed 0.19.8, asking the wrapper's offload (``WrapperOffload``); the
host side and the moments: ``offload.py``. Imported by ``run.py`` and ``wrapper.py``, so it imports neither."""

from __future__ import annotations

from dataclasses import replace
from itertools import compress
from operator import attrgetter, not_

from zeroplan.engines.deepspeed.settings import Settings
from zeroplan.engines.deepspeed.terms import DSTerm
from zeroplan.formulas.peak import Term

S12 = "runtime/zero/stage_1_and_2.py"

MOVED_WITH_OPTIMIZER = ("fp32 master partition", "Adam m and v", "Adam step tensor", "overflow buffer",
                        "step scalars", "gradient partition")  # fmt: skip
"""Model-state terms (``terms.py``) that ``offload_optimizer`` puts on the host (the step scalars become one
norm on the GPU: ZeRO-1/2's ``WrapperOffload.gpu_terms``, offload_wrappers.py)."""

HOST_TEMPORARIES = ("fp32 gradient partition (zeros", "grads_in_partition", "flat partition gradient",
                    "fp32 gradient of the master partition", "accumulated gradients of the partition",
                    "gradient partition copy", "16-bit partition converted to fp32", "fp32 master partition (the clone)")  # fmt: skip
"""Moment terms (``zero12.py``, ``zero3.py``, ``phases.py``) that ``offload_optimizer`` makes on the host or
not at all (ZeRO-1/2 copy gradients to the host, no ``grads_in_partition``), and Adam's temporaries (a name ending
in " temporaries"): ``on_device`` leaves them out (offload.py ``offload_moments``)."""


class _HostMade(dict):
    """Term name -> whether ``offload_optimizer`` makes it on the host or not at all (``HOST_TEMPORARIES``), tested
    once per name rather than per term of each moment (a speed-up, no rule: ~24,000 moments of a 1,024-GPU plan)."""

    def __missing__(self, name: str) -> bool:
        if len(self) >= 4096:  # names are few; bounded all the same
            self.clear()
        made = self[name] = name.startswith(HOST_TEMPORARIES) or name.endswith(" temporaries")
        return made


_HOST_MADE = _HostMade()
_NAME = attrgetter("name")


def on_device(terms: tuple[Term, ...]) -> tuple[Term, ...]:
    """``terms`` less those ``offload_optimizer`` makes on the host (``HOST_TEMPORARIES``); ``terms`` itself where
    none is (each name looked up in C, ``map``: most moments hold none)."""
    made = list(map(_HOST_MADE.__getitem__, map(_NAME, terms)))
    if not any(made):
        return terms
    return tuple(compress(terms, map(not_, made)))


def offloads(s: Settings) -> bool:
    return s.offload_optimizer.on or s.offload_param.on


def _moved(s: Settings, name: str) -> bool:
    if s.offload_param.on and name == "16-bit parameter partition":
        return True
    return s.offload_optimizer.on and name.startswith(MOVED_WITH_OPTIMIZER)


class WrapperOffload:
    """What a wrapper's offload does (``Wrapper.offload``, asked by ``on_gpu``, ``offload_collectives`` and
    offload.py; ``run``: a ``run.DSRun``). This default moves nothing: BF16_Optimizer, whose offload ``Settings``
    refuses; ZeRO-1/2's ``cpu_offload`` (stage_1_and_2.py) and ZeRO-3's (stage3.py): offload_wrappers.py."""

    def gpu_terms(self, s: Settings, numels: tuple[int, ...]) -> tuple[DSTerm, ...]:
        """What offload adds to the model states on the GPU."""
        return ()

    def fp32_norm(self, s: Settings) -> bool:
        """Whether offload keeps and all-reduces the global norm in fp32, not fp64."""
        return False

    def host_terms(self, run) -> tuple[Term, ...]:
        """One rank's host memory under offload (offload.py ``host_terms``)."""
        return ()

    def traffic(self, run) -> tuple[int, int]:
        """(host-to-device, device-to-host) bytes of one optimizer step (offload.py ``host_memory``)."""
        return 0, 0

    def moments(self, run, moments: tuple) -> tuple:
        """The wrapper's own moments under offload, after offload.py ``offload_moments`` moved its terms."""
        return tuple(moments)

    def host_at_states_init(self, run) -> tuple[Term, ...]:
        """The host at the wrapper's own init peak (``HostMemory.init_peak``); (): the steady host terms."""
        return ()

    def nvme_step_bytes(self, run) -> tuple[int | None, int | None]:
        """(read, write) NVMe bytes of one steady step; (None, None): no NVMe swapper."""
        return None, None

    def nvme_step_terms(self, run) -> tuple[Term, ...]:
        """Host terms of the NVMe swapper's first step (``HostMemory.step_terms``)."""
        return ()


NO_OFFLOAD = WrapperOffload()


def on_gpu(w, s: Settings, numels: tuple[int, ...], nd: int) -> tuple[DSTerm, ...]:
    """The model-state terms (``terms.py``) of wrapper ``w`` (``run.Wrapper``) less what offload puts on the host,
    plus its GPU buffers (``WrapperOffload.gpu_terms``); the global norm in fp32 where its offload keeps it so."""
    terms = w.terms(s, numels, nd)
    if not offloads(s):
        return terms
    fp32 = w.offload.fp32_norm(s)
    kept = (replace(t, dtype="fp32", source=f"{t.source}; fp32 with offload_optimizer (measured 4 B)")
            if fp32 and t.name == "grad-norm scalar" else t for t in terms if not _moved(s, t.name))
    return (*kept, *w.offload.gpu_terms(s, numels))


PARAM_NORMS = "per-parameter gradient norms (fp64, norm_for_param_grads)"
"""ZeRO-3 with ``offload_optimizer``: one fp64 scalar per parameter, made in backward, freed by ``_post_step``."""


def param_norm_count(numels: tuple[int, ...], nd: int, rank: int | None) -> int:
    """ZeRO-3 with ``offload_optimizer``: the parameters whose norm ``rank`` keeps from backward to the step.
    stage3.py ``partition_grads`` skips a parameter whose partition on the rank holds no real element
    (``contains_real_data``: ceil(n / N_d)·rank < n) and otherwise, at the accumulation boundary,
    ``_offload_grad_partition_at_boundary`` stores ``_constant_buffered_norm2`` of its partition (an fp64 scalar)
    in ``norm_for_param_grads``, which ``_post_step -> reset_cpu_buffers`` empties. Every rank described
    (``rank`` None): rank 0's, every parameter. Measured (gpt-tiny bf16, 28 tensors, N_d = 1 and 2, MemTracker):
    28 × 8 = 224 B freed by ``reset_cpu_buffers``."""
    r = rank or 0
    return sum(1 for n in numels if -(-n // nd) * r < n)


def offload_collectives(w, s: Settings, collectives: tuple) -> tuple:
    """Wrapper ``w``'s collectives (``collectives.py``) as offload issues them: the norm all-reduce in fp32 where
    its offload keeps the norm so (``WrapperOffload.fp32_norm``: ZeRO-3's)."""
    if not w.offload.fp32_norm(s):
        return collectives
    return tuple(replace(c, dtype="fp32") if (c.op, c.phase, c.dtype) == ("all-reduce", "optimizer_step", "fp64")
                 else c for c in collectives)


TORCH_ADAM_STEP = "torch Adam's step temporaries on the host (torch_adam)"
TORCH_ADAM_SRC = "torch/optim/adam.py (torch 2.13)"


def l2_weight_decay(s: Settings) -> bool:
    """torch's Adam with an L2 weight decay: ``torch_adam``, type ``Adam`` with ``adam_w_mode: false`` (engine.py
    ``_configure_basic_optimizer``: ``effective_adam_w_mode``; ``get_optimizer_configuration`` builds
    ``torch.optim.Adam``) and ``weight_decay`` above 0. DeepSpeed's own kernels (FusedAdam, DeepSpeedCPUAdam) add
    the decay inside the kernel, and AdamW's decoupled decay is an in-place ``param.mul_``: nothing allocated."""
    return s.torch_adam and s.optimizer == "adam" and not s.adam_w_mode and s.weight_decay > 0


def adam_step_fp32_temporaries(s: Settings, foreach: bool) -> int:
    """fp32 temporaries of one tensor's size alive together in torch's Adam update (``torch_adam``); 0 for
    DeepSpeed's fused kernels. ``_single_tensor_adam``: ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt)``: the
    sqrt and the quotient, 2; ``_multi_tensor_adam`` (foreach): ``torch._foreach_sqrt``, then in place, 1. With an L2
    weight decay (``l2_weight_decay``) the single-tensor path keeps one more through the update: ``grad =
    grad.add(param, alpha=weight_decay)``, 3; foreach's ``device_grads = torch._foreach_add(device_grads,
    device_params, ...)`` is deleted before the sqrt (``del device_grads``: "to save on peak memory"), still 1.
    Measured (gpt-tiny fp32, ZeRO-2, ``offload_optimizer`` cpu, N_d = 1, weight_decay 0.1, MemTracker): the step's
    peak 1,349,632 B single-tensor (3 predicted: 1,349,140; 2 before: 1,203,844, -10.8 %), 1,059,040 B foreach
    (1 predicted: 1,058,548; 2 would be 1,203,844, +13.7 %)."""
    if not s.torch_adam:
        return 0
    return 1 if foreach else 2 + (1 if l2_weight_decay(s) else 0)


def torch_adam_step_temporaries(s: Settings, part: int) -> Term | None:
    """``optimizer.params.torch_adam`` with ``offload_optimizer`` cpu: torch's Adam/AdamW steps the host's fp32 master
    partition, one tensor per group (ZeRO-1/2 ``single_partition_of_fp32_groups``, ZeRO-3 one sub-group's
    ``fp32_partitioned_groups_flat``), and its update allocates on the host while ``step`` runs, on top of the
    steady host terms (``offload.host_terms``): ``HostMemory.step_terms``. DeepSpeed passes ``foreach`` from the
    config (engine.py ``_configure_basic_optimizer``: ``{'foreach': foreach}``, None by default), and torch's default
    on CPU tensors is the single-tensor path (optimizer.py ``_default_to_fused_or_foreach``: CPU is not in
    ``_get_foreach_kernels_supported_devices``): ``adam_step_fp32_temporaries`` x 4 B per element of the partition
    (8 B single-tensor, 4 B foreach; 12 B single-tensor with Adam's L2 weight decay).
    ``part``: the fp32 master partition's elements (``Wrapper.partition_numel``).
    Measured (gpt-tiny fp32, N_d = 1, DS_ACCELERATOR=cpu, MemTracker; partition 36,324 elements): the step's peak
    290,956 B (ZeRO-1 and ZeRO-2) and 290,596 B (ZeRO-3) above the profile without it; this term 290,592 B."""
    if not (s.torch_adam and s.offload_optimizer.on and s.offload_optimizer.device == "cpu"):
        return None
    foreach = bool(s.foreach)
    n = adam_step_fp32_temporaries(s, foreach)
    how = "_multi_tensor_adam: _foreach_sqrt" if foreach else "_single_tensor_adam: exp_avg_sq.sqrt() / bias_correction2_sqrt"
    if l2_weight_decay(s) and not foreach:
        how += ", and grad.add(param, alpha=weight_decay) (Adam's L2 decay, adam_w_mode false)"
    return Term(TORCH_ADAM_STEP, part * n * 4, f"{TORCH_ADAM_SRC} {how} (fp32 partition)", n)
