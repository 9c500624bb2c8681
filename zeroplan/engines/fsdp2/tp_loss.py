"""The loss of FSDP2 + TP (engines/fsdp2/tp.py's plan): with loss parallel (torchtitan's default) the head's output
stays vocabulary-sharded and ``loss_parallel()`` computes the cross-entropy on it (``tensor/parallel/loss.py``);
without it (``Settings.loss_parallel`` false: the job config's ``parallelism.disable_loss_parallel`` of torchtitan's
earlier ``apply_tp``, ``output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not
loss_parallel``; torchtitan 0.3.0's ``decoder_sharding.py`` keeps the head S(-1) always) the head's output is
``Replicate`` (``ColwiseParallel(output_layouts=Replicate(), use_local_output=True)``): the N x V/T
logits are all-gathered over the vocabulary on every TP rank and the plain cross-entropy runs on the whole N x V.
Each function here returns () at T = 1 and in the other mode."""

from __future__ import annotations

from dataclasses import replace

from zeroplan.formulas.activation_terms import TOKEN_BYTES
from zeroplan.formulas.peak import Moment, Term

LOSS_SRC = "torch/distributed/tensor/parallel/loss.py:"
GATHER_SRC = "torch/distributed/_functional_collectives.py:all_gather_single"


def whole_logits(acts, t: int):
    """``acts`` (the TP-local architecture's, N x V/T logits) without loss parallel: the head's output is
    all-gathered to Replicate and ``use_local_output`` hands the whole N x V logits to the loss, so the logits,
    their fp32 copy, the log-softmax and the gradients of the loss (``acts.logits``, ``logits_fp32``,
    ``log_softmax``) are the whole vocabulary's, T times the TP-local ones."""
    return replace(acts, logits=acts.logits * t, logits_fp32=acts.logits_fp32 * t, log_softmax=acts.log_softmax * t)


def check_loss_parallel(t: int | None, loss_parallel: bool) -> None:
    """ValueError (one line) for ``loss_parallel`` false without TP: it is a setting of the TP plan's head."""
    if not loss_parallel and (t or 1) == 1:
        raise ValueError("loss_parallel=false: a tensor-parallel option (the head's output layout); give tp > 1")


def _loss_rows(run) -> tuple[int, int]:
    """(N, N·V/T·4): the tokens in the loss and one fp32 tensor of vocabulary-sharded logits (``run.acts``
    is the TP-local architecture's: its ``log_softmax`` is N·V/T·4, its ``batch`` the ids and targets)."""
    return run.acts.batch // (2 * TOKEN_BYTES), run.acts.log_softmax


def loss_parallel_log_softmax(run) -> tuple[Term, ...]:
    """Loss parallel's forward (T > 1; else ()): ``_log_softmax`` on the fp32 N·V/T logits, at its last op
    ``result = shifted - shifted_logsumexp``: the shifted copy ``x - x_max`` and the result (two fp32 N·V/T
    beside the logits; ``exp(shifted)`` is gone by then), the all-reduced row max, the all-reduced sum of exps
    and its log (three fp32 N; the local max and sum died when their names were rebound), before the loss
    exists: N·V/T·4 + 3·N·4 - 8 B over the "cross-entropy" moment (which holds the log-softmax and the 8 B
    loss). Traced op by op (one rank, a 1-rank mesh: the peak at that ``aten.sub``, 2·N·V/T·4 + 3·N·4 beyond the
    input) and measured: gloo dp_shard 2 x tp 2, bf16, 4 x 16 tokens, no SP, the forward peak, exact."""
    if (run.settings.tp or 1) == 1 or not run.settings.loss_parallel:
        return ()
    n, nv = _loss_rows(run)
    return (Term("loss parallel: shifted logits and the log-softmax being made (fp32)", 2 * nv,
                 LOSS_SRC + "_log_softmax", 2),
            Term("loss parallel: the all-reduced row max and sum of exps, its log (fp32)", 3 * n * 4,
                 LOSS_SRC + "_log_softmax", 3))  # fmt: skip


def loss_parallel_backward(run) -> tuple[Term, ...]:
    """Loss parallel's backward (T > 1; else ()): ``_nll_loss_and_log_softmax_backward`` at
    ``(grad_input + torch.exp(x)) * grad_output`` holds three fp32 N·V/T (grad_input, exp(x), their sum)
    where the profile's "cross-entropy backward" holds two, plus three int64 N (``safe_target``, the masked
    target ``_MaskPartial._mask_tensor`` makes, ``arange_1d``), two fp32 N (``grad_update``, the masked
    ``grad_output``), the bool N mask (``_MaskPartial.mask_buffer``) and the loss's 4 B gradient:
    N·V/T·4 + 3·N·8 + 2·N·4 + N + 4. Traced op by op (a 1-rank mesh: the peak at ``aten.add``, all but the
    loss's gradient, an input there) and measured: gloo dp_shard 2 x tp 2, bf16, 4 x 16 tokens, SP: the
    backward peak, exact."""
    if (run.settings.tp or 1) == 1 or not run.settings.loss_parallel:
        return ()
    n, nv = _loss_rows(run)
    return (Term("loss parallel: grad_input + exp(x), the third fp32 N·V/T", nv,
                 LOSS_SRC + "_nll_loss_and_log_softmax_backward"),
            Term("loss parallel: targets (int64), mask, grad_update and grad_output columns", 3 * n * 8 + 2 * n * 4
                 + n + 4, LOSS_SRC + "_nll_loss_and_log_softmax_backward", 7))  # fmt: skip


def logits_all_gather(run) -> tuple[Term, ...]:
    """Without loss parallel (T > 1; else ()): the head's output redistributed Shard(-1) -> Replicate
    (``style.py:ColwiseParallel._prepare_output_fn``, ``redistribute(async_op=True)``;
    ``placement_types.py:Shard._to_replicate_tensor``: ``funcol.all_gather_single`` along the vocabulary), at
    its join ``_maybe_view_chunk_cat``: ``all_gather_into_tensor``'s output (T x N x V/T, gathered on dim 0) and
    the ``cat`` of its chunks along the last dimension (the whole N x V logits, ``run.acts.logits`` here:
    ``whole_logits``) beside the head's own N x V/T output, the collective's input: N·V·a + N·V/T·a over
    the "LM head" moment; with SP also the head's argument, the final norm's N/T-row output, alive while the
    head runs (``h = self.norm(h); output = self.lm_head(h)``, torchtitan 0.3.0 ``models/common/decoder.py``; its
    all-gathered N rows are the input the head saves, in the moment already; without SP they are one tensor):
    N·d·a/T. Traced (MemTracker's live storages at the forward peak, gloo dp_shard 2 x tp 2, bf16, 4 x 16
    tokens: that ``aten.cat``) and measured with and without SP (tests/test_fsdp2_tp.py, the ``-no-lp`` rows)."""
    t = run.settings.tp or 1
    if t == 1 or run.settings.loss_parallel:
        return ()
    whole = run.acts.logits
    arg = (Term("no loss parallel: the head's argument, the final norm's N/T-row output (SP)", run.acts.embed_out,
                "torchtitan models/common/decoder.py: h = self.norm(h); output = self.lm_head(h)"),)
    return (Term("no loss parallel: the head's N·V/T output (the all-gather's input)", whole // t,
                 "torch/distributed/tensor/parallel/style.py:ColwiseParallel._prepare_output_fn"),
            Term("no loss parallel: all_gather_into_tensor's T x N x V/T output, its chunks being joined", whole,
                 GATHER_SRC + " (_maybe_view_chunk_cat)"), *(arg if run.settings.sequence_parallel else ()))  # fmt: skip


def logits_gather_moments(run, head: Moment) -> tuple[Moment, ...]:
    """The logits' all-gather (``logits_all_gather``) as a forward moment after ``head`` ("LM head"); ()
    with loss parallel."""
    terms = logits_all_gather(run)
    return (Moment("forward", "logits all-gather (no loss parallel)", (*head.terms, *terms)),) if terms else ()
