"""What `capplan optimize` prints: the trade-off curve, the choice, and the same as JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from capplan.errors import printable
from capplan.traffic.optimize import Optimized
from capplan.traffic.tiers import ReadyChoice, describe


def fitted_part(held_out: Any) -> str:
    """The steps the curve's figures are on: the fitted part when some was held out."""
    if held_out is None:
        return "the whole trace"
    return f"the fitted first {1 - held_out.share:.0%} of the trace ({held_out.fitted_steps} steps)"


def render_curve(result: Optimized, full: bool = False, held_out: Any = None, kept_default: str | None = None) -> str:
    """The trade-off curve as text: by default the points near the choice (up to twice its
    graph count, at most 40 rows), the rest summarized in one line; `full` prints them all.
    Every padding figure is on the fitted part (`held_out`: what was held out, if anything)."""
    d = result.default
    timed = result.objective == "step-time"
    part = fitted_part(held_out)
    if timed:
        goal = f"predicted step time on {part} (the simulator's replay priced by measured step times)"
    else:
        folds = any(p.fold_padded_tokens is not None for p in result.curve)
        goal = f"padded tokens on {part}, largest graph kept at {d.capture_sizes[-1]} tokens" + (
            ", each set judged on blocks of those steps it was not fitted on" if folds else ""
        )

    def num(value: float | None, fmt: str, width: int) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"

    default_steps = ""
    if timed:
        default_steps = f", ~{d.step_seconds:.2f} s of steps" if d.step_seconds is not None else ", steps not priced"
    memory = "graph memory not priced" if d.graph_memory_gib is None else f"~{d.graph_memory_gib:.2f} GiB"
    lines = [
        f"capplan optimize: budget {result.budget}; objective: {goal}",
        f"  step times: {result.basis}",
        f"  capture seconds and graph memory: {result.capture_basis}",
        *(f"    {n}" for n in result.capture_notes),
        f"  default capture set: {d.sizes} sizes, {d.graphs} graphs, {memory}, "
        f"padding {d.padding_overhead:.2%} on {part}" + default_steps,
        "  sizes  graphs  ~GiB    ~capture s  padded tokens  padding" + ("  ~step s" if timed else ""),
    ]
    shown = result.curve if full else [p for p in result.curve if p.graphs <= 2 * result.point.graphs]
    every = 1 if full else max(1, len(shown) // 40)
    for i, p in enumerate(shown):
        if p is result.point or i % every == 0 or i == len(shown) - 1:
            mark = (
                ("  <- best in budget, not kept (see below)" if kept_default else "  <- chosen")
                if p is result.point
                else ""
            )
            lines.append(
                f"  {p.sizes:>5}  {p.graphs:>6}  {num(p.graph_memory_gib, '.3f', 6)}  "
                f"{num(p.capture_seconds, '.1f', 10)}  {p.padded_tokens:>13}  {p.padding_overhead:>7.2%}"
                + (f"  {num(p.step_seconds, '.2f', 8)}" if timed else "")
                + mark
            )
    rest = len(result.curve) - len(shown)
    if rest:
        top = max(p.graphs for p in result.curve)
        lines.append(f"  ... {rest} more point(s), up to {top} graphs (--full-curve prints them)")
    if timed:
        unpriced = sum(1 for p in result.curve if p.step_seconds is None)
        if unpriced:
            lines.append(f"  ({unpriced} point(s) marked - need step times the calibration lacks; never chosen)")
    if result.assumption:
        lines.append(f"  note: {result.assumption}")
    return "\n".join(lines)


def written_lines(
    result: Optimized | None,
    output: Path,
    ready: ReadyChoice | None = None,
    held_out: Any = None,
    kept_default: str | None = None,
    judged: tuple[Any, ...] = (),
    raise_largest: Any = None,
) -> list[str]:
    """What optimize says after writing the spec: what was chosen against the default (one
    padding figure each, on the held-out steps when some were held out), why the spec's own
    sizes were kept when they were, and the ready tier when one was chosen."""
    if result is None:
        assert ready is not None
        return [f"wrote {printable(str(output))}: {describe(ready)}; its plan verifies"]
    p, d = result.point, result.default
    steps = ""
    if result.objective == "step-time" and p.step_seconds is not None:
        steps = f", predicted steps {p.step_seconds:.2f} s" + (
            f" vs {d.step_seconds:.2f} s" if d.step_seconds is not None else " (the default plan is not priced)"
        )
        steps += f" on {fitted_part(held_out)}"
    if kept_default is not None:
        lines = [
            f"wrote {printable(str(output))}: the spec's own capture sizes ({d.sizes} sizes, {d.graphs} graphs); "
            f"its plan verifies"
        ]
    elif held_out is not None:
        lines = [
            f"wrote {printable(str(output))}: {p.sizes} sizes, {p.graphs} graphs vs {d.graphs} by default{steps}; "
            "its plan verifies"
        ]
    else:
        lines = [
            f"wrote {printable(str(output))}: {p.sizes} sizes, {p.graphs} graphs vs {d.graphs} by default, padding "
            f"{p.padding_overhead:.2%} vs {d.padding_overhead:.2%} on the whole trace{steps}; its plan verifies"
        ]
    if result.fallback:
        lines.append(f"chosen by padded tokens, not step time (--padding-fallback): {printable(result.fallback)}")
    if ready is not None:
        lines.append(printable(describe(ready)))
    if kept_default is not None:
        lines.append(f"kept: {printable(kept_default)}")  # last: why the fitted sizes were not written
    else:
        if held_out is not None:
            lines.append(printable(held_out.line()))  # how the choice does on steps it was not fitted on
        lines += [printable(j.line()) for j in judged]  # and on other traffic
    if raise_largest is not None:
        lines.append(printable(raise_largest.line()))
    return lines


def optimize_json(
    result: Optimized | None,
    output: Path,
    ready: ReadyChoice | None = None,
    held_out: Any = None,
    kept_default: str | None = None,
    judged: tuple[Any, ...] = (),
    raise_largest: Any = None,
) -> dict[str, Any]:
    """`optimize --json`: the curve, the choice and the default, the ready tier, and where the
    spec went (the curve's keys are null when only the ready tier was chosen)."""
    tiers = None
    if ready is not None:
        tiers = {
            "share": ready.share,
            "ready_graphs": ready.ready,
            "deferred_graphs": len(ready.plan.graphs) - ready.ready,
            "chosen_by_trace": ready.named,
            "trace_steps": ready.steps,
            "graph_steps": ready.graph_steps,
            "covered_steps": ready.covered,
            "basis": "the trace alone (no calibration)",
        }
    if result is None:
        return {"output": str(output), "tiers": tiers}
    return {
        "tiers": tiers,
        "output": str(output),
        "budget": result.budget,
        "objective": result.objective,
        "basis": result.basis,
        "capture_basis": result.capture_basis,
        "capture_notes": list(result.capture_notes),
        "assumption": result.assumption,
        "padding_fallback": result.fallback,
        "chosen": result.point.to_json(),
        "default": result.default.to_json(),
        "curve": [c.to_json() for c in result.curve],
        "held_out": None if held_out is None else {k: v for k, v in held_out.__dict__.items()},
        "kept_default": kept_default,
        "judged_on": [dict(j.__dict__) for j in judged],
        "raise_largest": None if raise_largest is None else dict(raise_largest.__dict__),
    }
