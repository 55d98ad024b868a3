"""The rule tables of docs/vllm-releases.md, rendered from the release table (`capplan.releases`).

The document holds `render()`'s text between BEGIN and END, and tests/test_release_facts.py
checks that it is exactly that text: a change to `capplan.releases` that the document does not
follow fails there. After changing the release table, regenerate the block with

    python -m capplan.release_table docs/vllm-releases.md
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path

from capplan.releases import GROUPS, RELEASES, Release, Rules

BEGIN = "<!-- BEGIN generated from src/capplan/releases.py by `python -m capplan.release_table`; do not edit -->"
END = "<!-- END generated -->"


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, on one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for field, doc in zip(body, body[1:]):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[field.target.id] = " ".join(doc.value.value.split())
    return docs


def spans(versions: Iterable[str]) -> str:
    """Releases as runs of consecutive supported releases: "0.25.0 to 0.26.0, 0.28.0, 0.29.0"
    (a run of two: both named)."""
    wanted = set(versions)
    runs: list[list[str]] = []
    previous = False
    for version in RELEASES:
        if version in wanted:
            if previous:
                runs[-1].append(version)
            else:
                runs.append([version])
        previous = version in wanted
    return ", ".join(", ".join(run) if len(run) < 3 else f"{run[0]} to {run[-1]}" for run in runs) or "none"


def _rule_names() -> list[str]:
    return [f.name for f in fields(Rules) if f.type in ("bool", bool)]


def _row_flags() -> list[str]:
    return [f.name for f in fields(Release) if f.type in ("bool", bool)]


def render() -> str:
    """The generated block of docs/vllm-releases.md, BEGIN and END lines included."""
    lines = [
        BEGIN,
        "",
        "| group | releases | rules it adds to the group before it |",
        "|---|---|---|",
    ]
    before: Rules | None = None
    for group in GROUPS:
        added = [n for n in _rule_names() if getattr(group, n) and not (before and getattr(before, n))]
        members = [v for v, r in RELEASES.items() if r.rules == group]
        lines.append(f"| {group.group} | {spans(members)} | {', '.join(f'`{n}`' for n in added) or 'none'} |")
        before = group
    rule_docs = field_docs(Rules)
    lines += ["", "| rule (`Rules`) | releases | what it is |", "|---|---|---|"]
    for name in _rule_names():
        members = [v for v, r in RELEASES.items() if getattr(r.rules, name)]
        lines.append(f"| `{name}` | {spans(members)} | {rule_docs[name]} |")
    row_docs = field_docs(Release)
    lines += ["", "| release row flag (`Release`) | releases | what it is |", "|---|---|---|"]
    for name in _row_flags():
        members = [v for v, r in RELEASES.items() if getattr(r, name)]
        lines.append(f"| `{name}` | {spans(members)} | {row_docs[name]} |")
    lines += ["", END]
    return "\n".join(lines) + "\n"


def splice(document: str) -> str:
    """The document with its generated block (BEGIN to END) replaced by `render()`."""
    head, begin, rest = document.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"no generated block (from {BEGIN!r} to {END!r})")
    return head + render().removesuffix("\n") + tail


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/vllm-releases.md")
    path.write_text(splice(path.read_text()))
