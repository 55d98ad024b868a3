"""Candidate tables: which graphs a batch of N tokens and LoRA case c may replay.

vLLM's `_init_candidates`, second half. Two semantics:
- before vLLM 0.29 (`union`): token ranges run over the union of every mode's sizes, and
  a range only offers the graphs of exactly its upper size. A mixed batch
  just below a FULL-only size finds only that FULL uniform-decode graph and
  runs eager.
- 0.29+ (`per_mode`, the release rule `per_mode_ranges`): ranges per mode, FULL candidates first, then
  PIECEWISE; each mode offers its smallest graph >= N.
Stored as ranges: one row per (case, lo..hi) with the same candidates.
"""

from __future__ import annotations

import bisect

from capplan.schemas.plan import Descriptor, DispatchRange


def _by_case_and_tokens(descs: list[Descriptor], ids: dict[int, int]) -> dict[int, dict[int, list[int]]]:
    """case -> tokens -> graph ids; `ids` maps id(descriptor) to its capture position."""
    table: dict[int, dict[int, list[int]]] = {}
    for desc in descs:
        table.setdefault(desc.num_active_loras, {}).setdefault(desc.num_tokens, []).append(ids[id(desc)])
    return table


def build_ranges(
    by_mode: dict[str, list[Descriptor]],
    lora_cases: list[int],
    ids: dict[int, int],
    per_mode: bool,
) -> list[DispatchRange]:
    rows: list[DispatchRange] = []
    if per_mode:
        tables = [_by_case_and_tokens(by_mode.get(mode, []), ids) for mode in ("FULL", "PIECEWISE")]
    else:
        # Union ranges key one list per (tokens, case): decode graph before mixed graph.
        merged = by_mode.get("FULL", []) + by_mode.get("PIECEWISE", [])
        decode_first = sorted(merged, key=lambda d: d.uniform_token_count is None)
        tables = [_by_case_and_tokens(decode_first, ids)]
    all_sizes = sorted({d.num_tokens for descs in by_mode.values() for d in descs})
    for case in lora_cases:
        per_table = [(sorted(t.get(case, {})), t.get(case, {})) for t in tables]
        lo = 1
        for hi in all_sizes:
            candidates: list[int] = []
            for sizes, by_tokens in per_table:
                if per_mode:
                    idx = bisect.bisect_left(sizes, hi)
                    if idx < len(sizes):
                        candidates += by_tokens[sizes[idx]]
                else:
                    candidates += by_tokens.get(hi, [])
            if candidates:
                rows.append(DispatchRange.trusted(lora_case=case, lo=lo, hi=hi, candidates=candidates))
            lo = hi + 1
    return rows
