"""Applying a plan to a live vLLM engine (MRV2).

Only this package imports torch or vLLM, and only lazily, when a plan is
installed; `capplan.runtime.plugin` is the vLLM plugin entry point.
"""
