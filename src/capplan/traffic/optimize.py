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


def case_weights(trace: list[TraceBatch], max_size: int, plan: Plan) -> dict[int, dict[int, int]]:
    """Steps per LoRA case and token count (the case the plan's dispatcher gives each batch),
    for batches a graph can serve."""
    from capplan.planner.dispatch import Dispatcher

    d = Dispatcher(plan)
    per_case: dict[int, dict[int, int]] = {c: {} for c in plan.lora_capture_cases or [0]}
    for item in trace:
        t = item.batch.num_tokens
        if t <= max_size:
            weights = per_case.setdefault(d.lora_case(d.lora_count(item.batch)), {})
            weights[t] = weights.get(t, 0) + item.count
    return per_case


class Bucketing:
    """Exact k-size bucketing of weighted token counts.

    `weights` maps a LoRA case to {tokens: steps}. Without `price` the cost is
    padded tokens (a step of t tokens on size s costs s - t) and the top size
    is always chosen. With `price(case, size)` (milliseconds of one step
    replaying that size) the cost is step time; with `eager(case, tokens)` as
    well, the largest chosen size may stay below `top`, and batches above it
    are priced eager. Prices are made non-decreasing in size, which keeps the
    bucket cost Monge (so each DP layer's argmin is monotone).
    """

    def __init__(self, weights: dict[int, dict[int, int]], top: int, price=None, eager=None) -> None:
        counts = {t for w in weights.values() for t in w}
        self.sizes = sorted(counts | {top})
        if self.sizes[-1] != top:
            raise ValueError("weights above the top size")
        self.padding = price is None
        groups = [{t: sum(w.get(t, 0) for w in weights.values()) for t in counts}] if self.padding else None
        cases = [None] if self.padding else sorted(weights)
        self.w: list[list[int]] = []  # per group: prefix sums of steps
        self.g: list[list[float]] = []  # per group: price of each size (1-based)
        for case in cases:
            w = groups[0] if groups else weights[case]
            prefix = [0]
            for c in self.sizes:
                prefix.append(prefix[-1] + w.get(c, 0))
            self.w.append(prefix)
            prices, top_price = [0.0], 0.0
            for c in self.sizes:
                top_price = max(top_price, float(c) if self.padding else price(case, c))
                prices.append(top_price)
            self.g.append(prices)
        self.t = [0]  # prefix sums of weighted tokens (padding objective)
        merged = {t: sum(w.get(t, 0) for w in weights.values()) for t in counts}
        for c in self.sizes:
            self.t.append(self.t[-1] + merged.get(c, 0) * c)
        # tail[j]: eager cost of every batch above sizes[j-1] (inf: the top size must be chosen)
        m = len(self.sizes)
        self.tail = [INF] * m + [0.0]
        if eager is not None and not self.padding:
            acc = 0.0
            for j in range(m - 1, -1, -1):
                t = self.sizes[j]
                acc += sum(weights[case].get(t, 0) * eager(case, t) for case in cases)
                self.tail[j] = acc
        self.layers: list[list[float]] = []
        self.parents: list[list[int]] = []

    def cost(self, i: int, j: int) -> float:
        """Cost when sizes[j-1] serves every count in (sizes[i-1], sizes[j-1]] (1-based j)."""
        total = 0.0
        for w, g in zip(self.w, self.g):
            total += g[j] * (w[j] - w[i])
        if self.padding:
            total -= self.t[j] - self.t[i]
        return total

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
        """(cost, sizes) of the optimal set of at most k sizes (ending at the top size unless
        batches above a smaller largest size are priced eager)."""
        self.solve(k)
        k = min(k, len(self.sizes))
        m = len(self.sizes)
        layer = self.layers[k - 1]
        j = min(range(1, m + 1), key=lambda e: (layer[e] + self.tail[e], -e))
        value = layer[j] + self.tail[j]
        chosen = []
        for level in range(k - 1, -1, -1):
            if j <= 0:
                break
            chosen.append(self.sizes[j - 1])
            j = self.parents[level][j]
        return value, sorted(chosen)


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
    step_seconds: float | None = None  # predicted total step time on the trace (step-time objective)

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
    objective: str  # "padding" or "step-time"


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
        i = bisect.bisect_left(sizes, t)
        if i < len(sizes):  # above the largest size: eager, no padding
            total += w * (sizes[i] - t)
    return total


class Objective:
    """What a capture set costs on the trace: padded tokens, or predicted step time (ms).

    Under step time, batches are grouped by LoRA case and by the graph mode that
    would serve them: a uniform decode batch replays a FULL graph when its size
    is one vLLM captures FULL (up to the largest FULL size), a PIECEWISE one
    above that; any other batch replays PIECEWISE, or runs eager when the mode
    has no PIECEWISE graphs. Each group is priced with its own measured times.
    """

    def __init__(self, spec: Spec, trace: list[TraceBatch], top: int, plan: Plan, cost: CostModel, name: str) -> None:
        from capplan.planner.dispatch import Dispatcher, derive_uniform

        self.name = name
        self.steps = cost.steps if name == "step-time" else None
        self.flat = token_weights(trace, top)
        self.real = sum(t * w for t, w in self.flat.items())
        self.per_case = case_weights(trace, top, plan)
        self.fixed_ms = 0.0  # steps whose cost no capture set changes
        self.groups: dict[int, dict[tuple[int, str], dict[int, int]]] = {}  # case -> (case, kind) -> weights
        if self.steps is None:
            return
        union = compile_plan(with_sizes(spec, sorted(set(self.flat) | {top})), with_deviations=False)
        self.full_max = max(
            (g.descriptor.num_tokens for g in union.graphs if g.descriptor.cg_mode == "FULL"), default=0
        )
        has_piecewise = any(g.descriptor.cg_mode == "PIECEWISE" for g in union.graphs)
        d = Dispatcher(plan)
        dql = spec.decode_query_len
        for item in trace:
            b = item.batch
            case = d.lora_case(d.lora_count(b))
            decode = not b.has_prefill and derive_uniform(b, spec.target.vllm) == dql
            if b.num_tokens > top or not (decode or has_piecewise):
                self.fixed_ms += item.count * self.steps.ms("eager", case, b.num_tokens)
                continue
            kind = "full" if decode and self.full_max else "piecewise"
            weights = self.groups.setdefault(case, {}).setdefault((case, kind), {})
            weights[b.num_tokens] = weights.get(b.num_tokens, 0) + item.count

    def price(self, group: tuple[int, str], size: int) -> float:
        assert self.steps is not None
        case, kind = group
        if kind == "full" and size <= self.full_max:
            return self.steps.ms("graph", case, size)
        return self.steps.ms("piecewise", case, size)

    def eager(self, group: tuple[int, str], tokens: int) -> float:
        assert self.steps is not None
        return self.steps.ms("eager", group[0], tokens)

    def solver(self, cases: list[int], top: int, open_top: bool) -> Bucketing:
        """The bucketing problem of these LoRA cases (all of them: one shared size list)."""
        if self.steps is None:
            merged: dict[int, int] = {}
            for c in cases:
                for t, w in self.per_case.get(c, {}).items():
                    merged[t] = merged.get(t, 0) + w
            return Bucketing({0: merged}, top)
        groups = {g: w for c in cases for g, w in self.groups.get(c, {}).items()}
        return Bucketing(groups, top, self.price, self.eager if open_top else None)

    def step_seconds(self, per_case_sizes: dict[int, list[int]]) -> float | None:
        """Predicted total step time for these sizes per case (None under the padding objective)."""
        if self.steps is None:
            return None
        import bisect

        total = self.fixed_ms
        for case, groups in self.groups.items():
            sizes = per_case_sizes.get(case) or per_case_sizes.get(-1) or max(per_case_sizes.values())
            for group, weights in groups.items():
                for t, w in weights.items():
                    i = bisect.bisect_left(sizes, t)
                    total += w * (self.price(group, sizes[i]) if i < len(sizes) else self.eager(group, t))
        return round(total / 1000, 3)


def optimize(
    spec: Spec,
    trace: list[TraceBatch],
    cost: CostModel,
    *,
    max_graphs: int | None = None,
    max_graph_memory: float | None = None,
    max_capture_seconds: float | None = None,
    shared_sizes: bool = False,
    objective: str | None = None,
    max_points: int = 400,
) -> Optimized:
    budgets = [b for b in (max_graphs, max_graph_memory, max_capture_seconds) if b is not None]
    if len(budgets) != 1:
        raise UsageError("give exactly one budget: --max-graphs N, --max-graph-memory GIB or --max-capture-seconds S")
    if objective is None:
        objective = "step-time" if cost.steps is not None else "padding"
    if objective not in ("step-time", "padding"):
        raise UsageError(f"--objective must be step-time or padding (got {objective!r})")
    if objective == "step-time" and cost.steps is None:
        raise UsageError(
            f"the calibration {cost.name} has no step times, so step time cannot be the objective",
            "pass --calibration with a file from capplan calibrate, or --objective padding",
        )
    default_sizes, top = resolve_capture_sizes(spec)
    if top == 0:
        raise UsageError("cudagraph.mode is NONE: there are no graphs to choose")
    base = spec.model_copy(update={"cudagraph": spec.cudagraph.model_copy(update={"lora_case_sizes": None})})
    default_plan = compile_plan(spec)
    goal = Objective(spec, trace, top, default_plan, cost, objective)
    default = _point(
        default_plan,
        cost,
        default_sizes,
        _padding(goal.flat, default_sizes),
        goal.real,
        None,
        goal.step_seconds({-1: default_sizes, **_case_sizes(spec)}),
    )
    if max_graphs is not None:
        budget = f"{max_graphs} graphs"
    elif max_graph_memory is not None:
        budget = f"{max_graph_memory} GiB graph memory"
    else:
        budget = f"{max_capture_seconds} s capture"

    def fits(p: CurvePoint) -> bool:
        if max_graphs is not None:
            return p.graphs <= max_graphs
        if max_graph_memory is not None:
            return p.graph_memory_gib <= max_graph_memory
        return p.capture_seconds <= max_capture_seconds

    per_case = (
        not shared_sizes
        and spec.lora.enabled
        and spec.parallel.data_parallel_size == 1
        and len(default_plan.lora_capture_cases) > 1
    )
    if per_case:
        curve = _per_case_curve(base, goal, cost, top, default_plan, max_points)
    else:
        curve = _shared_curve(base, goal, cost, top, fits, max_points)
    feasible = [p for p in curve if fits(p)]
    if not feasible:
        raise UsageError(
            f"no capture set fits {budget}: the smallest needs {min(p.graphs for p in curve)} graphs "
            f"(~{min(p.graph_memory_gib for p in curve):.2f} GiB, ~{min(p.capture_seconds for p in curve):.0f} s)",
            "raise the budget",
        )
    if objective == "step-time":
        best = min(feasible, key=lambda p: (p.step_seconds, p.graphs))
    else:
        best = min(feasible, key=lambda p: (p.padded_tokens, p.graphs))
    return Optimized(best.spec, compile_plan(best.spec), best, default, curve, budget, objective)


def _case_sizes(spec: Spec) -> dict[int, list[int]]:
    entries = spec.cudagraph.lora_case_sizes or []
    return {e.case: e.sizes for e in entries}


def _shared_curve(spec: Spec, goal: Objective, cost: CostModel, top: int, fits, max_points: int) -> list[CurvePoint]:
    """One size set for every LoRA case (what vLLM can express; required under DP). Under the
    step-time objective the largest size is chosen too: batches above it are priced eager."""
    solver = goal.solver(sorted(goal.per_case), top, open_top=True)
    curve: list[CurvePoint] = []
    for k in range(1, min(len(solver.sizes), max_points) + 1):
        value, sizes = solver.best(k)
        if curve and sizes == curve[-1].capture_sizes:
            break  # no more sizes pay
        chosen = with_sizes(spec, sizes)
        padded = _padding(goal.flat, sizes)
        point = _point(
            compile_plan(chosen, with_deviations=False),
            cost,
            sizes,
            padded,
            goal.real,
            chosen,
            goal.step_seconds({-1: sizes}),
        )
        curve.append(point)
        if len(curve) > 1 and not fits(point) and not fits(curve[-2]):
            break  # two past the budget: graph counts only grow from here
        if goal.steps is None and value == 0:
            break
    return curve


def _per_case_curve(
    spec: Spec, goal: Objective, cost: CostModel, top: int, default_plan: Plan, max_points: int
) -> list[CurvePoint]:
    """Sizes per LoRA case: exact per-case bucketing, budget split across cases by a knapsack.

    Every case keeps the largest size (the spec requires it of cudagraph.lora_case_sizes,
    so no batch loses its graph); a case the trace never uses keeps only that one. The
    graph cost of a size for a case is counted from the compiled union of all candidate
    sizes, so the knapsack sees pruning and FULL/PIECEWISE; every curve point is compiled
    for its exact count.
    """
    cases = default_plan.lora_capture_cases
    per_case = {c: goal.per_case.get(c, {}) for c in cases}
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

    options: dict[int, list[tuple[int, float, list[int]]]] = {}
    for c in cases:
        solver = goal.solver([c], top, open_top=False)
        opts: list[tuple[int, float, list[int]]] = []
        for k in range(1, min(len(solver.sizes), max_points) + 1):
            value, sizes = solver.best(k)
            if opts and value >= opts[-1][1]:
                break
            opts.append((graphs_for(c, sizes), value, sizes))
            if goal.steps is None and value == 0:
                break
        options[c] = opts
    total = sum(o[-1][0] for o in options.values())
    floor = sum(o[0][0] for o in options.values())
    # Knapsack over cases: best[b] = least cost with at most b graphs.
    best: list[float] = [0.0] * (total + 1)
    picks: list[list[int]] = []
    for c in cases:
        new = [INF] * (total + 1)
        pick = [-1] * (total + 1)
        for b in range(total + 1):
            for i, (g, value, _) in enumerate(options[c]):
                if g <= b and best[b - g] + value < new[b]:
                    new[b], pick[b] = best[b - g] + value, i
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
        padded = sum(_padding(per_case[c], chosen[c]) for c in cases)
        curve.append(_point(plan, cost, union_sizes, padded, goal.real, cand, goal.step_seconds(chosen)))
    curve.sort(key=lambda p: (p.graphs, p.padded_tokens))
    return curve


def _point(
    plan: Plan,
    cost: CostModel,
    sizes: list[int],
    padded: int,
    real: int,
    spec: Spec | None = None,
    step_seconds: float | None = None,
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
        step_seconds,
    )


def render_curve(result: Optimized, full: bool = False) -> str:
    """The trade-off curve as text: by default the points near the choice (up to twice its
    graph count, at most 40 rows), the rest summarized in one line; `full` prints them all."""
    d = result.default
    timed = result.objective == "step-time"
    if timed:
        goal = "predicted step time on the trace (graph replay vs eager, from the calibration's step times)"
    else:
        goal = f"padded tokens on the trace (largest graph kept at {d.capture_sizes[-1]} tokens)"
    lines = [
        f"capplan optimize: budget {result.budget}; objective: {goal}",
        f"  default capture set: {d.sizes} sizes, {d.graphs} graphs, ~{d.graph_memory_gib:.2f} GiB, "
        f"padding {d.padding_overhead:.2%}" + (f", ~{d.step_seconds:.2f} s of steps" if timed else ""),
        "  sizes  graphs  ~GiB    ~capture s  padded tokens  padding" + ("  ~step s" if timed else ""),
    ]
    shown = result.curve if full else [p for p in result.curve if p.graphs <= 2 * result.point.graphs]
    every = 1 if full else max(1, len(shown) // 40)
    for i, p in enumerate(shown):
        if p is result.point or i % every == 0 or i == len(shown) - 1:
            mark = "  <- chosen" if p is result.point else ""
            lines.append(
                f"  {p.sizes:>5}  {p.graphs:>6}  {p.graph_memory_gib:>6.3f}  {p.capture_seconds:>10.1f}  "
                f"{p.padded_tokens:>13}  {p.padding_overhead:>7.2%}"
                + (f"  {p.step_seconds:>8.2f}" if timed else "")
                + mark
            )
    rest = len(result.curve) - len(shown)
    if rest:
        top = max(p.graphs for p in result.curve)
        lines.append(f"  ... {rest} more point(s), up to {top} graphs (--full-curve prints them)")
    return "\n".join(lines)
