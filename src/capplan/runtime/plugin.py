"""vLLM general plugin: puts the plan named by CAPPLAN_PLAN in force.

Registered as the `vllm.general_plugins` entry point `capplan`, so vLLM
loads it in every engine and worker process. Without CAPPLAN_PLAN it does
nothing but join the data-parallel plan check (DP > 1 only), so that a rank
launched without a plan stops every rank at start instead of leaving the
ranks that have one waiting. A plan that does not load or a vLLM capplan
cannot hook stops the process with one clear line, before any graph is
captured.
"""

from __future__ import annotations

import os
import sys

ENV = "CAPPLAN_PLAN"


def register() -> None:
    path = os.environ.get(ENV)
    if not path:
        _guard_only()
        return
    from capplan.errors import CapplanError
    from capplan.loading import load_plan
    from capplan.runtime.mrv2 import install

    try:
        plan = load_plan(path)
    except CapplanError as exc:
        raise SystemExit(f"capplan: {ENV}={path}: {exc.one_line()}") from None
    install(plan, path)
    print(f"capplan: plan {path} in force ({len(plan.graphs)} graphs, fixes: "
          f"{', '.join(plan.fixes) or 'none'})", file=sys.stderr)


def _guard_only() -> None:
    try:
        from capplan.runtime.mrv2 import install_dp_guard

        install_dp_guard()
    except Exception:  # noqa: BLE001 - without a plan, capplan must never break a vLLM it cannot hook
        return
