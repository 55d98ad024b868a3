"""Capture descriptors: vLLM's `CudaGraphManager._init_candidates`, first half.

For every (capture size, LoRA case), in that order: a uniform-decode FULL
descriptor when the mode separates decode (token count rounded up to a
multiple of decode_query_len, dropped past max_num_seqs requests or the max
capture size), then a mixed descriptor (PIECEWISE: no request padding; FULL:
min(tokens, max_num_seqs) requests). Capture runs PIECEWISE then FULL, each
largest first.
"""

from __future__ import annotations

from collections.abc import Callable

from capplan.schemas.plan import Descriptor
from capplan.schemas.spec import Spec

CAPTURE_MODE_ORDER = ("PIECEWISE", "FULL")


def descriptors_by_mode(
    spec: Spec,
    capture_sizes: list[int],
    max_capture_size: int,
    lora_cases: list[int],
    reachable: Callable[[int], set[int]] | None = None,
    dropped: list[Descriptor] | None = None,
) -> dict[str, list[Descriptor]]:
    """Descriptors per cg_mode, in vLLM's insertion order (ascending tokens).

    With `reachable` (prune_unreachable: requests a graph holds -> the LoRA
    cases batches of that many requests can reach), a descriptor of an
    unreachable case is appended to `dropped` instead.
    """
    mode = spec.cudagraph.mode
    by_mode: dict[str, list[Descriptor]] = {}
    if not capture_sizes or mode.value == "NONE":
        return by_mode
    max_num_seqs = spec.scheduler.max_num_seqs
    dql = spec.decode_query_len
    decode_mode, mixed_mode = mode.decode_mode, mode.mixed_mode
    # Built from validated inputs: construct without re-validating (compile
    # runs on every commit and must stay cheaper than vLLM's own startup).
    make = Descriptor.trusted
    drop: list[Descriptor] = dropped if dropped is not None else []
    decode_kept: list[Descriptor] = []
    mixed_kept: list[Descriptor] = []
    seen: set[tuple[int, int]] = set()
    for num_tokens in capture_sizes:
        rounded = -(-num_tokens // dql) * dql
        decode_reqs = rounded // dql
        decode_ok = mode.separate_routine and rounded <= max_capture_size and decode_reqs <= max_num_seqs
        mixed_reqs = min(num_tokens, max_num_seqs) if mixed_mode == "FULL" else None
        if reachable is None:  # no pruning: every case is kept
            decode_cases = mixed_cases = None
        else:  # the LoRA cases batches that fit these graphs can reach
            decode_cases = reachable(min(decode_reqs, rounded)) if decode_ok else None
            mixed_cases = reachable(min(num_tokens, max_num_seqs))
        for case in lora_cases:
            if decode_ok and (rounded, case) not in seen:
                seen.add((rounded, case))
                desc = make(
                    cg_mode=decode_mode,
                    num_tokens=rounded,
                    num_reqs=decode_reqs,
                    uniform_token_count=dql,
                    max_query_len=None,
                    num_active_loras=case,
                )
                (decode_kept if decode_cases is None or case in decode_cases else drop).append(desc)
            if mixed_mode != "NONE":
                desc = make(
                    cg_mode=mixed_mode,
                    num_tokens=num_tokens,
                    num_reqs=mixed_reqs,
                    uniform_token_count=None,
                    max_query_len=None,
                    num_active_loras=case,
                )
                (mixed_kept if mixed_cases is None or case in mixed_cases else drop).append(desc)
    # Decode graphs exist only when the mode separates them, and then the two
    # routines run in different modes, so the lists never share a key.
    if decode_kept:
        by_mode[decode_mode] = decode_kept
    if mixed_kept:
        by_mode[mixed_mode] = mixed_kept
    return by_mode


def capture_order(by_mode: dict[str, list[Descriptor]]) -> list[Descriptor]:
    """PIECEWISE first (larger activations fill the pool), then FULL; largest first."""
    ordered: list[Descriptor] = []
    for mode in CAPTURE_MODE_ORDER:
        # sorted() is stable: equal token counts keep insertion (LoRA case) order.
        ordered += sorted(by_mode.get(mode, []), key=lambda d: d.num_tokens, reverse=True)
    return ordered
