"""Which of the plan's graphs one process has captured, which are pending, and the graph a
batch replays meanwhile.

Invariants: `captured` and `pending` are disjoint and together every graph of the plan;
`pending` keeps plan order; a batch dispatched to a graph that is not captured replays the
first captured graph of its chain (`planner.tiers`), which `capplan verify` proves replays the
batch in every state, and counts a miss of that graph. In a single-rank engine the next graph
to land is the pending one the traffic missed most (plan order among equals): under load, the
graphs the traffic uses land first, not the last of the queue. Ranks that must capture alike
(TP, PP, DP that pad to one another) keep plan order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from capplan.planner.tiers import case_groups, replayed
from capplan.schemas.plan import Plan, address


class GraphSets:
    """The plan's graphs as one process has them: captured, pending, ready."""

    def __init__(self, plan: Plan) -> None:
        assert plan.tiers is not None
        self.graphs = plan.graphs
        self.tiers = plan.tiers
        self.pending: list[int] = list(plan.tiers.deferred)
        self.captured: set[int] = set(range(len(plan.graphs))) - set(self.pending)
        self.ready_ids = sorted(self.captured)  # captured before the engine is ready
        # DP ranks that pad to one another capture a graph's group at once: every LoRA case of its size
        self.group_of = {g: group for group in case_groups(plan.graphs, self.pending) for g in group}
        self.fallback_steps = 0  # dispatches that replayed a fallback graph
        self.misses: Counter[int] = Counter()  # per pending graph: the dispatches that replayed its fallback

    def resolve(self, graph_id: int, traffic: bool = True) -> int:
        """The graph a batch dispatched to `graph_id` replays now (-1: eager); `traffic`: the
        dispatch of a step of real requests (not vLLM's warm-up, not a second dispatch of the
        step), which counts a miss of a pending graph."""
        if graph_id in self.captured:
            return graph_id
        self.fallback_steps += 1
        if traffic:
            self.misses[graph_id] += 1
        return replayed(self.tiers, graph_id, self.captured)

    def ranked(self, by_misses: bool = True) -> list[int]:
        """The pending graphs in the order they should land: the most missed first, plan order
        among equals; plan order alone where ranks must pick alike (`by_misses` off: misses are
        counted by each rank's own dispatch, which differs between DP ranks)."""
        if not by_misses:
            return list(self.pending)
        order = {g: i for i, g in enumerate(self.pending)}
        return sorted(self.pending, key=lambda g: (-self.misses[g], order[g]))

    def next(self, by_misses: bool = True) -> int:
        """The pending graph to capture next (`ranked`'s first)."""
        return self.pending[0] if not by_misses else self.ranked()[0]

    def mode(self, gid: int) -> str:
        return self.graphs[gid].descriptor.cg_mode

    def name(self, gid: int) -> str:
        return address(self.graphs[gid].descriptor)

    def pending_of(self, mode: str) -> list[int]:
        """The pending graphs of `mode`, in plan order."""
        return [g for g in self.pending if self.mode(g) == mode]

    def take(self, ids: Iterable[int]) -> None:
        """These pending graphs are captured."""
        chosen = set(ids)
        self.pending = [g for g in self.pending if g not in chosen]
        self.captured |= chosen

    def ready_now(self) -> None:
        """Every graph captured so far counts as ready (captured before the engine is ready)."""
        self.ready_ids = sorted(self.captured)
