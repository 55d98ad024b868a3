"""The deferred-capture fault of the positive control (see sitecustomize.py beside this file).

Pure: it reads the plan's graphs and the ids captured so far, so that a CPU test can check on a
real plan that the fault bites (it swaps fallbacks) and stays shape-compatible (vLLM replays the
swapped graph without an error, only with one adapter slot too few).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any


def one_slot_short(graphs: Sequence[Any], captured: Collection[int], graph_id: int, got: int) -> int:
    """The graph to replay instead of fallback `got` for a batch dispatched to `graph_id`: a
    captured graph of the same mode and uniform-decode count as `got`, the next smaller LoRA case,
    at least `graph_id`'s tokens and requests (the fewest tokens of those); `got` itself where
    nothing was swapped (`got` is the graph itself, eager, of the smallest case, or has no such
    neighbour)."""
    if got < 0 or got == graph_id:
        return got
    want = graphs[graph_id].descriptor
    fell = graphs[got].descriptor
    smaller = sorted(
        {g.descriptor.num_active_loras for g in graphs if g.descriptor.num_active_loras < fell.num_active_loras}
    )
    if not smaller:
        return got
    case = smaller[-1]
    fits = [
        gid
        for gid in captured
        if (g := graphs[gid].descriptor).cg_mode == fell.cg_mode
        and g.num_active_loras == case
        and g.num_tokens >= want.num_tokens
        and (g.num_reqs is None or (want.num_reqs is not None and g.num_reqs >= want.num_reqs))
        and g.uniform_token_count == fell.uniform_token_count
    ]
    return min(fits, key=lambda gid: graphs[gid].descriptor.num_tokens) if fits else got
