"""ZeRO-1/2's buckets reduced at a sparse MLP's gradient hook (moe12_hooks.py ``sparse_hook_partitions``): what every
run of one layout and bucket size holds there alike, found once for them (a speed-up, no rule)."""

from __future__ import annotations

import zeroplan.engines.deepspeed.boundary as B
from zeroplan.engines.deepspeed.layout_ranks import _hook_buckets
from zeroplan.engines.deepspeed.moe_offload import norms_at_hooks
from zeroplan.engines.deepspeed.reduce import _hook_copies_of, hook_copy_term
from zeroplan.engines.deepspeed.run import DSRun, _pbytes, shared_memo
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES
from zeroplan.formulas.peak import Term

SRC = "runtime/zero/stage_1_and_2.py"
LARGE = "gradients larger than the bucket, in the bucket reduced"


def sparse_hooks(run: DSRun, roles: dict[int, str]) -> tuple:
    """The buckets reduced at a sparse MLP's hook (``roles``: moe12_hooks.py ``_roles``), each (b, hook, role, block
    j, its place after the hook, (the bucket's gradients larger than it, the hooked gradient), the bucket's flattened
    copy (``hook_copy_term``), the moment's name, whether gate_up_proj's gradient waits past it): what every run of
    the layout, bucket size, dtypes and offload's norms (``norms_at_hooks``) holds alike, once for them
    (``shared_memo``; a speed-up, no rule: the every-rank run and each rank's made them anew;
    tests/test_deepspeed_moe_memos.py ``test_sparse_hooks_shared_equal_each_run_built``)."""
    order, buckets, first_of_bucket, _ = _hook_buckets(run)
    numels, blocks, limit = run.numels, run.param_blocks, run.settings.reduce_bucket_size
    p, norms, deepseek = _pbytes(run), norms_at_hooks(run), run.spec.model_type == "deepseek_v3"

    def make() -> tuple:
        out = []
        for b in range(len(buckets) - 1):
            hook = order[first_of_bucket[b + 1]]
            role, j = roles.get(hook), blocks[hook]
            if role not in ("gate_up", "router", "norm", "shared_down", "shared_up", "shared_gate", "down",
                            "attention") or (role in ("down", "attention") and not norms and (  # measured with
                    role == "attention" or deepseek)):  # offload's norm copies (DeepSeek-V3's down: only there)
                continue
            large = sum(numels[i] for i in order[first_of_bucket[b]:first_of_bucket[b + 1]] if numels[i] > limit)
            hooked = (Term(LARGE, large * p,
                           f"{SRC} reduce_ipg_grads (extra_large_param_to_reduce)"),
                      Term("the hooked parameter's gradient (waiting)", numels[hook] * p,
                           f"{SRC} reduce_independent_p_g_buckets_and_remove_grads (the bucket first)"))  # fmt: skip
            out.append((b, hook, role, j, B.position(run, hook) + 1, hooked, hook_copy_term(run, b),
                        f"block {j} sparse MLP {role} hook, bucket {b} reduced",
                        role == "gate_up" and numels[hook] > limit))
        return tuple(out)

    return shared_memo("sparse hooks", (order, first_of_bucket, numels, blocks, roles, _hook_copies_of(run)),  # type: ignore
                       (limit, p, DTYPE_BYTES[run.settings.grad_dtype], norms, deepseek), make)
