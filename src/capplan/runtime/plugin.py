"""vLLM general plugin: puts the plan named by CAPPLAN_PLAN in force.

Registered as the `vllm.general_plugins` entry point `capplan`, so vLLM
loads it in every engine and worker process. Without CAPPLAN_PLAN it does
nothing but join the plan check of an engine of several ranks, so that a
rank (or node) launched without a plan stops every rank at start instead of
leaving the ranks that have one waiting, or capturing another graph set. A
plan that does not load or a vLLM capplan cannot hook stops the process with
one clear line, before any graph is captured: in the process that loads the plugin for the
hooks of vLLM modules it has imported, at the import of the others (the model runner's, in the
engine process, before any weight loads), so that vLLM's API server, which loads the plugin
while it builds its parser, imports nothing of the engine's for capplan.
"""

from __future__ import annotations

import os
from pathlib import Path

from capplan.envvars import PLAN as ENV


def register() -> None:
    path = os.environ.get(ENV)
    if not path:
        _guard_only()
        return
    from capplan.errors import CapplanError
    from capplan.planfile import load_plan

    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0":
        raise SystemExit(
            f"capplan: {ENV}={path} is set, but VLLM_USE_V2_MODEL_RUNNER=0 puts the engine on vLLM's "
            "V1 model runner, where the plan cannot be in force (unset one of the two)"
        )
    try:
        plan = load_plan(Path(path))
    except CapplanError as exc:
        raise SystemExit(f"capplan: {ENV}={path}: {exc.one_line()}") from None
    from capplan.errors import EngineRefusal
    from capplan.runtime.registry import install

    try:
        install(plan, path)
    except EngineRefusal as exc:  # capplan's own refusal: its line names capplan
        raise SystemExit(str(exc)) from None
    except RuntimeError as exc:  # anything else vLLM raised while capplan hooked it
        raise SystemExit(f"capplan: {exc}") from None


def _guard_only() -> None:
    try:
        from capplan.runtime.registry import install_guard

        install_guard()
    except Exception:  # noqa: BLE001 - without a plan, capplan must never break a vLLM it cannot hook
        return
