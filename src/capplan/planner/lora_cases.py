"""LoRA capture cases and the map from a batch's LoRA count to a captured case.

vLLM: `get_lora_capture_cases` (v1/worker/gpu/lora_utils.py),
`get_captured_lora_counts` (lora/utils.py), `CudaGraphManager._build_lora_dispatch_map`.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # kernel_slots is imported on the fast dispatch path, without pydantic
    from capplan.schemas.spec import Spec


def captured_lora_counts(max_loras: int, specialize_active: bool) -> list[int]:
    """Counts the LoRA kernels round their grid up to (powers of two, max_loras + 1)."""
    if not specialize_active:
        return [max_loras + 1]
    top = max_loras + 1
    return sorted({1 << k for k in range(top.bit_length()) if 1 << k <= top} | {top})


def lora_capture_cases(spec: Spec) -> list[int]:
    """num_active_loras values graphs are captured for; 0 is the no-LoRA case."""
    lora = spec.lora
    if not lora.enabled:
        return [0]
    if lora.specialize:
        return [0] + captured_lora_counts(lora.max_loras, lora.specialize_active)
    return [0, lora.max_loras + 1]


def lora_dispatch_map(cases: list[int]) -> dict[int, int]:
    """Count -> smallest captured case >= count, for 1..largest case."""
    with_lora = sorted(c for c in cases if c > 0)
    if not with_lora:
        return {}
    return {n: with_lora[bisect.bisect_left(with_lora, n)] for n in range(1, with_lora[-1] + 1)}


def case_for(count: int, dispatch_map: dict[int, int]) -> int:
    """The LoRA case a batch's count dispatches to: 0 stays 0; a count above the map's
    largest clamps to the largest captured case (vLLM's rule); no LoRA cases: the count."""
    if count <= 0 or not dispatch_map:
        return count if count > 0 else 0
    return dispatch_map.get(count, max(dispatch_map.values()))


def kernel_slots(num_adapters: int, has_base: bool) -> int:
    """Distinct ids the LoRA kernels see: adapters, plus the -1 slot when base requests share the batch.

    The kernels size their grid by distinct ids *including* -1 (no adapter),
    while vLLM dispatches by adapters alone (docs/design.md failure class 6).
    """
    if num_adapters <= 0:
        return 0
    return num_adapters + (1 if has_base else 0)


def kernel_grid(lora_ids: list[int], num_reqs: int, spec: Spec) -> int:
    """Grid the LoRA kernels record when a dummy batch with these cycled ids is captured.

    Mirrors `LoRAKernelMeta.prepare_tensors`/`meta_args`: all -1 short-circuits
    (no kernels recorded); otherwise specialize_active uses the distinct-id
    count rounded up to the captured counts, else max_loras + 1.
    """
    present = set(lora_ids[: min(num_reqs, len(lora_ids))])
    if present <= {-1}:
        return 0
    lora = spec.lora
    if not lora.specialize_active:
        return lora.max_loras + 1
    distinct = len(present)
    counts = captured_lora_counts(lora.max_loras, True)
    idx = bisect.bisect_left(counts, distinct)
    return counts[idx] if idx < len(counts) else distinct


def reachable_cases(spec: Spec, dispatch_map: dict[int, int], max_requests: int) -> set[int]:
    """LoRA cases a batch of at most max_requests requests can dispatch to.

    Each request brings at most one adapter, and the no-LoRA slot needs a
    request of its own, so such a batch has at most max_requests kernel slots
    (or adapters, without lora_slot); a case is reachable when some count up
    to that maps to it (3 slots map to case 4, so a 3-request graph may need
    case 4). With DP > 1 an idle rank runs vLLM's dummy batch, one request
    that counts as max_loras + 1: that case is reachable at every size.
    """
    from capplan.schemas.spec import Fix

    if not dispatch_map:
        return {0}
    lora = spec.lora
    most = lora.max_loras + 1 if spec.has(Fix.lora_slot) else lora.max_loras
    out = {0} | {dispatch_map[n] for n in range(1, min(max_requests, most) + 1)}
    if spec.parallel.synced_size > 1:
        out.add(dispatch_map.get(lora.max_loras + 1, max(dispatch_map.values())))
    return out


def slots_by_case(spec: Spec, by_slots: bool, mapping: dict[int, int]) -> dict[int, list[tuple[int, str]]]:
    """Per LoRA case: (kernel slots, example batch) of every adapter mix that dispatches to it,
    sorted, keeping the largest slots per request count. `by_slots`: the plan dispatches by
    kernel slots (lora_slot), not adapters; `mapping`: its LoRA dispatch map."""
    lora = spec.lora
    if not lora.enabled:
        return {}
    top = max(mapping.values(), default=0)
    out: dict[int, list[tuple[int, str]]] = {}
    for k in range(1, lora.max_loras + 1):
        for base in (False, True):
            slots = kernel_slots(k, base)
            count = slots if by_slots else k
            case = mapping.get(count, top)
            out.setdefault(case, []).append((slots, f"{k} adapter(s)" + (" + base requests" if base else "")))
    for case, rows in out.items():
        rows.sort()
        # Running max: a graph holding R requests must cover every mix of <= R slots.
        best: list[tuple[int, str]] = []
        for slots, example in rows:
            if not best or slots > best[-1][0]:
                best.append((slots, example))
        out[case] = best
    return out
