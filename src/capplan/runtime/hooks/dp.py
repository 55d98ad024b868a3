"""Data-parallel hooks: what each step runs after DP sync, and the plan check across ranks.

vLLM's model runner calls `dispatch_cg_and_sync_dp`: a local dispatch, then with DP > 1
an all-reduce of token counts and modes and a second dispatch for the agreed (padded)
token count with this rank's own LoRA count. Only the final descriptor runs, so only it
is counted; the sync wrapper records whether another rank's batch set the padded size
and whether the ranks ran eager together (class 7). With CAPPLAN_DP_AUDIT=1 each step
also all-reduces the padded token count and counts graph steps where the ranks disagreed
(there must be none; the plan's verify proves it, this checks it).
"""

from __future__ import annotations

import functools
from typing import Any

from capplan.releases import MANAGER
from capplan.runtime.context import HookContext
from capplan.runtime.dp_check import NO_PLAN, agree_across_ranks, audit_on
from capplan.runtime.hooking import Hook, binder, resolve

STEP = "vllm.v1.worker.gpu.dp_utils:dispatch_cg_and_sync_dp"
SYNC = "vllm.v1.worker.gpu.dp_utils:sync_cudagraph_and_dp_padding"


def _step(ctx: HookContext, hook: Hook, original: Any) -> Any:
    manager_cls = resolve(MANAGER)
    bind = binder(original)
    mql = ctx.release.rules.max_query_len_in_descriptor
    step, report = ctx.step, ctx.report

    @functools.wraps(original)
    def dispatch_cg_and_sync_dp(*args: Any, **kwargs: Any) -> Any:
        step.dp_step += 1  # every rank makes this call (an all-reduce under DP) at every step
        call = bind(args, kwargs)
        if not isinstance(call["cudagraph_manager"], manager_cls):
            return original(*args, **kwargs)
        step.inside = True
        if mql:  # vLLM passes max_query_len, None when a prefill is in the batch
            step.has_prefill = call["max_query_len"] is None
        try:
            result = original(*args, **kwargs)
        finally:
            step.inside = False
        if result[0].num_tokens:  # 0: every DP rank was idle, nothing runs
            report.count(result[0])
        return result

    return dispatch_cg_and_sync_dp


def _sync(ctx: HookContext, hook: Hook, original: Any) -> Any:
    manager_cls = resolve(MANAGER)
    bind = binder(original)
    audit = audit_on()

    @functools.wraps(original)
    def sync_cudagraph_and_dp_padding(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        call = bind(args, kwargs)
        manager = call["cudagraph_manager"]
        if manager is None or isinstance(manager, manager_cls):
            synced = result[0]
            disagreed = None
            if audit:
                disagreed = _disagreed(synced)
            ctx.report.dp_step(
                call["dp_rank"], call["dp_size"], call["num_tokens"], call["desired_batch_desc"], synced, disagreed
            )
        return result

    return sync_cudagraph_and_dp_padding


def _disagreed(synced: Any) -> bool | None:
    import torch
    import torch.distributed as dist
    from vllm.v1.worker.gpu import dp_utils

    both = torch.tensor([synced.num_tokens, -synced.num_tokens], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=dp_utils.get_dp_group().cpu_group)
    if synced.cg_mode.name == "NONE":  # eager together keeps per-rank counts, by design
        return None
    return int(both[0]) != -int(both[1])


def guard(original: Any) -> Any:
    """For a process with no plan: take part in the plan check, saying "no plan" (an engine of
    several ranks).

    Without it, a rank launched without CAPPLAN_PLAN (a node started without it, a DP rank)
    would never join the all-gather and the ranks that have a plan would wait forever, or,
    under TP and PP, capture vLLM's graphs while the others capture the plan's. Never changes
    what vLLM captures or dispatches."""

    @functools.wraps(original)
    def _init_candidates(self: Any) -> None:
        original(self)
        agree_across_ranks(NO_PLAN, None, self.vllm_config.parallel_config)

    return _init_candidates


GUARD = Hook(
    "dp.guard",
    f"{MANAGER}._init_candidates",
    "a rank without a plan joins the plan check, so a launch missing CAPPLAN_PLAN on one rank or node fails at start",
)
HOOKS = (
    Hook(
        "dp.step",
        STEP,
        "count what each step runs after DP sync (class 7)",
        _step,
        at="vllm.v1.worker.gpu.model_runner:dispatch_cg_and_sync_dp",  # the runner calls the name it imported
        reads=("cudagraph_manager",),
    ),
    Hook(
        "dp.sync",
        SYNC,
        "record the DP-agreed size per rank (class 7)",
        _sync,
        reads=("cudagraph_manager", "desired_batch_desc", "num_tokens", "dp_size", "dp_rank"),
    ),
)
