"""The graph manager's hooks: the plan's capture list, dispatch table and capture.

- `_init_candidates`: checks the plan against the live manager (and, in an engine of several
  ranks, that every rank loaded the same plan), then installs the plan's capture list (plan order),
  candidate table and LoRA dispatch map in place of vLLM's (failure classes 3, 6, 8).
- `dispatch`: the plan's O(1) dispatcher in place of vLLM's candidate scan (classes 6, 8).
- `capture`: timing and graph memory for the report; refuses to capture a list the plan
  did not install (fail closed); tells vLLM's memory-profiling capture (graphs it
  discards) from the real one.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from capplan.calibration.budget import outgrown
from capplan.releases import MANAGER, Release
from capplan.runtime.context import HookContext
from capplan.runtime.dp_check import agree_across_ranks, audit_on, launch_rank, plan_identity
from capplan.runtime.engine_check import PlanMismatch, breakable_problem, engine_problem
from capplan.runtime.hooking import Hook, PlanNotInForce, binder, check_attributes
from capplan.runtime.hooks.memory import GraphMemoryOutgrown, out_of_memory
from capplan.runtime.log import log
from capplan.schemas.plan import Descriptor

PROFILING_MARK = "_capture_mem_samples"  # a list while vLLM's memory profiling captures, None otherwise
MANAGER_STATE = (
    "_capture_descs",
    "_candidates",
    "_lora_dispatch_map",
    "_max_lora_case",
    "_graphs_captured",
    "vllm_config",
    "cudagraph_mode",
    "lora_capture_cases",
    "decode_query_len",
)


def to_vllm(engine_release: Release, desc_cls: Any, d: Descriptor) -> Any:
    """The plan's descriptor as vLLM's BatchExecutionDescriptor (max_query_len where it has one)."""
    from vllm.config.compilation import CUDAGraphMode

    kwargs: dict[str, Any] = dict(
        cg_mode=CUDAGraphMode[d.cg_mode],
        num_tokens=d.num_tokens,
        num_reqs=d.num_reqs,
        uniform_token_count=d.uniform_token_count,
        num_active_loras=d.num_active_loras,
    )
    if engine_release.rules.max_query_len_in_descriptor:
        kwargs["max_query_len"] = d.max_query_len
    return desc_cls(**kwargs)


def _init_candidates(ctx: HookContext, hook: Hook, original: Any) -> Any:
    plan, plan_path, vllm_descs = ctx.plan, ctx.plan_path, ctx.vllm_descs

    @functools.wraps(original)
    def _init_candidates(self: Any) -> None:
        original(self)  # vLLM's own tables, kept for the report
        check_attributes(hook, self)  # every attribute written below exists on vLLM's side
        vllm_planned = [d for mode in self._capture_descs.values() for d in mode]
        # (a release whose breakable graphs pad requests sets use_breakable_cg before this call; 0.25 after)
        breakable = ctx.release.breakable_pads_requests and breakable_problem(
            plan, plan_path, ctx.release, self.use_breakable_cg
        )
        problem = breakable or engine_problem(plan, plan_path, self)
        parallel = self.vllm_config.parallel_config
        dp_size = parallel.data_parallel_size
        # Every rank exchanges its verdict before any rank raises: a rank
        # refusing alone would leave the others blocked in a collective.
        agree_across_ranks(plan_identity(plan, audit_on() and dp_size > 1), problem, parallel)
        if problem:
            raise PlanMismatch(problem)  # before anything is captured
        self._capture_descs = {}
        for desc in vllm_descs:  # plan order: PIECEWISE then FULL, largest first
            self._capture_descs.setdefault(desc.cg_mode, []).append(desc)
        self._candidates = {}
        for row in plan.dispatch:
            cands = [vllm_descs[i] for i in row.candidates]
            for n in range(row.lo, row.hi + 1):
                self._candidates[(n, row.lora_case)] = cands
        self._lora_dispatch_map = dict(plan.lora_dispatch_map)
        self._max_lora_case = max(plan.lora_dispatch_map.values(), default=0)
        ctx.report.dp_rank = launch_rank(self.vllm_config.parallel_config)
        ctx.report.planned(vllm_planned_count=len(vllm_planned))
        ctx.report.identify(self.vllm_config)
        where = f", DP rank {ctx.report.dp_rank} of {dp_size} (all ranks run this plan)" if dp_size > 1 else ""
        if not ctx.in_force:  # once: vLLM's memory profiling may build a manager of its own first
            log.info(
                "plan %s in force: capturing %d graphs (vLLM alone: %d; fixes: %s)%s",
                plan_path,
                len(vllm_descs),
                len(vllm_planned),
                ", ".join(plan.fixes) or "none",
                where,
            )
        ctx.in_force = True
        self._capplan_plan = plan_path  # this manager's capture list is the plan's (checked by capture)

    return _init_candidates


def _dispatch(ctx: HookContext, hook: Hook, original: Any) -> Any:
    from vllm.config.compilation import CUDAGraphMode

    desc_cls, vllm_descs, report, step = ctx.desc_cls, ctx.vllm_descs, ctx.report, ctx.step
    lookup, lora_case = ctx.dispatcher.lookup, ctx.dispatcher.lora_case
    none_mode = CUDAGraphMode.NONE
    ubatches = ctx.release.dispatch_ubatches
    bind = binder(original)

    @functools.wraps(original)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        call = bind(args, kwargs)
        num_reqs, num_tokens, num_active_loras = call["num_reqs"], call["num_tokens"], call["num_active_loras"]
        num_ubatches = call["num_ubatches"] if ubatches else 1
        if not call["self"]._graphs_captured or num_ubatches != 1:
            fields: dict[str, Any] = dict(
                cg_mode=none_mode,
                num_tokens=num_tokens,
                num_reqs=num_reqs,
                num_active_loras=lora_case(num_active_loras),
            )
            if num_ubatches != 1:
                fields["num_ubatches"] = num_ubatches
            desc = desc_cls(**fields)
        else:
            result = lookup(num_reqs, num_tokens, call["uniform_token_count"], num_active_loras)
            graph_id = result.graph_id
            if graph_id >= 0 and ctx.deferred is not None:
                # not captured yet: its chain's first captured graph; a miss where a step of real
                # requests dispatches (inside vLLM's dispatch-and-DP-sync, not a warm-up step)
                graph_id = ctx.deferred.resolve(graph_id, step.inside and not step.warmup)
            if graph_id >= 0:
                desc = vllm_descs[graph_id]
            else:
                desc = desc_cls(
                    cg_mode=none_mode,
                    num_tokens=num_tokens,
                    num_reqs=num_reqs,
                    num_active_loras=result.num_active_loras,
                )
        # vLLM dispatches every step through dispatch_cg_and_sync_dp, whose wrapper counts what
        # runs; once steps run, a dispatch outside it is no step (from 0.30.0, fast prefill's
        # padding of the logits batch). Before any step, only a direct caller (a check) is counted.
        if not step.inside and step.dp_step < 0:
            report.count(desc)
        return desc

    return dispatch


def _not_in_force(ctx: HookContext) -> PlanNotInForce:
    return PlanNotInForce(
        f"capplan: vLLM is about to capture CUDA graphs without the plan {ctx.plan_path} installed "
        "(its graph manager was built another way); refusing, nothing was captured"
    )


def _capture(ctx: HookContext, hook: Hook, original: Any) -> Any:
    bind = binder(original)
    profiles = ctx.release.profiling_capture

    @functools.wraps(original)
    def capture(*args: Any, **kwargs: Any) -> Any:
        call = bind(args, kwargs)
        manager = call["self"]
        check_attributes(hook, manager)
        if getattr(manager, "_capplan_plan", None) is None:  # this manager's list is not the plan's: fail closed
            raise _not_in_force(ctx)
        if ctx.deferred is not None:  # the first capture reads the attention kernels' switch (once)
            ctx.deferred.warm_attention(call)
        if profiles and getattr(manager, PROFILING_MARK) is not None:
            # vLLM's memory profiling: a sample of the plan's graphs, on a manager and pool it
            # then discards. Counted apart; the real capture follows on a new manager.
            ctx.report.profiling_started()
            try:
                if ctx.deferred is not None:  # the ready graphs, and an estimate for the others
                    return ctx.deferred.profile_ready(manager, original, call)
                return call.run(original)
            finally:
                ctx.report.profiling_finished(manager)
        deferred = ctx.deferred
        ctx.report.capture_started()
        try:
            if deferred is not None and not deferred.active:
                deferred.ready_only(manager)  # start-up: the ready graphs only, each measured
                return deferred.capture_ready(manager, original, call)
            result = _capture_each(ctx, manager, original, call) if ctx.capture_each else call.run(original)
        except Exception as exc:
            if ctx.graph_budget is not None and type(exc).__name__ == "OutOfMemoryError":
                raise GraphMemoryOutgrown(out_of_memory(ctx.graph_budget)) from None
            raise
        finally:
            ctx.report.capture_finished(manager)
        if ctx.graph_budget is not None and ctx.report.graph_memory_bytes is not None:
            line = outgrown(ctx.graph_budget, ctx.report.graph_memory_bytes)
            if line is not None:
                raise GraphMemoryOutgrown(line)
        return result

    return capture


def _capture_each(ctx: HookContext, manager: Any, original: Any, call: Any) -> Any:
    """vLLM's one capture of the plan's graphs, as it runs it (one stream, one pool), each graph's
    seconds and pool growth read between one graph and the next (CAPPLAN_CAPTURE_EACH, `capplan
    calibrate`). vLLM walks its capture list in order; the list is handed over as `Boundaries`,
    which reads the clock and the memory as vLLM takes each graph and once more when it is done.
    (Capturing each graph in a call of its own is no measure: vLLM captures each call on a new
    stream, so no graph reuses another's freed pool memory: at 8B on an H100, 4.3x the memory.)"""
    from capplan.runtime.deferred.device_memory import growth, in_use, open_for_current_device

    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:  # capplan's CPU checks of the hooks
        cuda = False
    memory = open_for_current_device() if cuda else None
    ids = {id(d): gid for gid, d in enumerate(ctx.vllm_descs)}

    def mark() -> tuple[float, tuple[int | None, int]]:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter(), (in_use(memory) if cuda else (None, 0))

    def taken(desc: Any, before: tuple[float, tuple[int | None, int]]) -> None:
        after = mark()
        gid = ids.get(id(desc))
        if gid is None:  # not one of the plan's descriptors (a speculator's): not measured here
            return
        used, _ = growth(before[1], after[1])
        ctx.report.captured_one(gid, after[0] - before[0], used)

    lists = manager._capture_descs
    manager._capture_descs = {mode: Boundaries(descs, taken, mark) for mode, descs in lists.items()}
    try:
        return call.run(original)
    finally:
        manager._capture_descs = lists


class Boundaries(list):  # type: ignore[type-arg]
    """A capture list that reports each item taken once the loop comes back for the next one (or
    ends): `taken(item, mark_before)`."""

    def __init__(self, items: list[Any], taken: Any, mark: Any) -> None:
        super().__init__(items)
        self._taken, self._mark = taken, mark

    def __iter__(self) -> Any:
        for item in list.__iter__(self):
            before = self._mark()
            yield item
            self._taken(item, before)


def _capture_attributes(release: Release) -> tuple[str, ...]:
    """Where vLLM captures once for memory profiling first, the mark that tells that capture apart."""
    return (PROFILING_MARK,) if release.profiling_capture else ()


HOOKS = (
    Hook(
        "manager.init_candidates",
        f"{MANAGER}._init_candidates",
        "install the plan's capture list, candidate table and LoRA map; refuse a plan that does not match "
        "the engine (classes 3, 6, 8)",
        _init_candidates,
        attributes=MANAGER_STATE,
    ),
    Hook(
        "manager.dispatch",
        f"{MANAGER}.dispatch",
        "dispatch every step through the plan's table (classes 6, 8)",
        _dispatch,
        attributes=("_graphs_captured",),
        reads=("self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras"),
    ),
    Hook(
        "manager.capture",
        f"{MANAGER}.capture",
        "time capture and count graphs for the report; refuse a capture list the plan did not install; "
        "where vLLM profiles memory by a capture first, tell that capture (graphs it discards) from the real one",
        _capture,
        attributes=_capture_attributes,
        reads=("self", "attn_groups"),
    ),
)
