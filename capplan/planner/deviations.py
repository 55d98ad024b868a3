"""What each capplan fix changed against vLLM, computed by compiling twice."""

from __future__ import annotations

from capplan.planner.regions import target_changes
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


def _mixed_ranges(plan: Plan, exact: Plan) -> list[str]:
    if plan.dispatch == exact.dispatch:
        if plan.spec.target.vllm != "0.25":
            return ["no change: vLLM 0.31+ already builds ranges per mode"]
        return ["no change: for this spec 0.25's union ranges offer the same candidates"]
    return ["dispatch: " + line for line in target_changes(exact, plan)]
