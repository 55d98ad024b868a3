"""What each capplan fix changed against vLLM, computed by compiling twice."""

from __future__ import annotations

from collections.abc import Callable

from capplan.planner.lora_cases import case_for
from capplan.planner.regions import target_changes
from capplan.releases import label
from capplan.schemas.plan import Descriptor, Deviation, DispatchRange, DummyLayout, Plan, PlannedGraph
from capplan.schemas.spec import Fix

FAILURE_CLASSES = {
    Fix.lora_slot: "6: no-LoRA slot not counted (adapters + base can replay a grid one slot short)",
    Fix.dummy_remainder: "5: dummy requests longer than max_model_len (remainder piled on one request)",
    Fix.mixed_ranges: "8: coverage holes (0.25 union ranges send mixed batches eager)",
    Fix.prune_unreachable: "cost: graphs captured that no reachable batch can replay (capture time, graph memory)",
    Fix.encoder_lora_eager: "11: encoder graphs skip tower/connector LoRA (kernel grid of 0 adapters at capture)",
}


class ExactTwin:
    """What vLLM itself (fixes: []) would plan for the same spec, computed lazily.

    Only prune_unreachable changes which graphs exist (the dropped ones are
    handed over); otherwise the twin shares the plan's descriptors and only
    recomputes what a fix touches: dummy layouts of the graphs it can change,
    and (on 0.25) the dispatch ranges.
    """

    def __init__(
        self, plan: Plan, ranges: Callable[..., list[DispatchRange]], dropped: list[Descriptor] | None = None
    ) -> None:
        from capplan.planner.dummy_layout import DummyLayouts

        self.spec = plan.spec.model_copy(update={"fixes": []})
        self.graphs = plan.graphs
        self.decode_query_len = plan.decode_query_len
        self.lora_capture_cases = plan.lora_capture_cases
        self.lora_dispatch_map = plan.lora_dispatch_map
        self._layout = DummyLayouts(self.spec)
        self._ranges = ranges
        self._dispatch: list[DispatchRange] | None = None
        self.dropped = dropped or []

    def dummy(self, graph: PlannedGraph) -> DummyLayout:
        return self._layout(graph.descriptor)

    @property
    def dispatch(self) -> list[DispatchRange]:
        if self._dispatch is None:
            self._dispatch = self._ranges(per_mode=self.spec.rules.per_mode_ranges)
        return self._dispatch


def describe_deviations(plan: Plan, exact: ExactTwin) -> list[Deviation]:
    describe = {
        Fix.lora_slot: _lora_slot,
        Fix.dummy_remainder: _dummy_remainder,
        Fix.mixed_ranges: _mixed_ranges,
        Fix.prune_unreachable: _prune_unreachable,
        Fix.encoder_lora_eager: _encoder_lora_eager,
    }
    return [
        Deviation(fix=fix.value, failure_class=FAILURE_CLASSES[fix], changes=describe[fix](plan, exact))
        for fix in plan.spec.fixes
    ]


def _encoder_lora_eager(plan: Plan, exact: ExactTwin) -> list[str]:
    enc = plan.encoder
    if enc is None or enc.budgets == enc.vllm_budgets:
        return ["no change: encoder graphs are off, or cannot skip tower LoRA here (specialize_active off)"]
    return [
        f"encoder: runs eager; vLLM would capture {len(enc.vllm_budgets)} budget graph(s) "
        f"{enc.vllm_budgets} whose tower/connector LoRA kernels launch with a grid of 0 adapters"
    ]


def _case(plan: Plan | ExactTwin, count: int) -> int:
    return case_for(count, plan.lora_dispatch_map)


def _lora_slot(plan: Plan, exact: ExactTwin) -> list[str]:
    if not plan.spec.lora.enabled:
        return ["no change: LoRA is off"]
    changes = []
    for k in range(1, plan.spec.lora.max_loras + 1):
        before, after = _case(exact, k), _case(plan, k + 1)
        if before != after:
            changes.append(f"dispatch: {k} adapter(s) + base requests -> LoRA case {after} (vLLM: {before})")
    grids: dict[tuple[int, int | None, int | None], int] = {}
    id_changes = 0
    # Only the max_loras + 1 case gets a different dummy (its -1 row).
    for new in plan.graphs:
        if new.descriptor.num_active_loras <= plan.spec.lora.max_loras:
            continue
        old = exact.dummy(new)
        id_changes += old.lora_ids != new.dummy.lora_ids
        if new.dummy.kernel_grid != old.kernel_grid:
            key = (new.descriptor.num_active_loras, old.kernel_grid, new.dummy.kernel_grid)
            grids[key] = grids.get(key, 0) + 1
    for (case, grid_before, grid_after), n in sorted(
        grids.items(), key=lambda kv: tuple(-1 if v is None else v for v in kv[0])
    ):
        changes.append(
            f"capture: {n} graph(s) of LoRA case {case} get a -1 dummy row: kernel grid {grid_before} -> {grid_after}"
        )
    if id_changes and not grids:
        changes.append(
            f"capture: {id_changes} dummy layout(s) of case {plan.spec.lora.max_loras + 1} "
            "include the -1 slot (kernel grid unchanged: specialize_active is off)"
        )
    return changes or ["no change: every adapter count already maps to a case covering its kernel slots"]


def _dummy_remainder(plan: Plan, exact: ExactTwin) -> list[str]:
    changed = []
    if not plan.spec.rules.spreads_dummy_remainder:  # a release that spreads: nothing to compare
        for graph in plan.graphs:
            if len(graph.dummy.tokens) > 1:  # a remainder exists
                old = exact.dummy(graph)
                if old.tokens != graph.dummy.tokens:
                    changed.append((graph.dummy, old))
    limit = plan.spec.scheduler.max_model_len
    lines = []
    if changed:
        longest_before = max(b.max_query_len for _, b in changed)
        longest_after = max(a.max_query_len for a, _ in changed)
        over_before = sum(1 for _, b in changed if b.max_query_len > limit)
        over_after = sum(1 for a, _ in changed if a.max_query_len > limit)
        lines.append(
            f"capture: {len(changed)} dummy batch(es) spread the token remainder over the last requests; "
            f"longest dummy request {longest_before} -> {longest_after} tokens "
            f"(max_model_len {limit}: {over_before} -> {over_after} over)"
        )
    for run in plan.dummy_runs:
        if run.vllm != run.plan:
            lines.append(
                f"{run.run} dummy run ({run.tokens} tokens): longest dummy request {run.vllm_longest} -> "
                f"{run.longest} tokens (max_model_len {limit})"
            )
    if lines:
        return lines
    if plan.spec.rules.spreads_dummy_remainder:
        return [f"no change: vLLM {label(plan.spec.target.vllm)} already spreads the remainder"]
    return ["no change: no dummy batch of this spec has a token remainder"]


def _mixed_ranges(plan: Plan, exact: ExactTwin) -> list[str]:
    if plan.spec.rules.per_mode_ranges:
        return [f"no change: vLLM {label(plan.spec.target.vllm)} already builds ranges per mode"]
    if plan.dispatch == exact.dispatch:
        return [f"no change: for this spec {label(plan.spec.target.vllm)}'s union ranges offer the same candidates"]
    lines = ["dispatch: " + line for line in target_changes(exact, plan, reachable=_reachable_by_requests(plan))]
    return lines or ["no change in what any batch replays (fallback candidates added behind the first)"]


def _reachable_by_requests(plan: Plan) -> Callable[[int], set[int]]:
    """Request count -> LoRA cases a batch of at most that many requests can
    dispatch to; other (tokens, case) pairs are no batch's concern (and the
    ones prune_unreachable drops graphs for)."""
    from capplan.planner.lora_cases import reachable_cases

    seqs = plan.spec.scheduler.max_num_seqs
    memo: dict[int, set[int]] = {}

    def reachable(requests: int) -> set[int]:
        reqs = min(requests, seqs)
        if reqs not in memo:
            memo[reqs] = reachable_cases(plan.spec, plan.lora_dispatch_map, reqs)
        return memo[reqs]

    return reachable


def _prune_unreachable(plan: Plan, exact: ExactTwin) -> list[str]:
    if not exact.dropped:
        return ["no change: every (graph, LoRA case) pair can be reached by some batch"]
    total = len(plan.graphs) + len(exact.dropped)
    lines = [
        f"capture: {len(exact.dropped)} of {total} graphs dropped: a graph of n tokens holds at most "
        "min(n, its requests) requests, so at most that many kernel slots, and no such batch maps to "
        "their LoRA case; every reachable batch dispatches as before"
    ]
    per: dict[tuple[str, int], list[int]] = {}
    for d in exact.dropped:
        per.setdefault((d.cg_mode, d.num_active_loras), []).append(d.num_tokens)
    for (mode, case), sizes in sorted(per.items()):
        sizes = sorted(set(sizes))
        shown = ", ".join(map(str, sizes[:8])) + (", ..." if len(sizes) > 8 else "")
        lines.append(f"capture: {mode} case {case}: {len(sizes)} size(s) not captured ({shown} tokens)")
    return lines
