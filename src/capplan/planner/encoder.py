"""The multimodal encoder on MRV2: which encoder CUDA graphs vLLM captures, and how it
packs an encoder batch onto them (vLLM's EncoderCudaGraphManager, MRV2 from 0.28), and
failure class 11 of docs/design.md (encoder graphs that skip tower/connector LoRA).

vLLM captures one graph per token budget (one default path, no capture axes:
the shape capplan models), largest budget first. The budgets, the most items
a graph takes and its frame limit are resolved from the compilation config
and the model's budget range:

- budgets and max items both given: those budgets (sorted), those items; the
  items must not exceed the smallest budget;
- max items only: powers of two from max(min budget, items) to the max budget
  (the max budget always included);
- budgets only: those budgets; items = min(max // min of the model's range,
  smallest budget);
- neither: powers of two over the model's range; items as above.
- frames: 0 without video, else the given limit, else items x the model's
  max_frames_per_video.

Packing (vLLM 0.32+, the release rule `encoder_packing_defers`): items sorted
by output tokens, ascending, are added to the current batch while it has fewer than max items and its tokens stay within
the largest budget; an item that alone needs at least the current batch's
budget, and whose own budget plus the current batch's is below the budget
they would need together, starts a new batch. Each batch replays the smallest
budget >= its tokens, or runs eager when none fits (a single item above the
largest budget). Before 0.32 vLLM packs without the "starts a new batch" rule.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from capplan.schemas.spec import Fix, Spec


@dataclass(frozen=True)
class EncoderGraphs:
    budgets: list[int]  # ascending
    max_items: int
    max_frames: int


def power_budgets(lo: int, hi: int) -> list[int]:
    """vLLM's `_generate_budgets`: lo, 2 lo, 4 lo, ... up to hi, and hi itself."""
    out = []
    b = lo
    while b <= hi:
        out.append(b)
        b *= 2
    if not out or out[-1] < hi:
        out.append(hi)
    return out


def resolve_encoder_graphs(spec: Spec) -> EncoderGraphs | None:
    """The encoder graphs vLLM would capture for this spec, or None when it captures none."""
    mm = spec.multimodal
    if mm is None or not mm.encoder_cudagraphs:
        return None
    items = mm.max_vision_items_per_batch
    if mm.token_budgets is not None and items > 0:
        budgets = sorted(mm.token_budgets)
        assert items <= budgets[0]  # the spec's own validator refuses more items than the smallest budget
    else:
        assert mm.budget_range is not None  # the spec's own validator requires it here
        lo, hi = mm.budget_range
        if items > 0:
            budgets = power_budgets(max(lo, items), hi)
        else:
            budgets = sorted(mm.token_budgets) if mm.token_budgets is not None else power_budgets(lo, hi)
            items = min(hi // lo, budgets[0])
    if not mm.video:
        frames = 0
    elif mm.max_frames_per_batch is not None:
        frames = mm.max_frames_per_batch
    else:
        frames = items * mm.max_frames_per_video
    return EncoderGraphs(budgets, items, frames)


def fitting_budget(budgets: list[int], tokens: int) -> int | None:
    """The smallest budget >= tokens; 0 for no tokens; None when none fits."""
    if tokens == 0:
        return 0
    i = bisect.bisect_left(budgets, tokens)
    return budgets[i] if i < len(budgets) else None


def pack(graphs: EncoderGraphs, item_tokens: list[int], defer: bool = True) -> list[tuple[list[int], int | None]]:
    """vLLM's packing of one encoder batch: (item indices, budget or None for eager) per batch."""
    budgets, top = graphs.budgets, graphs.budgets[-1]
    batches: list[tuple[list[int], int | None]] = []
    current: list[int] = []
    tokens = 0
    for i in sorted(range(len(item_tokens)), key=lambda k: item_tokens[k]):
        item = item_tokens[i]
        fits = len(current) < graphs.max_items and tokens + item <= top
        split = False
        if current and fits and defer and item:
            b_cur, b_alone, b_merged = (fitting_budget(budgets, n) for n in (tokens, item, tokens + item))
            assert b_cur is not None and b_alone is not None and b_merged is not None
            split = b_cur + b_alone < b_merged and b_alone >= b_cur
        if current and (not fits or split):
            batches.append((current, fitting_budget(budgets, tokens)))
            current, tokens = [], 0
        current.append(i)
        tokens += item
    if current:
        batches.append((current, fitting_budget(budgets, tokens)))
    return batches


def encoder_plan_graphs(spec: Spec) -> tuple[EncoderGraphs | None, EncoderGraphs | None]:
    """(what vLLM would capture, what the plan captures): the plan captures none under
    encoder_lora_eager when tower LoRA is on with specialize_active (failure class 11)."""
    vllm = resolve_encoder_graphs(spec)
    if vllm is not None and encoder_lora_unsafe(spec) and spec.has(Fix.encoder_lora_eager):
        return vllm, None
    return vllm, vllm


def encoder_lora_unsafe(spec: Spec) -> bool:
    """Encoder graphs that would skip the tower/connector LoRA kernels (failure class 11)."""
    mm = spec.multimodal
    return bool(mm and mm.encoder_cudagraphs and mm.tower_connector_lora and spec.lora.specialize_active)
