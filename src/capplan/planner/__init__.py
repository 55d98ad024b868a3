"""The core: spec -> plan, and a plan's dispatch. Pure functions: no file I/O, no torch, no vLLM.

Exports resolve lazily, so the runtime can import `capplan.planner.dispatch`
without building every planning module.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Batch", "Dispatcher", "compile_plan"]


def __getattr__(name: str) -> Any:
    if name == "compile_plan":
        from capplan.planner.compiler import compile_plan

        return compile_plan
    if name in ("Batch", "Dispatcher"):
        from capplan.planner import dispatch

        return getattr(dispatch, name)
    raise AttributeError(f"module 'capplan.planner' has no attribute {name!r}")
