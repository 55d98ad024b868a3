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

`Pricer` is the one way any command prices a plan (show, diff, flags, simulate, optimize): the
deployment's evidence where its identity matches the spec (starts and probes; else capture runs
of `capplan calibrate-steps`, scaled without an interval), else the shape model's prediction
where the model's shape is known, else "not priced" and what would price it. One result type,
`Priced`, whichever way it is asked.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from capplan.calibration.budget import default_margin_bytes, plan_starts, reading_bytes
from capplan.calibration.identity import judge, same_gpu
from capplan.errors import InputError
from capplan.schemas.calibration import Calibration, ModelShape, Start
from capplan.schemas.plan import Plan

if TYPE_CHECKING:
    from pathlib import Path as _Path

DATA = Path(__file__).resolve().parent.parent / "data" / "calibrations"
GIB = float(1 << 30)
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "float8_e4m3fn": 1}

Kind = Literal["exact", "measured", "scaled", "predicted", "not priced"]

NOT_PRICED = (
    "no probe or start of this deployment: capplan calibrate PLAN --model CONFIG.json on its GPU prices it; "
    "the model's shape (spec model.num_layers and hidden_size, or --model-config) gives the shape model's prediction"
)


@dataclass(frozen=True)
class Figure:
    """A figure and the interval the true value lies in, as far as the data shows: lo and hi None,
    no interval (the figure's error is not known); lo == hi == value, a reading taken as it is
    (one start of this very plan, or nothing to capture)."""

    value: float
    lo: float | None = None
    hi: float | None = None

    def text(self, fmt: str, unit: str) -> str:
        if self.lo is None or self.hi is None:
            return f"{self.value:{fmt}} {unit} (no interval)"
        if self.lo == self.hi == self.value:
            return f"{self.value:{fmt}} {unit}"
        return f"{self.value:{fmt}} {unit} [{self.lo:{fmt}}..{self.hi:{fmt}}]"


@dataclass(frozen=True)
class Priced:
    """A plan's capture seconds and graph memory: `exact` (no graphs), `measured` (starts of this
    very plan), `scaled` (the deployment's starts of another plan, or its capture runs),
    `predicted` (the shape model) or `not priced` (seconds and gib None); `basis` says from what,
    or why there is no price and what would give one; `notes` what is extrapolated."""

    graphs: int
    seconds: Figure | None
    gib: Figure | None
    kind: Kind
    basis: str
    notes: tuple[str, ...] = ()
    reserve_gib: float | None = None  # the largest reading of this plan's starts whose capture ran first
    source: str = ""  # the evidence the figures rest on: two prices of one source err alike (`PriceDelta`)

    @property
    def priced(self) -> bool:
        return self.seconds is not None and self.gib is not None

    def text(self) -> str:
        if self.seconds is None or self.gib is None:
            return f"{self.graphs} graphs; capture time and graph memory not priced"
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
    """The median of a plan's readings and their range (one reading: itself)."""
    return Figure(statistics.median(values), min(values), max(values))


def price_from_starts(plan: Plan, cal: Calibration, errors: PairErrors | None = None) -> Priced | None:
    """The plan priced by the deployment's own starts; None when the calibration has none whose
    memory is a plan's. A plan the starts measured is `measured`; another is `scaled`: its seconds
    graph by graph from the starts' per-capture seconds (`capture_seconds`) where a probe recorded
    them, else by graphs; its memory by graphs and workspace. A scaled figure's interval is the
    error of that scaling on plan pairs measured on the GPU (`errors`, `plan_pair_errors`), none
    where no pair was measured."""
    memory = [s for s in cal.starts if s.plan_memory]
    if not memory:
        return None
    shape = cal.identity.shape if cal.identity else None
    graphs, top = _plan_figures(plan)
    same = [s for s in memory if s.fingerprint == plan.fingerprint]
    if same:
        seconds = _figure([s.capture_seconds for s in same])
        return Priced(
            graphs,
            seconds,
            _figure([s.graph_memory_gib for s in same]),
            "measured",
            f"measured: {len(same)} start(s) of this plan in calibration {cal.name} ({_sources(same)}), {whose(cal)}",
            (*_release_note(plan, cal), *_after_profiling_note(same), _host_note(cal.starts, seconds)),
            reserve_gib=_first_capture_reading(plan, cal),
            source=f"calibration {cal.name}",
        )
    errors = errors if errors is not None else project_pair_errors()
    # The pairs measured the scaling by per-capture seconds and from first-capture memory: their
    # error bounds only a figure scaled the same way; another way has no interval, said.
    by_capture = capture_seconds(plan, cal.starts)
    secs, how = by_capture if by_capture is not None else rate_seconds(plan, cal)
    first = [s for s in memory if s.after_profiling is False]
    mem, mem_how = scaled_memory(_graph_keys(plan), first or memory, shape, errors.split if first else None)
    seconds_errs = [e.error for e in errors.seconds] if by_capture is not None else []
    seconds_fig, gib_fig = _within(secs, seconds_errs), _within(mem, [e.error for e in errors.gib] if first else [])
    notes = [*how, mem_how, *_release_note(plan, cal), _host_note(cal.starts, seconds_fig)]
    if not first:
        notes += [*_after_profiling_note(memory), "graph memory scaled from no first-capture start: no interval"]
    if by_capture is not None:
        notes.append(_error_note("capture seconds", errors.seconds))
    else:
        notes.append("capture seconds scaled without a probe's per-capture seconds: no interval")
    if first:
        notes.append(_error_note("graph memory", errors.gib))
    return Priced(
        graphs,
        seconds_fig,
        gib_fig,
        "scaled",
        f"scaled from {len(cal.starts)} start(s) in calibration {cal.name} ({_sources(cal.starts)}), {whose(cal)}",
        tuple(notes),
        source=f"calibration {cal.name}",
    )


ONE_OFF = 3.0  # a capture over this many times its mode and case's median holds a one-off cost (a kernel built)


def capture_seconds(plan: Plan, starts: list[Start]) -> tuple[float, list[str]] | None:
    """The plan's capture seconds from per-capture seconds (a probe's `captures`), graph by graph,
    and what was carried over; None without any. Each mode and LoRA case is a line in tokens
    fitted to its captures (seconds follow the launches a graph records, a little more for more
    tokens), a case the starts did not capture priced as the nearest one of the same kind (with
    adapters or without); one-off costs (a capture over ONE_OFF times its line's median: a kernel
    built the first time a shape runs) are added once, as they recur once in any start."""
    measured = [s for s in starts if s.captures]
    if not measured:
        return None
    totals, said = [], set()
    for start in measured:
        rows: dict[tuple[str, int], list[tuple[int, float]]] = {}
        for c in start.captures:
            rows.setdefault((c.cg_mode, c.lora_case), []).append((c.num_tokens, c.seconds))
        lines, one_off = {}, 0.0
        for key, points in rows.items():
            med = statistics.median(t for _, t in points)
            usual = [(n, t) for n, t in points if t <= ONE_OFF * med]
            one_off += sum(t - med for _, t in points if t > ONE_OFF * med)
            lines[key] = (_line(usual), max(n for n, _ in points))
        total = one_off
        for g in plan.graphs:
            d = g.descriptor
            key = (d.cg_mode, d.num_active_loras)
            if key not in lines:
                same_kind = [c for m, c in lines if m == d.cg_mode and (c > 0) == (d.num_active_loras > 0)]
                if not same_kind:
                    return None
                near = min(same_kind, key=lambda c: (abs(c - d.num_active_loras), c))
                said.add(f"{d.cg_mode} LoRA case {d.num_active_loras} priced as case {near} (not captured)")
                key = (d.cg_mode, near)
            (a, b), top = lines[key]
            if d.num_tokens > top:
                said.add(f"{d.cg_mode} graphs above {top} tokens extrapolated from the captures' line")
            total += a + b * d.num_tokens
        totals.append(total)
    notes = [f"capture seconds graph by graph from {len(measured)} probe(s)' per-capture seconds"]
    return statistics.median(totals), notes + sorted(said)


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Seconds = a + b x tokens by least squares (b at least 0: more tokens never capture faster)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx) if sxx else 0.0
    return my - b * mx, b


def rate_seconds(plan: Plan, cal: Calibration) -> tuple[float, list[str]]:
    """A plan's capture seconds from the calibration's starts of other plans where no probe
    recorded each capture: graphs x layers x each start's rate (the median)."""
    shape = cal.identity.shape if cal.identity else None
    graphs = len(plan.graphs)
    rates = [second_rate(s, shape) * _layers(shape) * graphs for s in cal.starts]
    return statistics.median(rates), [
        "capture seconds by graphs from the starts' rate (no probe's per-capture seconds)"
    ]


@dataclass(frozen=True)
class Runs:
    """A deployment's capture runs (`capplan calibrate-steps`: plans captured offline) fitted by
    least squares. Seconds: per graph without LoRA, per LoRA graph, and once where any LoRA graph
    is captured (the LoRA kernels' first launches). Memory: a base, the largest graph's workspace
    per token of that graph (paid once in the shared pool) and a share per graph."""

    per_graph: float
    per_lora_graph: float
    lora_fixed: float
    base_gib: float
    gib_per_max_token: float
    gib_per_graph: float


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


def fit_runs(cal: Calibration) -> Runs | None:
    """The calibration's capture runs fitted (None: it has none); refused where they cannot price
    a plan (under three runs, a singular, infinite or negative fit)."""
    if not cal.runs:
        return None
    if len(cal.runs) < 3:
        raise InputError(
            f"calibration {cal.name}: {len(cal.runs)} capture run(s); the capture model needs at least 3",
            "give runs without LoRA, with few LoRA graphs and with many (capplan calibrate-steps writes three)",
        )
    secs = _least_squares(
        [[r.no_lora_graphs, r.lora_graphs, 1.0 if r.lora_graphs else 0.0] for r in cal.runs],
        [r.capture_seconds for r in cal.runs],
        "give runs without LoRA, with few LoRA graphs and with many",
    )
    # Runs that all share one largest graph cannot separate its workspace from the base: the
    # base then holds it (a plan with another largest graph is priced as if it had this one).
    tops = len({r.max_tokens for r in cal.runs}) > 1
    base, *rest = _least_squares(
        [[1.0, r.no_lora_graphs + r.lora_graphs] + ([r.max_tokens] if tops else []) for r in cal.runs],
        [r.graph_memory_gib for r in cal.runs],
        "give runs with different graph counts",
    )
    runs = Runs(secs[0], secs[1], secs[2], base, rest[1] if tops else 0.0, rest[0])
    if not all(math.isfinite(v) for v in runs.__dict__.values()):
        raise InputError(
            f"calibration {cal.name}: its capture runs do not fit a finite cost",
            "measure the runs again (capplan calibrate-steps)",
        )
    negative = [
        name
        for name, value in (
            ("seconds per graph", runs.per_graph),
            ("seconds per LoRA graph", runs.per_lora_graph),
            ("seconds for the first LoRA graph", runs.lora_fixed),
            ("GiB base", runs.base_gib),
            ("GiB per token of the largest graph", runs.gib_per_max_token),
            ("GiB per graph", runs.gib_per_graph),
        )
        if value < -1e-9
    ]
    if negative:
        raise InputError(
            f"calibration {cal.name}: its capture runs fit a negative cost ({negative[0]}), so they cannot "
            "price a plan",
            "measure the runs again (capplan calibrate-steps); a run's graphs and its seconds or memory disagree",
        )
    return runs


def runs_price(plan: Plan, cal: Calibration) -> Priced | None:
    """A plan priced by the deployment's capture runs (`fit_runs`), scaled by graph counts and the
    largest graph, with no interval: no plan pair measured under `vllm serve` bounds that fit."""
    runs = fit_runs(cal)
    if runs is None:
        return None
    lora = sum(1 for g in plan.graphs if g.descriptor.num_active_loras > 0)
    plain = len(plan.graphs) - lora
    seconds = runs.per_graph * plain + runs.per_lora_graph * lora + (runs.lora_fixed if lora else 0.0)
    top = max(g.descriptor.num_tokens for g in plan.graphs)
    gib = runs.base_gib + runs.gib_per_max_token * top + runs.gib_per_graph * len(plan.graphs)
    return Priced(
        len(plan.graphs),
        Figure(seconds),
        Figure(gib),
        "scaled",
        f"fitted to {len(cal.runs)} capture run(s) in calibration {cal.name}, {whose(cal)}",
        (
            "capture runs (capplan calibrate-steps) are no starts under vllm serve: no interval; a probe "
            "(capplan calibrate) of this deployment prices it with one",
            *_release_note(plan, cal, "capture runs"),
        ),
        source=f"capture runs of {cal.name}",
    )


@dataclass(frozen=True)
class PairError:
    """Scaling's error on one plan pair measured on the GPU: the changed plan's price from the
    other plan's starts, against its own starts (predicted / measured - 1)."""

    calibration: str
    changed: str  # the changed plan's fingerprint (12 hex digits)
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


@dataclass(frozen=True)
class PairErrors:
    seconds: tuple[PairError, ...] = ()
    gib: tuple[PairError, ...] = ()
    split: float | None = None  # a PIECEWISE graph's memory over a FULL one's, per layer (`memory_split`)


def _graph_keys(plan: Plan) -> list[tuple[str, int, int]]:
    return [(g.descriptor.cg_mode, g.descriptor.num_active_loras, g.descriptor.num_tokens) for g in plan.graphs]


def _keys_of(start: Start) -> list[tuple[str, int, int]]:
    return [(g.cg_mode, g.lora_case, n) for g in start.graph_sizes for n in g.sizes]


def _plans_of(cal: Calibration) -> dict[str, list[Start]]:
    """The calibration's starts whose memory is a plan's and that say their graphs, by plan."""
    out: dict[str, list[Start]] = {}
    for s in cal.starts:
        if s.plan_memory and s.graph_sizes and s.after_profiling is not True:
            out.setdefault(s.fingerprint, []).append(s)
    return out


def memory_readings(cal: Calibration) -> tuple[object, ...] | None:
    """What a calibration measured of graph memory: its model shape and each plan's first-capture
    readings. Graph memory is the same to the byte on every machine for one shape and plan, so two
    calibrations with the same readings are one measurement made twice (seconds are the
    machine's and differ). None: no plan's memory measured."""
    plans = _plans_of(cal)
    if not plans:
        return None
    shape = cal.identity.shape.model_dump_json() if cal.identity and cal.identity.shape else None
    return (shape, *sorted((fp, tuple(sorted(s.graph_memory_gib for s in ss))) for fp, ss in plans.items()))


def memory_split(cals: list[Calibration]) -> float | None:
    """A PIECEWISE graph's memory over a FULL graph's, per layer of the model: a PIECEWISE graph is
    one graph per piece between attention layers, a FULL graph one graph. Solved from every
    deployment whose first-capture starts measured two plans of different mixes (two plans, two
    unknowns: a FULL graph's and a PIECEWISE graph's share beside the workspace); the median
    over deployments, a deployment measured again to the byte counted once (`memory_readings`).
    None: no deployment measured two plans."""
    ratios = []
    seen = set()
    for cal in cals:
        shape = cal.identity.shape if cal.identity else None
        plans = list(_plans_of(cal).values())
        if shape is None or len(plans) < 2 or memory_readings(cal) in seen:
            continue
        seen.add(memory_readings(cal))
        rows = []
        for starts in plans[:2]:
            keys = _keys_of(starts[0])
            full = sum(1 for m, _, _ in keys if m == "FULL")
            top = max(n for _, _, n in keys)
            rows.append(
                (
                    full,
                    len(keys) - full,
                    statistics.median(s.graph_memory_gib for s in starts) - workspace_gib(shape, top),
                )
            )
        (f1, p1, m1), (f2, p2, m2) = rows
        det = f1 * p2 - f2 * p1
        if det == 0:
            continue
        full_gib, piece_gib = (m1 * p2 - m2 * p1) / det, (f1 * m2 - f2 * m1) / det
        if full_gib > 0 and piece_gib > 0:
            ratios.append(piece_gib / full_gib / shape.num_layers)
    return statistics.median(ratios) if ratios else None


def scaled_memory(
    keys: list[tuple[str, int, int]], starts: list[Start], shape: ModelShape | None, split: float | None
) -> tuple[float, str]:
    """A plan's graph memory (its graphs as (mode, LoRA case, tokens)) from starts of another plan:
    the largest graph's workspace, and a share per graph, a PIECEWISE graph's `split` x layers
    times a FULL graph's where the split is known and the starts say their graphs; else one share
    for every graph. The median over the starts."""
    top = max(n for _, _, n in keys)
    layers = _layers(shape)

    def units(ks: list[tuple[str, int, int]]) -> float:
        assert split is not None
        return sum(1.0 if m == "FULL" else split * layers for m, _, _ in ks)

    if split is not None and all(s.graph_sizes for s in starts):
        values = [
            (s.graph_memory_gib - workspace_gib(shape, s.max_tokens)) / units(_keys_of(s)) * units(keys)
            + workspace_gib(shape, top)
            for s in starts
        ]
        how = (
            f"graph memory by mode: a PIECEWISE graph {split * layers:.2f}x a FULL graph's share ({split:.3f} per "
            "layer, from the plan pairs measured on the GPU), plus the largest graph's workspace"
        )
        return max(0.0, statistics.median(values)), how
    values = [memory_rate(s, shape) * len(keys) + workspace_gib(shape, top) for s in starts]
    return statistics.median(values), "graph memory by graphs and the largest graph's workspace"


def plan_pair_errors(cals: list[Calibration], split_from: list[Calibration] | None = None) -> PairErrors:
    """Every plan pair in the calibrations: within one calibration (one deployment), each plan its
    starts measured priced from the starts of the others (seconds from a probe's captures,
    memory from first-capture starts), against the median of its own starts. The memory's mode
    split is solved from `split_from` where given (calibrations measured before these, for a
    held-out test), else from the other deployments' pairs: none of a pair's own figures prices it,
    nor the same readings made again on another machine. A deployment's memory measured again to
    the byte (`memory_readings`) gives its memory pairs once; seconds are the machine's, and each
    deployment's seconds pair counts."""
    seconds, gib = [], []
    seen = set()
    for cal in cals:
        shape = cal.identity.shape if cal.identity else None
        plans = _plans_of(cal)
        mine_read = memory_readings(cal)
        others_cals = [c for c in cals if c is not cal and (mine_read is None or memory_readings(c) != mine_read)]
        split = memory_split(split_from if split_from is not None else others_cals)
        repeated = mine_read in seen
        seen.add(mine_read)
        for fp, mine in plans.items():
            others = [s for s in cal.starts if s.fingerprint != fp]
            keys = _keys_of(mine[0])
            found = capture_seconds(_plan_of(keys), others)
            if found is not None:
                truth = statistics.median(s.capture_seconds for s in mine)
                seconds.append(PairError(cal.name, fp[7:19], found[0], truth))
            mem = [s for f, ss in plans.items() if f != fp for s in ss]
            if mem and not repeated:
                guess, _ = scaled_memory(keys, mem, shape, split)
                truth = statistics.median(s.graph_memory_gib for s in mine)
                gib.append(PairError(cal.name, fp[7:19], guess, truth))
    return PairErrors(tuple(seconds), tuple(gib), memory_split(cals))


def _plan_of(graphs: list[tuple[str, int, int]]) -> Plan:
    """A stand-in for a plan of these graphs (mode, LoRA case, tokens): what pricing reads of one."""
    from types import SimpleNamespace

    return SimpleNamespace(  # type: ignore[return-value]
        graphs=[
            SimpleNamespace(descriptor=SimpleNamespace(cg_mode=m, num_active_loras=c, num_tokens=n))
            for m, c, n in graphs
        ]  # fmt: skip
    )


@functools.cache
def project_pair_errors() -> PairErrors:
    """The plan pairs of the project's calibrations (`capplan/data/calibrations/`)."""
    return plan_pair_errors(project_calibrations())


T975 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}  # fmt: skip


def error_band(errors: Sequence[float]) -> tuple[float, float] | None:
    """Where the next pair's error (predicted / measured - 1) lies, 95%: the measured errors (as
    log ratios) as a normal sample, mean +/- t x sd x sqrt(1 + 1/n); None under two."""
    n = len(errors)
    if n < 2:
        return None
    logs = [math.log1p(e) for e in errors]
    mean = statistics.fmean(logs)
    t = T975[max(k for k in T975 if k <= n - 1)] if n - 1 <= 30 else 1.96  # a df between two listed: the larger t
    half = t * statistics.stdev(logs) * math.sqrt(1 + 1 / n)
    return math.expm1(mean - half), math.expm1(mean + half)


def _within(value: float, errors: Sequence[float]) -> Figure:
    """The value and where the truth lies, 95%, if scaling errs as on the plan pairs measured on
    the GPU (`error_band`); no interval under two pairs."""
    band = error_band(errors)
    if band is None:
        return Figure(value)
    lo_err, hi_err = band  # predicted / true - 1 lies in [lo_err, hi_err]
    return Figure(value, value / (1 + hi_err), value / (1 + lo_err))


def _error_note(what: str, errors: tuple[PairError, ...]) -> str:
    band = error_band([e.error for e in errors])
    if band is None:
        return f"{what}: under two plan pairs measured, so no interval: the figure's error is not known"
    spread = ", ".join(f"{100 * e.error:+.1f}%" for e in errors)
    return (
        f"{what}: 95% interval from scaling's error on {len(errors)} plan pair(s) measured on the GPU, each priced "
        f"without its own figures ({spread}; {', '.join(sorted({e.calibration for e in errors}))})"
    )


def _host_note(starts: list[Start], seconds: Figure) -> str:
    """Capture is bound by the host that records the kernels: which host's seconds these are, and
    the seconds on another machine, widened by the widest spread measured between machines
    (`machine_spread`)."""
    hosts = sorted({f"{s.host_cpu} ({s.host_cores} cores)" for s in starts if s.host_cpu})
    where = f"measured on {'; '.join(hosts)}" if hosts else "measured on a host not recorded"
    spread = project_machine_spread()
    if spread is None:
        return f"capture seconds {where}; on another machine they differ by an amount not measured"
    ratio, said = spread
    lo = (seconds.lo if seconds.lo is not None else seconds.value) / ratio
    hi = (seconds.hi if seconds.hi is not None else seconds.value) * ratio
    return (
        f"capture seconds {where}; on another machine {lo:.1f}..{hi:.1f} s, as far as the widest spread measured "
        f"between machines goes ({ratio:.2f}x: {said})"
    )


def machine_spread(cals: list[Calibration]) -> tuple[float, str] | None:
    """How far one plan's capture seconds moved between machines: the largest over the smallest
    median of the full starts (no probe's: a probe's seconds carry its own costs) of one plan,
    one model shape and one GPU measured in more than one calibration (each a run on a machine of
    its own); the widest such spread, and what it rests on. None where no plan was measured so."""
    groups: dict[tuple[object, ...], list[float]] = {}
    for cal in cals:
        ident = cal.identity
        if ident is None or ident.shape is None or ident.gpu is None:
            continue
        by_plan: dict[str, list[float]] = {}
        for start in cal.starts:
            if not start.captures:
                by_plan.setdefault(start.fingerprint, []).append(start.capture_seconds)
        for fingerprint, seconds in by_plan.items():
            key = (*_shape_key(ident.shape), ident.gpu, fingerprint)
            groups.setdefault(key, []).append(statistics.median(seconds))
    spreads = sorted((max(v) / min(v), sorted(v)) for v in groups.values() if len(v) > 1)
    if not spreads:
        return None
    ratio, values = spreads[-1]
    return ratio, f"one plan of one shape on {len(values)} machines took {', '.join(f'{v:.1f}' for v in values)} s"


@functools.cache
def project_machine_spread() -> tuple[float, str] | None:
    """`machine_spread` of the project's calibrations (`capplan/data/calibrations/`)."""
    return machine_spread(project_calibrations())


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


def _release_note(plan: Plan, cal: Calibration, what: str = "starts") -> tuple[str, ...]:
    """Where the starts ran a vLLM the plan was not compiled for (it plans, captures and measures
    differently): said, since their figures are then another release's."""
    ran = cal.identity.vllm if cal.identity else None
    if ran is None:
        return ("the calibration records no vLLM release: its figures may be another release's",)
    from capplan.releases import release_problem

    if release_problem(plan.spec.target.vllm, ran) is None:
        return ()
    return (f"the {what} ran vLLM {ran}; this plan targets vLLM {plan.spec.target.vllm}: another release's figures",)


def _sources(starts: list[Start]) -> str:
    names = sorted({s.report for s in starts})
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


@dataclass(frozen=True)
class Held:
    """One measured shape in the shape model's fit: its calibration, shape, GPU and rates. Its
    memory is in the fit only where a start's capture ran first (no profiling pass before it,
    whose leftovers the capture reuses) and its memory is a plan's."""

    name: str
    shape: ModelShape
    gpu: str
    vllm: str
    seconds_rate: float  # seconds per layer-graph, median over its starts of one plan
    graphs: int
    max_tokens: int
    seconds: float  # median measured capture seconds of those starts
    first: Start | None = None  # a first-capture start whose graphs are known: the memory in the fit
    mib_per_unit: float | None = None  # its memory beside the workspace, per unit (`memory_units`)


@dataclass(frozen=True)
class HeldOut:
    """The shape model's error on one shape left out of the fit (predicted / measured - 1); None
    where the shape's memory is not in the fit."""

    name: str
    seconds_error: float
    gib_error: float | None
    shape: tuple[int | None, ...] = ()  # `_shape_key` of the shape held out


def memory_units(keys: list[tuple[str, int, int]], layers: int, split: float | None) -> float:
    """A plan's graphs in units of a FULL graph's memory: a PIECEWISE graph `split` x layers units
    (one graph per piece between attention layers); every graph one unit where the split is not
    known."""
    if split is None:
        return float(len(keys))
    return sum(1.0 if m == "FULL" else split * layers for m, _, _ in keys)


@dataclass(frozen=True)
class ShapeModel:
    held: tuple[Held, ...]
    seconds_rate: float
    memory_rate: float | None  # GiB per unit (`memory_units`), None: no first-capture shape
    split: float | None
    held_out: tuple[HeldOut, ...]

    @property
    def seconds_errors(self) -> list[float]:
        return [h.seconds_error for h in self.held_out]

    @property
    def gib_errors(self) -> list[float]:
        """One memory error per shape (the median of its calibrations'): two runs of one shape
        read the same pool growth, and counted twice they would narrow the interval with no
        new evidence. (Seconds keep one error per calibration: each run is another machine.)"""
        by_shape: dict[tuple[int | None, ...], list[float]] = {}
        for h in self.held_out:
            if h.gib_error is not None:
                by_shape.setdefault(h.shape, []).append(h.gib_error)
        return [statistics.median(v) for v in by_shape.values()]

    def basis(self) -> str:
        shapes = "; ".join(
            f"{h.name}: {h.shape.num_layers} layers, hidden {h.shape.hidden_size} on {h.gpu}, vLLM {h.vllm}"
            for h in self.held
        )
        worst = ", ".join(
            f"{what} {max((abs(e) for e in errs), default=float('nan')) * 100:.0f}%"
            for what, errs in (("capture seconds", self.seconds_errors), ("graph memory", self.gib_errors))
        )
        count = len({_shape_key(h.shape) for h in self.held})
        return (
            f"predicted by the shape model from {count} measured shape(s) in {len(self.held)} calibration(s) "
            f"({shapes}); worst error on a shape held out: {worst}"
        )

    def predict(self, plan: Plan, shape: ModelShape, gpu: str | None) -> Priced:
        graphs, top = _plan_figures(plan)
        seconds = _within(self.seconds_rate * shape.num_layers * graphs, self.seconds_errors)
        notes = self.extrapolated(plan, shape, gpu)
        assert self.memory_rate is not None  # Pricer.price asks only then
        units = memory_units(_graph_keys(plan), shape.num_layers, self.split)
        gib = _within(self.memory_rate * units + workspace_gib(shape, top), self.gib_errors)
        notes.append(
            "intervals: 95% from the model's errors on each measured shape held out of the fit "
            f"({len(self.seconds_errors)} for seconds, {len(self.gib_errors)} for memory); "
            "a probe of this deployment (capplan calibrate) replaces the prediction"
        )
        if any(n.startswith("extrapolated") for n in notes):
            notes.append("the intervals do not bound the extrapolation")
        return Priced(graphs, seconds, gib, "predicted", self.basis(), tuple(notes), source="the shape model")

    def extrapolated(self, plan: Plan, shape: ModelShape, gpu: str | None) -> list[str]:
        """Where the deployment lies outside what was measured, and by how far."""
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
        if shape.num_experts and not any(h.shape.num_experts for h in self.held):
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
    usable = [s for s in cal.starts if s.plan_memory]
    if not usable or ident is None or ident.shape is None or ident.gpu is None:
        return None
    one = [s for s in usable if s.fingerprint == usable[0].fingerprint]  # one plan's: its median is a plan's
    shape = ident.shape
    first = next((s for s in usable if s.after_profiling is False and s.graph_sizes), None)
    return Held(
        cal.name,
        shape,
        ident.gpu,
        ident.vllm or "unrecorded",
        statistics.median(second_rate(s, shape) for s in one),
        one[0].graphs,
        one[0].max_tokens,
        statistics.median(s.capture_seconds for s in one),
        first,
    )


def _shape_key(shape: ModelShape) -> tuple[int | None, ...]:
    """What makes two calibrations one shape (the model's layers, widths and experts): held out
    together, whatever host or start they came from."""
    return (shape.num_layers, shape.hidden_size, shape.intermediate_size, shape.num_experts)


def _memory_rate(held: tuple[Held, ...], split: float | None) -> float | None:
    rates = [
        (h.first.graph_memory_gib - workspace_gib(h.shape, h.first.max_tokens))
        / memory_units(_keys_of(h.first), h.shape.num_layers, split)
        for h in held
        if h.first is not None
    ]
    return statistics.median(rates) if rates else None


def fit_shape_model(cals: list[Calibration]) -> ShapeModel | None:
    """The shape model fitted on every calibration with starts and a shape (None: none has),
    with its error on each shape held out of the fit (leave one shape out: the rates, and the
    mode split, from the others). Seconds: a rate per layer-graph (a capture records each layer's
    kernels); memory: the largest graph's workspace and a share per unit (`memory_units`), from
    first-capture starts only."""
    held = tuple(h for h in (held_of(c) for c in cals) if h is not None)
    if not held:
        return None
    split = memory_split(cals)
    out = []
    if len(held) > 1:
        for h in held:
            rest = tuple(x for x in held if _shape_key(x.shape) != _shape_key(h.shape))  # the shape held out
            if not rest:
                continue
            s_rate = statistics.median(x.seconds_rate for x in rest)
            seconds_error = s_rate * h.shape.num_layers * h.graphs / h.seconds - 1
            gib_error = None
            if h.first is not None:
                own_split = memory_split([c for c in cals if c.identity is None or c.identity.shape is None
                                          or _shape_key(c.identity.shape) != _shape_key(h.shape)])  # fmt: skip
                m_rate = _memory_rate(rest, own_split)
                if m_rate is not None:
                    keys = _keys_of(h.first)
                    guess = m_rate * memory_units(keys, h.shape.num_layers, own_split)
                    guess += workspace_gib(h.shape, h.first.max_tokens)
                    gib_error = guess / h.first.graph_memory_gib - 1
            out.append(HeldOut(h.name, seconds_error, gib_error, _shape_key(h.shape)))
    return ShapeModel(
        held, statistics.median(h.seconds_rate for h in held), _memory_rate(held, split), split, tuple(out)
    )


def project_calibrations() -> list[Calibration]:
    """Every calibration the project holds (`capplan/data/calibrations/*.yaml`)."""
    from capplan.loading import load_calibration

    return [load_calibration(p) for p in sorted(DATA.glob("*.yaml"))]


@dataclass(frozen=True)
class Pricer:
    """The one pricing of plans: the deployment's own calibration (`deployment`: its starts and
    probes, or capture runs), the shape model (`model`), and a shape the operator gave
    (`--model-config`) over the spec's `model`."""

    deployment: Calibration | None = None
    model: ShapeModel | None = None
    shape: ModelShape | None = None
    unread: str | None = None  # a calibration folder found beside the plans that did not load, and why

    def price(self, plan: Plan) -> Priced:
        """The deployment's own evidence where its identity matches the spec, else the shape
        model's prediction, else not priced (and why, and what would price it)."""
        priced = self._price(plan)
        return dataclasses.replace(priced, notes=(*priced.notes, self.unread)) if self.unread else priced

    def _price(self, plan: Plan) -> Priced:
        from capplan.calibration.shape import shape_from_spec

        if not plan.graphs:
            return Priced(0, Figure(0.0, 0.0, 0.0), Figure(0.0, 0.0, 0.0), "exact", "no graphs to capture")
        why_not, known = "", None
        if self.deployment is not None:
            cal = self.deployment
            basis = judge(cal, plan.spec)
            if basis.usable:
                priced = price_from_starts(plan, cal)
                if priced is None and cal.runs:
                    priced = runs_price(plan, cal)
                if priced is not None:
                    if basis.unchecked:
                        note = f"not checked against this deployment: {'; '.join(basis.unchecked)}"
                        priced = dataclasses.replace(priced, notes=(*priced.notes, note))
                    return priced
                why_not = (
                    f"calibration {cal.name} has no start whose graph memory is a plan's (a probe of report "
                    "format 1 prices seconds only) and no capture runs"
                )
                known = cal.identity.shape if cal.identity is not None else None  # its own shape, checked
            else:
                why_not = f"calibration {cal.name} not used: {basis.note}"
        shape = self.shape or shape_from_spec(plan.spec) or known
        if shape is not None and self.model is not None and self.model.memory_rate is not None:
            priced = self.model.predict(plan, shape, plan.spec.target.gpu)
            notes = priced.notes + ((why_not,) if why_not else ())
            if shape.intermediate_size is None:
                notes += ("intermediate size not given (--model-config): the workspace counts 4 x hidden per token",)
            return dataclasses.replace(priced, notes=notes)
        return Priced(len(plan.graphs), None, None, "not priced", f"{why_not}; {NOT_PRICED}" if why_not else NOT_PRICED)


def load_pricer(
    calibration: _Path | None = None, beside: _Path | None = None, model_config: _Path | None = None
) -> Pricer:
    """The pricer of the plans a command was given: the calibration given with --calibration,
    else the calibration folder found beside `beside` (`.capplan/calibration`), the shape model
    fitted on the project's calibrations, and the shape of --model-config."""
    from capplan.calibration.shape import shape_from_config
    from capplan.calibration.starts import find_folder, merged_folder
    from capplan.errors import CapplanError
    from capplan.loading import load_checked_calibration

    deployment, unread = None, None
    if calibration is not None:
        deployment = load_checked_calibration(calibration)
    elif beside is not None:
        folder = find_folder(beside)
        if folder is not None:
            try:
                deployment = merged_folder(folder)
            except CapplanError as exc:  # found, not named: it prices nothing, and that is said (not a failure)
                unread = f"calibration folder not read, so it prices nothing: {exc.one_line()}"
    shape = shape_from_config(model_config) if model_config is not None else None
    return Pricer(deployment, fit_shape_model(project_calibrations()), shape, unread)


@dataclass(frozen=True)
class PriceDelta:
    """Both plans priced, and the change: new minus old; None where either is not priced. Its
    interval is bound by bound where both prices rest on one source (the same rates: a start
    that ran slow prices both plans slow), else the widest the two intervals allow."""

    old: Priced
    new: Priced

    @property
    def graphs(self) -> int:
        return self.new.graphs - self.old.graphs

    @property
    def priced(self) -> bool:
        return self.old.priced and self.new.priced

    @property
    def seconds(self) -> Figure | None:
        return _minus(self.new.seconds, self.old.seconds, self._one_source)

    @property
    def gib(self) -> Figure | None:
        return _minus(self.new.gib, self.old.gib, self._one_source)

    @property
    def _one_source(self) -> bool:
        return bool(self.old.source) and self.old.source == self.new.source

    @property
    def kind(self) -> str:
        return " / ".join(dict.fromkeys((self.old.kind, self.new.kind)))


def _minus(a: Figure | None, b: Figure | None, one_source: bool) -> Figure | None:
    if a is None or b is None:
        return None
    if a.lo is None or a.hi is None or b.lo is None or b.hi is None:
        return Figure(a.value - b.value)
    if not one_source:
        return Figure(a.value - b.value, a.lo - b.hi, a.hi - b.lo)
    lo, hi = a.lo - b.lo, a.hi - b.hi
    return Figure(a.value - b.value, min(lo, hi), max(lo, hi))


def price_pair(old: Plan, new: Plan, pricer: Pricer) -> PriceDelta:
    return PriceDelta(pricer.price(old), pricer.price(new))
