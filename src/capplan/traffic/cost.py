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
(`eager`). `capplan calibrate-steps` measures decode steps offline (graph and
eager); `capplan calibrate-trace` fits all three from a trace recorded under
`vllm serve` (the step period as served, prefill included).

The step model prices only what was measured. A (mode, LoRA case, tokens)
point is priced when it was measured, or when it lies between two measured
points of the same mode and case: then it is interpolated linearly, and since
a larger batch never runs faster (times are made non-decreasing in tokens),
the true time lies between the two neighbours, which bound its error. Nothing
is extrapolated, and no mode or case stands in for another: a point outside
what was measured has no price, and whoever needs it says which point to
measure.

A calibration records what it was measured on (`identity`: the model, the
GPU, vLLM, torch and the parallel sizes). Estimates for a spec that names
another model, GPU or parallel layout are withheld (`Basis`), and they read
"not checked" unless every field that decides them was compared on both
sides (`not_compared` says which those are).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from capplan.errors import InputError
from capplan.schemas.calibration import Calibration, Identity, StepTime
from capplan.schemas.plan import Plan
from capplan.schemas.spec import Model, Spec

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
class Basis:
    """What a calibration's estimates rest on for one spec. `usable` False: the calibration is
    of another model or GPU, and its numbers are withheld."""

    calibration: str
    usable: bool
    note: str

    def label(self) -> str:
        if self.calibration == "none":  # no calibration given: `note` says what would price it
            return f"not priced: {self.note}"
        return f"calibration {self.calibration}: {self.note}"


def _params(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e8 else f"{n / 1e6:.3g}M"


def _identity_text(identity: Identity | None) -> str:
    if identity is None:
        return "model and GPU not recorded"
    parts = []
    m = identity.model
    if m is not None and _names_a_model(m):
        parts.append(m.name or m.architecture or "model")
        if m.parameters:
            parts.append(f"{_params(m.parameters)} parameters")
    if not parts:
        parts.append("an unrecorded model")
    parts.append(f"on {identity.gpu}" if identity.gpu else "GPU not recorded")
    layout = [
        f"{name} {size}"
        for name, size in (("TP", identity.tensor_parallel_size), ("PP", identity.pipeline_parallel_size))
        if size is not None
    ]
    if layout:
        parts.append(" ".join(layout))
    if identity.vllm:
        parts.append(f"vLLM {identity.vllm}")
    return ", ".join(parts)


def same_gpu(named: str, measured: str) -> bool:
    """Whether a GPU a spec names is the one a calibration measured: the name's words (case and
    the vendor word aside) begin the measured name's, as torch reports it ("NVIDIA H100" names
    "NVIDIA H100 80GB HBM3"; "H100 PCIe" does not)."""
    words = named.lower().replace("nvidia", "").split()
    return bool(words) and measured.lower().replace("nvidia", "").split()[: len(words)] == words


def model_differences(have: Model, want: Model) -> list[str]:
    """Fields both give that differ (parameter counts within 5%)."""
    out = []
    for field in ("architecture", "hidden_size", "num_layers", "dtype"):
        a, b = getattr(have, field), getattr(want, field)
        if a is not None and b is not None and a != b:
            out.append(f"{field} {a} vs {b}")
    same_size = False
    if have.parameters and want.parameters:
        same_size = abs(have.parameters - want.parameters) <= 0.05 * want.parameters
        if not same_size:
            out.append(f"parameters {_params(have.parameters)} vs {_params(want.parameters)}")
    # Two names of one model (a path and a hub id) agree only when both also give the same
    # architecture and parameter count; otherwise different names are different models.
    same_shape = same_size and have.architecture is not None and have.architecture == want.architecture
    if have.name and want.name and have.name != want.name and not same_shape:
        out.append(f"name {have.name} vs {want.name}")
    return out


def _names_a_model(model: Model | None) -> bool:
    return model is not None and any(v is not None for v in model.__dict__.values())


def not_compared(cal: Identity | None, spec: Spec) -> list[str]:
    """What decides step times and graph memory but was not compared, because one side (or
    both) does not give it, grouped by side. Compared are: the model (the same name on both
    sides, or the architecture and parameter count on both), its dtype (on both, or implied
    by the same name on both when neither gives one), the GPU, and the tensor- and
    pipeline-parallel sizes. Anything missing makes an estimate "not checked"."""
    ident = cal or Identity()
    spec_lacks: list[str] = []
    cal_lacks: list[str] = []
    apart: list[str] = []
    sm = spec.model if _names_a_model(spec.model) else None
    cm = ident.model if _names_a_model(ident.model) else None
    if sm is None:
        spec_lacks.append("model")
    if cm is None:
        cal_lacks.append("model")
    if sm is not None and cm is not None:
        same_name = sm.name is not None and sm.name == cm.name
        shape = all(v is not None for v in (sm.architecture, sm.parameters, cm.architecture, cm.parameters))
        if not (same_name or shape):
            apart.append("no model name, or architecture and parameters, on both sides")
        if not ((sm.dtype and cm.dtype) or (same_name and not sm.dtype and not cm.dtype)):
            (spec_lacks if not sm.dtype else cal_lacks).append("model.dtype")
    if not spec.target.gpu:
        spec_lacks.append("target.gpu")
    if not ident.gpu:
        cal_lacks.append("gpu")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(spec.parallel, name) is None:
            spec_lacks.append(f"parallel.{name}")
        if getattr(ident, name) is None:
            cal_lacks.append(name)
    out = []
    if spec_lacks:
        out.append(f"the spec does not give {', '.join(spec_lacks)}")
    if cal_lacks:
        out.append(f"the calibration does not record {', '.join(cal_lacks)}")
    return out + apart


def judge(cal: Calibration, spec: Spec) -> Basis:
    """Whether a calibration's estimates apply to a spec's deployment: withheld when a field
    both give differs, "not checked" unless every deciding field was compared (not_compared)."""
    ident = cal.identity
    said = _identity_text(ident)
    problems = []
    spec_model = spec.model if _names_a_model(spec.model) else None
    cal_model = ident.model if ident is not None and _names_a_model(ident.model) else None
    if spec_model is not None and cal_model is not None:
        problems += model_differences(cal_model, spec_model)
    if spec.target.gpu and ident is not None and ident.gpu and not same_gpu(spec.target.gpu, ident.gpu):
        problems.append(f"GPU {ident.gpu} vs {spec.target.gpu}")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        want, have = getattr(spec.parallel, name), getattr(ident, name) if ident is not None else None
        if want is not None and have is not None and want != have:
            problems.append(f"{name} {have} vs {want}")
    if problems:
        return Basis(
            cal.name, False, f"uncalibrated: measured on {said}; differs from the spec ({'; '.join(problems)})"
        )
    unchecked = not_compared(ident, spec)
    if unchecked:
        return Basis(
            cal.name, True, f"measured on {said}; not checked against this deployment ({'; '.join(unchecked)})"
        )
    return Basis(cal.name, True, f"measured on {said}")


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
    seconds: Coefficients | None  # None: the calibration has no capture runs
    gib: MemoryCoefficients | None
    steps: StepModel | None = None  # None: the calibration has no step times (padding is the objective)
    calibration: Calibration | None = None
    # A calibration of the deployment's starts (capplan calibrate-start) and no capture runs: the
    # plan priced by those starts (capplan.calibration.price; given by capplan.loading).
    from_starts: Callable[[Plan], Estimate] | None = None
    # Why capture is not priced although the calibration could (the shipped default: a toy's
    # runs, no evidence about the deployment); None: priced where the calibration can.
    unpriced: str | None = None

    def estimates_capture(self) -> bool:
        """Whether capture seconds and graph memory can be estimated (runs or starts)."""
        return (self.seconds is not None and self.gib is not None) or self.from_starts is not None

    def basis(self, spec: Spec) -> Basis:
        if self.unpriced is not None:
            return Basis("none", True, self.unpriced)
        if self.calibration is None:
            return Basis(self.name, True, "model and GPU not recorded")
        return judge(self.calibration, spec)

    def estimate(self, plan: Plan) -> Estimate | None:
        """Capture seconds and graph memory, or None when the calibration has no capture runs or starts."""
        if self.seconds is None or self.gib is None:
            return self.from_starts(plan) if self.from_starts is not None else None
        if not plan.graphs:
            return Estimate(0, 0.0, 0.0)
        lora = sum(1 for g in plan.graphs if g.descriptor.num_active_loras > 0)
        plain = len(plan.graphs) - lora
        s, m = self.seconds, self.gib
        seconds = s.per_graph * plain + s.per_lora_graph * lora + (s.lora_fixed if lora else 0.0)
        top = max(g.descriptor.num_tokens for g in plan.graphs)
        gib = m.base + m.per_max_token * top + m.per_graph * len(plan.graphs)
        return Estimate(len(plan.graphs), seconds, gib)

    def estimate_line(self, plan: Plan) -> str:
        """One line for show and diff: the estimate with what it rests on, or why there is none."""
        basis = self.basis(plan.spec)
        est = self.estimate(plan) if basis.usable else None
        if est is None:
            if self.unpriced is not None:
                return f"{len(plan.graphs)} graphs; capture time and graph memory not priced ({self.unpriced})"
            why = basis.label() if not basis.usable else f"calibration {self.name} has no capture runs"
            return f"{len(plan.graphs)} graphs; capture time and graph memory withheld ({why})"
        return f"{est.text()} ({basis.label()})"


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
    secs: Coefficients | None = None
    gib: MemoryCoefficients | None = None
    if cal.runs:
        if len(cal.runs) < 3:
            raise InputError(
                f"calibration {cal.name}: {len(cal.runs)} capture run(s); the capture model needs at least 3",
                "give runs without LoRA, with few LoRA graphs and with many (capplan calibrate-steps writes three)",
            )
        rows = [[r.no_lora_graphs, r.lora_graphs, 1.0 if r.lora_graphs else 0.0] for r in cal.runs]
        secs = Coefficients(
            *_least_squares(
                rows,
                [r.capture_seconds for r in cal.runs],
                "give runs without LoRA, with few LoRA graphs and with many",
            )
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
        import math

        if not all(math.isfinite(v) for v in (*secs.__dict__.values(), *gib.__dict__.values())):
            raise InputError(
                f"calibration {cal.name}: its capture runs do not fit a finite cost",
                "measure the runs again (capplan calibrate-steps)",
            )
        negative = [
            name
            for name, value in (
                ("seconds per graph", secs.per_graph),
                ("seconds per LoRA graph", secs.per_lora_graph),
                ("seconds for the first LoRA graph", secs.lora_fixed),
                ("GiB base", gib.base),
                ("GiB per token of the largest graph", gib.per_max_token),
                ("GiB per graph", gib.per_graph),
            )
            if value < -1e-9
        ]
        if negative:
            raise InputError(
                f"calibration {cal.name}: its capture runs fit a negative cost ({negative[0]}), so they cannot "
                "price a plan",
                "measure the runs again (capplan calibrate-steps); a run's graphs and its seconds or memory disagree",
            )
    steps = None
    if cal.step_times:
        steps = StepModel(cal.step_times)
    return CostModel(cal.name, secs, gib, steps, cal)


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
