"""Apply a capture plan to vLLM's Model Runner V2.

Installed by the `vllm.general_plugins` entry point (capplan.runtime.plugin) in every
engine and worker process. What is hooked, on which release and why is one table,
`capplan.runtime.registry.REGISTRY`; each hook lives in `capplan.runtime.hooks` (the graph
manager, LoRA, dummy batches, configuration, data parallel, the trace recorder, encoder
graphs) or `capplan.runtime.deferred` (capture while serving).
"""

from __future__ import annotations

from capplan.runtime.context import Engine
from capplan.runtime.hooking import IncompatibleVllm, PlanNotInForce
from capplan.runtime.registry import install, install_guard, installed

__all__ = ["Engine", "IncompatibleVllm", "PlanNotInForce", "install", "install_guard", "installed"]
