"""Spec and plan files -> validated models, with one-line errors naming the field path."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ValidationError

from capplan.errors import CapplanError, InputError, PlanError, SpecError, printable
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
    problem = case_sizes_problem(spec)
    if problem:
        raise SpecError(f"{source}: {problem}")
    graphs = graphs_bound(spec)
    if graphs * MIN_ENTRIES_PER_GRAPH > MAX_ITEMS:
        raise SpecError(
            f"{source}: the plan would have up to {graphs} graphs, more than a plan file can hold "
            f"({MAX_ITEMS} entries)",
            "capture fewer sizes or LoRA cases: set cudagraph.capture_sizes or max_capture_size",
        )
    return spec


def case_sizes_problem(spec: Spec) -> str | None:
    """Why the spec's cudagraph.lora_case_sizes names a case it does not capture, or None."""
    from capplan.planner.lora_cases import lora_capture_cases

    if spec.cudagraph.lora_case_sizes is None:
        return None
    cases = lora_capture_cases(spec)
    for entry in spec.cudagraph.lora_case_sizes:
        if entry.case not in cases:
            return (
                f"cudagraph.lora_case_sizes: case {entry.case} is not a LoRA capture case of this spec "
                f"(cases: {', '.join(map(str, cases))}); use one of those"
            )
    return None


# A graph's line in the plan file holds at least this many entries (its address,
# its dummy list, one run and the run's two numbers).
MIN_ENTRIES_PER_GRAPH = 5


def graphs_bound(spec: Spec) -> int:
    """An upper bound on the graphs the spec compiles to, computed without compiling."""
    from capplan.planner.capture_sizes import resolve_capture_sizes
    from capplan.planner.lora_cases import lora_capture_cases

    sizes = len(resolve_capture_sizes(spec)[0])
    cases = lora_capture_cases(spec) or [0]
    listed = {e.case: len(e.sizes) for e in spec.cudagraph.lora_case_sizes or []}
    return 2 * sum(listed.get(case, sizes) for case in cases)


def load_spec(path: Path) -> Spec:
    from capplan.files import read_yaml

    return spec_from_data(read_yaml(Path(path), "spec", SpecError), str(path))


def load_plan(path: Path) -> Plan:
    """Load a plan file: the plan its embedded spec compiles to, once the file is
    found to hold exactly that plan (format 2; comments are not compared).

    Refused, with one line saying why and what to run: unreadable or unsafe
    YAML, another format version, an invalid embedded spec, or any content that
    differs from what the spec compiles to (a hand edit, a merge gone wrong, a
    plan written by another capplan version).
    """
    from capplan.files import read_yaml

    path = Path(path)
    data = read_yaml(path, "plan", PlanError)
    plan, problem = plan_from_data(data, str(path))
    if problem is not None:
        raise PlanError(
            f"{path}: {problem} (edited by hand, or written by another capplan version)",
            "regenerate it with capplan compile SPEC",
        )
    return plan


def plan_from_data(data: object, source: str) -> tuple[Plan, str | None]:
    """(the plan the data's spec compiles to, None when the data is exactly that plan's
    file content, else what differs first). PlanError when the data is not a plan of
    this format or its spec is invalid."""
    from capplan.planfile import plan_file_data
    from capplan.planner.compiler import compile_plan

    if not isinstance(data, dict):
        raise PlanError(f"{source}: a plan must be a YAML mapping (got {type(data).__name__})")
    if "format_version" not in data:
        hint = "compile it first: capplan compile SPEC" if "scheduler" in data or "lora" in data else None
        raise PlanError(f"{source}: not a capplan plan (no format_version)" + (" but a spec" if hint else ""), hint)
    version = data["format_version"]
    if type(version) is not int:
        raise PlanError(
            f"{source}: format_version: must be the integer {FORMAT_VERSION} (got {version!r})",
            "regenerate it with capplan compile SPEC",
        )
    if version > FORMAT_VERSION:
        raise PlanError(
            f"{source}: format_version: {version} is newer than this capplan reads ({FORMAT_VERSION})",
            "upgrade capplan",
        )
    if version != FORMAT_VERSION:
        raise PlanError(
            f"{source}: a format {version} plan; this capplan reads format {FORMAT_VERSION}",
            "run capplan compile SPEC again to rewrite it",
        )
    spec_value = data.get("spec")  # validated as a spec, without the file-level empty/size refusals
    if not isinstance(spec_value, dict):
        raise PlanError(
            f"{source}: spec: must be a mapping of the spec's sections (got {spec_value!r:.40})",
            "regenerate it with capplan compile SPEC",
        )
    try:
        spec = Spec.model_validate(spec_value)
    except ValidationError as exc:
        raise PlanError(
            f"{source}: spec.{describe_validation_error(exc, Spec)}", "regenerate it with capplan compile SPEC"
        ) from None
    problem = case_sizes_problem(spec)
    if problem:
        raise PlanError(f"{source}: spec.{problem}", "regenerate it with capplan compile SPEC")
    _check_size(spec, data, source)
    plan = compile_plan(spec)
    return plan, plan_difference(data, plan_file_data(plan))


def plan_difference(actual: dict, expected: dict) -> str | None:
    """first_difference of a plan file's content and what its spec compiles to, leaving out
    the one informational field: the releases `target.vllm` lists for the plan's semantics.
    That list grows as capplan proves more releases, and the plan means the same."""
    target = actual.get("target")
    if isinstance(target, dict) and isinstance(target.get("vllm"), str) and isinstance(expected.get("target"), dict):
        actual = {**actual, "target": {**target, "vllm": expected["target"]["vllm"]}}
    return first_difference(actual, expected)


def _check_size(spec: Spec, data: dict, source: str) -> None:
    """Refuse, before compiling, a spec that compiles to far more graphs than the file lists:
    such a file cannot match, and a short file must not buy minutes of compile work."""
    listed = data.get("graphs")
    listed = len(listed) if isinstance(listed, list) else 0
    bound = graphs_bound(spec)
    if bound > 4 * listed + 128:
        raise PlanError(
            f"{source}: graphs: the file lists {listed} graph(s), its spec compiles to up to {bound}",
            "regenerate it with capplan compile SPEC",
        )


def first_difference(actual: object, expected: object, where: str = "") -> str | None:
    """Where `actual` first differs from `expected`, types included (`true` is not
    `1`): `graphs[3] (FULL:8x8@1).grid: the file says 3, its spec compiles to 4`; None
    when equal."""
    label = where.rstrip(".") or "the file"
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"{label}: must be a mapping"
        for key in expected:
            if key not in actual:
                return f"{where}{key}: is missing"
        for key in actual:
            if key not in expected:
                return f"{where}{printable(str(key))[:40]}: unknown key"
        # The embedded spec first: when it changed, that is the news, not what follows from it.
        for key, value in sorted(expected.items(), key=lambda item: item[0] != "spec"):
            found = first_difference(actual[key], value, f"{where}{key}.")
            if found is not None:
                return found
        return None
    if isinstance(expected, list):
        if not isinstance(actual, list):
            return f"{label}: must be a list"
        for i, (a, e) in enumerate(zip(actual, expected)):
            name = f" ({e['graph']})" if isinstance(e, dict) and "graph" in e else ""
            if name and isinstance(a, dict) and a.get("graph") != e["graph"]:
                # another graph at this place: that is the news, not the keys the two differ in
                said = printable(repr(a.get("graph")))[:60]
                return f"{label}[{i}]: the file has graph {said} where its spec compiles to {e['graph']!r}"
            found = first_difference(a, e, f"{label}[{i}]{name}.")
            if found is not None:
                return found
        if len(actual) != len(expected):
            return f"{label}: the file lists {len(actual)}, its spec compiles to {len(expected)}"
        return None
    if type(actual) is not type(expected) or actual != expected:
        said, wanted = printable(repr(actual)), repr(expected)
        if max(len(said), len(wanted)) > 40:
            return f"{label}: differs from what its spec compiles to"
        return f"{label}: the file says {said}, its spec compiles to {wanted}"
    return None


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


def size_problem(text: str, data: dict) -> str | None:
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


__all__ = [
    "CapplanError",
    "load_cost_model",
    "first_difference",
    "load_plan",
    "load_spec",
    "plan_from_data",
    "size_problem",
    "spec_from_data",
]
