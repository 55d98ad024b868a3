"""`capplan schema --defaults`: every spec field at its default, as a spec file, each field with
its description as a comment above it (the JSON Schema's facts, in the form a spec is written)."""

from __future__ import annotations

import textwrap

import yaml
from pydantic import BaseModel


def _value(value: object) -> str:
    """One YAML value (as JSON-mode data) on one line, flow style."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _comment(text: str | None, indent: str) -> list[str]:
    if not text:
        return []
    return [f"{indent}# {line}" for line in textwrap.wrap(" ".join(text.split()), 96 - len(indent))]


def render_defaults() -> str:
    """The default spec: every section and field, with its description."""
    from capplan.schemas.spec import Spec

    spec = Spec()
    data = spec.model_dump(mode="json")
    lines = [
        "# Every capplan spec field at its default (capplan schema --defaults). A spec need only give",
        "# the fields it changes; this file, as it is, compiles to the same plan as an empty spec.",
    ]
    for name, field in Spec.model_fields.items():
        value = getattr(spec, name)
        lines.append("")
        lines += _comment(field.description, "")
        if isinstance(value, BaseModel):
            lines.append(f"{name}:")
            for sub, subfield in type(value).model_fields.items():
                lines += _comment(subfield.description, "  ")
                lines.append(f"  {sub}: {_value(data[name][sub])}")
        else:
            lines.append(f"{name}: {_value(data[name])}")
    return "\n".join(lines) + "\n"
