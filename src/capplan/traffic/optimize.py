"""Choose capture sizes from traffic: the fewest padded tokens under a graph or memory budget.

The objective is the trace's padded tokens, sum over graph-eligible batches
of count x (size - num_tokens) where size is the smallest chosen capture size
>= num_tokens (one unit per padded token: capplan has no per-token runtime
model yet). The largest size stays the spec's resolved max capture size, so
no batch the default plan replays is sent eager.

For k sizes this is 1-D bucketing, solved exactly by dynamic programming
over the sorted candidate sizes (the distinct token counts of the trace plus
the max size; an optimal size set never needs a size that is not a batch's
token count, or it could shrink to one). The bucket cost
C(i, j) = c_j (W_j - W_i) - (T_j - T_i) (prefix sums of weights W and weighted
tokens T) is Monge, so each DP layer's argmin is monotone and a
divide-and-conquer pass computes it in O(m log m): O(k m log m) overall.

A graph budget is met by the largest k whose compiled plan (LoRA cases,
FULL/PIECEWISE, pruning: the real graph count) fits; the trade-off curve
lists every k so the choice can be reviewed.
"""

from __future__ import annotations

from dataclasses import dataclass

from capplan.errors import UsageError
from capplan.planner.capture_sizes import resolve_capture_sizes
from capplan.planner.compiler import compile_plan
from capplan.schemas.plan import Plan
from capplan.schemas.spec import Spec
from capplan.traffic.cost import CostModel
from capplan.traffic.simulate import TraceBatch

INF = float("inf")


def token_weights(trace: list[TraceBatch], max_size: int) -> dict[int, int]:
    """Steps per token count, for batches a graph can serve (num_tokens <= max_size)."""
    weights: dict[int, int] = {}
    for item in trace:
        t = item.batch.num_tokens
        if t <= max_size:
            weights[t] = weights.get(t, 0) + item.count
    return weights


class Bucketing:
    """Exact k-size bucketing of weighted token counts, top size fixed."""

    def __init__(self, weights: dict[int, int], top: int) -> None:
        self.sizes = sorted(set(weights) | {top})
        if self.sizes[-1] != top:
            raise ValueError("weights above the top size")
        self.w = [0]
        self.t = [0]
        for c in self.sizes:
            self.w.append(self.w[-1] + weights.get(c, 0))
            self.t.append(self.t[-1] + weights.get(c, 0) * c)
        self.layers: list[list[float]] = []
        self.parents: list[list[int]] = []

    def cost(self, i: int, j: int) -> float:
        """Padded tokens when sizes[j-1] serves every count in (sizes[i-1], sizes[j-1]] (1-based j)."""
        c = self.sizes[j - 1]
        return c * (self.w[j] - self.w[i]) - (self.t[j] - self.t[i])

    def solve(self, max_k: int) -> None:
        m = len(self.sizes)
        if not self.layers:
            self.layers.append([0.0] + [self.cost(0, j) for j in range(1, m + 1)])
            self.parents.append([0] * (m + 1))
        while len(self.layers) < min(max_k, m):
            prev = self.layers[-1]
            cur = [INF] * (m + 1)
            par = [0] * (m + 1)
            self._fill(prev, cur, par, 1, m, 0, m - 1)
            self.layers.append(cur)
            self.parents.append(par)

    def _fill(self, prev, cur, par, lo: int, hi: int, opt_lo: int, opt_hi: int) -> None:
        # cur[j] = min over i < j of prev[i] + cost(i, j); argmin monotone in j (Monge cost).
        stack = [(lo, hi, opt_lo, opt_hi)]
        while stack:
            lo, hi, opt_lo, opt_hi = stack.pop()
            if lo > hi:
                continue
            mid = (lo + hi) // 2
            best, arg = INF, opt_lo
            for i in range(opt_lo, min(mid - 1, opt_hi) + 1):
                v = prev[i] + self.cost(i, mid)
                if v < best:
                    best, arg = v, i
            cur[mid], par[mid] = best, arg
            stack.append((lo, mid - 1, opt_lo, arg))
            stack.append((mid + 1, hi, arg, opt_hi))

    def best(self, k: int) -> tuple[float, list[int]]:
        """(padded tokens, sizes) of the optimal k-size set ending at the top size."""
        self.solve(k)
        k = min(k, len(self.sizes))
        m = len(self.sizes)
        chosen, j = [], m
        for layer in range(k - 1, -1, -1):
            if j <= 0:
                break
            chosen.append(self.sizes[j - 1])
            j = self.parents[layer][j]
        return self.layers[k - 1][m], sorted(chosen)


@dataclass(frozen=True)
class CurvePoint:
    sizes: int
    graphs: int
    graph_memory_gib: float
    capture_seconds: float
    padded_tokens: int
    padding_overhead: float
    capture_sizes: list[int]
    spec: Spec

    def to_json(self) -> dict:
        data = {k: v for k, v in self.__dict__.items() if k != "spec"}
        case_sizes = self.spec.cudagraph.lora_case_sizes
        data["lora_case_sizes"] = None if case_sizes is None else {str(e.case): e.sizes for e in case_sizes}
        return data


@dataclass(frozen=True)
class Optimized:
    spec: Spec
    plan: Plan
    point: CurvePoint
    default: CurvePoint
    curve: list[CurvePoint]
    budget: str


def with_sizes(spec: Spec, sizes: list[int]) -> Spec:
    data = spec.model_dump(mode="json")
    data["cudagraph"]["capture_sizes"] = sizes
    data["cudagraph"]["max_capture_size"] = None
    data["cudagraph"]["lora_case_sizes"] = None
    return Spec.model_validate(data)


def _padding(weights: dict[int, int], sizes: list[int]) -> int:
    import bisect

    total = 0
    for t, w in weights.items():
        total += w * (sizes[bisect.bisect_left(sizes, t)] - t)
    return total


def optimize(
    spec: Spec,
    trace: list[TraceBatch],
    cost: CostModel,
    *,
    max_graphs: int | None = None,
    max_graph_memory: float | None = None,
    shared_sizes: bool = False,
    max_points: int = 400,
) -> Optimized:
    if (max_graphs is None) == (max_graph_memory is None):
        raise UsageError("give exactly one budget: --max-graphs N or --max-graph-memory GIB")
    default_sizes, top = resolve_capture_sizes(spec)
    if top == 0:
        raise UsageError("cudagraph.mode is NONE: there are no graphs to choose")
    base = spec.model_copy(update={"cudagraph": spec.cudagraph.model_copy(update={"lora_case_sizes": None})})
    weights = token_weights(trace, top)
    real = sum(t * w for t, w in weights.items())
    default_plan = compile_plan(spec)
    default = _point(default_plan, cost, default_sizes, _padding(weights, default_sizes), real)
    budget = f"{max_graphs} graphs" if max_graphs is not None else f"{max_graph_memory} GiB graph memory"
    per_case = (
        not shared_sizes
        and spec.lora.enabled
        and spec.parallel.data_parallel_size == 1
        and len(default_plan.lora_capture_cases) > 1
    )
    if per_case:
        curve = _per_case_curve(base, trace, cost, top, real, default_plan, max_points)
    else:
        curve = _shared_curve(base, weights, cost, top, real, max_graphs, max_graph_memory, max_points)
    feasible = [p for p in curve if _fits(p, max_graphs, max_graph_memory)]
    if not feasible:
        raise UsageError(
            f"no capture set fits {budget}: the smallest needs {min(p.graphs for p in curve)} graphs "
            f"(~{min(p.graph_memory_gib for p in curve):.2f} GiB)",
            "raise the budget",
        )
    best = min(feasible, key=lambda p: (p.padded_tokens, p.graphs))
    return Optimized(best.spec, compile_plan(best.spec), best, default, curve, budget)


def _shared_curve(
    spec: Spec,
    weights: dict[int, int],
    cost: CostModel,
    top: int,
    real: int,
    max_graphs: int | None,
    max_gib: float | None,
    max_points: int,
) -> list[CurvePoint]:
    """One size set for every LoRA case (what vLLM can express; required under DP)."""
    solver = Bucketing(weights, top)
    curve: list[CurvePoint] = []
    for k in range(1, min(len(solver.sizes), max_points) + 1):
        padded, sizes = solver.best(k)
        chosen = with_sizes(spec, sizes)
        point = _point(compile_plan(chosen, with_deviations=False), cost, sizes, int(padded), real, chosen)
        curve.append(point)
        if len(curve) > 1 and not _fits(point, max_graphs, max_gib) and not _fits(curve[-2], max_graphs, max_gib):
            break  # two past the budget: graph counts only grow from here
        if padded == 0:
            break
    return curve


def _per_case_curve(
    spec: Spec, trace: list[TraceBatch], cost: CostModel, top: int, real: int, default_plan: Plan, max_points: int
) -> list[CurvePoint]:
    """Sizes per LoRA case: exact per-case bucketing, budget split across cases by a knapsack.

    Every case keeps the largest size (no batch loses its graph); a case the
    trace never uses keeps only that one. The graph cost of a size for a case
    is counted from the compiled union of all candidate sizes, so the knapsack
    sees pruning and FULL/PIECEWISE; every curve point is compiled for its
    exact count.
    """
    from capplan.planner.dispatch import Dispatcher

    d = Dispatcher(default_plan)
    cases = default_plan.lora_capture_cases
    per_case: dict[int, dict[int, int]] = {c: {} for c in cases}
    for item in trace:
        t = item.batch.num_tokens
        if t <= top:
            weights = per_case[d.lora_case(d.lora_count(item.batch))]
            weights[t] = weights.get(t, 0) + item.count
    candidates = sorted({t for w in per_case.values() for t in w} | {top})
    union = compile_plan(with_sizes(spec, candidates), with_deviations=False)
    dql = spec.decode_query_len
    per_size: dict[tuple[int, int], int] = {}
    for g in union.graphs:
        desc = g.descriptor
        per_size[(desc.num_active_loras, desc.num_tokens)] = (
            per_size.get((desc.num_active_loras, desc.num_tokens), 0) + 1
        )

    def graphs_for(case: int, sizes: list[int]) -> int:
        keys = {(case, s) for s in sizes} | {(case, -(-s // dql) * dql) for s in sizes}
        return sum(per_size.get(k, 0) for k in keys)

    options: dict[int, list[tuple[int, int, list[int]]]] = {}
    for c in cases:
        solver = Bucketing(per_case[c], top)
        opts, last = [], None
        for k in range(1, min(len(solver.sizes), max_points) + 1):
            padded, sizes = solver.best(k)
            if last is not None and padded >= last:
                break
            opts.append((graphs_for(c, sizes), int(padded), sizes))
            last = padded
            if padded == 0:
                break
        options[c] = opts
    total = sum(o[-1][0] for o in options.values())
    floor = sum(o[0][0] for o in options.values())
    # Knapsack over cases: best[b] = least padding with at most b graphs.
    best: list[float] = [0.0] * (total + 1)
    picks: list[list[int]] = []
    for c in cases:
        new = [INF] * (total + 1)
        pick = [-1] * (total + 1)
        for b in range(total + 1):
            for i, (g, padded, _) in enumerate(options[c]):
                if g <= b and best[b - g] + padded < new[b]:
                    new[b], pick[b] = best[b - g] + padded, i
        best = new
        picks.append(pick)
    curve: list[CurvePoint] = []
    budgets = sorted({floor, total} | set(range(floor, total + 1, max(1, (total - floor) // 60))))
    seen: set[tuple] = set()
    for b in budgets:
        if best[b] == INF:
            continue
        chosen, rest = {}, b
        for c, pick in zip(reversed(cases), reversed(picks)):
            g, _, sizes = options[c][pick[rest]]
            chosen[c] = sizes
            rest -= g
        key = tuple(tuple(chosen[c]) for c in cases)
        if key in seen:
            continue
        seen.add(key)
        union_sizes = sorted({s for v in chosen.values() for s in v})
        data = with_sizes(spec, union_sizes).model_dump(mode="json")
        data["cudagraph"]["lora_case_sizes"] = [
            {"case": c, "sizes": chosen[c]} for c in cases if chosen[c] != union_sizes
        ]
        if not data["cudagraph"]["lora_case_sizes"]:
            data["cudagraph"]["lora_case_sizes"] = None
        cand = Spec.model_validate(data)
        plan = compile_plan(cand, with_deviations=False)
        curve.append(_point(plan, cost, union_sizes, int(best[b]), real, cand))
    curve.sort(key=lambda p: (p.graphs, p.padded_tokens))
    return curve


def _fits(point: CurvePoint, max_graphs: int | None, max_gib: float | None) -> bool:
    if max_graphs is not None:
        return point.graphs <= max_graphs
    return point.graph_memory_gib <= max_gib


def _point(
    plan: Plan, cost: CostModel, sizes: list[int], padded: int, real: int, spec: Spec | None = None
) -> CurvePoint:
    est = cost.estimate(plan)
    return CurvePoint(
        len(sizes),
        len(plan.graphs),
        round(est.graph_memory_gib, 4),
        round(est.capture_seconds, 2),
        padded,
        padded / real if real else 0.0,
        list(sizes),
        spec or plan.spec,
    )


def render_curve(result: Optimized, full: bool = False) -> str:
    """The trade-off curve as text: by default the points near the choice (up to twice its
    graph count, at most 40 rows), the rest summarized in one line; `full` prints them all."""
    d = result.default
    lines = [
        f"capplan optimize: budget {result.budget}; objective: padded tokens on the trace "
        f"(largest graph kept at {d.capture_sizes[-1]} tokens)",
        f"  default capture set: {d.sizes} sizes, {d.graphs} graphs, ~{d.graph_memory_gib:.2f} GiB, "
        f"padding {d.padding_overhead:.2%}",
        "  sizes  graphs  ~GiB    ~capture s  padded tokens  padding",
    ]
    shown = result.curve if full else [p for p in result.curve if p.graphs <= 2 * result.point.graphs]
    every = 1 if full else max(1, len(shown) // 40)
    for i, p in enumerate(shown):
        if p is result.point or i % every == 0 or i == len(shown) - 1:
            mark = "  <- chosen" if p is result.point else ""
            lines.append(
                f"  {p.sizes:>5}  {p.graphs:>6}  {p.graph_memory_gib:>6.3f}  {p.capture_seconds:>10.1f}  "
                f"{p.padded_tokens:>13}  {p.padding_overhead:>7.2%}{mark}"
            )
    rest = len(result.curve) - len(shown)
    if rest:
        top = max(p.graphs for p in result.curve)
        lines.append(f"  ... {rest} more point(s), up to {top} graphs (--full-curve prints them)")
    return "\n".join(lines)
