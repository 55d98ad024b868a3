"""Step times: milliseconds of one engine step, measured, for `simulate` and `optimize`.

A calibration may list measured step times (`step_times`): milliseconds of one engine step of N
tokens per LoRA case, replaying a FULL graph of N tokens (`graph`), a PIECEWISE graph
(`piecewise`), or with no graph (`eager`). `capplan calibrate-steps` measures decode steps
offline (graph and eager); `capplan calibrate-trace` fits all three from a trace recorded under
`vllm serve` (the step period as served, prefill included).

The step model prices only what was measured. A (mode, LoRA case, tokens) point is priced when
it was measured, or when it lies between two measured points of the same mode and case: then it
is interpolated linearly, and since a larger batch never runs faster (times are made
non-decreasing in tokens), the true time lies between the two neighbours, which bound its
error. Nothing is extrapolated, and no mode or case stands in for another: a point outside what
was measured has no price, and whoever needs it says which point to measure.

Whether a calibration's step times apply to a spec's deployment is judged by its identity
(`capplan.calibration.identity.judge`). Capture seconds and graph memory are priced elsewhere,
by one model (`capplan.calibration.price.Pricer`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from capplan.calibration.identity import Basis, judge
from capplan.schemas.calibration import Calibration, StepTime
from capplan.schemas.plan import Plan
from capplan.schemas.spec import Spec

DEFAULT_CALIBRATION = Path(__file__).resolve().parent.parent / "data" / "h200-vllm025.yaml"


@dataclass(frozen=True)
class Price:
    """One step's predicted milliseconds; the true time lies in [lo, hi] (equal to ms when measured)."""

    ms: float
    lo: float
    hi: float


@dataclass(frozen=True, order=True)
class Point:
    """A (mode, LoRA case, tokens) point of the step model."""

    mode: str
    case: int
    tokens: int

    def text(self) -> str:
        return f"{self.mode} case {self.case} at {self.tokens} tokens"


class StepModel:
    """Predicted milliseconds of one step, from measured step times only."""

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

    def price(self, mode: str, case: int, tokens: int) -> Price | None:
        """The price of a point: measured, or between two measured neighbours; None outside."""
        table = self.tables.get((mode, case))
        if table is None:
            return None
        xs, ys = table
        i = bisect.bisect_left(xs, tokens)
        if i < len(xs) and xs[i] == tokens:
            return Price(ys[i], ys[i], ys[i])
        if i == 0 or i == len(xs):
            return None
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return Price(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0), y0, y1)

    def measured_tokens(self, mode: str) -> set[int]:
        return {x for (m, _), (xs, _) in self.tables.items() if m == mode for x in xs}


@dataclass(frozen=True)
class StepTimes:
    """A calibration's step times (`model` None: it has none) and what they were measured on."""

    name: str
    model: StepModel | None
    calibration: Calibration | None = None

    def basis(self, spec: Spec) -> Basis:
        if self.calibration is None:
            return Basis(self.name, True, "model and GPU not recorded")
        return judge(self.calibration, spec)


def step_times(cal: Calibration) -> StepTimes:
    """A calibration's step times, as the step model reads them."""
    return StepTimes(cal.name, StepModel(cal.step_times) if cal.step_times else None, cal)


STEP_GAP_S = 0.1  # a longer interval between two recorded steps is idle time, not a step
MIN_STEP_S = 1e-5  # a shorter one is no model step (no GPU forward pass takes under 10 us)
MIN_SAMPLES = 3  # steps needed before a (mode, case, tokens) point is trusted


def fit_step_times(plan: Plan, batches: list, times: list[float]) -> list[StepTime]:
    """Step times as served, from a trace recorded under `plan` (`capplan apply --trace`).

    The interval from one recorded step to the next is the next step's period
    (recording happens as each step's model run returns); intervals over
    STEP_GAP_S are idle time and left out, and so are intervals under MIN_STEP_S. Each step is dispatched through the
    plan: graph steps are keyed by mode, LoRA case and padded size, eager steps
    by case and token count in half-octave bins (the bin's median count). The
    median of each key with at least MIN_SAMPLES steps becomes one row.
    """
    import math
    import statistics

    from capplan.planner.dispatch import Dispatcher

    d = Dispatcher(plan)
    samples: dict[tuple[Literal["graph", "piecewise", "eager"], int, int], list[tuple[float, int]]] = {}
    for i in range(1, len(batches)):
        dt = times[i] - times[i - 1]
        if not MIN_STEP_S <= dt <= STEP_GAP_S:
            continue
        batch = batches[i].batch
        r = d.dispatch(batch)
        key: tuple[Literal["graph", "piecewise", "eager"], int, int]
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
