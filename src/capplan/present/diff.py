"""`capplan diff` from its records (`analysis.diff.PlanDiff`): as text (terminal, git), as
markdown (a pull request) and as JSON (every record with its typed fields and its `text`,
the sentence the text form prints for it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, assert_never

from capplan.analysis.diff import (
    SIZES_KEY,
    CaptureSizesChange,
    CoverageShift,
    DeferredSwitch,
    DeviationChange,
    DispatchChange,
    DummyChange,
    EncoderChange,
    FixChange,
    FixesChange,
    GraphDelta,
    LoraCountChange,
    LoraKeyChange,
    LoraMapChange,
    NoLongerScheduled,
    PlanDiff,
    SpecChange,
    TierChange,
    TierMove,
    TierTotals,
)
from capplan.analysis.review import Verdict
from capplan.calibration.price import Figure
from capplan.planner.capture_sizes import compact
from capplan.planner.regions import NONE, Lane, where_text
from capplan.present.jsondoc import record_value
from capplan.present.show import figure_json, price_json
from capplan.schemas.plan import address


def signed(value: float, fmt: str = "d") -> str:
    """`value` with its sign (`+3`, `-0.25`)."""
    return f"{value:+{fmt}}" if fmt != "d" else f"{int(value):+d}"


# -- one record, one sentence ----------------------------------------------------------------


def capture_sizes_change(sizes: CaptureSizesChange) -> str:
    """`+1 added (120), -2 removed (8..16 step 8)`: the sizes themselves, as runs."""
    added, removed = list(sizes.added), list(sizes.removed)
    return (
        f"+{len(added)} added"
        + (f" ({compact(added)})" if added else "")
        + f", -{len(removed)} removed"
        + (f" ({compact(removed)})" if removed else "")
    )


def spec_change_text(change: SpecChange, sizes: CaptureSizesChange) -> str:
    """`lora.max_loras: 4 -> 8`; the spec's capture_sizes as the sizes added and removed (a
    one-size change in a list of dozens reads as the whole list), or as counts when the
    sizes are the same."""
    k = change.key
    if k == SIZES_KEY and sizes.changed:
        return f"capture sizes: {capture_sizes_change(sizes)}"
    if k == SIZES_KEY:
        return f"{k}: {_sizes(change.old, sizes.old_count)} -> {_sizes(change.new, sizes.new_count)} (the same sizes)"
    return f"{k}: {_fmt(change.old)} -> {_fmt(change.new)}"


def _sizes(value: object, count: int) -> str:
    return f"none ({count} derived)" if value is None else f"{count} listed"


def graph_delta_text(delta: GraphDelta) -> str:
    return f"{delta.cg_mode} case {delta.lora_case}: +{delta.added_count} -{delta.removed_count}"


def dummy_change_text(change: DummyChange) -> str:
    """`GRAPH: dummy [[runs]] -> [[runs]]`, with the adapter ids and the kernel grid where they
    changed."""
    ids = change.old_lora_ids != change.new_lora_ids
    grid = change.old_kernel_grid != change.new_kernel_grid

    def shown(tokens: tuple[tuple[int, int], ...], lora_ids: tuple[int, ...] | None, kernel_grid: int | None) -> str:
        return (
            f"{[list(run) for run in tokens]}"
            + (f", adapters {None if lora_ids is None else list(lora_ids)}" if ids else "")
            + (f", kernel grid {kernel_grid}" if grid else "")
        )

    before = shown(change.old_tokens, change.old_lora_ids, change.old_kernel_grid)
    after = shown(change.new_tokens, change.new_lora_ids, change.new_kernel_grid)
    return f"{address(change.graph)}: dummy {before} -> {after}"


def _region(change: DispatchChange | NoLongerScheduled) -> str:
    """`mixed batches of 3 token count(s) (3, 5..6; LoRA case 0)`, as `planner.regions` writes it
    (`LoRA case 5 -> 7` where the batches dispatch to another case in the new plan)."""
    runs = change.token_runs
    sample = ", ".join(f"{lo}..{hi}" if lo != hi else f"{lo}" for lo, hi in runs[:6])
    more = ", ..." if len(runs) > 6 else ""
    old_cases = change.old_lora_cases or change.lora_cases
    lanes = [
        Lane(0, False, NONE if o is None else o, NONE if n is None else n) for o, n in zip(old_cases, change.lora_cases)
    ]
    where = where_text(lanes, change.every_case)
    kind = change.batch_kind if change.query_len is None else f"{change.batch_kind} ({change.query_len} per request)"
    return f"{kind} batches of {change.token_count} token count(s) ({sample}{more}; {where})"


def dispatch_change_text(change: DispatchChange) -> str:
    return f"{_region(change)}: {change.old_target} -> {change.new_target}"


def unscheduled_text(change: NoLongerScheduled) -> str:
    tail = f"replayed {change.old_mode} in the old plan; the new spec never makes them ({change.reason})"
    return f"{_region(change)}: {tail}"


def coverage_text(shift: CoverageShift) -> str:
    """`REGRESSION: 32 mixed batch shape(s) of LoRA case 0 go from a graph to eager`."""
    case = (
        f"LoRA case {shift.new_lora_case}"
        if shift.old_lora_case == shift.new_lora_case
        else f"LoRA case {shift.old_lora_case} -> {shift.new_lora_case}"
    )
    if shift.to_eager:
        return f"REGRESSION: {shift.token_count} {shift.batch_kind} batch shape(s) of {case} go from a graph to eager"
    return f"{shift.token_count} {shift.batch_kind} batch shape(s) of {case} go from eager to a graph"


def coverage_headline(d: PlanDiff) -> str:
    """`REGRESSION: 64 batch shape(s) go from a graph to eager (LoRA cases 0, 5 -> 7)`, or how
    many come back to a graph; empty when coverage is unchanged."""
    if d.regression:
        lanes = dict.fromkeys(
            Lane(0, False, c.old_lora_case, c.new_lora_case) for c in d.coverage if c.to_eager
        )  # each case, or pair of cases, once
        back = f", {d.to_graph()} back to a graph" if d.to_graph() else ""
        where = where_text(list(lanes), False)
        return f"REGRESSION: {d.to_eager()} batch shape(s) go from a graph to eager ({where}){back}"
    if d.to_graph():
        return f"{d.to_graph()} batch shape(s) go from eager to a graph"
    return ""


def lora_map_text(change: LoraMapChange) -> str:
    match change:
        case LoraKeyChange():
            return f"LoRA dispatch by {change.old} -> {change.new}"
        case LoraCountChange():
            was = "not scheduled" if change.old_case is None else f"case {change.old_case}"
            now = "no longer scheduled" if change.new_case is None else f"case {change.new_case}"
            return f"LoRA count {change.count}: {was} -> {now}"
        case _:
            assert_never(change)


ENCODER_LABELS = {
    "graphs": "graphs",
    "max_items": "max items",
    "max_frames": "max frames",
    "tower_connector_lora": "tower/connector LoRA",
}


def encoder_change_text(change: EncoderChange) -> str:
    def shown(value: tuple[int, ...] | int | bool | None) -> str:
        if change.setting == "graphs":
            if value is None:
                return "none (no multimodal encoder)"
            assert isinstance(value, tuple)
            return ", ".join(f"ENCODER:{b}" for b in value) or "none (eager)"
        if isinstance(value, bool):
            return "on" if value else "off"
        return _fmt(value)

    return f"{ENCODER_LABELS[change.setting]}: {shown(change.old)} -> {shown(change.new)}"


def tier_change_text(change: TierChange) -> str:
    match change:
        case DeferredSwitch():
            counts = f"{change.ready} ready, {change.deferred} deferred"
            if change.on:
                return f"deferred capture on: {counts} (was every graph ready)"
            return f"deferred capture off: every graph ready (was {counts})"
        case TierTotals():
            return (
                f"{change.old_ready} ready, {change.old_deferred} deferred -> "
                f"{change.new_ready} ready, {change.new_deferred} deferred"
            )
        case TierMove():
            return f"{address(change.graph)}: {change.old_tier} -> {change.new_tier}"
        case _:
            assert_never(change)


def fix_change_text(change: FixChange) -> str:
    match change:
        case FixesChange():
            return f"fixes: {list(change.old)} -> {list(change.new)}"
        case DeviationChange():
            return f"{'+' if change.added else '-'} {change.fix}: {change.change}"
        case _:
            assert_never(change)


def _fmt(value: object) -> str:
    """A spec value as the spec writes it (YAML's words, no Python repr): sizes as runs, a
    case's sizes as `case N: runs`, anything else as compact JSON."""
    if value is None:
        return "none"
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(type(v) is int for v in value):
        return compact(value)
    if isinstance(value, list) and all(isinstance(v, dict) and set(v) == {"case", "sizes"} for v in value):
        return "; ".join(f"case {v['case']}: {compact(v['sizes'])}" for v in value) or "[]"
    return json.dumps(value, separators=(", ", ": "))


# -- the diff's lines, as the text and markdown forms list them ----------------------------------


def spec_lines(d: PlanDiff) -> list[str]:
    return [spec_change_text(c, d.capture_sizes) for c in d.spec_changes]


def dummy_lines(d: PlanDiff) -> list[str]:
    return [dummy_change_text(c) for c in d.dummy_changes]


def dispatch_lines(d: PlanDiff) -> list[str]:
    return [dispatch_change_text(c) for c in d.dispatch_changes]


def coverage_lines(d: PlanDiff) -> list[str]:
    return [coverage_text(c) for c in d.coverage]


def lora_map_lines(d: PlanDiff) -> list[str]:
    """LoRA dispatch changes other than a count's move (those lead, in `moves`)."""
    return [lora_map_text(c) for c in d.lora_map_changes if not isinstance(c, LoraCountChange)]


def encoder_lines(d: PlanDiff) -> list[str]:
    return [encoder_change_text(c) for c in d.encoder_changes]


def tier_lines(d: PlanDiff) -> list[str]:
    return [tier_change_text(c) for c in d.tier_changes]


def fix_lines(d: PlanDiff) -> list[str]:
    return [fix_change_text(c) for c in d.fix_changes]


def moves(d: PlanDiff) -> list[str]:
    """What moves batches, one per line, under the headline: each batch shape sent to eager
    (with its LoRA case, or the pair of cases it moves between), then each active-LoRA count
    whose capture case moves."""
    return [coverage_text(c) for c in d.coverage if c.to_eager] + count_moves(d)


def count_moves(d: PlanDiff) -> list[str]:
    """Each active-LoRA count whose capture case moves, one line per run of consecutive counts
    that move alike (`LoRA counts 6..8: not scheduled -> case 8`)."""
    runs: list[list[LoraCountChange]] = []
    for c in (c for c in d.lora_map_changes if isinstance(c, LoraCountChange)):
        last = runs[-1][-1] if runs else None
        if last is not None and (last.count + 1, last.old_case, last.new_case) == (c.count, c.old_case, c.new_case):
            runs[-1].append(c)
        else:
            runs.append([c])
    out = []
    for run in runs:
        text = lora_map_text(run[0])
        if len(run) > 1:
            text = text.replace(f"LoRA count {run[0].count}:", f"LoRA counts {run[0].count}..{run[-1].count}:", 1)
        out.append(text)
    return out


def graph_lines(d: PlanDiff) -> list[str]:
    return (
        [graph_delta_text(g) for g in d.graph_changes]
        + ([f"added e.g. {', '.join(map(address, d.added_sample))}"] if d.added_sample else [])
        + ([f"removed e.g. {', '.join(map(address, d.removed_sample))}"] if d.removed_sample else [])
    )


def graph_rows(d: PlanDiff) -> list[str]:
    return [f"| {g.cg_mode} | {g.lora_case} | {g.added_count} | {g.removed_count} |" for g in d.graph_changes]


@dataclass(frozen=True)
class Section:
    """One section of a diff's body, as every renderer lists it (`SECTIONS`, in order)."""

    text_title: str
    md_title: str  # as markdown writes it
    lines: Callable[[PlanDiff], list[str]]
    md_lines: Callable[[PlanDiff], list[str]] | None = None  # markdown's items, where they differ
    md_item: str = "- {}"  # how markdown writes one item
    md_head: tuple[str, ...] = ()  # a table's header (the items are its rows)
    md_fence: str = ""  # a code block's language (the items are its lines)
    text_bullet: str = "  * "
    text_sample: bool = False  # the text form shows the first few (markdown folds the rest)


SECTIONS: tuple[Section, ...] = (
    Section("spec", "**Spec**", spec_lines, md_item="- `{}`"),
    Section("capture sizes (as the spec now derives them)", "**Capture sizes** (as the spec now derives them)",
            lambda d: sizes(d)),
    Section("graphs", "**Graphs per mode and LoRA case**", graph_lines, md_lines=graph_rows, md_item="{}",
            md_head=("| mode | LoRA case | added | removed |", "|---|---:|---:|---:|")),
    Section("LoRA dispatch", "**LoRA dispatch**", lora_map_lines),
    Section("warm-up (graphs kept, captured from another dummy batch or kernel grid)",
            "**Warm-up (graphs kept, captured from another dummy batch or kernel grid)**", dummy_lines,
            text_sample=True),
    Section("encoder", "**Encoder**", encoder_lines),
    Section("tiers (ready: captured before the engine reports ready; deferred: while it serves)",
            "**Tiers (ready: captured before the engine reports ready; deferred: while it serves)**", tier_lines),
    Section("coverage (batch shapes that go from a graph to eager or back)", "**Coverage**", coverage_lines,
            md_lines=lambda d: [coverage_text(c) for c in d.coverage if not c.to_eager]),
    Section("dispatch (what a batch replays)", "**Dispatch changes**",
            lambda d: dispatch_lines(d) + unscheduled(d)),
    Section("fixes and deviations", "**Fixes and deviations**", fix_lines, md_item="{}", md_fence="diff",
            text_bullet="  "),  # -/+ mean removed/added
)  # fmt: skip


BRIEF = 70  # characters of one spec change in a headline


def _brief(change: SpecChange, d: PlanDiff) -> str:
    """A spec change short enough for a headline: whole when short, else its setting and the
    counts (`capture sizes: +117 -35`) or `changed` (the spec section lists it whole)."""
    text = spec_change_text(change, d.capture_sizes)
    if len(text) <= BRIEF:
        return text
    if change.key == SIZES_KEY and d.capture_sizes.changed:
        return f"capture sizes: +{len(d.capture_sizes.added)} -{len(d.capture_sizes.removed)}"
    return f"{text.partition(': ')[0][:BRIEF]} changed"


def headline(d: PlanDiff) -> str:
    """`lora.max_loras: 4 -> 8: +238 graphs, +25.5 [+20.3..+31.4] s capture, +0.957 [...] GiB graph
    memory (scaled)`, or the graphs and "not priced"."""
    if d.equal:
        return "no changes"
    p = d.price
    what = "; ".join(_brief(c, d) for c in d.spec_changes[:3]) or "plan changed"
    if len(d.spec_changes) > 3:
        what += f"; +{len(d.spec_changes) - 3} more"
    graphs = f"{signed(p.graphs)} graphs"
    # A regression leads the line: a saving in graphs or memory never hides it.
    lead = coverage_headline(d)
    lead = f"{lead}; " if d.regression else ""
    tail = f"; {coverage_headline(d)}" if coverage_headline(d) and not d.regression else ""
    if p.seconds is None or p.gib is None:
        return f"{lead}{what}: {graphs} (capture time and graph memory not priced){tail}"
    return (
        f"{lead}{what}: {graphs}, {_delta(p.seconds, '.1f')} s capture, {_delta(p.gib, '.3f')} GiB graph memory "
        f"({p.kind}){tail}"
    )


def _delta(f: Figure, fmt: str) -> str:
    """`+1.2 [+0.8..+1.9]`: a change and its interval (or that it has none)."""
    if f.lo is None or f.hi is None:
        return f"{f.value:+{fmt}} (no interval)"
    return f"{f.value:+{fmt}} [{f.lo:+{fmt}}..{f.hi:+{fmt}}]"


def price_lines(d: PlanDiff) -> list[str]:
    """Both plans priced, what the prices rest on (or why they are not priced), and what is
    extrapolated."""
    return _sides(d) + price_basis(d)


def _sides(d: PlanDiff) -> list[str]:
    """Each plan's price (none where neither is priced: the headline says so)."""
    p = d.price
    if not p.old.priced and not p.new.priced:
        return []
    return [
        f"{name}: {x.text()}" + (f" ({x.kind})" if x.priced else "") for name, x in (("old", p.old), ("new", p.new))
    ]


def price_basis(d: PlanDiff) -> list[str]:
    """What the prices rest on (or why there is none), then their notes."""
    p = d.price
    if p.old.basis == p.new.basis:
        lines = [f"{'basis' if p.new.priced else 'not priced'}: {p.new.basis}"]
    else:
        lines = [
            f"{side} {'basis' if x.priced else 'not priced'}: {x.basis}" for side, x in (("old", p.old), ("new", p.new))
        ]
    both = [n for n in p.old.notes if n in p.new.notes]
    notes = both + [f"{side}: {n}" for side, x in (("old", p.old), ("new", p.new)) for n in x.notes if n not in both]
    return lines + sorted(dict.fromkeys(notes), key=lambda n: "the interval" in n)  # what it does not bound, last


def _sample(items: list[str], shown: int = 8) -> list[str]:
    """The first `shown` items and a count of the rest (the JSON form has them all)."""
    return items if len(items) <= shown else [*items[:shown], f"... and {len(items) - shown} more"]


def sizes(d: PlanDiff) -> list[str]:
    """The capture sizes added and removed, when the spec's own line does not already say so
    (a changed max_num_seqs or max_capture_size moves the sizes vLLM derives)."""
    return [capture_sizes_change(d.capture_sizes)] if d.capture_sizes.changed and not d.sizes_in_spec_changes else []


def unscheduled(d: PlanDiff) -> list[str]:
    """Batches only the old spec schedules, marked as removed."""
    return [f"no longer scheduled: {unscheduled_text(c)}" for c in d.dispatch_unscheduled]


def verdict_lines(v: Verdict, policy: str) -> list[str]:
    """The verdict's findings below its headline, what it could not judge, and how to accept it."""
    lines = [f.text if f.level == v.judged else f"{f.level}: {f.text}" for f in v.findings if f.level != v.judged]
    lines += [f"not judged: {x}" for x in v.not_judged]
    if v.judged != "pass" and v.override is None:
        lines.append(f"to accept this plan, add under overrides: in {policy}: {v.accept_line()}")
    return lines


def render_text(d: PlanDiff, verdict: Verdict | None = None, policy: str = "") -> str:
    lines = [f"capplan diff {d.old_name} -> {d.new_name}: {headline(d)}"]
    if verdict is not None:
        lines.insert(0, f"verdict: {verdict.headline}")
        lines[1:1] = [f"  {line}" for line in verdict_lines(verdict, policy)]
    if d.equal:
        return "\n".join(lines) + "\n"
    lines += [f"  ! {line}" for line in moves(d)]
    lines += [f"  {line}" for line in price_lines(d)]
    for section in SECTIONS:
        items = section.lines(d)
        if items:
            lines.append(f"{section.text_title}:")
            lines += [f"{section.text_bullet}{item}" for item in (_sample(items) if section.text_sample else items)]
    return "\n".join(lines) + "\n"


SCREEN = 20  # markdown shows this many items of a list; the rest fold into <details>
BUDGET = 16_000  # characters of listed items in one markdown diff: far below a comment's 65,536
ITEM = 400  # characters of one listed item in markdown


class _Budget:
    """What is left of BUDGET as sections are listed: a section lists items while it lasts
    (its first always, each cut at ITEM characters), then says how many it leaves to the text
    and JSON forms, which list every one. Any pair of plans stays far below the 65,536
    characters of a pull-request comment."""

    def __init__(self, total: int = BUDGET) -> None:
        self.left = total

    def take(self, items: list[str]) -> tuple[list[str], int]:
        kept: list[str] = []
        for i, item in enumerate(items):
            if len(item) > ITEM:
                cut = item[: ITEM - 40]
                item = cut + ("`" if cut.count("`") % 2 else "") + " ... (cut; the text form has it whole)"
            if i and len(item) > self.left:
                break
            kept.append(item)
            self.left -= len(item) + 1
        return kept, len(items) - len(kept)


def _folded(lines: list[str], budget: _Budget, head: list[str] | None = None, fence: str = "") -> list[str]:
    """Markdown lines that show the first SCREEN of `lines` and fold the others the budget
    allows into a `<details>` block; what the budget leaves out is counted, with where to find
    it (`capplan diff` as text or --json lists every item). `head` repeats a table's header
    inside the fold; `fence` wraps each part in a code block."""
    lines, left_out = budget.take(lines)
    tail = (
        [f"<sub>{left_out} more not listed here, to keep the comment short: `capplan diff` (text or --json) "
         "lists every one.</sub>", ""]
        if left_out
        else []
    )  # fmt: skip

    def part(items: list[str]) -> list[str]:
        body = [*(head or []), *items]
        return [f"```{fence}", *body, "```"] if fence else body

    if len(lines) <= SCREEN + 1:  # "1 more" would hide no more than it shows
        return [*part(lines), "", *tail]
    rest = lines[SCREEN:]
    return [
        *part(lines[:SCREEN]),
        "",
        f"<details><summary>{len(rest)} more</summary>",
        "",
        *part(rest),
        "",
        "</details>",
        "",
        *tail,
    ]


def _code(name: str) -> str:
    """A file name as a markdown code span, whatever backticks it holds."""
    import re

    fence = "`" * (max((len(run) for run in re.findall("`+", name)), default=0) + 1)
    pad = " " if name.startswith("`") or name.endswith("`") else ""
    return f"{fence}{pad}{name}{pad}{fence}"


def render_markdown(d: PlanDiff, verdict: Verdict | None = None, policy: str = "") -> str:
    lines = [f"### capplan plan diff: {_code(d.old_name)} → {_code(d.new_name)}", ""]
    if verdict is not None:
        mark = {"pass": "✅", "warn": "⚠️", "deny": "⛔"}[verdict.level]
        lines += [f"{mark} **Verdict: {verdict.headline}**", ""]
        more = verdict_lines(verdict, _code(policy))
        if more:
            lines += [*(f"- {line}" for line in more), ""]
    lines += [f"**{headline(d)}**", ""]
    if d.equal:
        return "\n".join(lines)
    if d.regression:
        lines += [
            "> [!WARNING]",
            f"> **Regression**: {coverage_headline(d).removeprefix('REGRESSION: ')}.",
            *[f"> - {coverage_text(c).removeprefix('REGRESSION: ')}" for c in d.coverage if c.to_eager],
            "",
        ]
    counts = count_moves(d)
    if counts:
        lines += [*(f"- {line}" for line in counts), ""]
    p = d.price
    lines += [
        "| | old | new | change |",
        "|---|---:|---:|---:|",
        f"| graphs | {p.old.graphs} | {p.new.graphs} | {signed(p.graphs)} |",
    ]
    if p.old.priced or p.new.priced:

        def cell(f: Figure | None, fmt: str, unit: str) -> str:
            return "not priced" if f is None else f.text(fmt, unit)

        def change(f: Figure | None, fmt: str, unit: str) -> str:
            return "-" if f is None else f"{_delta(f, fmt)} {unit}"

        lines += [
            f"| capture time ({p.kind}) | {cell(p.old.seconds, '.1f', 's')} | {cell(p.new.seconds, '.1f', 's')} | "
            f"{change(p.seconds, '.1f', 's')} |",
            f"| graph memory ({p.kind}) | {cell(p.old.gib, '.3f', 'GiB')} | {cell(p.new.gib, '.3f', 'GiB')} | "
            f"{change(p.gib, '.3f', 'GiB')} |",
        ]
    lines += ["", "<sub>" + "<br>".join(price_basis(d)) + "</sub>", ""]
    budget = _Budget()
    for section in SECTIONS:
        items = (section.md_lines or section.lines)(d)
        if items:
            written = [section.md_item.format(item) for item in items]
            head = list(section.md_head) or None
            lines += [section.md_title, "", *_folded(written, budget, head=head, fence=section.md_fence)]
    return "\n".join(lines)


# -- JSON: every record with its typed fields and its sentence ---------------------------------


def _record(record: object, text: str, kind: str | None = None) -> dict[str, Any]:
    """A record's fields (and `type`, where a list holds records of several kinds), then `text`."""
    assert is_dataclass(record)
    out: dict[str, Any] = {} if kind is None else {"type": kind}
    out.update({f.name: record_value(getattr(record, f.name)) for f in fields(record)})
    if isinstance(record, (DispatchChange, NoLongerScheduled)):
        out["token_count"] = record.token_count
    out["text"] = text
    return out


def _price_json(d: PlanDiff) -> dict[str, Any]:
    """Both plans priced (`show --json`'s price form), and the change (null where either is not
    priced)."""
    p = d.price
    return {
        "old": price_json(p.old),
        "new": price_json(p.new),
        "delta": {
            "graphs": p.graphs,
            "capture_seconds": figure_json(p.seconds, 2),
            "graph_memory_gib": figure_json(p.gib, 4),
            "kind": p.kind,
        },
    }


RECORD_TYPES: dict[type, str] = {
    LoraKeyChange: "key",
    LoraCountChange: "count",
    DeferredSwitch: "switch",
    TierTotals: "totals",
    TierMove: "move",
    FixesChange: "fixes",
    DeviationChange: "deviation",
}


def verdict_json(v: Verdict | None) -> dict[str, Any] | None:
    """The review verdict (null without a policy)."""
    if v is None:
        return None
    return {
        "level": v.level,
        "judged": v.judged,
        "fingerprint": v.fingerprint,
        "headline": v.headline,
        "findings": [_record(f, f.text) for f in v.findings],
        "not_judged": list(v.not_judged),
        "override": None if v.override is None else v.override.model_dump(mode="json"),
    }


def diff_json(d: PlanDiff, verdict: Verdict | None = None) -> dict[str, Any]:
    """`capplan diff --format json` (docs/cli.md, "JSON output", lists every field)."""
    return {
        "verdict": verdict_json(verdict),
        "old": d.old_name,
        "new": d.new_name,
        "equal": d.equal,
        "headline": headline(d),
        "regression": d.regression,
        "coverage": {
            "to_eager": d.to_eager(),
            "to_graph": d.to_graph(),
            "shifts": [_record(x, coverage_text(x)) for x in d.coverage],
        },
        "spec_changes": [_record(s, spec_change_text(s, d.capture_sizes)) for s in d.spec_changes],
        "capture_sizes": {
            "added": list(d.capture_sizes.added),
            "removed": list(d.capture_sizes.removed),
            "old_count": d.capture_sizes.old_count,
            "new_count": d.capture_sizes.new_count,
        },
        "graphs": [
            {
                "cg_mode": g.cg_mode,
                "lora_case": g.lora_case,
                "added": g.added_count,
                "removed": g.removed_count,
                "added_graphs": record_value(g.added),
                "removed_graphs": record_value(g.removed),
                "text": graph_delta_text(g),
            }
            for g in d.graph_changes
        ],
        "dummy_changes": [_record(x, dummy_change_text(x)) for x in d.dummy_changes],
        "dispatch_changes": [_record(x, dispatch_change_text(x)) for x in d.dispatch_changes],
        "dispatch_no_longer_scheduled": [_record(x, unscheduled_text(x)) for x in d.dispatch_unscheduled],
        "lora_dispatch_changes": [_record(x, lora_map_text(x), RECORD_TYPES[type(x)]) for x in d.lora_map_changes],
        "encoder_changes": [_record(x, encoder_change_text(x)) for x in d.encoder_changes],
        "tier_changes": [_record(x, tier_change_text(x), RECORD_TYPES[type(x)]) for x in d.tier_changes],
        "fix_changes": [_record(x, fix_change_text(x), RECORD_TYPES[type(x)]) for x in d.fix_changes],
        "price": _price_json(d),
    }
