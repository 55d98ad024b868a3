"""Plan file -> the plan its embedded spec compiles to, or refused with one line.

Loading is a check, not a parse: the file's content must be exactly what its
spec compiles to (`compare.plan_difference`), so nothing downstream sees a
value the compiler did not produce.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from capplan.errors import PlanError
from capplan.loading import SpecGivenForPlan, document_kind
from capplan.planfile.compare import LoadDifference, plan_difference
from capplan.planner.spec_checks import capacity_problem, case_sizes_problem, tiers_problem
from capplan.schemas.plan import FORMAT_VERSION, Plan
from capplan.schemas.spec import Spec
from capplan.schemas.validation import describe_validation_error


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
            f"{path}: {problem.text()} (edited by hand, or written by another capplan version)",
            "regenerate it with capplan compile SPEC",
        )
    return plan


def plan_from_data(data: object, source: str) -> tuple[Plan, LoadDifference | None]:
    """(the plan the data's spec compiles to, None when the data is exactly that plan's
    file content, else where it differs first). PlanError when the data is not a plan of
    this format or its spec is invalid (SpecGivenForPlan when it is a spec)."""
    from capplan.planfile.write import plan_file_data
    from capplan.planner.compiler import compile_plan

    if not isinstance(data, dict):
        raise PlanError(f"{source}: a plan must be a YAML mapping (got {type(data).__name__})")
    if "format_version" not in data:
        if document_kind(data) == "spec":
            raise SpecGivenForPlan(
                f"{source}: not a capplan plan (no format_version) but a spec", "compile it first: capplan compile SPEC"
            )
        raise PlanError(f"{source}: not a capplan plan (no format_version)")
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
    _check_size(spec, source)
    problem = tiers_problem(spec)
    if problem:
        raise PlanError(f"{source}: spec.{problem}", "regenerate it with capplan compile SPEC")
    plan = compile_plan(spec)
    return plan, plan_difference(data, plan_file_data(plan))


def _check_size(spec: Spec, source: str) -> None:
    """Refuse, before compiling, a spec no plan file can hold (capplan never wrote this file;
    below that bound a compile takes well under a second)."""
    problem = capacity_problem(spec)
    if problem:
        raise PlanError(f"{source}: spec: {problem}", "regenerate it with capplan compile SPEC")
