"""``BF16_Optimizer`` (runtime/bf16_optimizer.py, DeepSpeed 0.19.8): ZeRO-1 with a bf16 model and fp32
gradient accumulation (engine.py ``_configure_bf16_optimizer``). Its schedule: forward on the full bf16 flat
group; backward leaves every bf16 gradient in ``param.grad``; after backward each is added into the full
fp32 gradient buffer (``update_hp_grads``) and the engine all-reduces that buffer; the step updates this
rank's fp32 partition and all-gathers the bf16 flat group.

The same on a mixture-of-experts model (transformers' 3-D expert tensors): no gradient hook reduces
(``immediate_grad_update`` false by default, runtime/precision_config.py; ``create_grad_acc_hooks`` not called), so
the buckets and the hooks' order that ZeRO-1/2 meet inside a sparse MLP's backward (moe12_hooks.py) play no part;
the largest 16-bit gradient ``_update_hp_grad`` upcasts is an expert tensor's. Measured on Mixtral, Qwen3-MoE,
Qwen2-MoE and DeepSeek-V3 (gloo, N_d = 2, both ranks): every phase within 644 B (0.0055 %), no term of its own
(tests/test_deepspeed_moe_opt.py; docs/engines/deepspeed.md "BF16_Optimizer and offload on mixture-of-experts")."""

from __future__ import annotations

from zeroplan.engines.deepspeed.collectives import bf16_collectives
from zeroplan.engines.deepspeed.phases import cast_moments, flatten_moment, later_blocks_held
from zeroplan.engines.deepspeed.run import DSRun, Wrapper, _act, _pbytes, _states
from zeroplan.engines.deepspeed.terms import bf16_terms, aligned_flat_numel
from zeroplan.formulas.peak import Moment, Term

SRC = "runtime/bf16_optimizer.py BF16_Optimizer"


class BF16Optimizer(Wrapper):
    name = "BF16_Optimizer"
    terms = staticmethod(bf16_terms)
    collectives = staticmethod(bf16_collectives)

    def init_moments(self, run: DSRun) -> tuple[Moment, ...]:
        """The cast, the flat copy, then (no ``initialize_optimizer_states``) the fp32 partition cloned from
        the 16-bit one (``.clone().float()``: the clone dies at once) and the full fp32 gradient buffer
        (``zeros_like``) completing the states."""
        p, flat = _pbytes(run), aligned_flat_numel(run.numels, run.nd)
        part = flat // run.nd
        bsrc = f"{SRC}._setup_for_real_optimizer"
        return (*cast_moments(run), flatten_moment(run),
                Moment("init", "fp32 partition cloned, gradient buffer zeroed", (*_states(run, after_step=False),)),
                Moment("init", "fp32 partition from the 16-bit clone", (
                    Term("16-bit flat parameters", flat * p, f"{bsrc} (bf16_groups_flat)"),
                    Term("16-bit partition clone", part * p, f"{bsrc} (bf16_dp_partitions[rank].clone())"),
                    Term("fp32 master partition", part * 4, f"{bsrc} (.float(): fp32_groups_flat_partition)"))))  # fmt: skip

    def held_between_micro_steps(self, run: DSRun) -> tuple[Term, ...]:
        """Reducing at the boundary only (engine.py ``allreduce_gradients``), autograd's gradients stay in
        ``param.grad`` across micro-steps (measured at G = 2)."""
        if run.grad_accum == 1:
            return ()
        return (Term("gradients of earlier micro-steps (param.grad)", sum(run.numels) * _pbytes(run),
                     "torch autograd AccumulateGrad; runtime/engine.py allreduce_gradients (stage 1: at the boundary only)"),)  # fmt: skip

    def keeps_gradients(self, run: DSRun) -> bool:
        return run.grad_accum == 1  # accumulating: all of them are in held_between_micro_steps

    def backward_after_last_block(self, run: DSRun, last: tuple[Term, ...],
                                  inflight: tuple[Term, ...]) -> tuple[Moment, ...]:
        """The blocks with the later blocks' gradients held, then ``update_hp_grads`` and the all-reduce."""
        later = later_blocks_held(run, last, inflight) if self.keeps_gradients(run) else ()
        return (Moment("backward", "last block backward", last), *later, *self.after_backward(run))

    @staticmethod
    def after_backward(run: DSRun) -> tuple[Moment, ...]:
        """Every 16-bit gradient (param.grad) is added into the fp32 buffer one tensor at a time through an
        fp32 copy, then the engine all-reduces the flat fp32 buffer converted to the communication dtype;
        the 16-bit gradients live on until zero_grad after the step."""
        numels, p, flat = run.numels, _pbytes(run), aligned_flat_numel(run.numels, run.nd)
        base = (*_states(run), _act("batch (token ids, targets)", run.acts.batch, 2), _act("loss", run.acts.loss),
                Term("16-bit gradients (param.grad)", sum(numels) * p,
                     "torch autograd; runtime/bf16_optimizer.py update_hp_grads (clear_lp_grads=False)"))  # fmt: skip
        return (
            Moment("backward", "update_hp_grads", (*base, Term(
                "fp32 copy of the largest 16-bit gradient", max(numels) * 4,
                "runtime/bf16_optimizer.py _update_hp_grad (lp.grad.data.to(hp_grad.dtype))")),),  # fmt: skip
            Moment("backward", "all-reduce of the flat gradients", (*base, Term(
                "flat fp32 gradients in the communication dtype", flat * p,
                "runtime/engine.py buffered_allreduce_fallback -> allreduce_bucket (tensor.to(communication_data_type))")),),  # fmt: skip
        )

    def optimizer_moments(self, run: DSRun, part: int, inner: str, temps: int) -> tuple[Moment, ...]:
        """The inner Adam's gradient is a view of the fp32 gradient buffer (step: param_partition.grad =
        grad_partition, fp32 already); the 16-bit param.grad live until zero_grad after the step."""
        return (Moment("optimizer_step", f"{inner} update", (*_states(run),
                Term("16-bit gradients (param.grad)", sum(run.numels) * _pbytes(run),
                     f"{SRC}.step; freed by zero_grad(set_to_none=True) after the step"),
                Term(f"{inner} temporaries", temps * part * 4, "torch/optim/adam.py _single_tensor_adam / _multi_tensor_adam",
                     max(temps, 1)))),)  # fmt: skip


BF16_OPTIMIZER = BF16Optimizer()
