"""What the planner refuses of a spec before compiling it: a LoRA case listed with its
own sizes that the spec does not capture, and (for the readers' size limits) an
upper bound on the graphs it compiles to, computed without compiling."""

from __future__ import annotations

from capplan.planner.capture_sizes import resolve_capture_sizes
from capplan.planner.lora_cases import lora_capture_cases
from capplan.schemas.spec import Spec


def case_sizes_problem(spec: Spec) -> str | None:
    """Why the spec's cudagraph.lora_case_sizes names a case it does not capture, or None."""
    if spec.cudagraph.lora_case_sizes is None:
        return None
    cases = lora_capture_cases(spec)
    for entry in spec.cudagraph.lora_case_sizes:
        if entry.case not in cases:
            return (
                f"cudagraph.lora_case_sizes: case {entry.case} is not a LoRA capture case of this spec "
                f"(cases: {', '.join(map(str, cases))}); use one of those"
            )
    return None


def graphs_bound(spec: Spec) -> int:
    """An upper bound on the graphs the spec compiles to, computed without compiling."""
    sizes = len(resolve_capture_sizes(spec)[0])
    cases = lora_capture_cases(spec) or [0]
    listed = {e.case: len(e.sizes) for e in spec.cudagraph.lora_case_sizes or []}
    return 2 * sum(listed.get(case, sizes) for case in cases)


# A graph's line in the plan file holds at least this many entries (its address,
# its dummy list, one run and the run's two numbers).
MIN_ENTRIES_PER_GRAPH = 5


def capacity_problem(spec: Spec) -> str | None:
    """Why this spec cannot have a plan file (it may compile to more graphs than a plan file
    holds), or None. The one rule for compile and for the loader: a plan file naming such a
    spec was not written by capplan, and compiling its spec is never started."""
    from capplan.limits import MAX_ITEMS

    graphs = graphs_bound(spec)
    if graphs * MIN_ENTRIES_PER_GRAPH > MAX_ITEMS:
        return f"the plan would have up to {graphs} graphs, more than a plan file can hold ({MAX_ITEMS} entries)"
    return None


def tiers_problem(spec: Spec) -> str | None:
    """Why the spec's tiers.ready names a graph its plan does not have, or None (compiles the
    spec without tiers to list its graphs, only when tiers.ready is a list of addresses)."""
    if spec.tiers is None or isinstance(spec.tiers.ready, str):
        return None
    from capplan.planner.compiler import compile_plan
    from capplan.planner.tiers import unknown_ready

    plan = compile_plan(spec.model_copy(update={"tiers": None}), with_deviations=False)
    return unknown_ready(spec, plan.graphs)
