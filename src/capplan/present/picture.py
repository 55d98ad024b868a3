"""What the plan picture shows: per mode, which (capture size, LoRA case) graphs are captured,
pruned, or (for two plans) added and removed, and which token ranges run eager."""

from __future__ import annotations

from capplan.present.plot import ADDED, CAPTURED, PRUNED, REMOVED
from capplan.schemas.plan import Plan
from capplan.schemas.spec import Fix

MODES = ("PIECEWISE", "FULL")


def _keys(plan: Plan) -> dict[str, set[tuple[int, int]]]:
    keys: dict[str, set[tuple[int, int]]] = {mode: set() for mode in MODES}
    for graph in plan.graphs:
        d = graph.descriptor
        keys[d.cg_mode].add((d.num_active_loras, d.num_tokens))
    return keys


def _grids(cases: list[int], colored: dict[str, dict[tuple[int, int], str]]) -> list:
    grids = []
    for mode in MODES:
        cells = colored[mode]
        if cells:
            sizes = sorted({size for _, size in cells})
            grids.append((mode, sizes, cases, cells))
    return grids


def plan_grids(plan: Plan) -> tuple[list, dict]:
    """Grids of one plan: captured graphs, and those prune_unreachable left out."""
    from capplan.planner.compiler import compile_plan

    captured = _keys(plan)
    pruned: dict[str, set[tuple[int, int]]] = {mode: set() for mode in MODES}
    if plan.spec.has(Fix.prune_unreachable):
        fixes = [f for f in plan.spec.fixes if f is not Fix.prune_unreachable]
        full = _keys(compile_plan(plan.spec.model_copy(update={"fixes": fixes}), with_deviations=False))
        pruned = {mode: full[mode] - captured[mode] for mode in MODES}
    colored = {mode: {**{k: PRUNED for k in pruned[mode]}, **{k: CAPTURED for k in captured[mode]}} for mode in MODES}
    legend = {CAPTURED: "captured", PRUNED: "not captured: no batch can replay it (prune_unreachable)"}
    return _grids(plan.lora_capture_cases, colored), legend


def diff_grids(old: Plan, new: Plan) -> tuple[list, dict]:
    a, b = _keys(old), _keys(new)
    colored = {
        mode: {
            **{k: REMOVED for k in a[mode] - b[mode]},
            **{k: ADDED for k in b[mode] - a[mode]},
            **{k: CAPTURED for k in a[mode] & b[mode]},
        }
        for mode in MODES
    }
    cases = sorted(set(old.lora_capture_cases) | set(new.lora_capture_cases))
    return _grids(cases, colored), {CAPTURED: "in both", ADDED: "added", REMOVED: "removed"}


def eager_note(plan: Plan) -> str:
    """The token ranges that run eager, as verify reports them (at most three)."""
    from capplan.present.verify import eager_regions

    regions = eager_regions(plan)
    if not regions:
        return "every reachable batch replays a graph"
    more = f" (+{len(regions) - 3} more)" if len(regions) > 3 else ""
    return "eager: " + "; ".join(regions[:3]) + more
