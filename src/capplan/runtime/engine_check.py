"""Check a plan against the engine it is applied to: first against vLLM's final config in
the process that starts the engine (before anything is spawned or loaded), then against
the CUDA-graph manager in each process that captures (the last word: it sees the mode
and LoRA cases the runner really resolved). The settings compared, and where vLLM holds
each, are capplan.settings' table."""

from __future__ import annotations

from typing import Any

from capplan.errors import EngineRefusal
from capplan.schemas.plan import Plan
from capplan.settings import BY_NAME, engine_values, read_config, read_manager


class PlanMismatch(EngineRefusal):
    """The engine's settings are not the ones the plan was compiled for."""


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _differences(plan: Plan, theirs: dict[str, object], in_manager: bool) -> list[str]:
    out = []
    for name, want in engine_values(plan).items():
        if name not in theirs:
            continue  # a setting only the manager holds
        setting, have = BY_NAME[name], theirs[name]
        if in_manager and setting.unseen_if_none and have is None:
            continue  # not visible from this manager
        if not setting.same(plan, have):
            out.append(f"{setting.label}: plan {_short(want)}, engine {_short(have)}")
    return out


def engine_problem(plan: Plan, plan_path: str, manager: Any) -> str | None:
    """The one-line refusal for this engine (its CUDA-graph manager), or None when the plan fits it."""
    diffs = _differences(plan, read_manager(manager), in_manager=True)
    if not diffs:
        return None
    return (
        f"capplan: {plan_path} does not match this engine ({'; '.join(diffs)}). Nothing was "
        "captured. Set the spec to the engine's settings and regenerate: capplan compile SPEC"
    )


def config_problem(plan: Plan, plan_path: str, cfg: Any) -> str | None:
    """The one-line refusal for an engine about to start with this config, or None."""
    diffs = _differences(plan, read_config(cfg), in_manager=False)
    if not diffs:
        return None
    return (
        f"capplan: {plan_path} does not match this engine ({'; '.join(diffs)}). Refused before the engine "
        "started. Set the spec to the engine's settings and regenerate: capplan compile SPEC"
    )
