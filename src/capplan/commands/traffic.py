"""`capplan simulate` and `optimize`: a plan (or a spec's candidate plans) replayed
against recorded traffic."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from capplan.calibration.price import Priced
from capplan.commands import Notes, inputs, no_notes
from capplan.errors import CapplanError, UsageError, printable
from capplan.schemas.plan import Plan
from capplan.traffic.optimize import Optimized
from capplan.traffic.simulate import Simulation
from capplan.traffic.tiers import ReadyChoice, choose_ready, describe


def _trace_notes(files: list[Any], notes: Notes) -> None:
    for note in {f.note for f in files if f.note}:
        notes(f"note: {note}")


@dataclass(frozen=True)
class Simulated:
    """A plan replayed over one trace (or one per DP rank); `data` is its JSON form."""

    plan: Plan
    simulation: Simulation
    data: dict[str, Any]
    priced: Priced  # the plan's capture price, as show gives it


def simulate(
    plan_path: Path,
    traces: list[Path],
    calibration: Path | None = None,
    plot: Path | None = None,
    notes: Notes = no_notes,
    drop_unschedulable: bool = False,
    model_config: Path | None = None,
) -> Simulated:
    """Replay the traces through the plan's dispatcher; with `plot`, draw hits and padding there;
    `drop_unschedulable`: leave out (and count) batches the plan's deployment never schedules."""
    from capplan.batches import read_rank_traces
    from capplan.calibration.price import load_pricer
    from capplan.loading import load_steps
    from capplan.planfile.read import load_plan
    from capplan.present.show import price_json
    from capplan.traffic.simulate import simulate as replay
    from capplan.traffic.simulate import simulate_ranks

    loaded = load_plan(plan_path)
    files = read_rank_traces(traces, loaded.spec, drop_unschedulable)
    _trace_notes(files, notes)
    steps = load_steps(calibration)
    priced = load_pricer(calibration, plan_path, model_config).price(loaded)
    if len(files) == 1:
        result = replay(loaded, files[0].batches, steps=steps)
    else:
        result = simulate_ranks(loaded, [f.batches for f in files], steps=steps)
    data = {**result.to_json(loaded), "price": price_json(priced)}
    if plot is not None:
        from capplan.files import write_atomic
        from capplan.present.plot import plot_bars, simulation_panels

        caption = (
            f"capplan simulate {plan_path.name} {' '.join(t.name for t in traces)}: "
            f"hit rate {data['graph_hit_rate']:.1%}, padding {data['padding_overhead']:.2%}"
        )
        write_atomic(plot, plot_bars(plot, simulation_panels(data), caption), inputs(plan_path, *traces, calibration))
    return Simulated(loaded, result, data, priced)


@dataclass(frozen=True)
class OptimizeRequest:
    """`capplan optimize`'s arguments: the spec, its traces, the budget and the outputs."""

    spec: Path
    traces: list[Path]
    max_graphs: int | None = None
    max_graph_memory: float | None = None
    max_capture_seconds: float | None = None
    max_slowdown: float | None = None
    objective: str | None = None
    padding_fallback: bool = False
    output: Path | None = None
    plot: Path | None = None
    calibration: Path | None = None
    shared_sizes: bool = False
    ready_share: float | None = None
    max_pad_ratio: float | None = 2.0
    holdout: float = 0.2
    drop_unschedulable: bool = False  # leave out batches the spec's deployment never schedules, counted
    model_config: Path | None = None  # the model's config.json: its shape, for the shape model's prices
    judge_on: tuple[Path, ...] = ()  # other traffic the choice is judged on, never fitted on


def worse_than_default(padding: float, default_padding: float, eager: int, default_eager: int) -> str | None:
    """Why the fitted sizes do worse than the spec's own on some steps (more padding, else more
    steps eager), or None."""
    if padding > default_padding:
        return f"padding {padding:.2%} against {default_padding:.2%}"
    if eager > default_eager:
        return f"{eager} eager steps against {default_eager}"
    return None


def scored(result: Optimized, trace: list) -> tuple[Any, Any]:
    """The chosen plan's and the spec's own plan's totals on `trace` (steps above the spec's
    largest graph left out: eager under both)."""
    from capplan.planner.compiler import compile_plan
    from capplan.traffic.simulate import simulate

    top = result.default.capture_sizes[-1] if result.default.capture_sizes else 0
    chosen = simulate(result.plan, trace, leave_out_above=top).total
    return chosen, simulate(compile_plan(result.default.spec), trace, leave_out_above=top).total


@dataclass(frozen=True)
class HeldOut:
    """The choice scored on the part of the trace it was not fitted on (the last `share` of
    its steps), against the spec's default sizes on the same steps."""

    share: float
    fitted_steps: int
    steps: int
    padding: float
    default_padding: float
    eager: int
    default_eager: int
    worst_pad: float  # the most any batch, traced or not, pads by under the chosen sizes
    max_pad: float | None

    def part(self) -> str:
        """Which steps the figures are on."""
        return (
            f"on the held-out last {self.share:.0%} of the trace ({self.steps} steps; fitted on the first "
            f"{1 - self.share:.0%}, {self.fitted_steps} steps)"
        )

    def worse(self) -> str | None:
        """Why the fitted sizes do worse than the default on the held-out steps, or None."""
        return worse_than_default(self.padding, self.default_padding, self.eager, self.default_eager)

    def line(self) -> str:
        bound = f" (bound {self.max_pad:g}x)" if self.max_pad is not None else " (unbounded)"
        return (
            f"{self.part()}: padding {self.padding:.2%} vs {self.default_padding:.2%} by default, {self.eager} eager "
            f"steps vs {self.default_eager}; no batch pads past {self.worst_pad:.2f}x{bound}"
        )


@dataclass(frozen=True)
class Judged:
    """The choice scored on other traffic (a trace it was not fitted on, `--judge-on`), against
    the spec's own sizes on the same steps."""

    trace: str
    steps: int
    padding: float
    default_padding: float
    eager: int
    default_eager: int

    def part(self) -> str:
        return f"on {self.trace} ({self.steps} steps, not fitted on)"

    def worse(self) -> str | None:
        """Why the fitted sizes do worse than the spec's own on this traffic, or None."""
        return worse_than_default(self.padding, self.default_padding, self.eager, self.default_eager)

    def line(self) -> str:
        return (
            f"{self.part()}: padding {self.padding:.2%} vs {self.default_padding:.2%} by default, {self.eager} eager "
            f"steps vs {self.default_eager}"
        )


def _judged(result: Optimized, name: str, trace: list) -> Judged:
    chosen, default = scored(result, trace)
    return Judged(
        trace=name,
        steps=sum(item.count for item in trace),
        padding=chosen.padding_overhead,
        default_padding=default.padding_overhead,
        eager=chosen.eager_steps,
        default_eager=default.eager_steps,
    )


RAISE_SHARE = 0.05  # steps above the largest graph, as a share of the trace, worth proposing a larger one
RAISE_COVER = 0.99  # the share of steps the proposed largest graph covers


@dataclass(frozen=True)
class Raise:
    """A larger largest graph, proposed where many steps run above it (eager under every
    candidate, so that no choice of sizes below it can help them): vLLM's own sizes up to the
    proposed ceiling, counted and simulated on the whole traffic."""

    top: int
    steps: int
    above: int
    ceiling: int
    graphs: int
    default_graphs: int
    eager: int

    def line(self) -> str:
        return (
            f"raise the largest graph? {self.above} of {self.steps} steps ({self.above / self.steps:.1%}) are above "
            f"it ({self.top} tokens) and run eager under every candidate; with cudagraph.max_capture_size: "
            f"{self.ceiling} ({RAISE_COVER:.0%} of the steps are at most that), vLLM's sizes capture {self.graphs} "
            f"graphs ({self.graphs - self.default_graphs:+d}) and {self.eager} steps run eager: set it in the spec "
            "and optimize again to weigh it"
        )


def _raise(spec: Any, traces: list[list], default_graphs: int) -> Raise | None:
    """The larger largest graph to propose for this traffic, or None (few steps above the
    largest, sizes the spec lists itself, or no larger ceiling within the token budget)."""
    from capplan.planner.capture_sizes import resolve_capture_sizes
    from capplan.planner.compiler import compile_plan
    from capplan.traffic.simulate import simulate

    if spec.cudagraph.capture_sizes is not None or spec.cudagraph.lora_case_sizes is not None:
        return None
    if spec.parallel.synced_size > 1 or spec.cudagraph.mode.value not in ("FULL_AND_PIECEWISE", "PIECEWISE"):
        return None  # DP ranks pad to one another (steps are not one rank's); no mixed graphs to raise
    _, top = resolve_capture_sizes(spec)
    counts: dict[int, int] = {}
    for trace in traces:
        for item in trace:
            counts[item.batch.num_tokens] = counts.get(item.batch.num_tokens, 0) + item.count
    steps = sum(counts.values())
    above = sum(n for tokens, n in counts.items() if tokens > top)
    if not top or not steps or above < RAISE_SHARE * steps:
        return None
    seen, cover = 0, top
    for tokens in sorted(counts):
        seen += counts[tokens]
        if seen >= RAISE_COVER * steps:
            cover = tokens
            break
    ceiling = min(spec.scheduler.max_num_batched_tokens, -(-cover // 16) * 16)
    if ceiling <= top:
        return None
    raised = spec.model_copy(update={"cudagraph": spec.cudagraph.model_copy(update={"max_capture_size": ceiling})})
    try:
        plan = compile_plan(raised)
    except CapplanError:
        return None  # more graphs than a plan can hold: nothing to propose
    eager = sum(simulate(plan, trace).total.eager_steps for trace in traces)
    return Raise(top, steps, above, ceiling, len(plan.graphs), default_graphs, eager)


def split_in_time(trace: list, share: float) -> tuple[list, list]:
    """(the first 1 - share of a trace's steps, the rest), a run of repeats cut where it falls."""
    from capplan.traffic.simulate import TraceBatch

    total = sum(item.count for item in trace)
    cut = total - round(total * share)
    first, rest, seen = [], [], 0
    for item in trace:
        if seen >= cut:
            rest.append(item)
        elif seen + item.count <= cut:
            first.append(item)
        else:
            first.append(TraceBatch(item.batch, cut - seen))
            rest.append(TraceBatch(item.batch, seen + item.count - cut))
        seen += item.count
    return first, rest


def _held_out(result: Optimized, fit: list, held: list, share: float, max_pad: float | None) -> HeldOut:
    from capplan.traffic.optimize import worst_pad

    chosen, default = scored(result, held)
    spec = result.spec
    sets = [result.point.capture_sizes] + [e.sizes for e in spec.cudagraph.lora_case_sizes or []]
    return HeldOut(
        share=share,
        fitted_steps=sum(item.count for item in fit),
        steps=sum(item.count for item in held),
        padding=chosen.padding_overhead,
        default_padding=default.padding_overhead,
        eager=chosen.eager_steps,
        default_eager=default.eager_steps,
        worst_pad=max(worst_pad(sizes) for sizes in sets),
        max_pad=max_pad,
    )


@dataclass(frozen=True)
class OptimizeOutcome:
    """The chosen point and its curve (None when only the ready tier was chosen), the ready
    tier (None without --ready-share), and where the optimized spec was written."""

    result: Optimized | None
    output: Path
    ready: ReadyChoice | None = None
    held_out: HeldOut | None = None  # None: --holdout 0, or DP rank traces
    kept_default: str | None = None  # why the spec's own sizes were written instead of the fitted ones
    judged: tuple[Judged, ...] = ()  # the choice on other traffic (--judge-on)
    raise_largest: Raise | None = None  # a larger largest graph, where many steps run above it


def optimized_path(spec: Path) -> Path:
    """Where optimize writes by default: SPEC.optimized.yaml beside the spec."""
    return spec.with_name(spec.name.removesuffix(".yaml").removesuffix(".yml") + ".optimized.yaml")


def optimize(request: OptimizeRequest, notes: Notes = no_notes) -> OptimizeOutcome:
    """Choose capture sizes for the traces under the budget; write the spec (and the picture)
    only once its plan verifies."""
    from capplan.batches import read_rank_traces
    from capplan.calibration.price import load_pricer
    from capplan.files import check_output, write_atomic
    from capplan.loading import load_spec, load_steps
    from capplan.planner.compiler import compile_plan
    from capplan.traffic.optimize import optimize as choose

    r = request
    out = r.output or optimized_path(r.spec)
    sources = inputs(r.spec, *r.traces, *r.judge_on, r.calibration)
    if r.plot is not None and os.path.realpath(r.plot) == os.path.realpath(out):
        raise UsageError(
            f"--plot {printable(str(r.plot))} is also the optimized spec's path", "give the picture its own"
        )
    for target in (out, r.plot):
        if target is not None:
            check_output(target, sources)
    loaded = load_spec(r.spec)
    files = read_rank_traces(r.traces, loaded, r.drop_unschedulable)
    _trace_notes(files, notes)
    budgets = (r.max_graphs, r.max_graph_memory, r.max_capture_seconds, r.max_slowdown)
    if r.ready_share is not None and all(b is None for b in budgets):
        if r.plot is not None:
            raise UsageError("--plot draws the capture-size curve: it needs a budget", "drop --plot")
        ready = choose_ready(loaded, [f.batches for f in files], r.ready_share)
        _check_verifies(ready.plan, out)
        write_atomic(out, tiers_spec_text(r.spec, r.traces, ready), sources)
        return OptimizeOutcome(None, out, ready)
    if not 0.0 <= r.holdout < 1.0:
        raise UsageError(f"--holdout must be at least 0 and below 1 (got {r.holdout:g})")
    fitted = [f.batches for f in files]
    held: list | None = None
    if r.holdout > 0 and len(files) == 1:
        first, rest = split_in_time(files[0].batches, r.holdout)
        if first and rest:
            fitted, held = [first], rest
        else:
            notes(f"note: too short a trace to hold out {r.holdout:.0%} of it: fitted on all of it")
    elif r.holdout > 0:
        notes("note: DP rank traces: fitted on every step of each rank, nothing held out (ranks pad to one another)")
    result = choose(
        loaded,
        fitted,
        load_steps(r.calibration),
        pricer=load_pricer(r.calibration, r.spec, r.model_config),
        max_graphs=r.max_graphs,
        max_graph_memory=r.max_graph_memory,
        max_capture_seconds=r.max_capture_seconds,
        max_slowdown=r.max_slowdown,
        shared_sizes=r.shared_sizes,
        objective=r.objective,
        padding_fallback=r.padding_fallback,
        max_pad=r.max_pad_ratio,
    )
    held_out = _held_out(result, fitted[0], held, r.holdout, r.max_pad_ratio) if held is not None else None
    judged_files = [read_rank_traces([path], loaded, r.drop_unschedulable)[0] for path in r.judge_on]
    _trace_notes(judged_files, notes)  # each trace on its own: other traffic of one engine
    judged = tuple(_judged(result, printable(str(p)), f.batches) for p, f in zip(r.judge_on, judged_files))
    kept = _keep_default(result, held_out, judged)
    larger = _raise(loaded, [f.batches for f in files], result.default.graphs)
    if kept is not None:  # the spec's own sizes: the user's spec as it is (the point stays the best fitted)
        result = replace(result, spec=loaded, plan=compile_plan(loaded))
    tiered: ReadyChoice | None = None
    if r.ready_share is not None:
        tiered = choose_ready(result.spec, [f.batches for f in files], r.ready_share)
        result = replace(result, spec=tiered.spec, plan=tiered.plan)
    _check_verifies(result.plan, out)
    picture = None
    if r.plot is not None:  # drawn before anything is written: a picture that cannot be made writes nothing
        from capplan.present.optimize import fitted_part
        from capplan.present.plot import plot_curve

        d = result.default
        caption = (
            f"capplan optimize {r.spec.name} {' '.join(t.name for t in r.traces)}: default {d.graphs} graphs, "
            f"padding {d.padding_overhead:.2%} on {fitted_part(held_out)}"
        )
        chosen = result.default if kept is not None else result.point
        picture = plot_curve(r.plot, result.curve, chosen, r.max_graphs, caption)
    text = optimized_spec_text(r.spec, r.traces, result, held_out, kept)
    if tiered is not None:
        text = f"# {printable(describe(tiered))}\n" + text
    write_atomic(out, text, sources)
    if r.plot is not None and picture is not None:
        write_atomic(r.plot, picture, sources)
    return OptimizeOutcome(result, out, tiered, held_out, kept, judged, larger)


def _keep_default(result: Optimized, held_out: HeldOut | None, judged: tuple[Judged, ...] = ()) -> str | None:
    """Why the spec's own sizes are the better choice, or None: the fitted sizes pad more (or run
    more steps eager) than the spec's own somewhere they were judged (the held-out steps, each
    trace of other traffic), under the padded-tokens objective (under step time the figures are
    reported, and the choice stands)."""
    p, d = result.point, result.default
    if result.objective != "padding":
        return None
    if p.capture_sizes == d.capture_sizes and p.spec.cudagraph.lora_case_sizes is None:
        return None  # the fitted set is the spec's own
    for where in (held_out, *judged):
        why = None if where is None else where.worse()
        if where is not None and why is not None:
            return (
                f"the best {p.sizes} sizes within {result.budget} ({p.graphs} graphs) do worse than the spec's own "
                f"{where.part()}: {why}"
            )
    return None


def user_comment(spec: Path) -> str:
    """The comment lines at the top of the user's spec (its header), to keep in the spec optimize writes."""
    from capplan.errors import SpecError
    from capplan.files import read_text

    lines = []
    # Lines as the user's editor shows them: ended by LF, CRLF or CR, never by the NEL, LS or PS
    # that str.splitlines also breaks at (one comment line would be kept as two).
    for line in re.split(r"\r\n|\r|\n", read_text(spec, "spec", SpecError)):
        if not line.startswith("#"):
            break
        lines.append(line)
    return "".join(f"{printable(line)}\n" for line in lines)


def _check_verifies(plan, out: Path) -> None:
    """The optimized spec is written only when its plan verifies and its plan file would load."""
    from capplan.analysis.verify import verify_plan
    from capplan.planfile.compare import size_problem
    from capplan.planfile.write import plan_file_data, render_plan
    from capplan.present.verify import violation_line

    data = plan_file_data(plan)
    problem = size_problem(render_plan(plan, out.name, None, data), data)
    if problem is not None:
        raise CapplanError(
            f"the optimized spec's plan would be {problem}, so no command could load it; nothing was written",
            "ask for a smaller --ready-share, or capture fewer sizes or LoRA cases",
        )
    report = verify_plan(plan)
    if not report.ok:
        raise CapplanError(
            f"the optimized plan does not verify: {violation_line(report.violations[0])}",
            "please report this; nothing was written",
        )


def tiers_spec_text(spec: Path, traces: list[Path], choice: ReadyChoice) -> str:
    """The spec with its ready tier chosen from the trace: a header saying how, then the spec."""
    from capplan.planfile.write import render_spec

    trace_names = " ".join(printable(t.name) for t in traces)
    header = (
        f"# capplan optimize {printable(spec.name)} {trace_names} --ready-share {choice.share:g}\n"
        f"# {printable(describe(choice))}\n"
    )
    return header + user_comment(spec) + render_spec(choice.spec)


def optimized_spec_text(
    spec: Path,
    traces: list[Path],
    result: Optimized,
    held_out: HeldOut | None = None,
    kept_default: str | None = None,
) -> str:
    """The optimized spec file: a header saying how it was chosen (and on which steps each
    padding figure is), the user's own header comment, then the spec."""
    from capplan.planfile.write import render_spec

    p, d = result.point, result.default
    trace_names = " ".join(printable(t.name) for t in traces)
    header = (
        f"# capplan optimize {printable(spec.name)} {trace_names} (budget {result.budget}, "
        f"objective {result.objective})\n"
    )
    if kept_default is not None:
        header += f"# the spec's own capture sizes ({d.sizes} sizes, {d.graphs} graphs): {printable(kept_default)}\n"
    elif held_out is not None:
        header += f"# {p.sizes} capture sizes, {p.graphs} graphs (default {d.graphs}); {printable(held_out.line())}\n"
    else:
        header += (
            f"# {p.sizes} capture sizes, {p.graphs} graphs (default {d.graphs}), padding {p.padding_overhead:.2%} "
            f"of real tokens on the whole trace (default {d.padding_overhead:.2%})\n"
        )
    if result.objective == "step-time" and p.step_seconds is not None and d.step_seconds is not None:
        header += (
            f"# predicted steps {p.step_seconds:.3f} s (default {d.step_seconds:.3f} s); {printable(result.basis)}\n"
        )
    if result.fallback:
        header += f"# chosen by padded tokens: {printable(result.fallback)}\n"
    return header + user_comment(spec) + render_spec(result.spec)
