"""Spec and plan files -> validated models, with one-line errors naming the field path."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pydantic import BaseModel, ValidationError

from capplan.errors import CapplanError, PlanError, SpecError
from capplan.limits import MAX_FILE_BYTES, MAX_ITEMS
from capplan.schemas.plan import FORMAT_VERSION, Plan
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
    from capplan.yaml_io import read_yaml

    return spec_from_data(read_yaml(Path(path), "spec", SpecError), str(path))


def load_plan(path: Path, *, check_consistency: bool = True) -> Plan:
    """Load a plan; refuse newer formats, and (by default) any plan that is not
    exactly what its embedded spec compiles to (a hand edit or a tampered table)."""
    from capplan.planner.compiler import compile_plan
    from capplan.planner.hashing import spec_hash

    path = Path(path)
    compiled = None  # what the fast path compiled from the file's spec lines, if it got that far
    if check_consistency:
        plan, compiled = _canonical_plan(path)
        if plan is not None:
            return plan
    from capplan.yaml_io import read_yaml

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
        # A file that failed only the byte comparison (reformatted, say) has been
        # compiled from the same spec already: compile once, not twice.
        expected = compiled if compiled is not None and compiled.spec == plan.spec else compile_plan(plan.spec)
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


def _past_comments(text: str) -> str | None:
    """The text after its leading `#` lines; None when a comment holds a character YAML
    would read as a line break or refuse (such a file is left to the full load)."""
    start = 0
    while text.startswith("#", start):
        end = text.find("\n", start)
        if end < 0:
            end = len(text)
        if not text[start:end].isprintable():
            return None
        start = end + 1
    return text[start:]


# One token of a flow mapping as `render` writes it: a JSON string, a bare
# word, an integer, punctuation, or spaces.
_FLOW_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[A-Za-z_][A-Za-z0-9_.\-]*|-?[0-9]+|[{}\[\],:]| +')


def _flow_as_json(text: str) -> object:
    """A one-line flow mapping in render's canonical form -> data (ValueError otherwise)."""
    out, pos = [], 0
    while pos < len(text):
        match = _FLOW_TOKEN.match(text, pos)
        if match is None:
            raise ValueError(f"not canonical at {pos}")
        token, pos = match.group(), match.end()
        if token[0].isalpha() or token[0] == "_":
            out.append(token if token in ("true", "false", "null") else f'"{token}"')
        elif token[0] != " ":
            out.append(token)
    return json.loads("".join(out))


def _embedded_spec(body: str) -> dict | None:
    """The `spec:` section of a canonical plan: one `  section: {flow}` line per section."""
    start = body.find("\nspec:\n")
    if start < 0:
        return None
    spec: dict = {}
    for line in body[start + 7:].split("\n"):
        if not line.startswith("  "):
            break
        key, sep, value = line[2:].partition(": ")
        if not sep or not key.isidentifier() or key in spec:
            return None
        spec[key] = _flow_as_json(value)
    return spec or None  # render writes every section: none read means another layout


# Every entry the full load counts (yaml_io.MAX_ITEMS) takes at least two
# characters of canonical plan text (a value and the ": ", ", ", "[" or "- "
# before it), so a smaller body cannot exceed the limit the full load enforces.
_CANONICAL_MAX_CHARS = 2 * MAX_ITEMS
# Compile work the fast path may spend per graph line the file holds, so a
# small file naming a huge spec is refused by the full load, not compiled.
_WORK_PER_GRAPH_LINE = 8


def _canonical_plan(path: Path) -> tuple[Plan | None, Plan | None]:
    """(the plan, None) when the file is byte for byte what its embedded spec
    compiles to (past the leading comment lines); else (None, the plan its
    spec lines compile to, or None when they were not read that far).

    Such a file passes the full load below by construction (render, parse and
    validate round-trip; tests/test_plan_file.py checks both paths agree), so
    this skips YAML and the validation of thousands of graph and dispatch
    lines: only the spec lines are read (a reading that is wrong can only
    fail the byte comparison) and only the spec is validated. Anything else
    (an edit, other formatting, a bad spec, a body over the full load's
    entry limit, a spec whose compile the file's size does not account for)
    is not accepted here, and the full load accepts it or words what is wrong.
    """
    from capplan.planner.capture_sizes import resolve_capture_sizes
    from capplan.planner.compiler import compile_plan
    from capplan.planner.lora_cases import lora_capture_cases
    from capplan.planner.render import render_plan

    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None, None
        body = _past_comments(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return None, None
    if body is None or len(body) > _CANONICAL_MAX_CHARS:
        return None, None
    try:
        data = _embedded_spec(body)
        if data is None:
            return None, None
        spec = Spec.model_validate(data)
        work = len(resolve_capture_sizes(spec)[0]) * max(1, len(lora_capture_cases(spec)))
        if work > _WORK_PER_GRAPH_LINE * (body.count("\n  - {id: ") + 8):
            return None, None
        plan = compile_plan(spec)
    except (ValueError, CapplanError, RecursionError):  # pydantic's ValidationError is a ValueError
        return None, None
    if _past_comments(render_plan(plan, "")) != body:
        return None, plan
    return plan, None


def reload_problem(text: str, plan: Plan) -> str | None:
    """Why the full load would refuse `text`, the rendering of `plan`; None when it loads.

    Compile checks this before writing, so it never writes (or caches the
    tables of) a plan no other command can load: the loader's size and entry
    limits are the only checks a rendered plan can fail.
    """
    size = len(text.encode("utf-8"))
    if size > MAX_FILE_BYTES:
        return f"{size} bytes, over the {MAX_FILE_BYTES} byte limit for a plan file"
    if len(text) > _CANONICAL_MAX_CHARS:  # shorter text cannot hold MAX_ITEMS entries
        from capplan.yaml_io import check_shape

        try:
            check_shape(plan.model_dump(mode="json"), "plan")
        except CapplanError:
            return f"over the {MAX_ITEMS} entry limit for a plan file ({len(plan.graphs)} graphs)"
    return None


__all__ = ["CapplanError", "load_plan", "load_spec", "reload_problem", "spec_from_data"]
