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

Every point of the curve is then scored by replaying the trace through its
compiled plan (`simulate`, DP sync included when one trace per rank is
given): the padded tokens and the predicted step time users see are the
simulator's, not the bucketing's approximation. Under the step-time
objective the bucketing only considers sizes every batch it would pad can be
priced at (see capplan.traffic.steps), and a point whose replay needs a price
the calibration does not have is never chosen: with no priced point left,
optimize refuses and names the points to measure.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from capplan.calibration.price import Figure, Pricer
from capplan.errors import UsageError
from capplan.planner.capture_sizes import resolve_capture_sizes
from capplan.planner.compiler import compile_plan
from capplan.schemas.plan import Plan
from capplan.schemas.spec import Spec
from capplan.traffic.folds import BANDWIDTHS, BLOCKS, Weights, held_out_scores, padded, smoothed, time_blocks
from capplan.traffic.simulate import Simulation, TraceBatch, simulate, simulate_ranks
from capplan.traffic.steps import Point, StepTimes

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

    `weights` maps a group (a LoRA case, or a (case, kind) pair) to {tokens:
    steps}. The candidate sizes are `sizes` (default: every token count and
    `top`); a batch pads to the smallest chosen size >= its tokens. Without
    `price` the cost is padded tokens (a step of t tokens on size s costs
    s - t) and the top size is always chosen. With `price(group, size)`
    (milliseconds of one step replaying that size, None when unknown) the cost
    is step time; with `eager(group, tokens)` as well, the largest chosen size
    may stay below the last candidate, and batches above it are priced eager.
    Prices are made non-decreasing in size, which keeps the bucket cost Monge
    (so each DP layer's argmin is monotone); an unknown price is infinite.
    """

    def __init__(
        self,
        weights: dict,
        top: int,
        price=None,
        eager=None,
        sizes: list[int] | None = None,
        max_pad: float | None = None,
        required: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        self.max_pad = max_pad  # no batch of n tokens pads past max_pad * n (None: unbounded)
        counts = {t for w in weights.values() for t in w}
        self.sizes = sorted(set(sizes) if sizes is not None else counts | {top})
        if counts and max(counts) > top:
            raise ValueError("weights above the top size")
        self.padding = price is None
        m = len(self.sizes)
        merged: dict[int, int] = {}
        for w in weights.values():
            for t, n in w.items():
                merged[t] = merged.get(t, 0) + n
        keys = [None] if self.padding else sorted(weights)
        self.w: list[list[int]] = []  # per group: prefix sums of steps padded to sizes[:j]
        self.g: list[list[float]] = []  # per group: price of each size (1-based)
        for key in keys:
            w = merged if key is None else weights[key]
            prefix = [0] * (m + 1)
            for t, n in w.items():
                j = bisect.bisect_left(self.sizes, t)
                if j < m:
                    prefix[j + 1] += n
            for j in range(1, m + 1):
                prefix[j] += prefix[j - 1]
            self.w.append(prefix)
            prices, top_price = [0.0], 0.0
            for j, c in enumerate(self.sizes, 1):
                value = float(c) if self.padding else price(key, c)
                if value is None:  # unknown: infinite, unless no step of this group pads to c or below
                    value = INF if prefix[j] else 0.0
                top_price = max(top_price, value)
                prices.append(top_price)
            self.g.append(prices)
        self.t = [0] * (m + 1)  # prefix sums of weighted tokens (padding objective)
        for t, n in merged.items():
            j = bisect.bisect_left(self.sizes, t)
            if j < m:
                self.t[j + 1] += n * t
        for j in range(1, m + 1):
            self.t[j] += self.t[j - 1]
        # tail[j]: eager cost of every batch above sizes[j-1] (inf: the last size must be chosen)
        self.tail = [INF] * m + [0.0]
        if eager is not None and not self.padding:
            above = sorted(((t, key, n) for key in keys for t, n in weights[key].items()), reverse=True)
            acc, k = 0.0, 0
            for j in range(m, -1, -1):
                bound = self.sizes[j - 1] if j > 0 else 0
                while k < len(above) and above[k][0] > bound:
                    t, key, n = above[k]
                    value = eager(key, t)
                    acc += INF if value is None else n * value
                    k += 1
                self.tail[j] = acc
        self.layers: list[list[float]] = []
        self.parents: list[list[int]] = []
        # first[j]: the smallest i whose bucket (sizes[i-1], sizes[j-1]] meets the padding bound
        self.first = [0] * (m + 1)
        if max_pad is not None:
            floors = [max_pad * ((self.sizes[i - 1] if i else 0) + 1) for i in range(m)]
            for j in range(1, m + 1):
                self.first[j] = min(bisect.bisect_left(floors, self.sizes[j - 1]), j - 1)
        # a required size is chosen: no bucket reaches across it (first only grows, as above)
        for size in required:
            p = bisect.bisect_left(self.sizes, size) + 1
            if p <= m and self.sizes[p - 1] == size:
                for j in range(p + 1, m + 1):
                    self.first[j] = max(self.first[j], p)

    def cost(self, i: int, j: int) -> float:
        """Cost when sizes[j-1] serves every count in (sizes[i-1], sizes[j-1]] (1-based j);
        infinite when the smallest of those counts, traced or not, would pad past max_pad."""
        if i < self.first[j]:
            return INF  # past the padding bound, or across a required size
        if self.max_pad is not None and self.sizes[j - 1] > self.max_pad * ((self.sizes[i - 1] if i else 0) + 1):
            return INF
        total = 0.0
        for w, g in zip(self.w, self.g):
            steps = w[j] - w[i]
            if steps:
                total += g[j] * steps
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
        last = max((i for i, v in enumerate(prev) if v < INF), default=-1)  # the last reachable i
        stack = [(lo, hi, opt_lo, opt_hi)]
        while stack:
            lo, hi, opt_lo, opt_hi = stack.pop()
            if lo > hi:
                continue
            mid = (lo + hi) // 2
            if self.first[mid] > last:
                # every bucket ending here starts past what k-1 sizes reach under the padding
                # bound, and so does every later one (first only grows): all unreachable
                for j in range(mid, hi + 1):
                    cur[j], par[j] = INF, opt_lo
                stack.append((lo, mid - 1, opt_lo, opt_hi))
                continue
            start = max(opt_lo, self.first[mid])  # below it every bucket breaks the padding bound
            best, arg = INF, start
            end = min(mid - 1, opt_hi)
            if self.padding and len(self.w) == 1 and start <= end and self.cost(start, mid) < INF:
                # padded tokens of one group, the cost inlined (the loop optimize spends its time in):
                # from `start` on every bucket meets the padding bound (it only gets narrower)
                w, t, size = self.w[0], self.t, self.sizes[mid - 1]
                wj, tj = w[mid], t[mid]
                for i in range(start, end + 1):
                    v = prev[i] + size * (wj - w[i]) - (tj - t[i])
                    if v < best:
                        best, arg = v, i
            else:
                for i in range(start, end + 1):
                    v = prev[i] + self.cost(i, mid)
                    if v < best:
                        best, arg = v, i
            cur[mid], par[mid] = best, arg
            if best == INF:  # no argmin to narrow the search by (unpriced sizes)
                stack.append((lo, mid - 1, opt_lo, opt_hi))
                stack.append((mid + 1, hi, opt_lo, opt_hi))
                continue
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
    graph_memory_gib: float | None  # None: not priced (the pricer's basis says why)
    capture_seconds: float | None
    padded_tokens: int
    padding_overhead: float
    capture_sizes: list[int]
    spec: Spec
    step_seconds: float | None = None  # predicted total step time on the trace; None: not priced
    step_seconds_bounds: tuple[float, float] | None = None  # where the true total lies (interpolated prices)
    unpriced: tuple[tuple[Point, int], ...] = ()  # points its replay needs that the calibration lacks
    slowdown_bound: float | None = None  # at most this fraction slower than the default plan (step time)
    fold_padded_tokens: int | None = None  # padded tokens of the fitted blocks, each under sizes fitted without it
    graph_memory_gib_hi: float | None = None  # the price's upper bound (its value where it has no interval)
    capture_seconds_hi: float | None = None

    def to_json(self) -> dict:
        data = {k: v for k, v in self.__dict__.items() if k not in ("spec", "unpriced", "step_seconds_bounds")}
        if self.slowdown_bound is not None:
            data["slowdown_bound"] = round(self.slowdown_bound, 6)
        data["step_seconds_bounds"] = None if self.step_seconds_bounds is None else list(self.step_seconds_bounds)
        data["unpriced_points"] = [
            {"mode": p.mode, "lora_case": p.case, "num_tokens": p.tokens, "steps": n} for p, n in self.unpriced
        ]
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
    basis: str  # what the step times rest on
    assumption: str | None = None  # how the trace stands for DP ranks
    fallback: str | None = None  # why the padding objective was used instead of step time
    capture_basis: str = ""  # what the chosen plan's capture seconds and graph memory rest on (and the default's kind)
    capture_notes: tuple[str, ...] = ()  # the chosen plan's price notes: what is extrapolated, not checked, not read


def worst_pad(sizes: list[int]) -> float:
    """The most any batch, traced or not, pads by with these sizes: the size above a gap over
    the smallest count it serves (batches above the largest size run eager: no padding)."""
    out, prev = 1.0, 0
    for size in sorted(sizes):
        out = max(out, size / (prev + 1))
        prev = size
    return out


def with_sizes(spec: Spec, sizes: list[int]) -> Spec:
    data = spec.model_dump(mode="json")
    data["cudagraph"]["capture_sizes"] = sizes
    data["cudagraph"]["max_capture_size"] = None
    data["cudagraph"]["lora_case_sizes"] = None
    return Spec.model_validate(data)


class Objective:
    """What a capture set costs on the trace: padded tokens, or predicted step time (ms).

    Under step time, batches are grouped by LoRA case and by the graph mode that
    would serve them: a uniform decode batch replays a FULL graph when its size
    is one vLLM captures FULL (up to the largest FULL size), a PIECEWISE one
    above that; any other batch replays PIECEWISE, or runs eager when the mode
    has no PIECEWISE graphs. Each group is priced with its own measured times
    only. This grouping guides the search; every point is then scored by the
    simulator (`score`).
    """

    def __init__(
        self,
        spec: Spec,
        traces: list[list[TraceBatch]],
        top: int,
        plan: Plan,
        step_times: StepTimes,
        pricer: Pricer,
        name: str,
        max_pad: float | None = None,
        blocks: int = BLOCKS,
    ) -> None:
        from capplan.planner.dispatch import Dispatcher, derive_uniform

        trace = [item for t in traces for item in t]
        self.max_pad = max_pad
        # sizes the trace never hits, so a padding bound can always be met: vLLM's own defaults
        self.fillers = set(plan.capture_sizes) if max_pad is not None else set()
        self.traces = traces
        self.top = top
        self.step_times = step_times
        self.pricer = pricer  # capture seconds and graph memory of each candidate plan
        self.name = name
        self.steps = step_times.model if name == "step-time" else None
        self.flat = token_weights(trace, top)
        self.per_case = case_weights(trace, top, plan)
        self.groups: dict[int, dict[tuple[int, str], dict[int, int]]] = {}  # case -> (case, kind) -> weights
        self.measured: set[int] = set()
        self.default_sim: Simulation | None = None  # the default plan's replay, once scored
        self.default_sizes = list(plan.capture_sizes)
        self.dql = spec.decode_query_len
        # the fitted trace in time-ordered blocks, per LoRA case: sizes are judged on steps they
        # were not fitted on (capplan.traffic.folds); one trace and the padding objective only
        self.blocks: list[dict[int, dict[int, int]]] = []
        if self.steps is None and len(traces) == 1 and name == "padding":
            parts = time_blocks(traces[0], blocks)
            if len(parts) > 1:
                self.blocks = [case_weights(part, top, plan) for part in parts]
        if self.steps is None:
            return
        self.measured = self.steps.measured_tokens("graph") | self.steps.measured_tokens("piecewise")
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
            decode = not b.has_prefill and derive_uniform(b, spec.rules) == dql
            if b.num_tokens > top or not (decode or has_piecewise):
                continue  # eager whatever the sizes: the same in every point
            kind = "full" if decode and self.full_max else "piecewise"
            weights = self.groups.setdefault(case, {}).setdefault((case, kind), {})
            weights[b.num_tokens] = weights.get(b.num_tokens, 0) + item.count

    def price(self, group: tuple[int, str], size: int) -> float | None:
        assert self.steps is not None
        case, kind = group
        mode = "graph" if kind == "full" and size <= self.full_max else "piecewise"
        found = self.steps.price(mode, case, size)
        return None if found is None else found.ms

    def eager(self, group: tuple[int, str], tokens: int) -> float | None:
        assert self.steps is not None
        found = self.steps.price("eager", group[0], tokens)
        return None if found is None else found.ms

    def solver(self, cases: list[int], top: int, open_top: bool) -> Bucketing | None:
        """The bucketing problem of these LoRA cases (all of them: one shared size list); None
        when no size can be priced."""
        if self.steps is None:
            merged: dict[int, int] = {}
            for c in cases:
                for t, w in self.per_case.get(c, {}).items():
                    merged[t] = merged.get(t, 0) + w
            candidates = sorted(set(merged) | {top} | {f for f in self.fillers if f <= top})
            return Bucketing({0: merged}, top, sizes=candidates, max_pad=self.max_pad)
        groups = {g: w for c in cases for g, w in self.groups.get(c, {}).items()}
        counts = {t for w in groups.values() for t in w}
        sizes = []
        for size in sorted((counts | self.measured | {top}) - {s for s in self.measured if s > top}):
            # a size is a candidate when every group that may pad to it has a price there
            if all(self.price(g, size) is not None for g, w in groups.items() if min(w, default=size + 1) <= size):
                sizes.append(size)
        if not open_top and top not in sizes:
            sizes.append(top)  # required of every case (cudagraph.lora_case_sizes); priced infinite if unknown
        if not sizes:
            return None
        return Bucketing(groups, top, self.price, self.eager if open_top else None, sizes, self.max_pad)

    def required(self, weights: dict) -> set[int]:
        """Sizes always kept: one decode step's tokens when the trace has single decodes (a lone
        request must not pad to twice its tokens because it is rare)."""
        return {self.dql} if weights.get(self.dql) else set()

    def chooser(self, weights: Weights, top: int, required: set[int]):
        """k -> the k sizes of least padded tokens on `weights` (None: none meets the bound)."""
        candidates = sorted(set(weights) | {top} | {f for f in self.fillers if f <= top} | required)
        solver = Bucketing({0: weights}, top, sizes=candidates, max_pad=self.max_pad, required=required)

        def choose(k: int) -> list[int] | None:
            value, sizes = solver.best(k)
            return None if value == INF else sizes

        return choose

    def options(self, cases: list[int], top: int, limit: int) -> list[tuple[float, float | None, list[int]]]:
        """Ways to choose one size list for these LoRA cases (padding objective): (fitted padded
        tokens, padded tokens on the folds or None, sizes), for each smoothing width and number
        of sizes up to `limit`, and vLLM's default sizes."""
        merged: Weights = {}
        for c in cases:
            for t, n in self.per_case.get(c, {}).items():
                merged[t] = merged.get(t, 0.0) + n
        required = self.required(merged)
        blocks: list[Weights] = []
        for part in self.blocks:
            block: Weights = {}
            for c in cases:
                for t, n in part.get(c, {}).items():
                    block[t] = block.get(t, 0.0) + n
            blocks.append(block)
        out: list[tuple[float, float | None, list[int]]] = []
        for width in BANDWIDTHS if blocks else (0.0,):
            fitted = smoothed(merged, width, top)
            candidates = sorted(set(fitted) | {top} | {f for f in self.fillers if f <= top} | required)
            solver = Bucketing({0: fitted}, top, sizes=candidates, max_pad=self.max_pad, required=required)
            chosen: list[tuple[int, float, list[int]]] = []
            # up to twice the default's sizes: past that each size saves a few padded tokens (smoothed
            # weights cover every count near a traced one), and each costs a DP layer per fold
            most = min(limit, max(2 * len(self.default_sizes), 1))
            for k in range(1, min(len(solver.sizes), most) + 1):
                value, sizes = solver.best(k)
                if value == INF:
                    continue  # no set of k sizes meets the padding bound
                if chosen and value >= chosen[-1][1]:
                    break
                chosen.append((k, value, sizes))
                if value == 0:
                    break
            ks = [k for k, _, _ in chosen]
            scores: list[float | None] = [None] * len(ks)
            if blocks:
                scores = list(held_out_scores(blocks, width, top, lambda w: self.chooser(w, top, required), ks))
            out += [(padded(sizes, merged), score, sizes) for (_, _, sizes), score in zip(chosen, scores)]
        default = [s for s in self.default_sizes if s <= top]
        if default and default[-1] == top and (self.max_pad is None or worst_pad(default) <= self.max_pad):
            out.append((padded(default, merged), sum(padded(default, b) for b in blocks) if blocks else None, default))
        return out

    def score(self, plan: Plan) -> Simulation:
        """The trace replayed through a compiled plan: padded tokens and predicted step time."""
        steps = self.step_times if self.steps is not None else None
        if len(self.traces) == 1:
            return simulate(plan, self.traces[0], steps=steps, leave_out_above=self.top)
        return simulate_ranks(plan, self.traces, steps=steps, leave_out_above=self.top)

    def left_out(self) -> str | None:
        """What the step times leave out: steps above the largest graph, eager in every candidate."""
        sim = self.default_sim
        if sim is None or sim.clock is None or not sim.clock.left_out:
            return None
        return (
            f"{sim.clock.left_out} step(s) above the largest graph ({self.top} tokens) run eager in every "
            "candidate and are left out of the predicted step times"
        )


@dataclass
class Budget:
    max_graphs: int | None = None
    max_graph_memory: float | None = None
    max_capture_seconds: float | None = None
    max_slowdown: float | None = None  # percent of the default plan's predicted step time
    text: str = field(default="")

    def fits(self, p: CurvePoint) -> bool:
        if self.max_graphs is not None:
            return p.graphs <= self.max_graphs
        # a price is held to a budget by its interval's upper bound: within it however the price errs
        if self.max_graph_memory is not None:
            return p.graph_memory_gib_hi is not None and p.graph_memory_gib_hi <= self.max_graph_memory
        if self.max_capture_seconds is not None:
            return p.capture_seconds_hi is not None and p.capture_seconds_hi <= self.max_capture_seconds
        return True  # max_slowdown: judged against the default plan once it is scored


MEASURE_HINT = (
    "measure them: record this traffic under the default plan and fit it (capplan apply --runner mrv2 PLAN "
    "--trace T.jsonl -- vllm serve ..., then capplan calibrate-trace PLAN T.jsonl -o CAL.yaml --calibration "
    "YOUR-CALIBRATION.yaml), or for FULL decode steps capplan calibrate-steps SPEC --model DIR -o CAL.yaml"
)
FALLBACK_HINT = "; or pass --padding-fallback to choose by padded tokens"


def _points_text(points: list[tuple[Point, int]], shown: int = 8) -> str:
    text = ", ".join(f"{p.text()} ({n} steps)" for p, n in points[:shown])
    return text + (f" and {len(points) - shown} more" if len(points) > shown else "")


def optimize(
    spec: Spec,
    trace: list[TraceBatch] | list[list[TraceBatch]],
    step_times: StepTimes,
    *,
    pricer: Pricer | None = None,
    max_graphs: int | None = None,
    max_graph_memory: float | None = None,
    max_capture_seconds: float | None = None,
    max_slowdown: float | None = None,
    shared_sizes: bool = False,
    objective: str | None = None,
    padding_fallback: bool = False,
    max_points: int = 400,
    max_pad: float | None = None,
    blocks: int = BLOCKS,
) -> Optimized:
    """Choose capture sizes. `trace`: one trace, or one per DP rank (a list of traces).
    `max_pad`: no batch of n tokens, traced or not, pads past max_pad * n (None: unbounded).
    `blocks`: the time-ordered blocks sets are judged on (capplan.traffic.folds); 1: by the
    padding on the whole trace, as fitted."""
    if max_pad is not None and not 1.0 <= max_pad <= 1e6:
        raise UsageError(
            f"--max-pad-ratio must be from 1 to 1000000 (got {max_pad:g})", "2 lets a batch at most double"
        )
    traces: list[list[TraceBatch]] = trace if trace and isinstance(trace[0], list) else [trace]  # type: ignore[list-item]
    budget = Budget(max_graphs, max_graph_memory, max_capture_seconds, max_slowdown)
    given = [b for b in (max_graphs, max_graph_memory, max_capture_seconds, max_slowdown) if b is not None]
    if len(given) != 1:
        raise UsageError(
            "give exactly one budget: --max-graphs N, --max-graph-memory GIB, --max-capture-seconds S "
            "or --max-slowdown PCT"
        )
    pricer = pricer if pricer is not None else Pricer()
    basis = step_times.basis(spec)
    if objective is None:
        objective = "step-time" if step_times.model is not None and basis.usable else "padding"
    if objective not in ("step-time", "padding"):
        raise UsageError(f"--objective must be step-time or padding (got {objective!r})")
    if not basis.usable and (objective == "step-time" or max_slowdown):
        raise UsageError(
            f"{basis.label()}: its step times cannot price this deployment",
            "pass --calibration with a calibration of this model and GPU, or --objective padding",
        )
    if objective == "step-time" and step_times.model is None:
        raise UsageError(
            f"the calibration {step_times.name} has no step times, so step time cannot be the objective",
            "pass --calibration with a file from capplan calibrate-steps, or --objective padding",
        )
    if max_slowdown is not None and objective != "step-time":
        raise UsageError("--max-slowdown compares predicted step times: it needs the step-time objective")
    if max_graph_memory is not None or max_capture_seconds is not None:
        priced = pricer.price(compile_plan(spec))
        if not priced.priced:
            said = "; ".join((priced.basis, *priced.notes))
            raise UsageError(f"capture is not priced for that budget: {said}")
    default_sizes, top = resolve_capture_sizes(spec)
    if top == 0:
        raise UsageError("cudagraph.mode is NONE: there are no graphs to choose")
    if max_graphs is not None:
        budget.text = f"{max_graphs} graphs"
    elif max_graph_memory is not None:
        budget.text = f"{max_graph_memory} GiB graph memory (the price's upper bound)"
    elif max_capture_seconds is not None:
        budget.text = f"{max_capture_seconds} s capture (the price's upper bound)"
    else:
        budget.text = f"at most {max_slowdown}% slower steps than the default plan (predicted)"

    def run(goal: str) -> Optimized:
        return _optimize(
            spec, traces, step_times, pricer, budget, shared_sizes, goal, max_points, basis.label(), max_pad, blocks
        )

    try:
        return run(objective)
    except Unpriced as exc:
        if not padding_fallback or max_slowdown is not None:
            offer = "" if padding_fallback or max_slowdown is not None else FALLBACK_HINT
            raise UsageError(exc.message, MEASURE_HINT + offer) from None
        return Optimized(**{**run("padding").__dict__, "fallback": exc.message})


class Unpriced(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _optimize(
    spec: Spec,
    traces: list[list[TraceBatch]],
    step_times: StepTimes,
    pricer: Pricer,
    budget: Budget,
    shared_sizes: bool,
    objective: str,
    max_points: int,
    basis: str,
    max_pad: float | None = None,
    blocks: int = BLOCKS,
) -> Optimized:
    default_sizes, top = resolve_capture_sizes(spec)
    base = spec.model_copy(update={"cudagraph": spec.cudagraph.model_copy(update={"lora_case_sizes": None})})
    default_plan = compile_plan(spec)
    goal = Objective(spec, traces, top, default_plan, step_times, pricer, objective, max_pad, blocks)
    goal.default_sim = goal.score(default_plan)
    default = _point(default_plan, default_sizes, spec, goal, goal.default_sim)  # its slowdown bound: 0
    per_case = (
        not shared_sizes
        and spec.lora.enabled
        and spec.parallel.synced_size == 1
        and len(default_plan.lora_capture_cases) > 1
    )
    if per_case:
        curve = _per_case_curve(base, goal, top, default_plan, max_points)
    else:
        curve = _shared_curve(base, goal, top, budget.fits, max_points)
    feasible = [p for p in curve if budget.fits(p)]
    if not feasible:
        if not curve and objective == "padding":
            raise UsageError(
                f"no capture set keeps every batch within the padding bound of {max_pad:g}x",
                "raise --max-pad-ratio: the candidate sizes (the trace's token counts and vLLM's default sizes) "
                "leave wider gaps; 2 lets a batch at most double",
            )
        if not curve:
            bound = f" (or none meets the padding bound of {max_pad:g}x)" if max_pad is not None else ""
            raise Unpriced(
                f"no capture size can be priced for this trace{bound}: the default plan's replay needs "
                f"{_points_text(list(default.unpriced)) or 'prices the calibration lacks'}"
            )
        graphs = min(p.graphs for p in curve)
        bound = f" with no batch padding past {max_pad:g}x" if max_pad is not None else ""
        raise UsageError(
            f"no capture set fits {budget.text}{bound}: the smallest needs {graphs} graphs",
            "raise the budget" + (", or --max-pad-ratio" if bound else ""),
        )
    if objective == "step-time":
        priced = [p for p in feasible if p.step_seconds is not None]
        if budget.max_slowdown is not None:
            if default.step_seconds_bounds is None:
                raise Unpriced(
                    "the default plan's step time cannot be predicted, so no slowdown against it can be: its replay "
                    f"needs {_points_text(list(default.unpriced))}"
                )
            limit = budget.max_slowdown / 100
            priced = [p for p in priced if p.slowdown_bound is not None and p.slowdown_bound <= limit + 1e-12]
            priced.append(default)  # the reference itself: 0% slower by definition
            if not priced:
                raise UsageError(
                    f"no priced capture set is proven within {budget.max_slowdown}% of the default plan's predicted "
                    f"step time ({default.step_seconds:.3f} s)",
                    "raise --max-slowdown, or measure more sizes so interpolated prices are tighter",
                )
            best = min(priced, key=lambda p: (p.graphs, p.step_seconds or 0.0))
        elif not priced:
            closest = min(feasible, key=lambda p: (sum(n for _, n in p.unpriced), p.graphs))
            raise Unpriced(
                f"every capture set within {budget.text} runs steps the calibration {step_times.name} did not measure "
                f"(nearest: {closest.graphs} graphs, needing {_points_text(list(closest.unpriced))})"
            )
        else:
            best = min(priced, key=lambda p: (p.step_seconds or 0.0, p.graphs))
    else:  # on steps each set was not fitted on, where the folds score them
        best = min(
            feasible,
            key=lambda p: (p.padded_tokens if p.fold_padded_tokens is None else p.fold_padded_tokens, p.graphs),
        )
    notes = [n for n in (goal.default_sim.assumption, goal.left_out()) if n]
    chosen = compile_plan(best.spec)
    capture, before = goal.pricer.price(chosen), goal.pricer.price(default_plan)
    kinds = capture.kind if before.kind == capture.kind else f"chosen {capture.kind}, default {before.kind}"
    return Optimized(
        best.spec,
        chosen,
        best,
        default,
        curve,
        budget.text,
        objective,
        basis,
        "; ".join(notes) or None,
        capture_basis=f"{kinds}; {capture.basis}" if capture.priced else f"not priced: {capture.basis}",
        capture_notes=capture.notes,
    )


def _shared_curve(spec: Spec, goal: Objective, top: int, fits, max_points: int) -> list[CurvePoint]:
    """One size set for every LoRA case (what vLLM can express; required under DP). Under the
    step-time objective the largest size is chosen too: batches above it are priced eager."""
    curve: list[CurvePoint] = []
    if goal.steps is None:  # padding: each way of choosing, scored on the folds when there are any
        missed, seen = 0, set()
        for _, folds, sizes in sorted(goal.options(sorted(goal.per_case), top, max_points), key=lambda o: len(o[2])):
            if tuple(sizes) in seen:
                continue
            seen.add(tuple(sizes))
            chosen = with_sizes(spec, sizes)
            point = _point(compile_plan(chosen, with_deviations=False), sizes, chosen, goal, folds=folds)
            curve.append(point)
            missed = 0 if fits(point) else missed + 1
            if missed >= 2 and any(fits(p) for p in curve):
                break  # two past the budget: graph counts only grow from here
        curve.sort(key=lambda p: (p.graphs, p.padded_tokens))
        return curve
    solver = goal.solver(sorted(goal.per_case), top, open_top=True)
    if solver is None:
        return curve
    for k in range(1, min(len(solver.sizes), max_points) + 1):
        value, sizes = solver.best(k)
        if curve and sizes == curve[-1].capture_sizes:
            break  # no more sizes pay
        if value == INF:
            continue  # no set of k sizes can be priced
        chosen = with_sizes(spec, sizes)
        point = _point(compile_plan(chosen, with_deviations=False), sizes, chosen, goal)
        curve.append(point)
        if len(curve) > 1 and not fits(point) and not fits(curve[-2]):
            break  # two past the budget: graph counts only grow from here
        if goal.steps is None and value == 0:
            break
    return curve


def _per_case_curve(spec: Spec, goal: Objective, top: int, default_plan: Plan, max_points: int) -> list[CurvePoint]:
    """Sizes per LoRA case: exact per-case bucketing, budget split across cases by a knapsack.

    Every case keeps the largest size (the spec requires it of cudagraph.lora_case_sizes,
    so no batch loses its graph); a case the trace never uses keeps only that one. The
    graph cost of a size for a case is counted from the compiled union of all candidate
    sizes, so the knapsack sees pruning and FULL/PIECEWISE; every curve point is compiled
    for its exact count.
    """
    cases = default_plan.lora_capture_cases
    per_case = {c: goal.per_case.get(c, {}) for c in cases}
    # padding objective: each case's ways to choose, scored on the folds when the trace has them
    # (fitted, folds, sizes); the knapsack below minimises the folds' padded tokens
    ways = {c: goal.options([c], top, max_points) for c in cases} if goal.steps is None else {}
    candidates = sorted(
        {t for w in per_case.values() for t in w}
        | {top}
        | {s for s in goal.measured if s <= top}
        | {s for way in ways.values() for _, _, sizes in way for s in sizes}
    )
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
    fitted_of: dict[tuple[int, tuple[int, ...]], float] = {}
    for c, way in ways.items():
        ranked = sorted(
            (graphs_for(c, sizes), fitted if folds is None else folds, fitted, sizes) for fitted, folds, sizes in way
        )
        kept: list[tuple[int, float, list[int]]] = []
        for count, value, fitted, sizes in ranked:  # the least graphs for each better score
            if not kept or value < kept[-1][1]:
                kept.append((count, value, sizes))
                fitted_of[(c, tuple(sizes))] = fitted
        if not kept:
            return []  # no size set of this case meets the padding bound
        options[c] = kept
    for c in cases if not ways else ():
        solver = goal.solver([c], top, open_top=False)
        opts: list[tuple[int, float, list[int]]] = []
        if solver is None:
            return []
        for k in range(1, min(len(solver.sizes), max_points) + 1):
            value, sizes = solver.best(k)
            if value == INF:
                continue  # no set of k sizes meets the padding bound (or can be priced)
            if opts and value >= opts[-1][1]:
                break
            opts.append((graphs_for(c, sizes), value, sizes))
            if goal.steps is None and value == 0:
                break
        if not opts:
            return []  # no size set of this case meets the padding bound
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
            for i, (count, value, _) in enumerate(options[c]):
                if count <= b and best[b - count] + value < new[b]:
                    new[b], pick[b] = best[b - count] + value, i
        best = new
        picks.append(pick)
    curve: list[CurvePoint] = []
    budgets = sorted({floor, total} | set(range(floor, total + 1, max(1, (total - floor) // 60))))
    seen: set[tuple] = set()
    for b in budgets:
        if best[b] == INF:
            continue
        chosen, rest, folds = {}, b, 0.0
        for c, pick in zip(reversed(cases), reversed(picks)):
            count, value, sizes = options[c][pick[rest]]
            chosen[c] = sizes
            folds += value
            rest -= count
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
        scored = folds if ways and goal.blocks else None
        curve.append(_point(compile_plan(cand, with_deviations=False), union_sizes, cand, goal, folds=scored))
    curve.sort(key=lambda p: (p.graphs, p.padded_tokens))
    return curve


def _point(
    plan: Plan,
    sizes: list[int],
    spec: Spec,
    goal: Objective,
    sim: Simulation | None = None,
    folds: float | None = None,
) -> CurvePoint:
    """A curve point, scored by replaying the trace through its compiled plan (`sim`: that
    replay, when the caller has it)."""
    priced = goal.pricer.price(plan)
    sim = sim or goal.score(plan)
    total = sim.total
    clock = sim.clock
    seconds = sim.step_seconds
    slowdown = None
    base = goal.default_sim
    if base is not None and clock is not None and base.clock is not None and base.clock.lo > 0:
        extra = clock.extra_ms_bound(base.clock)
        slowdown = None if extra is None else max(0.0, extra) / base.clock.lo
    return CurvePoint(
        len(sizes),
        len(plan.graphs),
        None if priced.gib is None else round(priced.gib.value, 4),
        None if priced.seconds is None else round(priced.seconds.value, 2),
        total.padded_tokens,
        total.padding_overhead,
        list(sizes),
        spec,
        None if seconds is None else round(seconds, 3),
        None if seconds is None or clock is None else (round(clock.lo / 1000, 3), round(clock.hi / 1000, 3)),
        tuple(sim.unpriced_points()),
        slowdown,
        None if folds is None else round(folds),
        _upper(priced.gib, 4),
        _upper(priced.seconds, 2),
    )


def _upper(figure: Figure | None, digits: int) -> float | None:
    """A price's upper bound (its value where it has no interval), what a budget is held to."""
    if figure is None:
        return None
    return round(figure.hi if figure.hi is not None else figure.value, digits)
