"""The KV cache sized by a calibration's measured graph memory, not by a throwaway capture.

From 0.29.0 vLLM's memory profiling captures a sample of the graphs once, discards it and
extrapolates (`GPUModelRunner.profile_cudagraph_memory`), then sizes the KV cache to leave that
estimate free; the real capture follows. Where CAPPLAN_CALIBRATION names a calibration that
measured this plan on this deployment with its capture run first (capplan.calibration.budget),
the estimate is answered from it: capture is paid once. (vLLM's estimate is not overstated: at
8B on an H100 it was 1.21 GiB for a plan that took 1.1914 GiB captured first; the reserve, the
reading plus the default margin, 1.1974 GiB, left the KV cache 64 tokens larger than vLLM's.)
vLLM's own profiling of weights and activations (`profile_run`) still runs. Anywhere else
vLLM's profiling stays in charge, and the log and the report say why. If the real capture
takes more than was left, the engine stops before serving with one line naming the figures
(`manager.capture`), never an out-of-memory error mid-serving.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from operator import attrgetter
from pathlib import Path
from typing import Any

from capplan.calibration.budget import GIB, GraphBudget, graph_budget, out_of_memory
from capplan.envvars import CALIBRATION, GRAPH_MARGIN
from capplan.errors import EngineRefusal, printable
from capplan.releases import RUNNER
from capplan.runtime.context import HookContext
from capplan.runtime.hooking import Hook, Need, binder
from capplan.runtime.log import log

__all__ = ["HOOKS", "GraphMemoryOutgrown", "budget_for", "out_of_memory"]


class GraphMemoryOutgrown(EngineRefusal):
    """The real capture took more than the calibration left for it: stopped before serving."""


def budget_for(ctx: HookContext, vllm_config: Any, env: Mapping[str, str]) -> GraphBudget | str:
    """The reserve the calibration named in `env` gives this engine, or why it gives none."""
    import vllm.envs as envs

    from capplan.calibration.starts import merged_folder
    from capplan.errors import CapplanError
    from capplan.loading import load_calibration
    from capplan.runtime.report import deployment_identity

    if not envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS:
        return "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0: vLLM leaves graph memory out of the KV cache's size"
    path = Path(env[CALIBRATION])
    try:
        given = env.get(GRAPH_MARGIN)
        margin = None if given is None else float(given)
        calibration = merged_folder(path) if path.is_dir() else load_calibration(path)
    except (CapplanError, ValueError, OSError) as exc:  # the launcher checked it; a change since is said
        return f"it could not be read ({exc})"
    if calibration is None:
        return "the folder holds no calibration with starts"
    return graph_budget(ctx.plan, calibration, deployment_identity(vllm_config), margin)


def _calibrated(ctx: HookContext, hook: Hook, original: Any) -> Any:
    bind = binder(original)

    @functools.wraps(original)
    def profile_cudagraph_memory(*args: Any, **kwargs: Any) -> Any:
        runner = bind(args, kwargs)["self"]
        where = os.environ.get(CALIBRATION, "")
        if not where:  # no calibration: vLLM's estimate, recorded beside the capture's measure
            return _estimate(ctx, original(*args, **kwargs))
        answer = budget_for(ctx, runner.vllm_config, os.environ)
        if isinstance(answer, str):
            ctx.report.graph_budget = {"source": "vllm", "calibration": where, "why": answer}
            log.info(
                "vLLM's profiling capture estimates CUDA-graph memory: calibration %s: %s", printable(where), answer
            )
            return _estimate(ctx, original(*args, **kwargs))
        ctx.graph_budget = answer
        ctx.report.graph_budget = {**answer.to_json(), "calibration": where}
        log.info(
            "CUDA-graph memory from calibration %s: %.4f GiB measured in %d start(s) of this plan + %.4f GiB margin "
            "= %.4f GiB left beside the KV cache; vLLM's profiling capture skipped",
            answer.source,
            answer.measured_bytes / GIB,
            answer.starts,
            answer.margin_bytes / GIB,
            answer.reserve_bytes / GIB,
        )
        return answer.reserve_bytes

    return profile_cudagraph_memory


def _estimate(ctx: HookContext, estimate: Any) -> Any:
    """vLLM's graph-memory estimate, recorded in the report as it is returned."""
    if type(estimate) is int:
        ctx.report.vllm_estimate_bytes = estimate
    return estimate


def _whole_capture(need: Need) -> bool:
    """Every graph captured at start (no tiers: deferred capture adds to vLLM's estimate itself)."""
    return need.plan.tiers is None


HOOKS = (
    Hook(
        "memory.calibrated",
        f"{RUNNER}:GPUModelRunner.profile_cudagraph_memory",
        "the KV cache sized by the plan's measured graph memory (a calibration of this deployment), not by a "
        "throwaway capture; the real capture checked against it; without a calibration, vLLM's estimate recorded",
        _calibrated,
        reads=("self",),
        releases=attrgetter("profiling_capture"),
        when=_whole_capture,
    ),
)
