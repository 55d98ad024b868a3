"""Spec and plan files -> validated models, with one-line errors naming the field path."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ValidationError

from capplan.errors import CapplanError, PlanError, SpecError
from capplan.schemas.plan import FORMAT_VERSION, Plan
from capplan.schemas.spec import Spec
from capplan.yaml_io import read_yaml


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
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
        got = f" (got {value!r})" if _scalar(value) and kind != "missing" else ""
    more = f" [+{len(errors) - 1} more]" if len(errors) > 1 else ""
    head = f"{path}: " if path else ""
    return f"{head}{what}{got}{more}"


def spec_from_data(data: object, source: str) -> Spec:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a spec must be a YAML mapping (got {type(data).__name__})")
    try:
        return Spec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"{source}: {describe_validation_error(exc, Spec)}") from None


def load_spec(path: Path) -> Spec:
    return spec_from_data(read_yaml(Path(path), "spec", SpecError), str(path))


def load_plan(path: Path, *, check_consistency: bool = True) -> Plan:
    """Load a plan; refuse newer formats, and (by default) any plan that is not
    exactly what its embedded spec compiles to (a hand edit or a tampered table)."""
    from capplan.planner.compiler import compile_plan
    from capplan.planner.hashing import spec_hash

    path = Path(path)
    data = read_yaml(path, "plan", PlanError)
    if not isinstance(data, dict):
        raise PlanError(f"{path}: a plan must be a YAML mapping (got {type(data).__name__})")
    version = data.get("format_version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise PlanError(
            f"{path}: format_version: {version} is newer than this capplan reads ({FORMAT_VERSION})",
            "upgrade capplan",
        )
    try:
        plan = Plan.model_validate(data)
    except ValidationError as exc:
        raise PlanError(
            f"{path}: {describe_validation_error(exc, Plan)}", "regenerate it with capplan compile SPEC"
        ) from None
    if plan.format_version != FORMAT_VERSION:
        raise PlanError(f"{path}: format_version: must be {FORMAT_VERSION} (got {plan.format_version})")
    if check_consistency:
        if plan.spec_hash != spec_hash(plan.spec):
            raise PlanError(
                f"{path}: spec_hash does not match the embedded spec (edited by hand?)",
                "regenerate it with capplan compile SPEC",
            )
        expected = compile_plan(plan.spec)
        if expected != plan:
            field = next(
                (name for name in Plan.model_fields if getattr(expected, name) != getattr(plan, name)),
                "?",
            )
            raise PlanError(
                f"{path}: {field} does not match what its spec compiles to (edited by hand, "
                "or written by another capplan version)",
                "regenerate it with capplan compile SPEC",
            )
    return plan


__all__ = ["CapplanError", "load_plan", "load_spec", "spec_from_data"]
