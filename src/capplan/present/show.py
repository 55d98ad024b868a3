"""Human tables for `capplan show`, drawn from the same Plan the JSON form dumps."""

from __future__ import annotations

from typing import Any

from capplan.calibration.budget import FIRST_CAPTURE_HINT, MARGIN_RULE
from capplan.calibration.price import Figure, Priced
from capplan.planner.capture_sizes import compact
from capplan.schemas.plan import Plan


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [fmt(headers), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def _label(plan: Plan, graph_id: int) -> str:
    d = plan.graphs[graph_id].descriptor
    extra = []
    if d.num_reqs is not None:
        extra.append(f"{d.num_reqs}r")
    if d.uniform_token_count is not None:
        extra.append(f"u{d.uniform_token_count}")
    return f"{d.cg_mode}:{d.num_tokens}" + (f"({','.join(extra)})" if extra else "")


def _ranges(plan: Plan) -> list[str]:
    by_case: dict[int, list[tuple[int, int, str]]] = {}
    for row in plan.dispatch:
        labels = " > ".join(_label(plan, i) for i in row.candidates)
        by_case.setdefault(row.lora_case, []).append((row.lo, row.hi, labels))
    # Cases share token ranges when the plan is LoRA-invariant: print them once.
    groups: dict[tuple, list[int]] = {}
    for case, rows in by_case.items():
        groups.setdefault(tuple(rows), []).append(case)
    lines: list[str] = []
    for shared, cases in groups.items():
        rows = list(shared)
        lines.append(
            f"Token ranges, LoRA case{'s' if len(cases) > 1 else ''} {', '.join(map(str, cases))} "
            "(candidates in priority order; r = request slots, u = uniform tokens/request):"
        )
        lines += _table(
            ["tokens", "candidates"],
            [[f"{lo}" if lo == hi else f"{lo}..{hi}", labels] for lo, hi, labels in rows],
        )
        lines.append("")
    top = max((row.hi for row in plan.dispatch), default=0)
    budget = plan.spec.scheduler.max_num_batched_tokens
    if top < budget:
        lines.append(f"Batches of {top + 1}..{budget} tokens run eager (above the largest graph).")
        lines.append("")
    return lines


def render_show(plan: Plan, name: str, price: str = "") -> str:
    spec = plan.spec
    lora = spec.lora
    lines = [
        f"{name}",
        f"  target: vLLM {plan.target['vllm']} ({plan.target['runner']}), mode "
        f"{spec.cudagraph.mode.value}, decode_query_len {plan.decode_query_len}, "
        f"DP {spec.parallel.data_parallel_size}"
        + (
            " (dense: independent engines, DP 1 each)"
            if spec.parallel.synced_size < spec.parallel.data_parallel_size
            else ""
        ),
        "  LoRA: "
        + (
            f"max_loras {lora.max_loras}, specialize {str(lora.specialize).lower()}, "
            f"specialize_active {str(lora.specialize_active).lower()}"
            if lora.enabled
            else "off"
        ),
        f"  fixes: {', '.join(plan.fixes) or 'none (exactly vLLM)'}",
        f"  spec_hash {plan.spec_hash[:19]}  fingerprint {plan.fingerprint[:19]}",
        "",
        f"Capture sizes ({len(plan.capture_sizes)}, max {plan.max_capture_size}): "
        + (", ".join(map(str, plan.capture_sizes)) or "none"),
        "",
        "Graphs to capture (PIECEWISE first, then FULL, largest first):",
    ]
    if price:
        lines.insert(-1, f"Price: {price}")
        lines.insert(-1, "")
    cases = plan.lora_capture_cases
    rows = []
    for mode in ("PIECEWISE", "FULL"):
        row = plan.stats.get(mode)
        if row:
            rows.append([mode, *(str(row.get(str(c), 0)) for c in cases), str(sum(row.values()))])
    rows.append(
        [
            "total",
            *(str(sum(1 for g in plan.graphs if g.descriptor.num_active_loras == c)) for c in cases),
            str(len(plan.graphs)),
        ]
    )
    lines += _table(["mode", *(f"case {c}" for c in cases), "total"], rows)
    lines.append("")
    if plan.lora_dispatch_map:
        by_slots = plan.lora_dispatch_key == "kernel_slots"
        key = "kernel slots (adapters + 1 with base requests)" if by_slots else "adapters"
        lines.append(f"LoRA dispatch by {key}:")
        lines += _table(["count", "case"], [[str(k), str(v)] for k, v in plan.lora_dispatch_map.items()])
        lines.append("")
    lines += _ranges(plan)
    if plan.encoder is not None:
        lines += _encoder_lines(plan)
    if plan.deviations:
        lines.append("Deviations from vLLM:")
        for dev in plan.deviations:
            lines.append(f"  {dev.fix} (failure class {dev.failure_class} in docs/design.md)")
            lines += [f"    - {change}" for change in dev.changes]
        lines.append("")
    lines += _tier_lines(plan)
    dp_line = _dp_line(plan)
    if dp_line:
        lines.append(dp_line)
    return "\n".join(lines) + "\n"


def _dp_line(plan: Plan) -> str | None:
    """How DP ranks run the plan; None at data_parallel_size 1 (there is no other rank)."""
    dp = plan.dp
    if plan.spec.parallel.data_parallel_size == 1:
        return None
    if plan.spec.parallel.synced_size < plan.spec.parallel.data_parallel_size:
        return (
            f"DP: {plan.spec.parallel.data_parallel_size} independent engines of a dense model (vLLM sets "
            "data_parallel_size 1 in each); no rank pads to another, each runs this DP 1 plan."
        )
    return (
        f"DP: size {dp.data_parallel_size}; {dp.sync}; padded token counts "
        f"{'do not depend' if dp.padded_tokens_lora_invariant else 'DEPEND'} on the LoRA count."
    )


def _tier_lines(plan: Plan) -> list[str]:
    """Deferred capture: how many graphs are ready, how many deferred, and how they land."""
    tiers = plan.tiers
    if tiers is None:
        return []
    ready = len(plan.graphs) - len(tiers.deferred)
    rule = plan.spec.tiers.ready if plan.spec.tiers is not None else None
    named = len(rule or [])
    chosen = (
        "FULL uniform-decode graphs"
        if rule == "full_decode"
        else f"{named} graph{'' if named == 1 else 's'} named in the spec"
    )
    by_mode: dict[str, int] = {}
    for g in tiers.deferred:
        mode = plan.graphs[g].descriptor.cg_mode
        by_mode[mode] = by_mode.get(mode, 0) + 1
    return [
        f"Tiers: {ready} ready ({chosen}; the largest of each mode and LoRA case; and the largest of each kernel "
        "class, so that no deferred capture waits on a kernel compile), "
        f"{len(tiers.deferred)} deferred ({', '.join(f'{m} {n}' for m, n in sorted(by_mode.items())) or 'none'}): "
        f"captured while serving, one every {tiers.every_steps} steps and back to back while idle; until then a "
        "batch replays the next larger captured graph of its mode and LoRA case (capplan verify proves it for "
        "every intermediate state)",
        "",
    ]


def _encoder_lines(plan: Plan) -> list[str]:
    enc = plan.encoder
    assert enc is not None
    if enc.budgets:
        head = (
            f"Encoder graphs ({len(enc.budgets)}, largest first): {', '.join(map(str, enc.budgets))} tokens; "
            f"up to {enc.max_items} items and {enc.max_frames} frames a graph; a batch above the largest "
            "budget runs eager."
        )
    elif enc.vllm_budgets:
        head = f"Encoder: eager (vLLM alone would capture {len(enc.vllm_budgets)} graphs: {enc.vllm_budgets})."
    else:
        head = "Encoder: eager (no encoder CUDA graphs)."
    lines = [head]
    if enc.lora:
        lines.append(f"  tower/connector LoRA: {enc.lora}")
    return [*lines, ""]


def _runs(numbers: list[int]) -> str:
    """Token counts as contiguous runs: `1..4, 9`."""
    out: list[list[int]] = []
    for n in sorted(numbers):
        if out and out[-1][1] == n - 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ", ".join(f"{lo}..{hi}" if lo != hi else f"{lo}" for lo, hi in out)


def _cases(cases: list[int], every: list[int]) -> str:
    if cases == every and len(every) > 1:
        return "all"
    return ", ".join(map(str, cases))


def _eager(plan: Plan) -> list[str]:
    """The batches no graph serves, as verify reports them."""
    from capplan.analysis.verify import eager_records
    from capplan.present.verify import eager_text

    regions = eager_records(plan)
    return [f"  {eager_text(region)}" for region in regions] or ["  none: every reachable batch replays a graph"]


def render_show_short(plan: Plan, name: str, price: str = "") -> str:
    """About one screen: the header, then per mode and LoRA case the graph sizes and counts,
    the batches that run eager, and what each fix changed (`render_show` has every table)."""
    full = render_show(plan, name, price).split("\n")
    head = full[: full.index("") + 1]  # name, target, LoRA, fixes, hashes
    lines = [
        *head,
        f"Capture sizes ({len(plan.capture_sizes)}, max {plan.max_capture_size}): {compact(plan.capture_sizes)}",
    ]
    if price:
        lines.append(f"Price: {price}")
    lines += ["", "Graphs per mode and LoRA case (sizes in tokens):"]
    every = list(plan.lora_capture_cases)
    rows = []
    for mode in ("PIECEWISE", "FULL"):
        sizes: dict[int, list[int]] = {}
        for g in plan.graphs:
            d = g.descriptor
            if d.cg_mode == mode:
                sizes.setdefault(d.num_active_loras, []).append(d.num_tokens)
        grouped: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        for case in every:
            if case in sizes:
                grouped.setdefault((len(sizes[case]), tuple(sorted(set(sizes[case])))), []).append(case)
        for (count, distinct), cases in grouped.items():
            rows.append([mode, _cases(cases, every), str(count), compact(list(distinct))])
    lines += _table(["mode", "LoRA cases", "graphs each", "sizes"], rows)
    lines.append(f"total: {len(plan.graphs)} graphs")
    lines.append("")
    if plan.lora_dispatch_map:
        by_case: dict[int, list[int]] = {}
        for count, case in plan.lora_dispatch_map.items():
            by_case.setdefault(case, []).append(int(count))
        key = "kernel slots" if plan.lora_dispatch_key == "kernel_slots" else "adapters"
        lines.append(
            f"LoRA dispatch by {key}: " + "; ".join(f"{_runs(counts)} -> case {c}" for c, counts in by_case.items())
        )
        lines.append("")
    lines.append("Eager (no graph serves the batch):")
    lines += _eager(plan)
    lines.append("")
    if plan.encoder is not None:
        lines += _encoder_lines(plan)
    if plan.deviations:
        lines.append("Fixes (what each changed against vLLM):")
        for dev in plan.deviations:
            changes = [c for c in dev.changes if not c.startswith("no change")]
            if not changes:
                lines.append(f"  {dev.fix}: {dev.changes[0] if dev.changes else 'no change'}")
            else:
                kinds = sorted({c.split(":", 1)[0] for c in changes})
                lines.append(f"  {dev.fix}: {len(changes)} change(s) to {' and '.join(kinds)}")
        lines.append("")
    lines += _tier_lines(plan)
    dp_line = _dp_line(plan)
    if dp_line:
        lines.append(dp_line)
    lines.append("(capplan show --full: every table, token range and deviation)")
    return "\n".join(lines) + "\n"


def show_json(plan: Plan, priced: Priced) -> dict[str, Any]:
    """`show --json`: the plan's machine-readable form and its `price` (`price_json`)."""
    from capplan.planfile.write import plan_to_json

    data = plan_to_json(plan)
    data["price"] = price_json(priced)
    return data


def price_lines(priced: Priced) -> list[str]:
    """The plan's capture cost with its interval and basis (or why it is not priced), and the
    graph memory to leave free beside the KV cache where it was measured for this deployment."""
    if not priced.priced:
        return [f"{priced.text()} ({priced.basis})", *priced.notes]
    return [f"{priced.text()} ({priced.kind}; {priced.basis})", *priced.notes, reserve_line(priced)]


def reserve_line(priced: Priced) -> str:
    """The graph memory to leave free beside the KV cache where this deployment's starts measured
    the plan, else that vLLM's own estimate stays in charge (`show`, `flags`)."""
    reserve = priced.reserve_bytes()
    if priced.kind == "exact":
        return "no graphs: no graph memory to leave free beside the KV cache"
    if reserve is None and priced.kind == "measured":
        return (
            "graph memory no reserve: not every start of this plan ran its capture first (after vLLM's profiling "
            "pass the capture reuses what that pass left allocated, and its reading leaves that out); vLLM's own "
            "estimate stays in charge of the KV cache (" + FIRST_CAPTURE_HINT + ")"
        )
    if reserve is None:
        return (
            "graph memory not measured for this deployment: vLLM's own estimate stays in charge of the KV cache "
            "(calibrate-start from a start of this plan measures it)"
        )
    return (
        f"graph memory to leave free beside the KV cache: {reserve / 2**30:.3f} GiB ({reserve} bytes: "
        f"the largest of the starts' readings + {MARGIN_RULE}); size the KV cache "
        "(--kv-cache-memory-bytes, or --gpu-memory-utilization) to leave that, in place of vLLM's "
        "profiling estimate of its graphs"
    )


def figure_json(f: Figure | None, digits: int) -> dict[str, float | None] | None:
    """A figure as JSON: its value and interval (lo and hi null: no interval); null: not priced."""
    if f is None:
        return None
    return {
        "value": round(f.value, digits),
        "lo": None if f.lo is None else round(f.lo, digits),
        "hi": None if f.hi is None else round(f.hi, digits),
    }


def price_json(priced: Priced) -> dict[str, Any]:
    return {
        "graphs": priced.graphs,
        "capture_seconds": figure_json(priced.seconds, 2),
        "graph_memory_gib": figure_json(priced.gib, 4),
        "kind": priced.kind,
        "basis": priced.basis,
        "notes": list(priced.notes),
        "graph_memory_reserve_bytes": priced.reserve_bytes(),
    }
