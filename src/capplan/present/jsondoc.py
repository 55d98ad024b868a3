"""JSON as every command prints it."""

from __future__ import annotations

import json


def dumps(data: object, indent: int | None = None) -> str:
    """Strict JSON: a NaN or an infinity is a bug, never printed as `NaN`."""
    return json.dumps(data, allow_nan=False, indent=indent)
