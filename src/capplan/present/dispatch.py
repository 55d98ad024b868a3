"""What `capplan dispatch` prints: the graph a batch replays and why, a batch file's
descriptors, or how an encoder batch is packed."""

from __future__ import annotations

from typing import Any

from capplan.planner.dispatch import Batch, Dispatch
from capplan.present.jsondoc import dumps
from capplan.schemas.plan import address


def explained_lines(batch: Batch, desc: Dispatch, trace: list[str], as_json: bool) -> list[str]:
    """The graph (or eager) that serves `batch`, with the reasons in `trace`; or its descriptor as JSON."""
    if as_json:
        return [dumps(desc.descriptor())]
    if desc.cg_mode == "NONE":
        lines = [f"eager (cg_mode NONE): {batch.num_tokens} tokens, no graph replay"]
    else:
        padding = desc.num_tokens - batch.num_tokens
        lines = [
            f"graph {address(desc)}: {desc.cg_mode} num_tokens={desc.num_tokens} "
            f"num_reqs={desc.num_reqs} uniform_token_count={desc.uniform_token_count} "
            f"num_active_loras={desc.num_active_loras} (pads {padding} token(s))"
        ]
    return lines + [f"  - {line}" for line in trace]


def descriptor_lines(descriptors: list[dict[str, Any]]) -> list[str]:
    """One JSON object a line, a batch file's batches in order."""
    return [dumps(d) for d in descriptors]


def encoder_lines(
    items: list[int],
    batches: list[tuple[list[int], int | None]],
    eager_why: str,
    has_graphs: bool,
    as_json: bool,
    packing: str = "",
) -> list[str]:
    """Each packed encoder batch: its items, tokens and the graph it replays (or eager, and why)."""
    if as_json:
        rows = [
            {"items": idx, "tokens": sum(items[i] for i in idx), "graph": None if b is None else f"ENCODER:{b}"}
            for idx, b in batches
        ]
        return [dumps(rows)]
    lines = []
    for idx, b in batches:
        tokens = sum(items[i] for i in idx)
        if b is None:
            lines.append(f"eager: items {idx} ({tokens} tokens; {eager_why})")
        else:
            lines.append(f"ENCODER:{b}: items {idx} ({tokens} tokens, pads {b - tokens})")
    if has_graphs and packing:
        lines.append(f"  - {packing}")
    return lines
