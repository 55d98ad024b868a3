"""Choose the ready tier from a recorded trace: the fewest graphs that replay a given share
of the trace's graph steps.

The trace's batches are dispatched through the spec's own plan (capture sizes unchanged);
graphs are taken by the steps they replay, most first, until the share is reached. The
planner then adds the largest graph of each mode and LoRA case (every deferred graph needs
a ready fallback), so the final ready set covers at least the share. The choice rests on
the trace alone: no calibration prices it, and a workload unlike the trace can land on
deferred graphs more often (it stays correct: such batches replay a fallback).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pydantic import ValidationError

from capplan.errors import UsageError
from capplan.planner.compiler import compile_plan
from capplan.planner.dispatch import Dispatcher
from capplan.schemas.plan import Plan, address
from capplan.schemas.spec import Spec, Tiers, deferred_capture_refusals
from capplan.schemas.validation import describe_validation_error
from capplan.traffic.simulate import TraceBatch


@dataclass(frozen=True)
class ReadyChoice:
    """The spec with its ready tier chosen, and what the choice rests on."""

    spec: Spec
    plan: Plan
    share: float
    named: int  # graphs the trace chose (written to tiers.ready)
    steps: int  # steps in the trace
    graph_steps: int  # steps that replay a graph of the plan
    covered: int  # graph steps whose graph is ready (the chosen ones and the planner's additions)

    @property
    def ready(self) -> int:
        assert self.plan.tiers is not None
        return len(self.plan.graphs) - len(self.plan.tiers.deferred)

    @property
    def covered_share(self) -> float:
        return self.covered / self.graph_steps if self.graph_steps else 1.0


def choose_ready(spec: Spec, traces: list[list[TraceBatch]], share: float) -> ReadyChoice:
    """The spec with tiers.ready naming the graphs that replay `share` of the trace's graph steps."""
    if not 0.0 < share <= 1.0:
        raise UsageError(f"--ready-share must be above 0 and at most 1 (got {share})")
    refusals = deferred_capture_refusals(spec)
    if refusals:
        why, _ = refusals[0]
        more = f" (and {len(refusals) - 1} more: {'; '.join(w for w, _ in refusals[1:])})" if len(refusals) > 1 else ""
        raise UsageError(f"--ready-share: {why}{more}", "choose capture sizes without --ready-share")
    if len(traces) != 1:
        raise UsageError("--ready-share: pass one trace (deferred capture runs on one DP rank)")
    base = spec.model_copy(update={"tiers": None})
    plan = compile_plan(base, with_deviations=False)
    dispatcher = Dispatcher(plan)
    hits: Counter[int] = Counter()
    steps = 0
    for item in traces[0]:
        steps += item.count
        graph_id = dispatcher.dispatch(item.batch).graph_id
        if graph_id >= 0:
            hits[graph_id] += item.count
    graph_steps = sum(hits.values())
    if not graph_steps:
        raise UsageError(
            "no step of the trace replays a graph of this spec's plan, so it cannot choose the ready graphs",
            "pass a trace of this deployment serving requests",
        )
    chosen: list[int] = []
    covered = 0
    for graph_id, count in sorted(hits.items(), key=lambda kv: (-kv[1], kv[0])):
        if covered >= share * graph_steps:
            break
        chosen.append(graph_id)
        covered += count
    every = spec.tiers.every_steps if spec.tiers is not None else Tiers.model_fields["every_steps"].default
    ready = [address(plan.graphs[g].descriptor) for g in sorted(chosen)]
    try:
        tiered = Spec.model_validate({**base.model_dump(), "tiers": {"ready": ready, "every_steps": every}})
    except ValidationError as exc:  # the spec was valid without tiers; a limit of the ready list
        raise UsageError(f"--ready-share: the chosen tiers: {describe_validation_error(exc, Spec)}") from None
    final = compile_plan(tiered)
    assert final.tiers is not None
    deferred = set(final.tiers.deferred)
    return ReadyChoice(
        spec=tiered,
        plan=final,
        share=share,
        named=len(chosen),
        steps=steps,
        graph_steps=graph_steps,
        covered=sum(n for g, n in hits.items() if g not in deferred),
    )


def describe(choice: ReadyChoice) -> str:
    """One line for the optimized spec's header and the terminal."""
    total = len(choice.plan.graphs)
    return (
        f"ready tier: {choice.ready} of {total} graphs ({choice.named} chosen by the trace, the rest the largest "
        f"of each mode and LoRA case and of each kernel class) replay {choice.covered} of the trace's "
        f"{choice.graph_steps} graph steps "
        f"({choice.covered_share:.1%}; asked {choice.share * 100:.4g}%); {total - choice.ready} deferred. Rests on the "
        "trace alone, no calibration"
    )
