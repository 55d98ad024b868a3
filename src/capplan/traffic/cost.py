"""A small cost model: capture seconds and graph memory of a plan, and step time.

Coefficients are fitted (least squares) from measured runs in a calibration file
(default: `src/capplan/data/h200-vllm025.yaml`, measured on the H200 with vLLM
0.25), so "max_loras 4 -> 8 adds N graphs, ~X s, ~Y GiB" is known before a GPU
boots. Capture seconds follow the graph counts with and without LoRA; graph
memory follows the graph count and the largest graph's tokens (the shared pool
keeps the largest graph's workspace, so a 7-graph plan up to 512 tokens costs
far more than 7/400 of a 400-graph plan).

A calibration may also list measured step times (`step_times`): milliseconds
of one engine step of N tokens per LoRA case, replaying a FULL graph of N
tokens (`graph`), a PIECEWISE graph (`piecewise`), or with no graph
(`eager`). `capplan calibrate` measures decode steps offline (graph and
eager); `capplan calibrate-trace` fits all three from a trace recorded under
`vllm serve` (the step period as served, prefill included). The step model
interpolates linearly in tokens (and extrapolates from the last two points),
per mode and LoRA case, taking the nearest measured case for one not
measured, and `graph` for `piecewise` when no PIECEWISE step was measured;
times are made non-decreasing in tokens, as a larger batch never runs faster.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from capplan.errors import InputError
from capplan.schemas.plan import Plan

DEFAULT_CALIBRATION = Path(__file__).resolve().parent.parent / "data" / "h200-vllm025.yaml"


class CalibrationRun(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str
    no_lora_graphs: int = Field(ge=0)
    lora_graphs: int = Field(ge=0)
    max_tokens: int = Field(ge=1)  # the largest graph's tokens: its workspace stays in the graph pool
    capture_seconds: float = Field(ge=0)
    graph_memory_gib: float = Field(ge=0)


class StepTime(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["graph", "piecewise", "eager"]
    case: int = Field(ge=0)
    tokens: int = Field(ge=1)
    ms: float = Field(gt=0)


class Calibration(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    runs: list[CalibrationRun] = Field(min_length=3)
    step_times: list[StepTime] = Field(default_factory=list, max_length=100_000)


class StepModel:
    """Predicted milliseconds of one step, from measured step times."""

    def __init__(self, rows: list[StepTime]) -> None:
        tables: dict[tuple[str, int], dict[int, float]] = {}
        for r in rows:
            tables.setdefault((r.mode, r.case), {})[r.tokens] = r.ms
        self.tables: dict[tuple[str, int], tuple[list[int], list[float]]] = {}
        for key, points in tables.items():
            xs = sorted(points)
            ys, top = [], 0.0
            for x in xs:
                top = max(top, points[x])
                ys.append(top)
            self.tables[key] = (xs, ys)
        self.modes = {mode for mode, _ in self.tables}

    def ms(self, mode: str, case: int, tokens: int) -> float:
        if mode not in self.modes and mode == "piecewise":
            mode = "graph"
        cases = [c for m, c in self.tables if m == mode]
        near = min(cases, key=lambda c: (abs(c - case), -c))  # ties: the larger case
        xs, ys = self.tables[(mode, near)]
        i = bisect.bisect_left(xs, tokens)
        if i < len(xs) and xs[i] == tokens:
            return ys[i]
        if i == 0:
            return ys[0]
        if i == len(xs):
            if len(xs) == 1:
                return ys[0]
            slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
            return ys[-1] + slope * (tokens - xs[-1])
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


@dataclass(frozen=True)
class Coefficients:
    """Capture seconds: per graph without LoRA, per LoRA graph, and once when any LoRA graph is
    captured (the LoRA kernels' first launches)."""

    per_graph: float
    per_lora_graph: float
    lora_fixed: float


@dataclass(frozen=True)
class MemoryCoefficients:
    """Graph memory: a base, the largest graph's workspace (per token of that graph) and a
    share per graph. Graphs share one memory pool, so the largest graph's activations are
    paid once whatever the number of graphs, and each graph keeps its own outputs."""

    base: float
    per_max_token: float
    per_graph: float


@dataclass(frozen=True)
class CostModel:
    name: str
    seconds: Coefficients
    gib: MemoryCoefficients
    steps: StepModel | None = None  # None: the calibration has no step times (padding is the objective)

    def estimate(self, plan: Plan) -> Estimate:
        if not plan.graphs:
            return Estimate(0, 0.0, 0.0)
        lora = sum(1 for g in plan.graphs if g.descriptor.num_active_loras > 0)
        plain = len(plan.graphs) - lora
        s, m = self.seconds, self.gib
        seconds = s.per_graph * plain + s.per_lora_graph * lora + (s.lora_fixed if lora else 0.0)
        top = max(g.descriptor.num_tokens for g in plan.graphs)
        gib = m.base + m.per_max_token * top + m.per_graph * len(plan.graphs)
        return Estimate(len(plan.graphs), seconds, gib)


@dataclass(frozen=True)
class Estimate:
    graphs: int
    capture_seconds: float
    graph_memory_gib: float

    def text(self) -> str:
        return f"{self.graphs} graphs, ~{self.capture_seconds:.0f} s capture, ~{self.graph_memory_gib:.2f} GiB"


def _least_squares(rows: list[list[float]], values: list[float], missing: str) -> list[float]:
    """Solve the normal equations (exact when there are as many rows as unknowns); `missing`
    says which runs to add when they do not determine the unknowns."""
    n = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    atb = [sum(r[i] * v for r, v in zip(rows, values)) for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda k: abs(ata[k][col]))
        if abs(ata[pivot][col]) < 1e-12:
            raise InputError(f"calibration runs do not determine the model: {missing}")
        ata[col], ata[pivot] = ata[pivot], ata[col]
        atb[col], atb[pivot] = atb[pivot], atb[col]
        for k in range(n):
            if k != col:
                f = ata[k][col] / ata[col][col]
                ata[k] = [a - f * b for a, b in zip(ata[k], ata[col])]
                atb[k] -= f * atb[col]
    return [atb[i] / ata[i][i] for i in range(n)]


def fit_cost_model(cal: Calibration) -> CostModel:
    """The cost model fitted (least squares) to a calibration's measured runs."""
    rows = [[r.no_lora_graphs, r.lora_graphs, 1.0 if r.lora_graphs else 0.0] for r in cal.runs]
    secs = _least_squares(
        rows,
        [r.capture_seconds for r in cal.runs],
        "give runs without LoRA, with few LoRA graphs and with many",
    )
    # Runs that all share one largest graph cannot separate its workspace from the base:
    # the base then holds it (a plan with another largest graph is estimated as if it had this one).
    tops = len({r.max_tokens for r in cal.runs}) > 1
    base, *rest = _least_squares(
        [[1.0, r.no_lora_graphs + r.lora_graphs] + ([r.max_tokens] if tops else []) for r in cal.runs],
        [r.graph_memory_gib for r in cal.runs],
        "give runs with different graph counts",
    )
    gib = MemoryCoefficients(base, rest[1] if tops else 0.0, rest[0])
    steps = None
    if cal.step_times:
        steps = StepModel(cal.step_times)
        if not {"graph", "eager"} <= steps.modes:
            raise InputError("calibration step_times need both graph and eager rows (capplan calibrate writes both)")
    return CostModel(cal.name, Coefficients(*secs), gib, steps)


STEP_GAP_S = 0.1  # a longer interval between two recorded steps is idle time, not a step
MIN_SAMPLES = 3  # steps needed before a (mode, case, tokens) point is trusted


def fit_step_times(plan: Plan, batches: list, times: list[float]) -> list[StepTime]:
    """Step times as served, from a trace recorded under `plan` (`capplan apply --trace`).

    The interval from one recorded step to the next is the next step's period
    (recording happens as each step's model run returns); intervals over
    STEP_GAP_S are idle time and left out. Each step is dispatched through the
    plan: graph steps are keyed by mode, LoRA case and padded size, eager steps
    by case and token count in half-octave bins (the bin's median count). The
    median of each key with at least MIN_SAMPLES steps becomes one row.
    """
    import math
    import statistics

    from capplan.planner.dispatch import Dispatcher

    d = Dispatcher(plan)
    samples: dict[tuple[str, int, int], list[tuple[float, int]]] = {}
    for i in range(1, len(batches)):
        dt = times[i] - times[i - 1]
        if not 0 < dt <= STEP_GAP_S:
            continue
        batch = batches[i].batch
        r = d.dispatch(batch)
        if r.graph_id >= 0:
            key = ("graph" if r.cg_mode == "FULL" else "piecewise", r.num_active_loras, r.num_tokens)
        else:
            key = ("eager", r.num_active_loras, round(2 * math.log2(batch.num_tokens)))
        samples.setdefault(key, []).append((1000 * dt, batch.num_tokens))
    rows = []
    for (mode, case, tokens), found in sorted(samples.items()):
        if len(found) < MIN_SAMPLES:
            continue
        if mode == "eager":
            tokens = int(statistics.median_low(t for _, t in found))
        ms = statistics.median(v for v, _ in found)
        rows.append(StepTime(mode=mode, case=case, tokens=tokens, ms=round(ms, 4)))
    return rows


def merge_step_times(base: list[StepTime], fitted: list[StepTime]) -> list[StepTime]:
    """The fitted rows, plus base rows for token counts the fit does not reach in the same
    mode and case (e.g. eager decode steps, which a plan that serves them from graphs never
    records)."""
    seen: dict[tuple[str, int], tuple[int, int]] = {}
    for r in fitted:
        lo, hi = seen.get((r.mode, r.case), (r.tokens, r.tokens))
        seen[(r.mode, r.case)] = (min(lo, r.tokens), max(hi, r.tokens))
    kept = [r for r in base if not ((r.mode, r.case) in seen and seen[(r.mode, r.case)][0] <= r.tokens)]
    return sorted(kept + fitted, key=lambda r: (r.mode, r.case, r.tokens))
