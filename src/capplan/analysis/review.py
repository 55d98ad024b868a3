"""A plan change judged by the repository's review policy: pass, warn or deny, from thresholds
on what the change costs (graphs, capture seconds, graph memory, batches sent eager, LoRA
counts whose capture case moves, graphs left unpriced), absolute and percent of the old plan's;
an override recorded against the new plan's fingerprint accepts it. Pure: no I/O."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from capplan.analysis.diff import LoraCountChange, PlanDiff
from capplan.schemas.review import MEASURES, Limit, Measure, Override, ReviewPolicy

Level = Literal["pass", "warn", "deny"]
RANK: dict[Level, int] = {"pass": 0, "warn": 1, "deny": 2}
UNITS: dict[Measure, str] = {
    "graphs": "graph(s)",
    "capture_seconds": "s capture",
    "graph_memory_gib": "GiB graph memory",
    "batches_to_eager": "batch shape(s) sent eager",
    "lora_case_moves": "LoRA count(s) whose case moves",
    "graphs_not_priced": "graph(s) left unpriced",
}


@dataclass(frozen=True)
class Finding:
    """One measure over one of its limits."""

    measure: Measure
    change: float
    percent: float | None  # of the old plan's value, where it has one
    level: Level
    limit: str  # which limit it is over: "deny 200", "warn_percent 10"
    text: str


@dataclass(frozen=True)
class Verdict:
    """The review's answer: `level` after any override (`judged`: before it)."""

    level: Level
    judged: Level
    fingerprint: str
    findings: tuple[Finding, ...] = ()
    not_judged: tuple[str, ...] = ()  # measures with a limit this diff cannot measure, and why
    override: Override | None = None

    @property
    def headline(self) -> str:
        """`DENY: +238 graph(s) (over deny 200)`, `PASS`, or `PASS (overridden: ...)`."""
        worst = [f.text for f in self.findings if f.level == self.judged]
        said = f": {'; '.join(worst)}" if worst else ""
        if self.override is not None and self.judged != "pass":
            by = f" by {self.override.by}" if self.override.by else ""
            return f"PASS (a {self.judged} accepted{by}: {self.override.reason}){said}"
        return f"{self.level.upper()}{said}"

    def accept_line(self) -> str:
        """What a reviewer adds under `overrides:` to accept this plan."""
        return f'- {{fingerprint: "{self.fingerprint}", reason: "WHY", by: "WHO"}}'


def _measure(d: PlanDiff, measure: Measure) -> tuple[float | None, float | None, str | None]:
    """(the change, the old plan's value, why it cannot be measured)."""
    p = d.price
    if measure == "graphs":
        return float(p.graphs), float(p.old.graphs), None
    if measure in ("capture_seconds", "graph_memory_gib"):
        change = p.seconds if measure == "capture_seconds" else p.gib
        old = p.old.seconds if measure == "capture_seconds" else p.old.gib
        if change is None:
            return None, None, "not priced (graphs_not_priced gates what is not)"
        return change.value, None if old is None else old.value, None
    if measure == "batches_to_eager":
        return float(d.to_eager()), None, None
    if measure == "lora_case_moves":
        moved = [
            c for c in d.lora_map_changes if isinstance(c, LoraCountChange) and c.old_case is not None
        ]  # a count the old plan scheduled, now in another case or none (a new count moves nothing)
        return float(len(moved)), None, None
    unpriced = [x.graphs if not x.priced else 0 for x in (p.old, p.new)]
    return float(unpriced[1] - unpriced[0]), None, None  # graphs left unpriced that were not before


def _percent(change: float, base: float | None) -> float | None:
    """The change as a percent of the old value (growth from nothing: infinite), or None."""
    if base is None:
        return None
    if base == 0:
        return math.inf if change > 0 else 0.0
    return 100.0 * change / base


def _over(limit: Limit, change: float, base: float | None) -> list[tuple[Level, str]]:
    percent = _percent(change, base)
    out: list[tuple[Level, str]] = []
    for level in ("deny", "warn"):
        absolute, relative = getattr(limit, level), getattr(limit, f"{level}_percent")
        if absolute is not None and change > absolute:
            out.append((level, f"{level} {absolute:g}"))
        elif relative is not None and percent is not None and percent > relative:
            out.append((level, f"{level}_percent {relative:g}"))
    return out


def review(d: PlanDiff, policy: ReviewPolicy, new_fingerprint: str) -> Verdict:
    """The verdict on `d` (whose new plan has `new_fingerprint`) under `policy`."""
    findings: list[Finding] = []
    not_judged: list[str] = [] if policy.thresholds else ["the policy sets no threshold: every change passes"]
    for measure in MEASURES if not d.equal else ():  # an unchanged plan has nothing to review
        limit = policy.thresholds.get(measure)
        if limit is None:
            continue
        change, base, why = _measure(d, measure)
        if change is None:
            not_judged.append(f"{measure}: {why}")
            continue
        over = _over(limit, change, base)
        if over:
            found, which = over[0]  # deny before warn
            exact = _percent(change, base)
            percent = None if exact is None or math.isinf(exact) else round(exact, 1)  # JSON holds no infinity
            shown = {"capture_seconds": f"{change:+.1f}", "graph_memory_gib": f"{change:+.3f}"}.get(
                measure, f"{change:+g}"
            )
            pct = f", {percent:+g}%" if percent is not None else (", from none" if base == 0 else "")
            findings.append(Finding(measure, change, percent, found, which,
                                    f"{shown} {UNITS[measure]}{pct} (over {which})"))  # fmt: skip
    judged: Level = max((f.level for f in findings), key=RANK.__getitem__, default="pass")
    override = next((o for o in policy.overrides if o.fingerprint == new_fingerprint), None)
    level: Level = "pass" if override is not None else judged
    return Verdict(level, judged, new_fingerprint, tuple(findings), tuple(not_judged), override)
