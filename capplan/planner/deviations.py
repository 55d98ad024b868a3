"""What each capplan fix changed against vLLM, computed by compiling twice."""

from __future__ import annotations

from capplan.schemas.plan import Deviation, Plan
from capplan.schemas.spec import Fix

FAILURE_CLASSES = {
    Fix.lora_slot: "6: no-LoRA slot not counted (adapters + base can replay a grid one slot short)",
    Fix.dummy_remainder: "5: dummy requests longer than max_model_len (remainder piled on one request)",
    Fix.mixed_ranges: "8: coverage holes (0.25 union ranges send mixed batches eager)",
}


def describe_deviations(plan: Plan, exact: Plan) -> list[Deviation]:
    describe = {
        Fix.lora_slot: _lora_slot,
        Fix.dummy_remainder: _dummy_remainder,
        Fix.mixed_ranges: _mixed_ranges,
    }
    return [
        Deviation(fix=fix.value, failure_class=FAILURE_CLASSES[fix], changes=describe[fix](plan, exact))
        for fix in plan.spec.fixes
    ]


def _case(plan: Plan, count: int) -> int:
    if count <= 0 or not plan.lora_dispatch_map:
        return 0 if count <= 0 else count
    return plan.lora_dispatch_map.get(count, max(plan.lora_dispatch_map.values()))


def _lora_slot(plan: Plan, exact: Plan) -> list[str]:
    if not plan.spec.lora.enabled:
        return ["no change: LoRA is off"]
    changes = []
    for k in range(1, plan.spec.lora.max_loras + 1):
        before, after = _case(exact, k), _case(plan, k + 1)
        if before != after:
            changes.append(f"dispatch: {k} adapter(s) + base requests -> LoRA case {after} (vLLM: {before})")
    grids: dict[tuple[int, int, int], int] = {}
    for new, old in zip(plan.graphs, exact.graphs):
        if new.dummy.kernel_grid != old.dummy.kernel_grid:
            key = (new.descriptor.num_active_loras, old.dummy.kernel_grid, new.dummy.kernel_grid)
            grids[key] = grids.get(key, 0) + 1
    for (case, old, new), n in sorted(grids.items()):
        changes.append(
            f"capture: {n} graph(s) of LoRA case {case} get a -1 dummy row: kernel grid {old} -> {new}"
        )
    id_changes = sum(1 for a, b in zip(plan.graphs, exact.graphs) if a.dummy.lora_ids != b.dummy.lora_ids)
    if id_changes and not grids:
        changes.append(
            f"capture: {id_changes} dummy layout(s) of case {plan.spec.lora.max_loras + 1} "
            "include the -1 slot (kernel grid unchanged: specialize_active is off)"
        )
    return changes or ["no change: every adapter count already maps to a case covering its kernel slots"]


def _dummy_remainder(plan: Plan, exact: Plan) -> list[str]:
    changed = [(a, b) for a, b in zip(plan.graphs, exact.graphs) if a.dummy.tokens != b.dummy.tokens]
    if not changed:
        if plan.spec.target.vllm != "0.25":
            return ["no change: vLLM 0.31+ already spreads the remainder"]
        return ["no change: no dummy batch of this spec has a token remainder"]
    limit = plan.spec.scheduler.max_model_len
    longest_before = max(b.dummy.max_query_len for _, b in changed)
    longest_after = max(a.dummy.max_query_len for a, _ in changed)
    over_before = sum(1 for _, b in changed if b.dummy.max_query_len > limit)
    over_after = sum(1 for a, _ in changed if a.dummy.max_query_len > limit)
    return [
        f"capture: {len(changed)} dummy batch(es) spread the token remainder over the last requests; "
        f"longest dummy request {longest_before} -> {longest_after} tokens "
        f"(max_model_len {limit}: {over_before} -> {over_after} over)"
    ]


def _targets(plan: Plan, ids: list[int]) -> tuple[str, str]:
    """(graph a mixed batch replays, graph a uniform-decode batch replays) from a candidate list."""
    descs = [plan.graphs[i].descriptor for i in ids]
    mixed = next((d for d in descs if d.uniform_token_count is None), None)
    decode = next((d for d in descs if d.uniform_token_count == plan.decode_query_len), mixed)
    label = lambda d: "eager" if d is None else f"{d.cg_mode}:{d.num_tokens}"  # noqa: E731
    return label(mixed), label(decode)


def _expand(plan: Plan) -> dict[tuple[int, int], list[int]]:
    return {
        (row.lora_case, n): row.candidates for row in plan.dispatch for n in range(row.lo, row.hi + 1)
    }


def _mixed_ranges(plan: Plan, exact: Plan) -> list[str]:
    if plan.dispatch == exact.dispatch:
        if plan.spec.target.vllm != "0.25":
            return ["no change: vLLM 0.31+ already builds ranges per mode"]
        return ["no change: for this spec 0.25's union ranges offer the same candidates"]
    before, after = _expand(exact), _expand(plan)
    # (batch kind, old target, new target) -> case -> token runs
    runs: dict[tuple[str, str, str], dict[int, list[list[int]]]] = {}
    for case, n in sorted(set(before) | set(after)):
        old = _targets(exact, before.get((case, n), []))
        new = _targets(plan, after.get((case, n), []))
        kinds = [("mixed", old[0], new[0])]
        if n % plan.decode_query_len == 0:
            kinds.append(("uniform-decode", old[1], new[1]))
        for kind, o, w in kinds:
            if o == w:
                continue
            case_runs = runs.setdefault((kind, _shape(o), _shape(w)), {}).setdefault(case, [])
            if case_runs and case_runs[-1][1] == n - 1:
                case_runs[-1][1] = n
            else:
                case_runs.append([n, n])
    lines = []
    for (kind, old, new), by_case in sorted(runs.items()):
        token_runs = next(iter(by_case.values()))
        same = all(r == token_runs for r in by_case.values())
        count = sum(hi - lo + 1 for lo, hi in token_runs)
        where = "all LoRA cases" if same else "LoRA cases " + ", ".join(map(str, sorted(by_case)))
        sample = ", ".join(f"{lo}..{hi}" if lo != hi else f"{lo}" for lo, hi in token_runs[:6])
        more = ", ..." if len(token_runs) > 6 else ""
        lines.append(
            f"dispatch: {kind} batches of {count} token count(s) ({sample}{more}; {where}): "
            f"{old} -> {new}"
        )
    return lines


def _shape(label: str) -> str:
    """Mode only: the exact size follows from the token count."""
    return label.split(":")[0]
