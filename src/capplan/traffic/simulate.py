"""The simulator: replay batch traces through a plan's dispatcher (reading traces: capplan.batches).

One trace is one engine's steps. With data parallelism (the plan's
dp.data_parallel_size > 1) each rank records its own trace, and the ranks
run in lockstep: at every step each rank dispatches its own batch, the ranks
all-reduce token counts and modes, and

- if any rank would run eager, every rank runs eager with its own tokens;
- otherwise every rank pads to the largest token count across ranks, the
  uniform-decode count survives only when all ranks share it, and each rank
  dispatches that padded count again with its own LoRA count;
- a rank with nothing scheduled runs vLLM's idle dummy batch (one uniform
  decode request, counted as max_loras + 1 adapters).

Rank traces are aligned by the `dp_step` the recorder writes under DP; traces
without it are aligned line by line, and the output says so. A step under DP
takes as long as the slowest rank's.

Step times are predicted only from what the calibration measured (see
capplan.traffic.steps): a step whose point was not measured (nor lies between
two measured points) leaves the prediction out and names the point.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from capplan.planner.dispatch import Batch, Dispatch, Dispatcher, derive_uniform
from capplan.schemas.plan import Plan
from capplan.traffic.steps import Point, StepModel, StepTimes

MODE_ORDER = {"NONE": 0, "PIECEWISE": 1, "FULL": 2}  # vLLM's CUDAGraphMode values: the lowest wins under DP


@dataclass(frozen=True)
class TraceBatch:
    batch: Batch
    count: int
    dp_step: int | None = None  # the DP step this batch ran in (the recorder writes it under DP)


@dataclass
class SimResult:
    """One engine's (one DP rank's) counts."""

    steps: int = 0
    graph_steps: int = 0
    eager_steps: int = 0
    idle_steps: int = 0  # DP: steps this rank ran vLLM's idle dummy batch (counted in graph/eager steps too)
    real_tokens: int = 0  # tokens of batches that replayed a graph
    padded_tokens: int = 0  # tokens added by padding on those batches
    eager_tokens: int = 0
    eager_above_largest: int = 0  # eager because more tokens than the largest graph
    hits: Counter = field(default_factory=Counter)  # graph id -> steps
    by_size: dict = field(default_factory=dict)  # num_tokens -> [steps, padded tokens]
    unused: list = field(default_factory=list)  # graph ids never replayed

    @property
    def hit_rate(self) -> float:
        return self.graph_steps / self.steps if self.steps else 0.0

    @property
    def padding_overhead(self) -> float:
        """Padded tokens per real token, over batches that replayed a graph."""
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0

    def add(self, d: Dispatch, batch: Batch | None, n: int, largest: int) -> None:
        """Count n steps of `batch` (None: the DP idle dummy) that ran `d`."""
        self.steps += n
        if d.graph_id >= 0:
            self.graph_steps += n
            self.hits[d.graph_id] += n
        else:
            self.eager_steps += n
        if batch is None:
            self.idle_steps += n
            return
        if d.graph_id < 0:
            self.eager_tokens += n * batch.num_tokens
            self.eager_above_largest += n * (batch.num_tokens > largest)
            return
        pad = d.num_tokens - batch.num_tokens
        self.real_tokens += n * batch.num_tokens
        self.padded_tokens += n * pad
        row = self.by_size.setdefault(d.num_tokens, [0, 0])
        row[0] += n
        row[1] += n * pad

    def to_json(self, plan: Plan) -> dict:
        unused = Counter(
            (plan.graphs[i].descriptor.cg_mode, plan.graphs[i].descriptor.num_active_loras) for i in self.unused
        )
        return {
            "steps": self.steps,
            "graph_steps": self.graph_steps,
            "eager_steps": self.eager_steps,
            "graph_hit_rate": round(self.hit_rate, 6),
            "eager_above_largest_graph": self.eager_above_largest,
            "real_tokens_in_graphs": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "padding_overhead": round(self.padding_overhead, 6),
            "eager_tokens": self.eager_tokens,
            "graphs": len(plan.graphs),
            "graphs_used": len(plan.graphs) - len(self.unused),
            "graphs_never_used": len(self.unused),
            "never_used_by_mode_and_case": [
                {"cg_mode": m, "lora_case": c, "graphs": n} for (m, c), n in sorted(unused.items())
            ],
            "by_size": [
                {"num_tokens": s, "steps": v[0], "padded_tokens": v[1]} for s, v in sorted(self.by_size.items())
            ],
        }


@dataclass
class StepClock:
    """Predicted step time, summed from measured prices; points without one are collected."""

    steps: StepModel
    ms: float = 0.0
    lo: float = 0.0
    hi: float = 0.0
    unpriced: Counter = field(default_factory=Counter)  # Point -> steps
    rows: dict = field(default_factory=dict)  # a step's batch (or batches, under DP) -> (its points, steps)
    left_out: int = 0  # steps not priced on purpose (see simulate's leave_out_above)

    def point(self, d: Dispatch, batch_tokens: int) -> Point:
        if d.graph_id < 0:
            return Point("eager", d.num_active_loras, batch_tokens)
        return Point("graph" if d.cg_mode == "FULL" else "piecewise", d.num_active_loras, d.num_tokens)

    def add(self, points: list[Point], n: int, key: object = None) -> None:
        """n steps in which these points ran side by side (DP ranks): the slowest sets the time.
        `key` names the batch (or the ranks' batches) so two plans' replays can be compared."""
        if key is not None:
            self.rows[key] = (tuple(points), n)
        prices = []
        for p in points:
            price = self.steps.price(p.mode, p.case, p.tokens)
            if price is None:
                self.unpriced[p] += n
            else:
                prices.append(price)
        if len(prices) == len(points):
            self.ms += n * max(p.ms for p in prices)
            self.lo += n * max(p.lo for p in prices)
            self.hi += n * max(p.hi for p in prices)

    @property
    def seconds(self) -> float | None:
        return None if self.unpriced else self.ms / 1000

    def extra_ms_bound(self, other: StepClock) -> float | None:
        """An upper bound on how many more milliseconds this replay takes than `other`'s of the
        same trace: steps that run the same points in both cost the same (their error cancels);
        the others differ by at most this one's upper bound less the other's lower bound."""
        if self.unpriced or other.unpriced:
            return None
        extra = 0.0
        for key, (points, n) in self.rows.items():
            theirs = other.rows.get(key)
            if theirs is None:
                return None
            if theirs[0] == points:
                continue
            mine = [self.steps.price(p.mode, p.case, p.tokens) for p in points]
            base = [other.steps.price(p.mode, p.case, p.tokens) for p in theirs[0]]
            extra += n * (max(p.hi for p in mine if p) - max(p.lo for p in base if p))
        return extra


@dataclass
class Simulation:
    ranks: list[SimResult]
    clock: StepClock | None = None
    step_model: str | None = None  # what the prediction rests on, or why there is none
    assumption: str | None = None  # how rank traces were aligned, or what one trace stands for
    dp_steps: int = 0

    @property
    def total(self) -> SimResult:
        if len(self.ranks) == 1:
            return self.ranks[0]
        out = SimResult()
        for r in self.ranks:
            for name in (
                "steps",
                "graph_steps",
                "eager_steps",
                "idle_steps",
                "real_tokens",
                "padded_tokens",
                "eager_tokens",
                "eager_above_largest",
            ):
                setattr(out, name, getattr(out, name) + getattr(r, name))
            out.hits.update(r.hits)
            for size, (steps, pad) in r.by_size.items():
                row = out.by_size.setdefault(size, [0, 0])
                row[0] += steps
                row[1] += pad
        out.unused = sorted(set.intersection(*(set(r.unused) for r in self.ranks)))
        return out

    @property
    def step_seconds(self) -> float | None:
        return None if self.clock is None else self.clock.seconds

    @property
    def step_ms(self) -> float | None:
        seconds = self.step_seconds
        return None if seconds is None else seconds * 1000

    def __getattr__(self, name: str):
        # The counts of the whole run (one engine, or every rank summed): sim.steps, sim.hits, ...
        if name.startswith("_") or name not in SimResult.__dataclass_fields__ and not hasattr(SimResult, name):
            raise AttributeError(name)
        return getattr(self.total, name)

    def unpriced_points(self) -> list[tuple[Point, int]]:
        if self.clock is None:
            return []
        return sorted(self.clock.unpriced.items(), key=lambda kv: (-kv[1], kv[0]))

    def to_json(self, plan: Plan) -> dict:
        data = self.total.to_json(plan)
        seconds = self.step_seconds
        data["predicted_step_seconds"] = None if seconds is None else round(seconds, 6)
        data["predicted_step_seconds_bounds"] = (
            None
            if seconds is None or self.clock is None
            else [round(self.clock.lo / 1000, 6), round(self.clock.hi / 1000, 6)]
        )
        data["step_model"] = self.step_model
        data["unpriced_points"] = [
            {"mode": p.mode, "lora_case": p.case, "num_tokens": p.tokens, "steps": n} for p, n in self.unpriced_points()
        ]
        data["assumption"] = self.assumption
        if len(self.ranks) > 1:
            data["dp_steps"] = self.dp_steps
            data["idle_steps"] = self.total.idle_steps
            data["ranks"] = [
                {
                    "rank": i,
                    "steps": r.steps,
                    "graph_steps": r.graph_steps,
                    "eager_steps": r.eager_steps,
                    "idle_steps": r.idle_steps,
                    "padded_tokens": r.padded_tokens,
                    "padding_overhead": round(r.padding_overhead, 6),
                }
                for i, r in enumerate(self.ranks)
            ]
        return data


def _clock(plan: Plan, steps: StepTimes | None) -> tuple[StepClock | None, str | None]:
    if steps is None:
        return None, None
    basis = steps.basis(plan.spec)
    if not basis.usable:
        return None, f"step time not predicted ({basis.label()})"
    if steps.model is None:
        return None, None
    return StepClock(steps.model), basis.label()


def simulate(
    plan: Plan,
    trace: list[TraceBatch],
    dispatcher: Dispatcher | None = None,
    steps: StepTimes | None = None,
    leave_out_above: int | None = None,
) -> Simulation:
    """Replay one engine's trace; with a calibration's step times, also predict the total
    step time. A DP plan given one trace: every rank is taken to run this trace, step for step.
    `leave_out_above`: steps of more tokens are counted but not priced (optimize compares plans
    on what they change; such a step runs eager in every candidate)."""
    dispatcher = dispatcher or Dispatcher(plan)
    result = SimResult()
    clock, model = _clock(plan, steps)
    largest = plan.max_capture_size
    weights: Counter[Batch] = Counter()
    for item in trace:  # a trace repeats its batches: each distinct one is dispatched once
        weights[item.batch] += item.count
    for batch, n in weights.items():
        d = dispatcher.dispatch(batch)
        result.add(d, batch, n, largest)
        if clock is not None:
            if leave_out_above is not None and batch.num_tokens > leave_out_above:
                clock.left_out += n
            else:
                clock.add([clock.point(d, batch.num_tokens)], n, batch)
    result.unused = [i for i in range(len(plan.graphs)) if i not in result.hits]
    size = plan.dp.data_parallel_size
    assumption = None
    if size > 1:
        assumption = (
            f"one trace for {size} DP ranks: every rank is taken to run these batches step for step, so DP "
            "padding never changes what a rank replays; pass one trace per rank (capplan apply --trace writes "
            "them) to model DP sync"
        )
    return Simulation([result], clock, model, assumption, result.steps)


def _aligned(traces: list[list[TraceBatch]]) -> tuple[Counter, int, str]:
    """The DP steps side by side, as (one batch or None (idle) per rank) -> how many steps ran
    so; the number of DP steps; how the traces were aligned. Work grows with the lines, not
    with the step numbers (a gap of a million idle steps is one entry)."""
    rows: Counter = Counter()
    idle_row = (None,) * len(traces)
    if all(item.dp_step is not None for t in traces for item in t):
        by_step: dict[int, list[Batch | None]] = {}
        for rank, t in enumerate(traces):
            for item in t:
                assert item.dp_step is not None
                by_step.setdefault(item.dp_step, [None] * len(traces))[rank] = item.batch
        steps = sorted(by_step)
        for step in steps:
            rows[tuple(by_step[step])] += 1
        gaps = steps[-1] - steps[0] + 1 - len(steps)
        if gaps:
            rows[idle_row] += gaps
        return (
            rows,
            steps[-1] - steps[0] + 1,
            (
                "rank traces aligned by their dp_step, from the first recorded step to the last; a rank without a "
                "batch at a step ran the idle dummy (every rank did, at a step no trace has)"
            ),
        )
    # Run-length: each rank's trace is runs of (batch, count), walked side by side, so the work
    # grows with the lines, not with the counts.
    runs = [[(item.batch, item.count) for item in t] for t in traces]
    at = [0] * len(runs)  # each rank's current run
    left = [r[0][1] if r else 0 for r in runs]  # steps left in it
    total = 0
    while True:
        live = [k for k in range(len(runs)) if at[k] < len(runs[k])]
        if not live:
            break
        n = min(left[k] for k in live)
        rows[tuple(runs[k][at[k]][0] if at[k] < len(runs[k]) else None for k in range(len(runs)))] += n
        total += n
        for k in live:
            left[k] -= n
            if left[k] == 0:
                at[k] += 1
                left[k] = runs[k][at[k]][1] if at[k] < len(runs[k]) else 0
    return (
        rows,
        total,
        (
            "rank traces aligned line by line (they carry no dp_step): the k-th step of every rank is taken to run "
            "together, and a rank whose trace ended runs the idle dummy"
        ),
    )


@dataclass(frozen=True)
class SyncedStep:
    """One DP step as vLLM's DP sync settles it: what the ranks agreed and what each replays."""

    tokens: int  # every rank pads to the largest token count (unless eager)
    mode: str  # the lowest mode any rank wanted: NONE makes every rank run eager
    uniform: int | None  # the uniform-decode count, kept only when every rank has the same one
    ranks: list[tuple[Batch, Dispatch]]  # each rank's batch (the idle dummy for an idle rank) and its dispatch


def sync_step(d: Dispatcher, spec, row: tuple[Batch | None, ...]) -> SyncedStep:
    """vLLM's DP sync of one step (see the module docstring): each rank's batch (None: idle, it
    runs vLLM's dummy batch) -> the token count, mode and uniform count the ranks agree on, and
    the graph each rank then replays with its own LoRA count."""
    dql = spec.decode_query_len
    idle_count = spec.lora.max_loras + 1 if spec.lora.enabled else 0
    idle = Batch(1, dql, dql)
    local: list[tuple[Batch, int | None, int, Dispatch]] = []
    for item in row:
        if item is None:
            local.append((idle, dql, idle_count, d.lookup(1, dql, dql, idle_count)))
        else:
            local.append((item, derive_uniform(item, d.rules), d.lora_count(item), d.dispatch(item)))
    lowest = min((desired.cg_mode for _, _, _, desired in local), key=MODE_ORDER.__getitem__)
    uniforms = {u for _, u, _, _ in local}
    synced_uniform = uniforms.pop() if len(uniforms) == 1 else None
    synced_tokens = max(b.num_tokens for b, _, _, _ in local)
    out = []
    for b, _, count, _ in local:
        if lowest == "NONE":
            final = Dispatch("NONE", b.num_tokens, b.num_reqs, None, None, d.lora_case(count), -1)
        else:
            final = d.lookup(b.num_reqs, synced_tokens, synced_uniform, count)
        out.append((b, final))
    return SyncedStep(synced_tokens, lowest, synced_uniform, out)


def simulate_ranks(
    plan: Plan, traces: list[list[TraceBatch]], steps: StepTimes | None = None, leave_out_above: int | None = None
) -> Simulation:
    """Replay one trace per DP rank through vLLM's DP sync (see the module docstring). A step in
    which any rank has more than `leave_out_above` tokens is counted but not priced."""
    d = Dispatcher(plan)
    rows, dp_steps, assumption = _aligned(traces)
    ranks = [SimResult() for _ in traces]
    clock, model = _clock(plan, steps)
    largest = plan.max_capture_size
    for row, n in rows.items():
        step = sync_step(d, plan.spec, row)
        points = []
        for rank, (item, (b, final)) in enumerate(zip(row, step.ranks)):
            ranks[rank].add(final, None if item is None else b, n, largest)
            if clock is not None:
                points.append(clock.point(final, b.num_tokens))
        if clock is not None:
            if leave_out_above is not None and any(b is not None and b.num_tokens > leave_out_above for b in row):
                clock.left_out += n
            else:
                clock.add(points, n, row)
    for r in ranks:
        r.unused = [i for i in range(len(plan.graphs)) if i not in r.hits]
    return Simulation(ranks, clock, model, assumption, dp_steps)
