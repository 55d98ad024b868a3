"""`capplan diff` as text (terminal, git) and as markdown (a pull request); the JSON
form is the PlanDiff's own `to_json`."""

from __future__ import annotations

from capplan.analysis.diff import PlanDiff, signed


def _sample(items: list[str], shown: int = 8) -> list[str]:
    """The first `shown` items and a count of the rest (the JSON form has them all)."""
    return items if len(items) <= shown else [*items[:shown], f"... and {len(items) - shown} more"]


def sizes(d: PlanDiff) -> list[str]:
    """The capture sizes added and removed, when the spec's own line does not already say so
    (a changed max_num_seqs or max_capture_size moves the sizes vLLM derives)."""
    changed = d.capture_sizes_added or d.capture_sizes_removed
    return [d.capture_sizes_change()] if changed and not d.sizes_in_spec_changes else []


def unscheduled(d: PlanDiff) -> list[str]:
    """Batches only the old spec schedules, marked as removed."""
    return [f"no longer scheduled: {line}" for line in d.dispatch_unscheduled]


def render_text(d: PlanDiff) -> str:
    lines = [f"capplan diff {d.old_name} -> {d.new_name}: {d.headline()}"]
    if d.equal:
        return lines[0] + "\n"
    o, n = d.old_estimate, d.new_estimate
    if o is None or n is None:
        lines.append(
            f"  estimate: none; {d.old_graphs} -> {d.new_graphs} graphs (calibration {d.calibration}: {d.basis})"
        )
    else:
        lines.append(f"  estimate ({d.calibration}: {d.basis}): {o.text()}  ->  {n.text()}")
    sections = [
        ("spec", d.spec_changes),
        ("capture sizes (as the spec now derives them)", sizes(d)),
        (
            "graphs",
            [f"{m} case {c}: +{a} -{r}" for m, c, a, r in d.graph_changes]
            + ([f"added e.g. {', '.join(d.added_sample)}"] if d.added_sample else [])
            + ([f"removed e.g. {', '.join(d.removed_sample)}"] if d.removed_sample else []),
        ),
        ("LoRA dispatch", d.lora_map_changes),
        ("warm-up (graphs kept, captured from another dummy batch or kernel grid)", _sample(d.dummy_changes)),
        ("encoder", d.encoder_changes),
        ("tiers (ready: captured before the engine reports ready; deferred: while it serves)", d.tier_changes),
        ("dispatch (what a batch replays)", d.dispatch_changes + unscheduled(d)),
        ("fixes and deviations", d.fix_changes),
    ]
    for title, items in sections:
        if items:
            lines.append(f"{title}:")
            bullet = "  " if title.startswith("fixes") else "  * "  # -/+ mean removed/added below
            lines += [f"{bullet}{item}" for item in items]
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


def render_markdown(d: PlanDiff) -> str:
    lines = [f"### capplan plan diff: {_code(d.old_name)} → {_code(d.new_name)}", "", f"**{d.headline()}**", ""]
    if d.equal:
        return "\n".join(lines)
    o, n = d.old_estimate, d.new_estimate
    lines += [
        "| | old | new | change |",
        "|---|---:|---:|---:|",
        f"| graphs | {d.old_graphs} | {d.new_graphs} | {signed(d.new_graphs - d.old_graphs)} |",
    ]
    if o is not None and n is not None:
        lines += [
            f"| est. capture time | {o.capture_seconds:.0f} s | {n.capture_seconds:.0f} s | "
            f"{signed(n.capture_seconds - o.capture_seconds, '.0f')} s |",
            f"| est. graph memory | {o.graph_memory_gib:.2f} GiB | {n.graph_memory_gib:.2f} GiB | "
            f"{signed(n.graph_memory_gib - o.graph_memory_gib, '.2f')} GiB |",
            "",
            f"<sub>Estimates from calibration `{d.calibration}`: {d.basis}.</sub>",
            "",
        ]
    else:
        lines += [
            "",
            f"<sub>Capture time and graph memory not estimated (calibration `{d.calibration}`: {d.basis}).</sub>",
            "",
        ]
    budget = _Budget()
    if d.spec_changes:
        lines += ["**Spec**", "", *_folded([f"- `{c}`" for c in d.spec_changes], budget)]
    if sizes(d):
        lines += [
            "**Capture sizes** (as the spec now derives them)",
            "",
            *_folded([f"- {x}" for x in sizes(d)], budget),
        ]
    if d.graph_changes:
        header = ["| mode | LoRA case | added | removed |", "|---|---:|---:|---:|"]
        rows = [f"| {m} | {c} | {a} | {r} |" for m, c, a, r in d.graph_changes]
        lines += ["**Graphs per mode and LoRA case**", "", *_folded(rows, budget, head=header)]
    for title, items in (
        ("LoRA dispatch", d.lora_map_changes),
        ("Warm-up (graphs kept, captured from another dummy batch or kernel grid)", d.dummy_changes),
        ("Encoder", d.encoder_changes),
        ("Tiers (ready: captured before the engine reports ready; deferred: while it serves)", d.tier_changes),
        ("Dispatch changes", d.dispatch_changes + unscheduled(d)),
    ):
        if items:
            lines += [f"**{title}**", "", *_folded([f"- {item}" for item in items], budget)]
    if d.fix_changes:
        lines += ["**Fixes and deviations**", "", *_folded(d.fix_changes, budget, fence="diff")]
    return "\n".join(lines)
