"""Applying a plan to a live vLLM engine (MRV2).

Only this package imports torch or vLLM, and only lazily, when a plan is
installed; `capplan.runtime.plugin` is the vLLM plugin entry point, which puts the plan in
force through `capplan.runtime.registry.install`. What is hooked, on which release and why is
one table, `registry.REGISTRY`; each hook lives in `capplan.runtime.hooks` (the graph manager,
LoRA, dummy batches, configuration, data parallel, the trace recorder, encoder graphs) or
`capplan.runtime.deferred` (capture while serving).
"""
