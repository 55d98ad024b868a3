"""Semantic diff of two plans: what a reviewer needs to judge a change.

Graphs added and removed per mode and LoRA case, dispatch regions whose
target changed, spec fields, fixes and deviations, and the estimated capture
time and memory delta. Rendered as text, markdown (for a pull request) or
JSON, all from one `PlanDiff`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import partial

from capplan.planner.capture_sizes import compact
from capplan.planner.dispatch import beyond_spec
from capplan.planner.regions import no_longer_scheduled, target_changes
from capplan.schemas.plan import Descriptor, Plan, address
from capplan.traffic.cost import CostModel, Estimate


@dataclass
class PlanDiff:
    old_name: str
    new_name: str
    equal: bool
    spec_changes: list[str] = field(default_factory=list)
    capture_sizes_added: list[int] = field(default_factory=list)  # the plans' capture sizes
    capture_sizes_removed: list[int] = field(default_factory=list)
    sizes_in_spec_changes: bool = False  # the spec's capture_sizes changed: its line is `capture_sizes_line`
    graph_changes: list[tuple[str, int, int, int]] = field(default_factory=list)  # mode, case, added, removed
    added_sample: list[str] = field(default_factory=list)
    removed_sample: list[str] = field(default_factory=list)
    dummy_changes: list[str] = field(default_factory=list)  # kept graphs warmed with another dummy batch
    dispatch_changes: list[str] = field(default_factory=list)  # batches the new spec schedules
    dispatch_unscheduled: list[str] = field(default_factory=list)  # batches only the old spec schedules
    lora_map_changes: list[str] = field(default_factory=list)
    encoder_changes: list[str] = field(default_factory=list)
    tier_changes: list[str] = field(default_factory=list)  # graphs moved between ready and deferred
    fix_changes: list[str] = field(default_factory=list)
    old_estimate: Estimate | None = None  # None: withheld (see basis) or no capture runs
    new_estimate: Estimate | None = None
    calibration: str = ""
    basis: str = ""  # what the estimates rest on, or why they are withheld
    old_graphs: int = 0
    new_graphs: int = 0

    def headline(self) -> str:
        if self.equal:
            return "no changes"
        o, n = self.old_estimate, self.new_estimate
        what = "; ".join(_brief(c) for c in self.spec_changes[:3]) or "plan changed"
        if len(self.spec_changes) > 3:
            what += f"; +{len(self.spec_changes) - 3} more"
        graphs = f"{signed(self.new_graphs - self.old_graphs)} graphs"
        if o is None or n is None:
            return f"{what}: {graphs} (capture time and graph memory not estimated)"
        seconds = signed(n.capture_seconds - o.capture_seconds, ".0f")
        return (
            f"{what}: {graphs}, {seconds} s "
            f"capture, {signed(n.graph_memory_gib - o.graph_memory_gib, '.2f')} GiB graph memory (estimated)"
        )

    def capture_sizes_change(self) -> str:
        """`+1 added (120), -2 removed (8..16 step 8)`: the sizes themselves, as runs."""
        added, removed = self.capture_sizes_added, self.capture_sizes_removed
        return (
            f"+{len(added)} added"
            + (f" ({compact(added)})" if added else "")
            + f", -{len(removed)} removed"
            + (f" ({compact(removed)})" if removed else "")
        )

    def capture_sizes_line(self) -> str:
        return f"capture sizes: {self.capture_sizes_change()}"

    def to_json(self) -> dict:
        est = lambda e: (
            None
            if e is None
            else {  # noqa: E731
                "graphs": e.graphs,
                "capture_seconds": round(e.capture_seconds, 2),
                "graph_memory_gib": round(e.graph_memory_gib, 3),
            }
        )
        return {
            "old": self.old_name,
            "new": self.new_name,
            "equal": self.equal,
            "headline": self.headline(),
            "spec_changes": self.spec_changes,
            "capture_sizes": {"added": self.capture_sizes_added, "removed": self.capture_sizes_removed},
            "graphs": [{"cg_mode": m, "lora_case": c, "added": a, "removed": r} for m, c, a, r in self.graph_changes],
            "dummy_changes": self.dummy_changes,
            "dispatch_changes": self.dispatch_changes,
            "dispatch_no_longer_scheduled": self.dispatch_unscheduled,
            "lora_dispatch_changes": self.lora_map_changes,
            "encoder_changes": self.encoder_changes,
            "tier_changes": self.tier_changes,
            "fix_changes": self.fix_changes,
            "estimate": {
                "old": est(self.old_estimate),
                "new": est(self.new_estimate),
                "calibration": self.calibration,
                "basis": self.basis,
            },
        }


def signed(value: float, fmt: str = "d") -> str:
    """`value` with its sign (`+3`, `-0.25`)."""
    return f"{value:+{fmt}}" if fmt != "d" else f"{int(value):+d}"


def _flatten(data: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def diff_plans(old: Plan, new: Plan, cost: CostModel, old_name: str = "old", new_name: str = "new") -> PlanDiff:
    result = PlanDiff(old_name, new_name, equal=old == new, calibration=cost.name)
    result.old_graphs, result.new_graphs = len(old.graphs), len(new.graphs)
    bases = [cost.basis(old.spec), cost.basis(new.spec)]
    withheld = [b for b in bases if not b.usable]
    if withheld:
        result.basis = withheld[0].note
    elif bases[0].note != bases[1].note:
        result.basis = f"old plan: {bases[0].note}; new plan: {bases[1].note}"
    else:
        result.basis = bases[1].note
    if not withheld:
        result.old_estimate, result.new_estimate = cost.estimate(old), cost.estimate(new)
    if result.old_estimate is None and not withheld:
        result.basis = f"calibration {cost.name} has no capture runs"
    if result.equal:
        return result
    a, b = _flatten(old.spec.model_dump(mode="json")), _flatten(new.spec.model_dump(mode="json"))
    old_sizes, new_sizes = set(old.capture_sizes), set(new.capture_sizes)
    result.capture_sizes_added = sorted(new_sizes - old_sizes)
    result.capture_sizes_removed = sorted(old_sizes - new_sizes)
    for k in [*a, *(k for k in b if k not in a)]:  # a section only the new spec has, too
        if a.get(k) == b.get(k):
            continue
        if k == SIZES_KEY and (result.capture_sizes_added or result.capture_sizes_removed):
            # A one-size change in a list of dozens reads as the whole list: name the sizes.
            result.spec_changes.append(result.capture_sizes_line())
            result.sizes_in_spec_changes = True
        elif k == SIZES_KEY:
            result.spec_changes.append(f"{k}: {_sizes(a.get(k), old)} -> {_sizes(b.get(k), new)} (the same sizes)")
        else:
            result.spec_changes.append(f"{k}: {_fmt(a.get(k))} -> {_fmt(b.get(k))}")
    old_set, new_set = set(old.descriptors), set(new.descriptors)
    added, removed = [d for d in new.descriptors if d not in old_set], [d for d in old.descriptors if d not in new_set]
    plus = Counter((d.cg_mode, d.num_active_loras) for d in added)
    minus = Counter((d.cg_mode, d.num_active_loras) for d in removed)
    result.graph_changes = [(m, c, plus[(m, c)], minus[(m, c)]) for m, c in sorted(set(plus) | set(minus))]
    result.added_sample = [address(d) for d in added[:8]]
    result.removed_sample = [address(d) for d in removed[:8]]
    result.dummy_changes = _dummy_changes(old, new)
    # Only batches a deployment can make are compared: a reviewer reads a change for a batch
    # the new spec never schedules as a regression that cannot happen.
    refusals = (partial(beyond_spec, spec=old.spec), partial(beyond_spec, spec=new.spec))
    result.dispatch_changes = target_changes(old, new, exact_sizes=True, refusals=refusals)
    result.dispatch_unscheduled = no_longer_scheduled(old, new, refusals)
    if old.lora_dispatch_key != new.lora_dispatch_key:
        result.lora_map_changes.append(f"LoRA dispatch by {old.lora_dispatch_key} -> {new.lora_dispatch_key}")
    for count in sorted(set(old.lora_dispatch_map) | set(new.lora_dispatch_map)):
        o, n = old.lora_dispatch_map.get(count), new.lora_dispatch_map.get(count)
        if o != n:
            was = "not scheduled" if o is None else f"case {o}"
            now = "no longer scheduled" if n is None else f"case {n}"
            result.lora_map_changes.append(f"LoRA count {count}: {was} -> {now}")
    result.encoder_changes = _encoder_changes(old, new)
    result.tier_changes = _tier_changes(old, new)
    if old.fixes != new.fixes:
        result.fix_changes.append(f"fixes: {old.fixes} -> {new.fixes}")
    old_dev = {d.fix: d.changes for d in old.deviations}
    new_dev = {d.fix: d.changes for d in new.deviations}
    for fix in list(old_dev) + [f for f in new_dev if f not in old_dev]:
        before, after = old_dev.get(fix, []), new_dev.get(fix, [])
        result.fix_changes += [f"- {fix}: {c}" for c in before if c not in after]
        result.fix_changes += [f"+ {fix}: {c}" for c in after if c not in before]
    return result


SIZES_KEY = "cudagraph.capture_sizes"
BRIEF = 70  # characters of one spec change in a headline


def _brief(change: str) -> str:
    """A spec change short enough for a headline: whole when short, else its setting and the
    counts (`capture sizes: +117 -35`) or `changed` (the spec section lists it whole)."""
    if len(change) <= BRIEF:
        return change
    key, _, rest = change.partition(": ")
    import re

    counts = re.match(r"\+(\d+) added.*, -(\d+) removed", rest)
    if key == "capture sizes" and counts:
        return f"capture sizes: +{counts.group(1)} -{counts.group(2)}"
    return f"{key[:BRIEF]} changed"


def _sizes(value: object, plan: Plan) -> str:
    return f"none ({len(plan.capture_sizes)} derived)" if value is None else f"{len(plan.capture_sizes)} listed"


def _dummy_changes(old: Plan, new: Plan) -> list[str]:
    """Graphs in both plans whose warm-up dummy batch differs: the same graph, captured from
    other inputs (a dummy layout or its adapter ids)."""

    def shown(dummy, ids: bool, grid: bool) -> str:
        return (
            f"{[list(run) for run in dummy.tokens]}"
            + (f", adapters {dummy.lora_ids}" if ids else "")
            + (f", kernel grid {dummy.kernel_grid}" if grid else "")
        )

    before = {g.descriptor: g.dummy for g in old.graphs}
    lines = []
    for g in new.graphs:
        was = before.get(g.descriptor)
        if was is not None and was != g.dummy:
            ids, grid = was.lora_ids != g.dummy.lora_ids, was.kernel_grid != g.dummy.kernel_grid
            lines.append(f"{address(g.descriptor)}: dummy {shown(was, ids, grid)} -> {shown(g.dummy, ids, grid)}")
    return lines


def _tier_changes(old: Plan, new: Plan) -> list[str]:
    """Graphs in both plans that moved between the ready and deferred tiers (one line each),
    or one line when deferred capture was turned on or off."""

    def deferred(plan: Plan) -> set[Descriptor]:
        return set() if plan.tiers is None else {plan.graphs[g].descriptor for g in plan.tiers.deferred}

    def counts(plan: Plan) -> str:
        later = len(deferred(plan))
        return f"{len(plan.graphs) - later} ready, {later} deferred"

    if (old.tiers is None) != (new.tiers is None):
        if new.tiers is None:
            return [f"deferred capture off: every graph ready (was {counts(old)})"]
        return [f"deferred capture on: {counts(new)} (was every graph ready)"]
    if old.tiers is None or new.tiers is None:
        return []
    before, after = deferred(old), deferred(new)
    both = [d for d in new.descriptors if d in set(old.descriptors)]
    moved = [f"{address(d)}: ready -> deferred" for d in both if d in after and d not in before]
    moved += [f"{address(d)}: deferred -> ready" for d in both if d in before and d not in after]
    if moved or old.tiers.every_steps != new.tiers.every_steps:
        moved.insert(0, f"{counts(old)} -> {counts(new)}")
    return moved


def _encoder_changes(old: Plan, new: Plan) -> list[str]:
    def shown(plan: Plan) -> dict[str, object]:
        enc = plan.encoder
        if enc is None:
            return {"graphs": "none (no multimodal encoder)"}
        return {
            "graphs": ", ".join(f"ENCODER:{b}" for b in enc.budgets) or "none (eager)",
            "max items": enc.max_items,
            "max frames": enc.max_frames,
            "tower/connector LoRA": "on" if enc.lora else "off",
        }

    a, b = shown(old), shown(new)
    return [f"{k}: {_fmt(a.get(k))} -> {_fmt(b.get(k))}" for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]


def _fmt(value: object) -> str:
    """A spec value as the spec writes it (YAML's words, no Python repr): sizes as runs, a
    case's sizes as `case N: runs`, anything else as compact JSON."""
    import json

    from capplan.planner.capture_sizes import compact

    if value is None:
        return "none"
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(type(v) is int for v in value):
        return compact(value)
    if isinstance(value, list) and all(isinstance(v, dict) and set(v) == {"case", "sizes"} for v in value):
        return "; ".join(f"case {v['case']}: {compact(v['sizes'])}" for v in value) or "[]"
    return json.dumps(value, separators=(", ", ": "))
