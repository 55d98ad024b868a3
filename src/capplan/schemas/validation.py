"""A pydantic validation error as one line naming the field path: what every reader of a
model (spec, plan, calibration, the optimizer's chosen tiers) prints."""

from __future__ import annotations

from pydantic import BaseModel, ValidationError


def _allowed_keys(model: type[BaseModel], loc: tuple[object, ...]) -> list[str]:
    """Field names of the model found by walking `loc` (minus its last element)."""
    current: type[BaseModel] | None = model
    for part in loc[:-1]:
        if current is None or not isinstance(part, str) or part not in current.model_fields:
            return []
        annotation = current.model_fields[part].annotation
        current = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return sorted(current.model_fields) if current is not None else []


def _scalar(value: object) -> bool:
    return value is None or isinstance(value, (int, float, str, bool))


def describe_validation_error(exc: ValidationError, model: type[BaseModel]) -> str:
    """First error as `path.to.field: what is wrong (got X)`, plus how many more."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    loc = tuple(err["loc"])
    path = ".".join(p if isinstance(p, str) and p.isidentifier() else repr(p) for p in loc)
    kind, ctx, value = err["type"], err.get("ctx", {}), err.get("input")
    if kind == "extra_forbidden":
        known = _allowed_keys(model, loc)
        what = "unknown key" + (f"; known keys: {', '.join(known)}" if known else "")
        value = None
        got = ""
    else:
        messages = {
            "greater_than_equal": f"must be >= {ctx.get('ge')}",
            "greater_than": f"must be > {ctx.get('gt')}",
            "less_than": f"must be < {ctx.get('lt')}",
            "string_pattern_mismatch": "must hold no control characters (line breaks, escapes)",
            "less_than_equal": f"must be <= {ctx.get('le')}",
            "missing": "is required",
            "int_type": "must be an integer",
            "int_parsing": "must be an integer",
            "int_from_float": "must be an integer",
            "bool_parsing": "must be true or false",
            "bool_type": "must be true or false",
            "string_type": "must be a string",
            "list_type": "must be a list",
            "model_type": "must be a mapping of keys to values",
            "dict_type": "must be a mapping of keys to values",
            "too_long": f"has too many items (at most {ctx.get('max_length')})",
        }
        what = messages.get(kind) or err["msg"].removeprefix("Value error, ")
        if kind == "literal_error":
            what = "must be " + str(ctx.get("expected", "")).replace("'", '"')
        if kind == "is_instance_of" and ctx.get("class") == "Fix":
            from capplan.schemas.spec import Fix

            what = "must be one of " + ", ".join(f.value for f in Fix)
        elif kind == "enum":
            what = "must be one of " + str(ctx.get("expected", "")).replace("'", "")
        if kind in ("finite_number", "float_type", "float_parsing"):
            what = "must be a finite number"
        got = f" (got {value!r})" if _scalar(value) and kind != "missing" else ""
    more = f" (and {len(errors) - 1} more problem(s) in this file)" if len(errors) > 1 else ""
    head = f"{path}: " if path else ""
    return f"{head}{what}{got}{more}"
