"""Pure planning functions: spec -> plan. Imports neither torch nor vLLM.

Exports resolve lazily, so `capplan.planner.dispatch` can be imported (the
fast `capplan dispatch` path) without building the pydantic schemas.
"""

from __future__ import annotations

__all__ = ["Batch", "Dispatcher", "compile_plan"]


def __getattr__(name: str):
    if name == "compile_plan":
        from capplan.planner.compiler import compile_plan

        return compile_plan
    if name in ("Batch", "Dispatcher"):
        from capplan.planner import dispatch

        return getattr(dispatch, name)
    raise AttributeError(f"module 'capplan.planner' has no attribute {name!r}")
