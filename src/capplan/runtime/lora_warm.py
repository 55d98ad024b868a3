"""The dummy LoRA mapping a graph is warmed with: the plan's dummy batch for the graph, and its
adapter ids as vLLM's prompt and token mappings. Shared by vLLM's own capture hook
(`hooks.lora`) and deferred capture's warm-up (`deferred.serving`)."""

from __future__ import annotations

from typing import Any

from capplan.runtime.context import HookContext
from capplan.schemas.plan import DummyLayout


def dummy_mapping(layout: DummyLayout, num_reqs: int) -> tuple[Any, Any]:
    """A graph's dummy LoRA mapping as vLLM's prompt and token mappings (numpy arrays): adapter
    ids cycled over the requests, 0 for "no adapter" (-1 once vLLM converts it for the kernels)."""
    import numpy as np

    per_req = np.array([t for count, t in layout.tokens for _ in range(count)], dtype=np.int32)
    ids = layout.lora_ids or [-1]
    prompt = np.array([max(ids[i % len(ids)], 0) for i in range(num_reqs)], dtype=np.int32)
    return prompt, np.repeat(prompt, per_req)


def layout_for(ctx: HookContext, num_active_loras: int, num_reqs: int, num_tokens: int) -> DummyLayout:
    layout = ctx.layouts.get((num_tokens, num_reqs, num_active_loras))
    if layout is None:
        raise RuntimeError(
            f"capplan: no dummy layout in {ctx.plan_path} for a {num_tokens}-token, "
            f"{num_reqs}-request graph of LoRA case {num_active_loras}"
        )
    return layout
