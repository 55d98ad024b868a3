"""Check a plan against the engine it is applied to: first against vLLM's final config in
the process that starts the engine (before anything is spawned or loaded), then against
the CUDA-graph manager in each process that captures (the last word: it sees the mode
and LoRA cases the runner really resolved). The settings compared, and where vLLM holds
each, are capplan.settings' table."""

from __future__ import annotations

from typing import Any

from capplan.errors import EngineRefusal
from capplan.releases import Release
from capplan.schemas.plan import Plan
from capplan.settings import BY_NAME, engine_values, read_config, read_manager


class PlanMismatch(EngineRefusal):
    """The engine's settings are not the ones the plan was compiled for."""


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _differences(plan: Plan, theirs: dict[str, object], in_manager: bool) -> tuple[list[str], bool]:
    """(each setting where the engine differs, whether the spec can give every engine value)."""
    out, in_spec = [], True
    for name, want in engine_values(plan).items():
        if name not in theirs:
            continue  # a setting only the manager holds
        setting, have = BY_NAME[name], theirs[name]
        if in_manager and setting.unseen_if_none and have is None:
            continue  # not visible from this manager
        if setting.same(plan, have):
            continue
        if setting.only is not None:
            out.append(f"{setting.label}: engine {_short(have)}, but {setting.only}")
            in_spec = False
        else:
            out.append(f"{setting.label}: plan {_short(want)}, engine {_short(have)}")
    return out, in_spec


def _refusal(plan_path: str, diffs: list[str], in_spec: bool, what: str) -> str:
    fix = " Set the spec to the engine's settings and regenerate: capplan compile SPEC" if in_spec else ""
    return f"capplan: {plan_path} does not match this engine ({'; '.join(diffs)}). {what}.{fix}"


def engine_problem(plan: Plan, plan_path: str, manager: Any) -> str | None:
    """The one-line refusal for this engine (its CUDA-graph manager), or None when the plan fits it."""
    diffs, in_spec = _differences(plan, read_manager(manager), in_manager=True)
    return _refusal(plan_path, diffs, in_spec, "Nothing was captured") if diffs else None


def config_problem(plan: Plan, plan_path: str, cfg: Any) -> str | None:
    """The one-line refusal for an engine about to start with this config, or None."""
    diffs, in_spec = _differences(plan, read_config(cfg), in_manager=False)
    return _refusal(plan_path, diffs, in_spec, "Refused before the engine started") if diffs else None


def breakable_problem(plan: Plan, plan_path: str, release: Release, on: bool | None = None) -> str | None:
    """The refusal when vLLM's breakable CUDA graphs are on where they change the graphs
    MRV2 captures (a release row's `breakable_pads_requests`: its mixed PIECEWISE graphs),
    or None. `on`: whether they are, as the graph manager resolved it (`use_breakable_cg`, in
    each process that captures); None reads vLLM's setting, after the engine config is built
    (vLLM turns it on itself for some architectures)."""
    if not release.breakable_pads_requests or plan.spec.cudagraph.mode.mixed_mode != "PIECEWISE":
        return None
    if on is None:
        import vllm.envs as envs

        on = bool(getattr(envs, "VLLM_USE_BREAKABLE_CUDAGRAPH", False))
    if not on:
        return None
    return (
        f"capplan: VLLM_USE_BREAKABLE_CUDAGRAPH is on (set, or turned on by vLLM {release.version} for this "
        f"model), so vLLM {release.version} pads requests in its mixed PIECEWISE graphs, which the plan "
        f"{plan_path} does not plan; refusing to start (set VLLM_USE_BREAKABLE_CUDAGRAPH=0, or remove CAPPLAN_PLAN)"
    )
