"""Every hook capplan puts into vLLM, in one table, and the one function that installs them.

`REGISTRY` is the contract between capplan and vLLM: each entry names the vLLM function
it wraps or relies on, the releases and plans it applies to, the private attributes it
touches, and why (the failure class it prevents, docs/design.md); its parameters on each
release are in the release's row (capplan.releases). If vLLM renamed any of them, a hook
would write a new attribute while vLLM kept its own, and the plan would quietly not be in
force; so `install` checks every entry that applies before it installs any, and refuses
the engine with every problem at once. Entries install in table order, all or none.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from capplan.planner.dispatch import Dispatcher
from capplan.releases import Release, release_problem
from capplan.runtime.context import HookContext, adopt, current, layouts_of
from capplan.runtime.deferred import hooks as deferred_hooks
from capplan.runtime.deferred.capture import DeferredCapture
from capplan.runtime.hooking import (
    MARK,
    Hook,
    IncompatibleVllm,
    Need,
    at_problem,
    install_all,
    replace,
    resolve,
    signature_problem,
)
from capplan.runtime.hooks import config, dp, dummy, encoder, lora, manager, memory, record
from capplan.runtime.report import Report
from capplan.runtime.versions import detect_release
from capplan.schemas.plan import Plan

REGISTRY: tuple[Hook, ...] = (
    *manager.HOOKS,
    *lora.HOOKS,
    *dummy.HOOKS,
    *config.HOOKS,
    *dp.HOOKS,
    *record.HOOKS,
    *encoder.HOOKS,
    *memory.HOOKS,
    *deferred_hooks.HOOKS,  # last: it wraps execute_model after the recorder
)


def entries(release: Release, table: tuple[Hook, ...] = REGISTRY) -> list[Hook]:
    """The entries that can apply on this release (for some plan), each as it applies there."""
    return [h.on(release) for h in table if h.releases(release)]


def selected(need: Need, table: tuple[Hook, ...] = REGISTRY) -> list[Hook]:
    """The entries that apply in this process: this release, this plan, this environment."""
    return [h for h in entries(need.release, table) if h.when(need)]


def problems(hooks: list[Hook], release: Release) -> list[str]:
    """Every entry checked against the live vLLM; the problems found (empty: all hold)."""
    found = []
    for hook in hooks:
        problem = signature_problem(hook, release) or at_problem(hook)
        if problem is not None:
            found.append(f"{hook.name}: {problem}")
    return found


def check_all(release: Release) -> list[str]:
    """Every entry that can apply on this release, checked against the live vLLM."""
    return problems(entries(release), release)


def install(
    plan: Plan, plan_path: str, env: Mapping[str, str] | None = None, table: tuple[Hook, ...] = REGISTRY
) -> HookContext:
    """Hook vLLM for this plan (once per process). Raises IncompatibleVllm, naming every
    problem, before anything is installed."""
    ctx = current()
    if ctx is not None:
        return ctx
    import vllm
    import vllm.v1.worker.gpu.cudagraph_utils as cg

    release = detect_release(vllm.__version__)
    problem = release_problem(plan.spec.target.vllm, vllm.__version__)
    if problem:
        raise IncompatibleVllm(f"capplan: {problem[0]}; {problem[1]}")
    hooks = selected(Need(release, plan, os.environ if env is None else env), table)
    found = problems(hooks, release)
    if found:
        raise IncompatibleVllm(
            f"capplan: this vLLM {vllm.__version__} is not shaped as capplan's hooks expect, so the plan could not be "
            f"in force: {'; '.join(found)}"
        )
    report = Report(plan, plan_path)
    ctx = HookContext(
        plan=plan,
        plan_path=plan_path,
        release=release,
        dispatcher=Dispatcher(plan),
        report=report,
        desc_cls=cg.BatchExecutionDescriptor,
        vllm_descs=[],
        layouts=layouts_of(plan),
    )
    ctx.vllm_descs = [manager.to_vllm(release, ctx.desc_cls, g.descriptor) for g in plan.graphs]
    report.graph_ids = {desc: i for i, desc in enumerate(ctx.vllm_descs)}
    if plan.tiers is not None:
        ctx.deferred = report.deferred = DeferredCapture(ctx)
    install_all(hooks, ctx)
    adopt(ctx)
    return ctx


def installed() -> HookContext | None:
    return current()


def install_guard() -> None:
    """For a process with no plan: only the plan check across ranks (dp.GUARD), never anything else."""
    import vllm

    release = detect_release(vllm.__version__)
    owner = dp.GUARD.target
    if getattr(resolve(owner), MARK, None) == dp.GUARD.name:
        return
    problem = signature_problem(dp.GUARD, release)
    if problem is not None:
        raise IncompatibleVllm(f"capplan: {problem}")
    replace(owner, dp.guard, dp.GUARD.name)
