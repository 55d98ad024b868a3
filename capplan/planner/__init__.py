"""Pure planning functions: spec -> plan. Imports neither torch nor vLLM."""

from capplan.planner.compiler import compile_plan
from capplan.planner.dispatch import Batch, Dispatcher

__all__ = ["Batch", "Dispatcher", "compile_plan"]
