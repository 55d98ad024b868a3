"""JSON as every command prints it."""

from __future__ import annotations

import json
from typing import Any

from capplan.schemas.plan import Descriptor, address


def dumps(data: object, indent: int | None = None) -> str:
    """Strict JSON: a NaN or an infinity is a bug, never printed as `NaN`."""
    return json.dumps(data, allow_nan=False, indent=indent)


def record_value(value: object) -> Any:
    """A record field as JSON: a graph as its address, tuples as lists."""
    if isinstance(value, Descriptor):
        return address(value)
    if isinstance(value, (tuple, list)):
        return [record_value(v) for v in value]
    return value
