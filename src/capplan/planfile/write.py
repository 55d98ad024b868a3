"""Plan -> the plan file (format 2) and -> JSON data.

The file is written to review well as a lock file in `git diff`:

- every graph has an address derived from what it is,
  `MODE:TOKENS[xREQUESTS]@LORA_CASE` (`FULL:64x64@4`, `PIECEWISE:512@0`), and
  everything that names a graph uses the address, never a position, so adding
  or removing one graph adds or removes that graph's line and nothing else;
- graphs are listed in vLLM's capture order, which the list order states;
- no null fields, nothing written twice: values that follow from others
  (a dummy's request count and longest request, the decode query length,
  the per-graph adapter ids, which depend only on the LoRA case) are left out
  and recomputed on load, which compiles the embedded spec anyway;
- integer lists are written as runs (`8..256/8` is every 8th size from 8
  to 256), one run per line, so adding a size changes one line;
- no line is longer than MAX_LINE characters.

`plan_file_data` is the format: the data a YAML reader gets back from the
text `render_plan` writes. Loading a plan compares the file's data with
`plan_file_data` of what its spec compiles to, so the two never disagree.
"""

from __future__ import annotations

import functools
import json
import re
import textwrap
from collections.abc import Iterator
from typing import Any

from capplan import __version__
from capplan.planner.capture_sizes import runs
from capplan.planner.hashing import spec_data
from capplan.schemas.plan import DispatchRange, Plan, PlannedGraph, address
from capplan.schemas.spec import Spec

MAX_LINE = 120
_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
# Graph addresses and integer runs read back as the same strings without quotes
# (no YAML 1.1 int, float, sexagesimal or timestamp pattern matches them).
_PLAIN_NAMES = re.compile(r"^(?:(?:PIECEWISE|FULL|NONE):[0-9]+(?:x[0-9]+)?@[0-9]+|[0-9]+\.\.[0-9]+(?:/[0-9]+)?)$")
_YAML_WORDS = {"null", "true", "false", "yes", "no", "on", "off", "y", "n", "~"}


def int_runs(values: list[int]) -> list[int | str]:
    """Integers as runs (capture_sizes.runs): `A..B` (step 1) or `A..B/S`; anything else stays
    an integer."""
    return [a if not step else f"{a}..{b}" + ("" if step == 1 else f"/{step}") for a, b, step in runs(values)]


def _scalar(value: object) -> str:
    if type(value) is int:  # most values in a plan
        return str(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return _string(str(value))


@functools.lru_cache(maxsize=4096)
def _string(text: str) -> str:
    """A string as a YAML scalar: bare when YAML reads it back as the same string."""
    if (_PLAIN.match(text) and text.lower() not in _YAML_WORDS) or _PLAIN_NAMES.match(text):
        return text
    return _quoted(text)


def _quoted(text: str) -> str:
    """`text` as a YAML double-quoted scalar in ASCII, which every YAML reader reads back as
    `text`: JSON's escapes, except where YAML has no such escape or forbids the character raw:
    a character outside the Basic Multilingual Plane is `\\UXXXXXXXX` (JSON writes a surrogate
    pair, which YAML readers refuse), DEL is `\\u007f`."""
    quoted = json.dumps(text)
    if "\\ud" not in quoted and "\x7f" not in quoted:
        return quoted
    escape = "\\u{:04x}".format
    wide = "\\U{:08x}".format
    return "".join(
        c if " " <= c <= "~" else (escape(ord(c)) if ord(c) < 0x10000 else wide(ord(c)))
        for c in json.dumps(text, ensure_ascii=False)
    )


def flow(value: object) -> str:
    """One-line YAML flow form."""
    if isinstance(value, dict):
        return "{" + ", ".join([f"{_scalar(k)}: {flow(v)}" for k, v in value.items()]) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join([flow(v) for v in value]) + "]"
    return _scalar(value)


def _emit(key: str, value: object, indent: int) -> Iterator[str]:
    """`key: value` as one flow line when it fits in MAX_LINE, else as a block
    (mappings and lists one entry per line; a long list of numbers wrapped;
    a long string folded at spaces, which YAML reads back as one line)."""
    pad = " " * indent
    line = f"{pad}{key}: {flow(value)}"
    if len(line) <= MAX_LINE:
        yield line
    elif isinstance(value, dict) and value:
        yield f"{pad}{key}:"
        for k, v in value.items():
            yield from _emit(_scalar(k), v, indent + 2)
    elif isinstance(value, list) and value and all(isinstance(v, (int, str)) and len(flow(v)) < 60 for v in value):
        # A flow list may span lines; YAML joins them.
        text = ", ".join(flow(v) for v in value) + "]"
        parts = textwrap.wrap(text, MAX_LINE - indent - len(key) - 3, break_long_words=False, break_on_hyphens=False)
        yield f"{pad}{key}: [{parts[0]}"
        for part in parts[1:]:
            yield f"{pad}  {part}"
    elif isinstance(value, list) and value:
        yield f"{pad}{key}:"
        for item in value:
            yield from _emit_item(item, indent + 2)
    elif isinstance(value, str):
        yield f"{pad}{key}:"
        yield from _folded(value, indent + 2)
    else:
        yield line  # nothing shorter exists


def _emit_item(item: object, indent: int) -> Iterator[str]:
    pad = " " * indent
    line = f"{pad}- {flow(item)}"
    if len(line) <= MAX_LINE:
        yield line
    elif isinstance(item, dict) and item:
        first = True
        for k, v in item.items():
            for sub in _emit(_scalar(k), v, indent + 2):
                yield (f"{pad}- " + sub[indent + 2 :]) if first else sub
                first = False
    elif isinstance(item, str):
        yield from _folded(item, indent, bullet=True)
    else:
        yield line


def _folded(text: str, indent: int, bullet: bool = False) -> Iterator[str]:
    """A long string as a double-quoted scalar over several lines: YAML folds
    each line break (and the indentation after it) into one space."""
    pad = " " * indent
    quoted = _quoted(text)
    width = MAX_LINE - indent - 2
    parts = textwrap.wrap(quoted, width, break_long_words=False, break_on_hyphens=False, drop_whitespace=True)
    if " ".join(parts) != quoted:  # runs of spaces would not survive folding: one long line
        parts = [quoted]
    lead = f"{pad}- " if bullet else pad
    follow = f"{pad}  "
    for i, part in enumerate(parts):
        yield (lead if i == 0 else follow) + part


def plan_file_data(plan: Plan) -> dict[str, Any]:
    """The plan file's content (format 2), as YAML reads it back."""
    spec = spec_data(plan.spec)
    data: dict[str, Any] = {
        "format_version": plan.format_version,
        "fingerprint": plan.fingerprint,
        "target": dict(plan.target),
        "spec": {section: _drop_nulls(value) for section, value in spec.items()},
        "deviations": [
            {"fix": d.fix, "failure_class": d.failure_class, "changes": list(d.changes)} for d in plan.deviations
        ],
        "capture_sizes": int_runs(plan.capture_sizes),
        "max_capture_size": plan.max_capture_size,
        "lora_dispatch_key": plan.lora_dispatch_key,
        "lora_cases": _lora_cases(plan),
        "dp": {"padded_tokens_lora_invariant": plan.dp.padded_tokens_lora_invariant},
        "graph_counts": _graph_counts(plan),
        "graphs": [_graph_entry(plan, g) for g in plan.graphs],
        "dummy_runs": [
            {"run": r.run, "tokens": r.tokens, "vllm": [list(x) for x in r.vllm], "plan": [list(x) for x in r.plan]}
            for r in plan.dummy_runs
        ],
        "dispatch": [_dispatch_entry(plan, row) for row in plan.dispatch],
    }
    if plan.encoder is not None:
        e = plan.encoder
        data["encoder"] = {
            "graphs": [f"ENCODER:{b}" for b in e.budgets],
            "max_items": e.max_items,
            "max_frames": e.max_frames,
            "vllm_graphs": [f"ENCODER:{b}" for b in e.vllm_budgets],
            "dispatch": ENCODER_DISPATCH if e.budgets else "eager: no encoder graphs",
            "lora": e.lora,
        }
    return data


ENCODER_DISPATCH = (
    "items by output tokens, ascending, packed while under max_items and the largest budget (0.32+: an item "
    "needing at least the batch's budget, cheaper alone, starts a new batch); each batch replays the "
    "smallest budget >= its tokens, else eager"
)


def _drop_nulls(value: object) -> object:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    return value


def _lora_cases(plan: Plan) -> list[dict[str, Any]]:
    """One entry per LoRA capture case: the counts that dispatch to it and the
    adapter ids its dummy batches cycle over (-1: the no-adapter slot)."""
    serves: dict[int, list[int]] = {}
    for count, case in sorted(plan.lora_dispatch_map.items()):
        serves.setdefault(case, []).append(count)
    ids_by_case = {g.descriptor.num_active_loras: g.dummy.lora_ids for g in plan.graphs}
    out = []
    for case in plan.lora_capture_cases:
        entry: dict[str, Any] = {"case": case}
        if case in serves:
            entry["serves"] = int_runs(serves[case])
        ids = ids_by_case.get(case)
        if ids is not None:
            entry["dummy_ids"] = int_runs(ids)
        out.append(entry)
    return out


def _graph_counts(plan: Plan) -> dict[str, Any]:
    counts: dict[str, Any] = {}
    for mode in ("PIECEWISE", "FULL"):
        row = plan.stats.get(mode)
        if row:
            counts[mode] = {int(case): n for case, n in row.items()}
    counts["total"] = plan.stats["total"]["graphs"]
    if plan.tiers is not None:
        counts["deferred"] = len(plan.tiers.deferred)
    return counts


def _graph_entry(plan: Plan, graph: PlannedGraph) -> dict[str, Any]:
    d, m = graph.descriptor, graph.dummy
    entry: dict[str, Any] = {"graph": address(d)}
    if d.uniform_token_count is not None:
        entry["uniform"] = d.uniform_token_count
    if d.max_query_len is not None:
        entry["max_query_len"] = d.max_query_len
    entry["dummy"] = [list(run) for run in m.tokens]
    if m.kernel_grid is not None:
        entry["grid"] = m.kernel_grid
    if plan.tiers is not None and graph.id in plan.tiers.fallback:
        entry["deferred"] = address(plan.graphs[plan.tiers.fallback[graph.id]].descriptor)
    return entry


def _dispatch_entry(plan: Plan, row: DispatchRange) -> dict[str, Any]:
    tokens: int | str = row.lo if row.lo == row.hi else f"{row.lo}..{row.hi}"
    return {
        "case": row.lora_case,
        "tokens": tokens,
        "graphs": [address(plan.graphs[i].descriptor) for i in row.candidates],
    }


HEADER = """\
# Generated by capplan {version}. Do not edit: review changes as a diff.
# Compiled from {spec}; to regenerate, run from this file's folder:
#   {command}
# A graph's address is MODE:TOKENS[xREQUESTS]@LORA_CASE; a dummy is runs of [requests, tokens each];
# grid is the adapter slots the captured LoRA kernels cover; a..b/s is every s-th value from a to b."""

_SECTION_NOTES = {
    "capture_sizes": "# token counts graphs are captured for; a batch pads up to the next one",
    "lora_cases": "# LoRA capture cases: the adapter counts each serves, and its dummy batches' adapter ids",
    "graphs": "# in capture order: PIECEWISE, then FULL, largest first",
    "dummy_runs": "# dummy batches outside capture (profile/warm-up, DP idle step): vLLM's runs and the plan's",
    "dispatch": "# per LoRA case and token range: the graphs tried in order (none compatible: eager)",
}


DEFERRED_NOTE = (
    "# deferred: captured while serving (spec tiers); until then its batches replay the graph named, or that\n"
    "# graph's own fallback while it is deferred too"
)


def iter_plan_lines(data: dict[str, Any], header: str) -> Iterator[str]:
    """The text lines of a plan file holding `data` (plan_file_data's output)."""
    yield from header.splitlines()
    for key, value in data.items():
        note = _SECTION_NOTES.get(key)
        if key in ("capture_sizes", "lora_cases", "graphs", "dummy_runs", "dispatch", "deviations"):
            if note:
                yield note
            if not value:
                yield f"{key}: []"
                continue
            if key == "graphs" and any("deferred" in item for item in value):
                yield DEFERRED_NOTE
            yield f"{key}:"
            for item in value:
                yield from _emit_item(item, 2)
        elif key in ("spec", "graph_counts", "encoder"):  # one line per entry: a change stays on its line
            yield f"{key}:"
            for k, v in value.items():
                yield from _emit(_scalar(k), v, 2)
        else:
            yield from _emit(key, value, 0)


def render_plan(plan: Plan, spec_name: str, command: str | None = None, data: dict[str, Any] | None = None) -> str:
    """The plan file's text; the header names the spec (relative to the plan's folder)
    and the command that regenerates the plan from there. `data`: plan_file_data(plan),
    when the caller has it already."""
    header = HEADER.format(version=__version__, spec=spec_name, command=command or f"capplan compile {spec_name}")
    data = plan_file_data(plan) if data is None else data
    return "\n".join(iter_plan_lines(data, header)) + "\n"


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The machine-readable form (public API): top-level `capture_sizes`,
    `lora_capture_cases`, `lora_dispatch_map`, and `descriptors` in capture order
    with vLLM's BatchExecutionDescriptor field names."""
    data = plan.model_dump(mode="json")
    data["spec"] = spec_data(plan.spec)
    data["descriptors"] = [g["descriptor"] for g in data["graphs"]]
    data["lora_dispatch_map"] = {str(k): v for k, v in data["lora_dispatch_map"].items()}
    return data


def render_spec(spec: Spec) -> str:
    """A spec as YAML, sections in schema order, short lists inline (for optimize's output)."""
    import yaml

    return str(yaml.safe_dump(spec_data(spec), sort_keys=False, default_flow_style=None, width=100))
