"""Every hook capplan puts into vLLM, in one table, and the one function that installs them.

`REGISTRY` is the contract between capplan and vLLM: each entry names the vLLM function
it wraps or relies on, the releases and plans it applies to, the private attributes it
touches, and why (the failure class it prevents, docs/design.md); its parameters on each
release are in the release's row (capplan.releases). If vLLM renamed any of them, a hook
would write a new attribute while vLLM kept its own, and the plan would quietly not be in
force; so `install` checks the entries that apply before it installs them, and refuses
the engine with every problem at once. Entries install in table order, all or none, as their
vLLM module is imported: those of modules the process has imported when the plugin loads, at
once; the others (the model runner's, the worker's, in the engine process) at that module's
import, before it returns (`capplan.runtime.imports`), so that vLLM's API server imports
nothing of the engine's for capplan.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping

from capplan.envvars import CAPTURE_EACH
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
from capplan.runtime.imports import module_of, when_imported
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
    """Hook vLLM for this plan (once per process). The entries whose vLLM modules this process
    has imported are checked, every problem at once, and installed, all or none; IncompatibleVllm
    before anything is installed. The entries of modules not imported yet (the engine's, in vLLM's
    API server) wait for their module's import, where they are checked and installed the same way,
    before the import returns: in the engine process, before any weight loads (`imports`)."""
    ctx = current()
    if ctx is not None:
        return ctx
    import vllm

    release = detect_release(vllm.__version__)
    problem = release_problem(plan.spec.target.vllm, vllm.__version__)
    if problem:
        raise IncompatibleVllm(f"capplan: {problem[0]}; {problem[1]}")
    environ = os.environ if env is None else env
    hooks = selected(Need(release, plan, environ), table)
    report = Report(plan, plan_path)
    ctx = HookContext(
        plan=plan,
        plan_path=plan_path,
        release=release,
        dispatcher=Dispatcher(plan),
        report=report,
        desc_cls=None,
        vllm_descs=[],
        layouts=layouts_of(plan),
        capture_each=environ.get(CAPTURE_EACH) == "1" and plan.tiers is None,
    )
    if plan.tiers is not None:
        ctx.deferred = report.deferred = DeferredCapture(ctx)
    by_module: dict[str, list[Hook]] = {}
    for hook in hooks:  # table order within each module
        by_module.setdefault(module_of(hook.at or hook.target), []).append(hook)
    now = [h for m, group in by_module.items() if m in sys.modules for h in group]
    checked(now, release, vllm.__version__)  # before anything, the descriptors included
    when_imported(DESCRIPTORS, lambda: _with_descriptors(ctx))  # before any hook reads them
    install_all(now, ctx)
    adopt(ctx)
    for module, group in by_module.items():
        if module not in sys.modules:
            when_imported(module, functools.partial(_install_checked, group, release, vllm.__version__, ctx))
    return ctx


def _install_checked(hooks: list[Hook], release: Release, version: str, ctx: HookContext) -> None:
    install_all(checked(hooks, release, version), ctx)


def checked(hooks: list[Hook], release: Release, version: str) -> list[Hook]:
    """`hooks`, once every one holds against the live vLLM; else IncompatibleVllm naming every problem."""
    found = problems(hooks, release)
    if found:
        raise IncompatibleVllm(
            f"capplan: this vLLM {version} is not shaped as capplan's hooks expect, so the plan could not be "
            f"in force: {'; '.join(found)}"
        )
    return hooks


DESCRIPTORS = "vllm.v1.worker.gpu.cudagraph_utils"  # where vLLM's BatchExecutionDescriptor is


def _with_descriptors(ctx: HookContext) -> None:
    """The plan's graphs as vLLM's descriptors, once vLLM's descriptor class is imported (before
    any hook of that module or of one importing it is installed)."""
    import vllm.v1.worker.gpu.cudagraph_utils as cg

    ctx.desc_cls = cg.BatchExecutionDescriptor
    ctx.vllm_descs = [manager.to_vllm(ctx.release, ctx.desc_cls, g.descriptor) for g in ctx.plan.graphs]
    ctx.report.graph_ids = {desc: i for i, desc in enumerate(ctx.vllm_descs)}


def installed() -> HookContext | None:
    return current()


def install_guard() -> None:
    """For a process with no plan: only the plan check across ranks (dp.GUARD), never anything
    else; at the import of its vLLM module, not before (a vLLM that capplan is installed beside
    but not applied to imports nothing more for it). At that import, a vLLM the guard does not fit
    is left unhooked: without a plan, capplan never breaks vLLM."""
    import vllm

    release = detect_release(vllm.__version__)

    def guard() -> None:
        owner = dp.GUARD.target
        if getattr(resolve(owner), MARK, None) == dp.GUARD.name:
            return
        if signature_problem(dp.GUARD, release) is None:
            replace(owner, dp.guard, dp.GUARD.name)

    module = module_of(dp.GUARD.target)
    if module in sys.modules:  # checked here, where the caller hears of a problem
        problem = signature_problem(dp.GUARD, release)
        if problem is not None:
            raise IncompatibleVllm(f"capplan: {problem}")
    when_imported(module, guard)
