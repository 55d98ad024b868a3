"""Spec and calibration files -> validated models, with one-line errors naming the field path.

The schema validates the model. What a spec file is refused for beyond that is decided
here, in order, each with its own hint: a plan given where a spec is expected, LoRA
options written without `lora.enabled` (a rule about the keys the file wrote, not about
the values the model holds), and the planner's checks (`planner.spec_checks`: a LoRA
case the spec does not capture, more graphs than a plan file can hold), which the
schemas cannot make since they import no planner code."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from capplan.errors import CapplanError, InputError, PlanError, SpecError, printable
from capplan.schemas.spec import Spec
from capplan.schemas.validation import describe_validation_error

DocumentKind = Literal["spec", "plan"]


def document_kind(data: object) -> DocumentKind | None:
    """What a YAML document is, decided here alone: a capture plan (it has `format_version`
    and `graphs`), a spec (no `format_version`, and a spec's `scheduler` or `lora` section),
    or None (neither: each loader says why it refuses it)."""
    if not isinstance(data, dict):
        return None
    if "format_version" in data:
        return "plan" if "graphs" in data else None
    return "spec" if "scheduler" in data or "lora" in data else None


class WrongDocument(CapplanError):
    """A spec given where a plan is expected, or a plan where a spec is: `found` says which
    (so `diff` names the mix-up without reading the message)."""

    found: DocumentKind


class PlanGivenForSpec(WrongDocument, SpecError):
    found: DocumentKind = "plan"


class SpecGivenForPlan(WrongDocument, PlanError):
    found: DocumentKind = "spec"


def wrong_document(exc: CapplanError) -> DocumentKind | None:
    """What the refused file is when a loader refused it as the wrong kind of document, else None."""
    return exc.found if isinstance(exc, WrongDocument) else None


def spec_from_data(data: object, source: str) -> Spec:
    """The spec a file's YAML data holds, or SpecError naming `source` and what is wrong."""
    if data is None:
        raise SpecError(f"{source}: the spec is empty", "write its sections (or {} for every default)")
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a spec must be a YAML mapping (got {type(data).__name__})")
    if document_kind(data) == "plan":
        raise PlanGivenForSpec(
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
    from capplan.schemas.calibration import Calibration
    from capplan.traffic.steps import DEFAULT_CALIBRATION

    path = Path(path) if path else DEFAULT_CALIBRATION
    data = read_yaml(path, "calibration", InputError)
    try:
        return Calibration.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        hint = None
        if first["type"] == "missing" and first["loc"][-1:] == ("max_tokens",):
            hint = "give each run the tokens of its largest graph; capplan calibrate-steps writes it"
        raise InputError(f"{printable(str(path))}: {describe_validation_error(exc, Calibration)}", hint) from None


def load_checked_calibration(path: Path | None = None):
    """A calibration file (default: the shipped H200 one) whose capture runs, if it has any, can
    price a plan (`capplan.calibration.price.fit_runs`); refused naming the file otherwise."""
    from capplan.calibration.price import fit_runs
    from capplan.traffic.steps import DEFAULT_CALIBRATION

    try:
        cal = load_calibration(path)
        fit_runs(cal)
        return cal
    except InputError as exc:
        if exc.message.startswith(printable(str(path or DEFAULT_CALIBRATION))):
            raise
        raise InputError(f"{printable(str(path or DEFAULT_CALIBRATION))}: {exc.message}", exc.hint) from None


def load_steps(path: Path | None = None):
    """A calibration file's step times (`capplan.traffic.steps.StepTimes`); without one, the
    shipped H200 file's. Capture is priced by `capplan.calibration.price.load_pricer`."""
    from capplan.traffic.steps import step_times

    return step_times(load_checked_calibration(path))
