"""Compare a plan file with what its spec compiles to: the question `compile --check`
asks and the one the loader asks, in one place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from capplan.errors import CapplanError, PlanError, printable
from capplan.limits import MAX_FILE_BYTES, MAX_ITEMS


@dataclass(frozen=True)
class LoadDifference:
    """Where a plan file first differs from what its spec compiles to: `path` (`graphs[3]
    (FULL:8x8@1).grid`; `the file` for the whole document), what differs (`kind`), and the
    values the file has (`actual`) and its spec compiles to (`expected`):

    - `type`: not the `expected` shape (`mapping` or `list`);
    - `missing`: a key the file lacks (`expected` its value); `unknown_key`: one it should
      not have (`actual` its value);
    - `graph`: another graph at this place of a list (`actual`, `expected`: the graphs' names);
    - `length`: a list of `actual` items where the spec compiles to `expected`;
    - `value`: another value (types included: `true` is not `1`).
    """

    path: str
    kind: Literal["type", "missing", "unknown_key", "graph", "length", "value"]
    expected: object = None
    actual: object = None

    def text(self) -> str:
        """The one line the loader and `compile --check` print: `graphs[3] (FULL:8x8@1).grid:
        the file says 3, its spec compiles to 4`."""
        if self.kind == "type":
            return f"{self.path}: must be a {self.expected}"
        if self.kind == "missing":
            return f"{self.path}: is missing"
        if self.kind == "unknown_key":
            return f"{self.path}: unknown key"
        if self.kind == "graph":
            said = printable(repr(self.actual))[:60]
            return f"{self.path}: the file has graph {said} where its spec compiles to {self.expected!r}"
        if self.kind == "length":
            return f"{self.path}: the file lists {self.actual}, its spec compiles to {self.expected}"
        said, wanted = printable(repr(self.actual)), repr(self.expected)
        if max(len(said), len(wanted)) > 40:
            return f"{self.path}: differs from what its spec compiles to"
        return f"{self.path}: the file says {said}, its spec compiles to {wanted}"

    def __str__(self) -> str:
        return self.text()


def plan_difference(actual: dict[str, Any], expected: dict[str, Any]) -> LoadDifference | None:
    """first_difference of a plan file's content and what its spec compiles to, leaving out
    the one informational field when it names fewer releases: the releases `target.vllm` lists
    grow as capplan proves more, and the plan means the same. A list naming a release the plan
    does not run on, or one twice or out of order, is a difference."""
    target = actual.get("target")
    want = expected.get("target")
    if isinstance(target, dict) and isinstance(target.get("vllm"), str) and isinstance(want, dict):
        listed, runs = target["vllm"].split(", "), want["vllm"].split(", ")
        if listed and [r for r in runs if r in listed] == listed:  # in order, no repeats, each one it runs on
            actual = {**actual, "target": {**target, "vllm": want["vllm"]}}
    return first_difference(actual, expected)


def first_difference(actual: object, expected: object, where: str = "") -> LoadDifference | None:
    """Where `actual` first differs from `expected`, types included (`true` is not
    `1`): `graphs[3] (FULL:8x8@1).grid: the file says 3, its spec compiles to 4` as a
    record; None when equal."""
    label = where.rstrip(".") or "the file"
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return LoadDifference(label, "type", "mapping", actual)
        for key in expected:
            if key not in actual:
                return LoadDifference(f"{where}{key}", "missing", expected[key])
        for key in actual:
            if key not in expected:
                return LoadDifference(f"{where}{printable(str(key))[:40]}", "unknown_key", actual=actual[key])
        # The embedded spec first: when it changed, that is the news, not what follows from it.
        for key, value in sorted(expected.items(), key=lambda item: item[0] != "spec"):
            found = first_difference(actual[key], value, f"{where}{key}.")
            if found is not None:
                return found
        return None
    if isinstance(expected, list):
        if not isinstance(actual, list):
            return LoadDifference(label, "type", "list", actual)
        for i, (a, e) in enumerate(zip(actual, expected)):
            name = f" ({e['graph']})" if isinstance(e, dict) and "graph" in e else ""
            if name and isinstance(a, dict) and a.get("graph") != e["graph"]:
                # another graph at this place: that is the news, not the keys the two differ in
                return LoadDifference(f"{label}[{i}]", "graph", e["graph"], a.get("graph"))
            found = first_difference(a, e, f"{label}[{i}]{name}.")
            if found is not None:
                return found
        if len(actual) != len(expected):
            return LoadDifference(label, "length", len(expected), len(actual))
        return None
    if type(actual) is not type(expected) or actual != expected:
        return LoadDifference(label, "value", expected, actual)
    return None


def size_problem(text: str, data: dict[str, Any]) -> str | None:
    """Why the loader would refuse `text` (a rendered plan, `data` its content) for its
    size alone; None when it loads. Compile checks this first, so it never writes
    a plan no other command can load."""
    from capplan.files import check_shape

    size = len(text.encode("utf-8"))
    if size > MAX_FILE_BYTES:
        return f"{size} bytes, over the {MAX_FILE_BYTES} byte limit for a plan file"
    try:
        check_shape(data, "plan")
    except CapplanError:
        return f"over the {MAX_ITEMS} entry limit for a plan file ({len(data['graphs'])} graphs)"
    return None


def stale_reason(plan_path: Path, expected: dict[str, Any]) -> str | None:
    """Why the plan file at `plan_path` does not hold `expected` (the content its spec
    compiles to, as data), or None: the question `compile --check` asks."""
    from capplan.files import read_yaml

    if not plan_path.exists():
        return f"{plan_path} does not exist"
    try:
        current = read_yaml(plan_path, "plan", PlanError)
    except PlanError as exc:
        return exc.message
    version = current.get("format_version") if isinstance(current, dict) else None
    if not isinstance(current, dict) or version != expected["format_version"] or type(version) is not int:
        return f"{plan_path} is format {version!r}, this capplan writes format {expected['format_version']}"
    found = plan_difference(current, expected)
    return None if found is None else f"{plan_path}: {found.text()}"
