"""Semantic diff of two plans: what a reviewer needs to judge a change, as records.

Graphs added and removed per mode and LoRA case, dispatch regions whose
target changed, spec fields, fixes and deviations, and both plans priced (capture
time and graph memory, `capplan.calibration.price`). `diff_plans` builds one `PlanDiff` of typed, frozen
change records and renders nothing: `capplan.present.diff` turns it into text,
markdown (for a pull request) and JSON.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Literal

from capplan.calibration.price import PriceDelta, Pricer, price_pair
from capplan.planner.dispatch import beyond_spec
from capplan.planner.regions import (
    NONE,
    NOT_SCHEDULED,
    Lane,
    Refusal,
    lora_lanes,
    query_len_of,
    regions,
    target_runs,
    unscheduled_runs,
)
from capplan.schemas.plan import Descriptor, DummyLayout, Plan

SIZES_KEY = "cudagraph.capture_sizes"

BatchKind = Literal["mixed", "uniform-decode"]
Tier = Literal["ready", "deferred"]
EncoderSetting = Literal["graphs", "max_items", "max_frames", "tower_connector_lora"]


@dataclass(frozen=True)
class SpecChange:
    """One spec setting that changed: its dotted key path and both values as the spec's JSON
    holds them (None: not set, or the section is absent on that side)."""

    key: str
    old: object
    new: object


@dataclass(frozen=True)
class CaptureSizesChange:
    """The plans' capture sizes (as the specs derive them): added, removed, and how many each
    plan captures."""

    added: tuple[int, ...]
    removed: tuple[int, ...]
    old_count: int
    new_count: int

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed)


@dataclass(frozen=True)
class GraphDelta:
    """The graphs one cudagraph mode and LoRA case gains and loses, in capture order."""

    cg_mode: str
    lora_case: int
    added: tuple[Descriptor, ...]
    removed: tuple[Descriptor, ...]

    @property
    def added_count(self) -> int:
        return len(self.added)

    @property
    def removed_count(self) -> int:
        return len(self.removed)


@dataclass(frozen=True)
class DummyChange:
    """A graph in both plans captured from another warm-up dummy batch: its runs of
    (requests, tokens each), its dummy adapter ids and its LoRA kernel grid, before and after."""

    graph: Descriptor
    old_tokens: tuple[tuple[int, int], ...]
    new_tokens: tuple[tuple[int, int], ...]
    old_lora_ids: tuple[int, ...] | None
    new_lora_ids: tuple[int, ...] | None
    old_kernel_grid: int | None
    new_kernel_grid: int | None


@dataclass(frozen=True)
class DispatchChange:
    """Batches of one kind whose replayed graph changed: their token counts (as runs), the
    LoRA cases they dispatch to in the new plan and in the old one (`old_lora_cases`, in the
    same order; another case where the LoRA settings changed; `every_case`: every adapter
    mix, when more than one), and the target in each plan (`MODE:TOKENS`, `eager`, or `not
    scheduled` by the old spec)."""

    batch_kind: BatchKind
    token_runs: tuple[tuple[int, int], ...]
    lora_cases: tuple[int | None, ...]
    every_case: bool
    old_target: str
    new_target: str
    old_lora_cases: tuple[int | None, ...] = ()
    query_len: int | None = None  # uniform batches' tokens per request, where the plans decode different counts

    @property
    def token_count(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.token_runs)


@dataclass(frozen=True)
class NoLongerScheduled:
    """Batches only the old spec schedules: the mode the old plan replayed them with
    (`eager` for none) and why the new spec never makes them."""

    batch_kind: BatchKind
    token_runs: tuple[tuple[int, int], ...]
    lora_cases: tuple[int | None, ...]
    every_case: bool
    old_mode: str
    reason: str
    old_lora_cases: tuple[int | None, ...] = ()
    query_len: int | None = None  # as DispatchChange's

    @property
    def token_count(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.token_runs)


@dataclass(frozen=True)
class LoraKeyChange:
    """The LoRA dispatch map counts another thing (`adapters` or `kernel_slots`)."""

    old: str
    new: str


@dataclass(frozen=True)
class LoraCountChange:
    """The LoRA case a count of adapters (or kernel slots) dispatches to; None: not scheduled."""

    count: int
    old_case: int | None
    new_case: int | None


LoraMapChange = LoraKeyChange | LoraCountChange


@dataclass(frozen=True)
class EncoderChange:
    """One encoder setting that changed. `graphs`: the budgets captured (() eager, None no
    multimodal encoder); `max_items`, `max_frames`: ints; `tower_connector_lora`: bool; any
    value None when that plan has no multimodal encoder."""

    setting: EncoderSetting
    old: tuple[int, ...] | int | bool | None
    new: tuple[int, ...] | int | bool | None


@dataclass(frozen=True)
class DeferredSwitch:
    """Deferred capture turned on or off: the ready and deferred graph counts of the plan
    that has tiers (the new one when on, the old one when off)."""

    on: bool
    ready: int
    deferred: int


@dataclass(frozen=True)
class TierTotals:
    """Both plans defer capture: their ready and deferred graph counts."""

    old_ready: int
    old_deferred: int
    new_ready: int
    new_deferred: int


@dataclass(frozen=True)
class TierMove:
    """A graph in both plans that moved between the ready and deferred tiers."""

    graph: Descriptor
    old_tier: Tier
    new_tier: Tier


TierChange = DeferredSwitch | TierTotals | TierMove


@dataclass(frozen=True)
class FixesChange:
    """The spec's list of fixes changed."""

    old: tuple[str, ...]
    new: tuple[str, ...]


@dataclass(frozen=True)
class DeviationChange:
    """One change a fix made (a plan's deviation line) that only one plan has."""

    fix: str
    change: str
    added: bool  # False: only the old plan has it


FixChange = FixesChange | DeviationChange


@dataclass(frozen=True)
class CoverageShift:
    """Batch shapes of one kind and LoRA case (the old plan's case, the new plan's) that go
    from a graph to eager (`to_eager`) or from eager to a graph: how many token counts. A
    shift to eager is a regression whatever else the change saves."""

    batch_kind: BatchKind
    old_lora_case: int
    new_lora_case: int
    to_eager: bool
    token_count: int


@dataclass(frozen=True)
class PlanDiff:
    """Every change between two plans, as records (`equal`: the plans are the same)."""

    old_name: str
    new_name: str
    equal: bool
    price: PriceDelta  # both plans priced by one pricer (each may say it is not priced, and why)
    capture_sizes: CaptureSizesChange
    spec_changes: tuple[SpecChange, ...] = ()
    graph_changes: tuple[GraphDelta, ...] = ()  # by mode, then LoRA case
    added_sample: tuple[Descriptor, ...] = ()  # the first graphs added, in the new plan's order
    removed_sample: tuple[Descriptor, ...] = ()
    dummy_changes: tuple[DummyChange, ...] = ()  # kept graphs warmed with another dummy batch
    dispatch_changes: tuple[DispatchChange, ...] = ()  # batches the new spec schedules
    dispatch_unscheduled: tuple[NoLongerScheduled, ...] = ()  # batches only the old spec schedules
    lora_map_changes: tuple[LoraMapChange, ...] = ()
    encoder_changes: tuple[EncoderChange, ...] = ()
    tier_changes: tuple[TierChange, ...] = ()  # graphs moved between ready and deferred
    fix_changes: tuple[FixChange, ...] = ()
    coverage: tuple[CoverageShift, ...] = ()  # batch shapes that go from a graph to eager or back

    @property
    def regression(self) -> bool:
        """Some batch the new spec schedules, which the old plan replayed from a graph, runs eager."""
        return any(c.to_eager for c in self.coverage)

    def to_eager(self) -> int:
        return sum(c.token_count for c in self.coverage if c.to_eager)

    def to_graph(self) -> int:
        return sum(c.token_count for c in self.coverage if not c.to_eager)

    @property
    def sizes_in_spec_changes(self) -> bool:
        """The spec's capture_sizes changed and the sizes did: its spec change names the sizes."""
        return self.capture_sizes.changed and any(c.key == SIZES_KEY for c in self.spec_changes)


SAMPLE = 8  # graphs added and removed named in `added_sample` / `removed_sample`


def diff_plans(
    old: Plan,
    new: Plan,
    pricer: Pricer,
    old_name: str = "old",
    new_name: str = "new",
) -> PlanDiff:
    """Every change between two plans, both priced by `pricer`."""
    equal = old == new
    price = price_pair(old, new, pricer)
    old_sizes, new_sizes = set(old.capture_sizes), set(new.capture_sizes)
    counts = len(old.capture_sizes), len(new.capture_sizes)
    sizes = (
        CaptureSizesChange((), (), *counts)
        if equal
        else CaptureSizesChange(tuple(sorted(new_sizes - old_sizes)), tuple(sorted(old_sizes - new_sizes)), *counts)
    )
    if equal:
        return PlanDiff(old_name, new_name, True, price, sizes)
    a, b = _flatten(old.spec.model_dump(mode="json")), _flatten(new.spec.model_dump(mode="json"))
    spec_changes = tuple(
        SpecChange(k, a.get(k), b.get(k))
        for k in [*a, *(k for k in b if k not in a)]  # a section only the new spec has, too
        if a.get(k) != b.get(k)
    )
    old_set, new_set = set(old.descriptors), set(new.descriptors)
    added, removed = [d for d in new.descriptors if d not in old_set], [d for d in old.descriptors if d not in new_set]
    groups = sorted({(d.cg_mode, d.num_active_loras) for d in [*added, *removed]})
    graph_changes = tuple(
        GraphDelta(
            m,
            c,
            tuple(d for d in added if (d.cg_mode, d.num_active_loras) == (m, c)),
            tuple(d for d in removed if (d.cg_mode, d.num_active_loras) == (m, c)),
        )
        for m, c in groups
    )
    # Only batches a deployment can make are compared: a reviewer reads a change for a batch
    # the new spec never schedules as a regression that cannot happen.
    refusals = (partial(beyond_spec, spec=old.spec), partial(beyond_spec, spec=new.spec))
    dispatch = tuple(_dispatch_changes(old, new, refusals))
    return PlanDiff(
        old_name,
        new_name,
        False,
        price,
        sizes,
        spec_changes=spec_changes,
        graph_changes=graph_changes,
        added_sample=tuple(added[:SAMPLE]),
        removed_sample=tuple(removed[:SAMPLE]),
        dummy_changes=tuple(_dummy_changes(old, new)),
        dispatch_changes=dispatch,
        dispatch_unscheduled=tuple(_unscheduled(old, new, refusals)),
        lora_map_changes=tuple(_lora_map_changes(old, new)),
        encoder_changes=tuple(_encoder_changes(old, new)),
        tier_changes=tuple(_tier_changes(old, new)),
        fix_changes=tuple(_fix_changes(old, new)),
        coverage=_coverage(dispatch),
    )


def _coverage(changes: tuple[DispatchChange, ...]) -> tuple[CoverageShift, ...]:
    """Token counts per batch kind and LoRA case that go from a graph to eager or back, over
    every dispatch change (every adapter mix, whatever else changed)."""
    counts: dict[tuple[BatchKind, int, int, bool], int] = {}
    for c in changes:
        was_graph = c.old_target not in ("eager", NOT_SCHEDULED)
        if was_graph == (c.new_target != "eager"):
            continue  # graph to graph, eager to eager, or a batch only the new spec makes
        if not was_graph and c.old_target != "eager":
            continue
        for old_case, new_case in zip(c.old_lora_cases or c.lora_cases, c.lora_cases):
            if old_case is None or new_case is None:
                continue  # a mix one plan never schedules (listed as such, not a coverage shift)
            key = (c.batch_kind, old_case, new_case, was_graph)
            counts[key] = counts.get(key, 0) + c.token_count
    return tuple(CoverageShift(*key, n) for key, n in sorted(counts.items(), key=lambda kv: (not kv[0][3], kv[0])))


def _flatten(data: dict[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _tokens(dummy: DummyLayout) -> tuple[tuple[int, int], ...]:
    return tuple((count, tokens) for count, tokens in dummy.tokens)


def _dummy_changes(old: Plan, new: Plan) -> Iterator[DummyChange]:
    """Graphs in both plans whose warm-up dummy batch differs: the same graph, captured from
    other inputs (a dummy layout or its adapter ids)."""
    before = {g.descriptor: g.dummy for g in old.graphs}
    for g in new.graphs:
        was = before.get(g.descriptor)
        if was is not None and was != g.dummy:
            yield DummyChange(
                g.descriptor,
                _tokens(was),
                _tokens(g.dummy),
                None if was.lora_ids is None else tuple(was.lora_ids),
                None if g.dummy.lora_ids is None else tuple(g.dummy.lora_ids),
                was.kernel_grid,
                g.dummy.kernel_grid,
            )


def _kind(kind: str) -> BatchKind:
    return "mixed" if kind == "mixed" else "uniform-decode"  # of either plan's length (`query_len`)


def _lanes(lanes: tuple[Lane, ...]) -> tuple[tuple[int | None, ...], tuple[int | None, ...]]:
    """The lanes' cases in the new plan and in the old (None: that plan never schedules the mix)."""

    def case(c: int) -> int | None:
        return None if c == NONE else c

    return tuple(case(lane.new_case) for lane in lanes), tuple(case(lane.old_case) for lane in lanes)


def _dispatch_changes(old: Plan, new: Plan, refusals: tuple[Refusal, Refusal]) -> Iterator[DispatchChange]:
    """`planner.regions.target_changes(exact_sizes=True)` over every adapter mix as records:
    what each batch the new spec schedules replays, where that changed; a batch only it
    schedules was `not scheduled`."""
    lanes = lora_lanes(old, new)
    runs = target_runs(old, new, exact_sizes=True, refusals=refusals, lanes=lanes)
    for (kind, a, b), token_runs, moved, every in regions(runs, lanes):
        cases, old_cases = _lanes(moved)
        yield DispatchChange(_kind(kind), token_runs, cases, every, a, b, old_cases, query_len_of(kind))


def _unscheduled(old: Plan, new: Plan, refusals: tuple[Refusal, Refusal]) -> Iterator[NoLongerScheduled]:
    """`planner.regions.no_longer_scheduled` over every adapter mix as records."""
    lanes = lora_lanes(old, new)
    runs, why = unscheduled_runs(old, new, refusals, lanes=lanes)
    for key, token_runs, moved, every in regions(runs, lanes):
        cases, old_cases = _lanes(moved)
        yield NoLongerScheduled(
            _kind(key[0]), token_runs, cases, every, key[1], why[key], old_cases, query_len_of(key[0])
        )


def _lora_map_changes(old: Plan, new: Plan) -> Iterator[LoraMapChange]:
    if old.lora_dispatch_key != new.lora_dispatch_key:
        yield LoraKeyChange(old.lora_dispatch_key, new.lora_dispatch_key)
    for count in sorted(set(old.lora_dispatch_map) | set(new.lora_dispatch_map)):
        o, n = old.lora_dispatch_map.get(count), new.lora_dispatch_map.get(count)
        if o != n:
            yield LoraCountChange(count, o, n)


def _tier_changes(old: Plan, new: Plan) -> list[TierChange]:
    """Graphs in both plans that moved between the ready and deferred tiers (one record
    each, after both plans' totals), or one record when deferred capture was turned on or off."""

    def deferred(plan: Plan) -> set[Descriptor]:
        return set() if plan.tiers is None else {plan.graphs[g].descriptor for g in plan.tiers.deferred}

    def counts(plan: Plan) -> tuple[int, int]:
        later = len(deferred(plan))
        return len(plan.graphs) - later, later

    if (old.tiers is None) != (new.tiers is None):
        on = new.tiers is not None
        return [DeferredSwitch(on, *counts(new if on else old))]
    if old.tiers is None or new.tiers is None:
        return []
    before, after = deferred(old), deferred(new)
    both = [d for d in new.descriptors if d in set(old.descriptors)]
    moved: list[TierChange] = [TierMove(d, "ready", "deferred") for d in both if d in after and d not in before]
    moved += [TierMove(d, "deferred", "ready") for d in both if d in before and d not in after]
    if moved or old.tiers.every_steps != new.tiers.every_steps:
        moved.insert(0, TierTotals(*counts(old), *counts(new)))
    return moved


def _encoder_changes(old: Plan, new: Plan) -> list[EncoderChange]:
    def settings(plan: Plan) -> dict[EncoderSetting, tuple[int, ...] | int | bool | None]:
        enc = plan.encoder
        if enc is None:
            return {"graphs": None}
        return {
            "graphs": tuple(enc.budgets),
            "max_items": enc.max_items,
            "max_frames": enc.max_frames,
            "tower_connector_lora": bool(enc.lora),
        }

    a, b = settings(old), settings(new)
    return [EncoderChange(k, a.get(k), b.get(k)) for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]


def _fix_changes(old: Plan, new: Plan) -> list[FixChange]:
    out: list[FixChange] = []
    if old.fixes != new.fixes:
        out.append(FixesChange(tuple(old.fixes), tuple(new.fixes)))
    old_dev = {d.fix: d.changes for d in old.deviations}
    new_dev = {d.fix: d.changes for d in new.deviations}
    for fix in list(old_dev) + [f for f in new_dev if f not in old_dev]:
        before, after = old_dev.get(fix, []), new_dev.get(fix, [])
        out += [DeviationChange(fix, c, False) for c in before if c not in after]
        out += [DeviationChange(fix, c, True) for c in after if c not in before]
    return out
