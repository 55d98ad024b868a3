"""Capture sizes: vLLM's `VllmConfig._set_cudagraph_sizes`, per target release (its rules)."""

from __future__ import annotations

from capplan.schemas.spec import CudagraphMode, Spec


def _stride_grid(limit: int, interactivity: bool) -> list[int]:
    """1, 2, 4, then steps of 8 below 256, then steps of 16, up to `limit`."""
    if interactivity:
        sizes = list(range(1, min(limit, 32) + 1))
    else:
        sizes = [n for n in (1, 2, 4) if n <= limit]
    if limit >= 8:
        sizes += range(8, min(limit + 1, 256), 8)
    if limit >= 256:
        sizes += range(256, limit + 1, 16)
    return sizes


def _request_counts(max_reqs: int, ceiling: int) -> list[int]:
    """Request counts whose uniform-decode batches get their own sizes (speculative_decode_sizes)."""
    max_reqs = min(max_reqs, ceiling)
    counts = [n for n in (1, 2, 4) if n <= max_reqs]
    counts += range(8, min(max_reqs + 1, 256), 8)
    counts += range(256, max_reqs + 1, 16)
    return sorted(set(counts) | {max_reqs})


def resolve_capture_sizes(spec: Spec) -> tuple[list[int], int]:
    """Return (capture sizes ascending, max capture size) as vLLM computes them."""
    cg = spec.cudagraph
    if cg.mode is CudagraphMode.NONE:
        return [], 0
    max_num_seqs = spec.scheduler.max_num_seqs
    max_num_tokens = spec.scheduler.max_num_batched_tokens
    dql = spec.decode_query_len
    rules = spec.rules

    decode_sizes: list[int] = []
    limit = cg.max_capture_size
    if limit is None:
        ceiling = 1024 if (rules.blackwell_ceiling_1024 and spec.target.blackwell) else 512
        limit = min(max_num_seqs * dql * 2, ceiling)
        if dql > 1 and rules.speculative_decode_sizes:
            decode_sizes = sorted({n * dql for n in _request_counts(max_num_seqs, ceiling) if n * dql <= limit})
        elif dql == 1 and rules.max_num_seqs_size and max_num_seqs <= limit:
            decode_sizes = [max_num_seqs]
    limit = min(max_num_tokens, limit)

    if cg.capture_sizes is not None:
        sizes = [s for s in cg.capture_sizes if s <= max_num_tokens]
    else:
        sizes = _stride_grid(limit, cg.performance_mode == "interactivity")
        # vLLM captures the whole scheduler budget when it fits, even off-stride.
        if max_num_tokens <= limit and max_num_tokens not in sizes:
            sizes.append(max_num_tokens)
        sizes += [s for s in decode_sizes if s <= max_num_tokens]
        sizes = sorted(set(sizes))
    return sizes, (sizes[-1] if sizes else 0)


def runs(values: list[int]) -> list[tuple[int, int, int]]:
    """Integers, in the order given, as (first, last, step) runs: three or more values rising by
    the same step from a value >= 0 make a run; any other value is (value, value, 0)."""
    out: list[tuple[int, int, int]] = []
    i = 0
    while i < len(values):
        j = i + 1
        if j < len(values):
            step = values[j] - values[i]
            while j + 1 < len(values) and values[j + 1] - values[j] == step:
                j += 1
            if j - i >= 2 and step > 0 and values[i] >= 0:
                out.append((values[i], values[j], step))
                i = j + 1
                continue
        out.append((values[i], values[i], 0))
        i += 1
    return out


def compact(numbers: list[int]) -> str:
    """Sorted numbers as runs: `1, 2, 4, 8..256 step 8, 272..512 step 16`."""
    parts = [
        str(a) if not step else f"{a}..{b}" + (f" step {step}" if step > 1 else "")
        for a, b, step in runs(sorted(set(numbers)))
    ]
    return ", ".join(parts) or "none"
