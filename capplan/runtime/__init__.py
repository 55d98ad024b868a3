"""Applying a plan to a live vLLM engine (not implemented yet).

Only this package may import torch or vLLM, and only lazily.
"""
