"""Spec and calibration files -> validated models, with one-line errors naming the field path.

The schema validates the model. What a spec file is refused for beyond that is decided
here, in order, each with its own hint: a plan given where a spec is expected, LoRA
options written without `lora.enabled` (a rule about the keys the file wrote, not about
the values the model holds), and the planner's checks (`planner.spec_checks`: a LoRA
case the spec does not capture, more graphs than a plan file can hold), which the
schemas cannot make since they import no planner code."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ValidationError

from capplan.errors import InputError, SpecError, printable
from capplan.schemas.spec import Spec


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
    more = f" [+{len(errors) - 1} more]" if len(errors) > 1 else ""
    head = f"{path}: " if path else ""
    return f"{head}{what}{got}{more}"


def spec_from_data(data: object, source: str) -> Spec:
    """The spec a file's YAML data holds, or SpecError naming `source` and what is wrong."""
    if data is None:
        raise SpecError(f"{source}: the spec is empty", "write its sections (or {} for every default)")
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a spec must be a YAML mapping (got {type(data).__name__})")
    if "format_version" in data and "graphs" in data:
        raise SpecError(
            f"{source}: this is a capture plan, not a spec", "give the spec it was compiled from; its header names it"
        )
    try:
        spec = Spec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"{source}: {describe_validation_error(exc, Spec)}") from None
    lora = data.get("lora")
    if isinstance(lora, dict) and "enabled" not in lora:
        given = [key for key in ("max_loras", "specialize", "specialize_active") if key in lora]
        if given:
            raise SpecError(
                f"{source}: lora.{given[0]} is set but lora.enabled is not (LoRA is off by default, so the plan "
                "would capture no LoRA graph)",
                "add enabled: true to the lora section, or enabled: false to plan without LoRA",
            )
    from capplan.planner.spec_checks import capacity_problem, case_sizes_problem, tiers_problem

    problem = case_sizes_problem(spec)
    if problem:
        raise SpecError(f"{source}: {problem}")
    problem = capacity_problem(spec)
    if problem:
        raise SpecError(
            f"{source}: {problem}", "capture fewer sizes or LoRA cases: set cudagraph.capture_sizes or max_capture_size"
        )
    problem = tiers_problem(spec)
    if problem:
        raise SpecError(f"{source}: {problem}")
    return spec


def load_spec(path: Path) -> Spec:
    from capplan.files import read_yaml

    return spec_from_data(read_yaml(Path(path), "spec", SpecError), str(path))


def load_calibration(path: Path | None = None):
    """A calibration file (default: the shipped H200 one), validated."""
    from capplan.files import read_yaml
    from capplan.traffic.cost import DEFAULT_CALIBRATION, Calibration

    path = Path(path) if path else DEFAULT_CALIBRATION
    data = read_yaml(path, "calibration", InputError)
    try:
        return Calibration.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        hint = None
        if first["type"] == "missing" and first["loc"][-1:] == ("max_tokens",):
            hint = "give each run the tokens of its largest graph; capplan calibrate writes it"
        raise InputError(f"{printable(str(path))}: {describe_validation_error(exc, Calibration)}", hint) from None


def load_cost_model(path: Path | None = None):
    """The cost model of a calibration file (default: the shipped H200 one)."""
    from capplan.traffic.cost import DEFAULT_CALIBRATION, fit_cost_model

    try:
        return fit_cost_model(load_calibration(path))
    except InputError as exc:
        if exc.message.startswith(printable(str(path or DEFAULT_CALIBRATION))):
            raise
        raise InputError(f"{printable(str(path or DEFAULT_CALIBRATION))}: {exc.message}", exc.hint) from None
