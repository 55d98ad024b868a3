"""What `capplan compile` says of each plan (on stderr)."""

from __future__ import annotations

from pathlib import Path

from capplan.errors import printable
from capplan.schemas.plan import Plan


def summary(plan: Plan) -> str:
    """`N graphs: PIECEWISE n (case c: k, ...); FULL ...`, or that everything runs eager."""
    parts = []
    for mode in ("PIECEWISE", "FULL"):
        row = plan.stats.get(mode)
        if row:
            cases = ", ".join(f"case {c}: {n}" for c, n in row.items())
            parts.append(f"{mode} {sum(row.values())} ({cases})")
    total = plan.stats["total"]["graphs"]
    return f"{total} graphs" + (": " + "; ".join(parts) if parts else " (cudagraph mode NONE: all eager)")


def outcome_line(action: str, plan_path: Path, plan: Plan) -> str:
    """The stderr line for a plan checked up to date, shown (dry run), left unchanged or written."""
    path = printable(str(plan_path))
    if action == "up to date":
        return f"{path}: up to date ({summary(plan)})"
    if action == "dry run":
        return f"dry run: would write {path}: {summary(plan)}"
    if action == "unchanged":
        return f"{path}: unchanged, {summary(plan)}"
    return f"wrote {path}: {summary(plan)}"
