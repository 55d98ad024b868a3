"""Capture seconds and graph memory of a plan, each with an interval and its basis.

Physics first. Capturing a graph records every kernel launch of a forward pass and then
instantiates the graph: its seconds follow the launches, layers x kernels per layer, so a
plan's capture costs a rate per layer-graph times layers x graphs. Graph memory is the
pool's growth, not a sum of per-graph deltas: graphs share one pool, captured largest first,
so the largest graph's workspace (activations of its tokens, about 4 x hidden + 2 x
intermediate values per token) is paid once, and each graph adds its own share (its outputs
and the instantiated graph). A plan's memory is that workspace plus a share per graph.

The rates come from measured starts. For the deployment's own calibration they are its
starts' (the plan a start measured is priced by its starts alone: measured); otherwise from
the shape model: the rates of every calibration the project holds (`capplan/data/
calibrations/`, one per measured shape), each figure with its error on a shape held out of
the fit, and "extrapolated" where the deployment lies outside the measured shapes and GPUs.
Adding a calibration file there refits the model; no code changes.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from capplan.calibration.budget import default_margin_bytes, plan_starts, reading_bytes
from capplan.schemas.calibration import Calibration, ModelShape, Start
from capplan.schemas.plan import Plan

if TYPE_CHECKING:
    from capplan.traffic.cost import CostModel, Estimate

DATA = Path(__file__).resolve().parent.parent / "data" / "calibrations"
GIB = float(1 << 30)
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "float8_e4m3fn": 1}

Kind = Literal["measured", "scaled", "predicted"]


@dataclass(frozen=True)
class Figure:
    """A figure and the interval the true value lies in, as far as the data shows."""

    value: float
    lo: float
    hi: float

    def text(self, fmt: str, unit: str) -> str:
        return f"{self.value:{fmt}} {unit} [{self.lo:{fmt}}..{self.hi:{fmt}}]"


@dataclass(frozen=True)
class Priced:
    """A plan's capture seconds and graph memory: `measured` (starts of this very plan),
    `scaled` (the deployment's starts of another plan, by graphs and workspace) or
    `predicted` (the shape model); `basis` says from what, `notes` what is extrapolated."""

    graphs: int
    seconds: Figure
    gib: Figure
    kind: Kind
    basis: str
    notes: tuple[str, ...] = ()
    reserve_gib: float | None = None  # the largest reading of this plan's starts whose capture ran first

    def text(self) -> str:
        return f"{self.graphs} graphs, {self.seconds.text('.1f', 's')} capture, {self.gib.text('.3f', 'GiB')}"

    def reserve_bytes(self) -> int | None:
        """The graph memory to leave free beside the KV cache (`show`; `flags` may call it): the
        largest of the starts' readings plus the default margin (`budget.MARGIN_RULE`), where starts
        whose capture ran first measured this plan; None where it is scaled, predicted or read after
        vLLM's profiling pass (vLLM's own estimate stays in charge)."""
        if self.reserve_gib is None:
            return None
        measured = reading_bytes(self.reserve_gib)
        return measured + default_margin_bytes(measured)


def dtype_bytes(shape: ModelShape | None) -> int:
    return DTYPE_BYTES.get((shape.dtype or "bfloat16").lower() if shape else "bfloat16", 2)


def workspace_gib(shape: ModelShape | None, max_tokens: int) -> float:
    """The largest graph's activations, paid once in the shared pool (0 without a shape)."""
    if shape is None:
        return 0.0
    inter = shape.intermediate_size or 0
    return max_tokens * (4 * shape.hidden_size + 2 * inter) * dtype_bytes(shape) / GIB


def _layers(shape: ModelShape | None) -> int:
    return shape.num_layers if shape else 1


def _plan_figures(plan: Plan) -> tuple[int, int]:
    graphs = len(plan.graphs)
    top = max((g.descriptor.num_tokens for g in plan.graphs), default=0)
    return graphs, top


def second_rate(start: Start, shape: ModelShape | None) -> float:
    """Seconds per layer-graph of one start."""
    return start.capture_seconds / (_layers(shape) * start.graphs)


def memory_rate(start: Start, shape: ModelShape | None) -> float:
    """GiB per graph of one start, its workspace taken out."""
    return max(0.0, start.graph_memory_gib - workspace_gib(shape, start.max_tokens)) / start.graphs


def _figure(values: list[float]) -> Figure:
    return Figure(statistics.median(values), min(values), max(values))


def price_from_starts(plan: Plan, cal: Calibration) -> Priced | None:
    """The plan priced by the deployment's own starts; None when the calibration has none."""
    if not cal.starts:
        return None
    shape = cal.identity.shape if cal.identity else None
    graphs, top = _plan_figures(plan)
    same = [s for s in cal.starts if s.fingerprint == plan.fingerprint]
    if same:
        return Priced(
            graphs,
            _figure([s.capture_seconds for s in same]),
            _figure([s.graph_memory_gib for s in same]),
            "measured",
            f"measured: {len(same)} start(s) of this plan in calibration {cal.name} ({_sources(same)}), {whose(cal)}",
            (*_release_note(plan, cal), *_after_profiling_note(same)),
            reserve_gib=_first_capture_reading(plan, cal),
        )
    if not graphs:
        return Priced(0, Figure(0, 0, 0), Figure(0, 0, 0), "scaled", f"no graphs (calibration {cal.name})")
    secs = [second_rate(s, shape) * _layers(shape) * graphs for s in cal.starts]
    mem = [memory_rate(s, shape) * graphs + workspace_gib(shape, top) for s in cal.starts]
    return Priced(
        graphs,
        _figure(secs),
        _figure(mem),
        "scaled",
        f"scaled by graphs and workspace from {len(cal.starts)} start(s) in calibration "
        f"{cal.name} ({_sources(cal.starts)}), {whose(cal)}",
        _release_note(plan, cal),
    )


def _first_capture_reading(plan: Plan, cal: Calibration) -> float | None:
    first, _ = plan_starts(plan, cal)
    return max(s.graph_memory_gib for s in first) if first else None


def _after_profiling_note(starts: list[Start]) -> tuple[str, ...]:
    """What a graph-memory reading taken after vLLM's profiling pass leaves out, where one was."""
    after = sum(1 for s in starts if s.after_profiling)
    if not after:
        return ()
    return (
        f"graph memory of {after} start(s) read after vLLM's profiling pass: it leaves out what that pass left "
        "allocated for the capture to reuse (one 8B plan on an H100: 0.35 GiB read so, 1.19 GiB captured first)",
    )


def priced_by_starts(model: CostModel) -> CostModel:
    """`model` estimating capture seconds and graph memory by its calibration's starts, where the
    calibration is one of the deployment's starts (capplan calibrate-start) and has no capture
    runs: `optimize`'s budgets then rest on them (`price_from_starts`, the median)."""
    cal = model.calibration
    if cal is None or not cal.starts or cal.runs:
        return model
    return dataclasses.replace(model, from_starts=functools.partial(_starts_estimate, cal))


def _starts_estimate(cal: Calibration, plan: Plan) -> Estimate:
    from capplan.traffic.cost import Estimate

    priced = price_from_starts(plan, cal)
    assert priced is not None  # the calibration has starts
    return Estimate(priced.graphs, priced.seconds.value, priced.gib.value)


def whose(cal: Calibration) -> str:
    """The deployment a calibration's starts measured, as its identity records it: the model (its
    name, else its shape), the GPU, vLLM and the parallel sizes; or that it records none."""
    ident = cal.identity
    if ident is None:
        return "of a deployment it does not record (no model, GPU or release)"
    parts = []
    if ident.model is not None and ident.model.name:
        parts.append(f"model {ident.model.name}")
    elif ident.shape is not None:
        parts.append(f"a model of {ident.shape.num_layers} layers, hidden size {ident.shape.hidden_size}")
    else:
        parts.append("no model recorded")
    parts.append(f"GPU {ident.gpu}" if ident.gpu else "no GPU recorded")
    parts.append(f"vLLM {ident.vllm}" if ident.vllm else "no vLLM release recorded")
    sizes = (ident.tensor_parallel_size, ident.pipeline_parallel_size)
    if any(n not in (None, 1) for n in sizes):
        parts.append(f"TP {ident.tensor_parallel_size or 1}, PP {ident.pipeline_parallel_size or 1}")
    return "on " + ", ".join(parts)


def _release_note(plan: Plan, cal: Calibration) -> tuple[str, ...]:
    """Where the starts ran a vLLM the plan was not compiled for (it plans, captures and measures
    differently): said, since their figures are then another release's."""
    ran = cal.identity.vllm if cal.identity else None
    if ran is None:
        return ("the calibration records no vLLM release: its figures may be another release's",)
    from capplan.releases import release_problem

    if release_problem(plan.spec.target.vllm, ran) is None:
        return ()
    return (f"the starts ran vLLM {ran}; this plan targets vLLM {plan.spec.target.vllm}: another release's figures",)


def _sources(starts: list[Start]) -> str:
    names = sorted({s.report for s in starts})
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


@dataclass(frozen=True)
class Held:
    """One measured shape in the shape model's fit: its calibration, shape, GPU and rates."""

    name: str
    shape: ModelShape
    gpu: str
    vllm: str
    seconds_rate: float  # median over its starts
    memory_rate: float
    seconds_rates: tuple[float, ...]
    memory_rates: tuple[float, ...]
    graphs: int
    max_tokens: int
    seconds: float  # median measured capture seconds and memory of its starts
    gib: float


@dataclass(frozen=True)
class HeldOut:
    """The shape model's error on one shape left out of the fit (predicted / measured - 1)."""

    name: str
    seconds_error: float
    gib_error: float


@dataclass(frozen=True)
class ShapeModel:
    held: tuple[Held, ...]
    seconds_rate: float
    memory_rate: float
    held_out: tuple[HeldOut, ...]

    @property
    def seconds_error(self) -> float:
        return max((abs(h.seconds_error) for h in self.held_out), default=float("inf"))

    @property
    def gib_error(self) -> float:
        return max((abs(h.gib_error) for h in self.held_out), default=float("inf"))

    def basis(self) -> str:
        shapes = "; ".join(
            f"{h.name}: {h.shape.num_layers} layers, hidden {h.shape.hidden_size} on {h.gpu}, vLLM {h.vllm}"
            for h in self.held
        )
        return (
            f"predicted by the shape model from {len(self.held)} measured shape(s) ({shapes}); "
            f"error on a shape held out: capture seconds {100 * self.seconds_error:.0f}%, "
            f"graph memory {100 * self.gib_error:.0f}%"
        )

    def predict(self, plan: Plan, shape: ModelShape, gpu: str | None) -> Priced:
        graphs, top = _plan_figures(plan)
        units = shape.num_layers * graphs
        s_all = [r for h in self.held for r in h.seconds_rates]
        m_all = [r for h in self.held for r in h.memory_rates]
        es, em = self.seconds_error, self.gib_error
        w = workspace_gib(shape, top)
        seconds = Figure(
            self.seconds_rate * units,
            min(min(s_all), self.seconds_rate * (1 - es)) * units,
            max(max(s_all), self.seconds_rate * (1 + es)) * units,
        )
        gib = Figure(
            self.memory_rate * graphs + w,
            min(min(m_all), self.memory_rate * (1 - em)) * graphs + w,
            max(max(m_all), self.memory_rate * (1 + em)) * graphs + w,
        )
        notes = self.extrapolated(plan, shape, gpu)
        if any(n.startswith("extrapolated") for n in notes):
            notes.append(
                "the interval is the measured shapes' spread and held-out error; it does not bound the extrapolation"
            )
        return Priced(graphs, seconds, gib, "predicted", self.basis(), tuple(notes))

    def extrapolated(self, plan: Plan, shape: ModelShape, gpu: str | None) -> list[str]:
        """Where the deployment lies outside what was measured, and by how far."""
        from capplan.traffic.cost import same_gpu

        out = []
        for label, value, measured in (
            ("layers", shape.num_layers, [h.shape.num_layers for h in self.held]),
            ("hidden size", shape.hidden_size, [h.shape.hidden_size for h in self.held]),
            ("largest graph's tokens", _plan_figures(plan)[1], [h.max_tokens for h in self.held]),
            ("graphs", len(plan.graphs), [h.graphs for h in self.held]),
        ):
            lo, hi = min(measured), max(measured)
            if value > hi:
                out.append(f"extrapolated: {label} {value}, {value / hi:.1f}x the largest measured ({hi})")
            elif value < lo:
                out.append(f"extrapolated: {label} {value}, {lo / value:.1f}x below the smallest measured ({lo})")
        if shape.num_experts:
            out.append(f"extrapolated: {shape.num_experts} experts; no MoE model was measured")
        gpus = sorted({h.gpu for h in self.held})
        if gpu is None:
            out.append(f"GPU not given; measured on {', '.join(gpus)}")
        elif not any(same_gpu(gpu, g) for g in gpus):
            out.append(f"extrapolated: GPU {gpu} not measured (measured: {', '.join(gpus)})")
        from capplan.releases import runs_on

        releases = sorted({h.vllm for h in self.held})
        if not set(runs_on(plan.spec.target.vllm)) & set(releases):
            out.append(f"extrapolated: vLLM {plan.spec.target.vllm} not measured (measured: {', '.join(releases)})")
        tp = plan.spec.parallel.tensor_parallel_size or 1
        if tp > 1:
            out.append(f"extrapolated: tensor parallel {tp}; only TP 1 was measured")
        return out


def held_of(cal: Calibration) -> Held | None:
    """A calibration's place in the shape model: it needs starts and a recorded shape and GPU."""
    ident = cal.identity
    if not cal.starts or ident is None or ident.shape is None or ident.gpu is None:
        return None
    shape = ident.shape
    s_rates = tuple(second_rate(s, shape) for s in cal.starts)
    m_rates = tuple(memory_rate(s, shape) for s in cal.starts)
    first = cal.starts[0]
    return Held(
        cal.name,
        shape,
        ident.gpu,
        ident.vllm or "unrecorded",
        statistics.median(s_rates),
        statistics.median(m_rates),
        s_rates,
        m_rates,
        first.graphs,
        first.max_tokens,
        statistics.median(s.capture_seconds for s in cal.starts),
        statistics.median(s.graph_memory_gib for s in cal.starts),
    )


def fit_shape_model(cals: list[Calibration]) -> ShapeModel | None:
    """The shape model fitted on every calibration with starts and a shape (None: none has),
    with its error on each shape held out of the fit (leave one shape out)."""
    held = tuple(h for h in (held_of(c) for c in cals) if h is not None)
    if not held:
        return None

    def rates(hs: tuple[Held, ...]) -> tuple[float, float]:
        return statistics.median(h.seconds_rate for h in hs), statistics.median(h.memory_rate for h in hs)

    s_rate, m_rate = rates(held)
    out = []
    if len(held) > 1:
        for h in held:
            s, m = rates(tuple(x for x in held if x is not h))
            predicted_s = s * h.shape.num_layers * h.graphs
            predicted_m = m * h.graphs + workspace_gib(h.shape, h.max_tokens)
            out.append(HeldOut(h.name, predicted_s / h.seconds - 1, predicted_m / h.gib - 1))
    return ShapeModel(held, s_rate, m_rate, tuple(out))


def project_calibrations() -> list[Calibration]:
    """Every calibration the project holds (`capplan/data/calibrations/*.yaml`)."""
    from capplan.loading import load_calibration

    return [load_calibration(p) for p in sorted(DATA.glob("*.yaml"))]


@dataclass(frozen=True)
class Pricing:
    """What prices plans: the deployment's own calibration (starts), the shape model, and a
    shape the operator gave (`--model-config`) over the spec's `model`."""

    deployment: Calibration | None
    model: ShapeModel | None
    shape: ModelShape | None = None

    def price(self, plan: Plan) -> Priced | None:
        """Measured data of the deployment first, else the shape model's prediction, else None
        (no calibration of this deployment and no model shape to predict from)."""
        from capplan.calibration.shape import shape_from_spec
        from capplan.traffic.cost import judge

        why_not = ""
        if self.deployment is not None:
            basis = judge(self.deployment, plan.spec)
            if basis.usable:
                priced = price_from_starts(plan, self.deployment)
                if priced is not None:
                    return priced
            why_not = f"calibration {self.deployment.name} not used: {basis.note}"
        shape = self.shape or shape_from_spec(plan.spec)
        if shape is None or self.model is None:
            return None
        priced = self.model.predict(plan, shape, plan.spec.target.gpu)
        notes = priced.notes + ((why_not,) if why_not else ())
        if shape.intermediate_size is None:
            notes += ("intermediate size not given (--model-config): the workspace counts 4 x hidden per token",)
        return Priced(priced.graphs, priced.seconds, priced.gib, priced.kind, priced.basis, notes)


@dataclass(frozen=True)
class PriceDelta:
    """Both plans priced, and the change: new minus old, bound by bound (both rest on the same
    rates, so a start that ran slow prices both plans slow)."""

    old: Priced
    new: Priced

    @property
    def seconds(self) -> Figure:
        return _minus(self.new.seconds, self.old.seconds)

    @property
    def gib(self) -> Figure:
        return _minus(self.new.gib, self.old.gib)

    @property
    def kind(self) -> str:
        kinds = dict.fromkeys((self.old.kind, self.new.kind))
        return " / ".join(kinds)


def _minus(a: Figure, b: Figure) -> Figure:
    lo, hi = a.lo - b.lo, a.hi - b.hi
    return Figure(a.value - b.value, min(lo, hi), max(lo, hi))


def price_pair(old: Plan, new: Plan, pricing: Pricing | None) -> PriceDelta | None:
    if pricing is None:
        return None
    a, b = pricing.price(old), pricing.price(new)
    return None if a is None or b is None else PriceDelta(a, b)
