"""Spec and calibration files -> validated models, with one-line errors naming the field path.

The schema validates the model. What a spec file is refused for beyond that is decided
here, in order, each with its own hint: a plan given where a spec is expected, LoRA
options written without `lora.enabled` (a rule about the keys the file wrote, not about
the values the model holds), and the planner's checks (`planner.spec_checks`: a LoRA
case the spec does not capture, more graphs than a plan file can hold), which the
schemas cannot make since they import no planner code."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ValidationError

from capplan.errors import CapplanError, InputError, PlanError, SpecError, printable
from capplan.schemas.spec import Spec
from capplan.schemas.validation import describe_validation_error

if TYPE_CHECKING:
    from capplan.launcher.deployment import DeploymentSettings

DocumentKind = Literal["spec", "plan"]


def document_kind(data: object) -> DocumentKind | None:
    """What a YAML document is, decided here alone: a capture plan (it has `format_version`
    and `graphs`), a spec (no `format_version`, and a spec's `scheduler`, `lora` or `deployment`
    section),
    or None (neither: each loader says why it refuses it)."""
    if not isinstance(data, dict):
        return None
    if "format_version" in data:
        return "plan" if "graphs" in data else None
    return "spec" if "scheduler" in data or "lora" in data or "deployment" in data else None


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
    """The spec a file holds, with the settings its `deployment` section's vLLM config gives."""
    return load_deployed_spec(path)[0]


def target_releases(data: dict[str, Any]) -> tuple[str, ...] | None:
    """The releases a spec's `target.vllm` (its default where none is given) names, or None where
    it names none (the spec's own check then says so)."""
    from capplan.releases import runs_on
    from capplan.schemas.spec import Target

    target = data.get("target")
    name = target.get("vllm") if isinstance(target, dict) and "vllm" in target else Target.model_fields["vllm"].default
    try:
        return runs_on(str(name))
    except KeyError:
        try:
            return runs_on(Target(vllm=str(name)).vllm)
        except (KeyError, ValueError):
            return None


def load_deployed_spec(path: Path) -> tuple[Spec, DeploymentSettings | None]:
    """The spec a file holds and, where it has a `deployment` section, what that vLLM config
    sets (read as vLLM reads it; each of those settings is the spec's value)."""
    from capplan.files import read_yaml

    path = Path(path)
    data = read_yaml(path, "spec", SpecError)
    found = None
    if isinstance(data, dict) and data.get("deployment") is not None:
        data, found = with_deployment(data, path)
    try:
        return spec_from_data(data, str(path)), found
    except SpecError as exc:
        if found is None:
            raise
        for field in found.fields():  # a value the vLLM config gave: say where it came from
            head = f"{path}: {field}:"
            if exc.message.startswith(head):
                said = f"{path}: {field} ({printable(found.said(field))}, in {found.label}):"
                raise SpecError(said + exc.message[len(head) :], exc.hint) from None
        raise


def with_deployment(data: dict[str, Any], path: Path) -> tuple[dict[str, Any], DeploymentSettings]:
    """A spec's data with the settings of the vLLM config its `deployment` section names merged
    in. Refused where the spec sets one of them too (two sources of one value), and where a
    setting the plan needs is left to vLLM to derive from the model."""
    import os
    import shlex
    import sys

    from capplan.files import read_text
    from capplan.launcher.deployment import read_settings, serve_line_of, server_argv, unexpanded, without_prefixes
    from capplan.schemas.spec import Deployment
    from capplan.settings import SETTINGS

    name = printable(str(path))
    try:
        source = Deployment.model_validate(data["deployment"])
    except ValidationError as exc:
        said = describe_validation_error(exc, Deployment)
        whole = not exc.errors(include_url=False)[0]["loc"]  # the section itself, not one of its keys
        raise SpecError(f"{name}: deployment{': ' if whole else '.'}{said}") from None
    folder = path.parent
    config = None if source.config is None else folder / source.config
    try:
        if config is not None:
            read_text(config, "vLLM config", SpecError)  # there, a file, readable
        script = None if source.script is None else folder / source.script
        text = None if script is None else read_text(script, "script", SpecError)
    except SpecError as exc:
        key = "config" if source.config is not None and exc.message.startswith(printable(str(config))) else "script"
        raise SpecError(f"{name}: deployment.{key}: {exc.message}", exc.hint) from None
    words: list[str] = []
    label = "deployment.command"
    base = folder  # where the line's relative paths are read from
    if source.command is not None:
        try:
            words = without_prefixes(shlex.split(source.command))
        except ValueError as exc:
            raise SpecError(f"{name}: deployment.command: does not split as a shell line ({exc})") from None
        unexpanded(words, f"{name}: deployment.command", SpecError)
        label = "deployment.command"
    elif script is not None and text is not None:
        label = printable(str(script))
        words = serve_line_of(text, label, SpecError)
        base = script.parent
    words = _line_config(words, base, folder, config, f"{name}: {label}")
    try:
        argv, label = server_argv(config, words, label)
        found = read_settings(
            argv, label, sys.executable, dict(os.environ), "spell it out in the vLLM config", target_releases(data)
        )
    except CapplanError as exc:
        field = "deployment.command" if source.command is not None else "deployment"
        raise SpecError(f"{name}: {field}: {exc.message}", exc.hint) from None
    found.script = script
    merged = {key: (dict(value) if isinstance(value, dict) else value) for key, value in data.items()}
    for field, value in found.fields().items():
        section, _, key = field.partition(".")
        given = merged.get(section)
        if isinstance(given, dict) and key in given:
            raise SpecError(
                f"{name}: {field} is set here and by {found.label}: {printable(found.said(field))}",
                f"remove {field} from the spec: compile reads it from the deployment",
            )
        if given is None:
            merged[section] = given = {}
        if isinstance(given, dict):
            given[key] = value
    for setting in SETTINGS:
        section, _, key = setting.name.partition(".")
        given = merged.get(section)
        if setting.derived_from and not (isinstance(given, dict) and key in given):
            raise SpecError(
                f"{name}: {setting.name}: {found.label} leaves it to vLLM, which derives it from "
                f"{setting.derived_from}, and the plan needs it",
                f"set the value vLLM derives as {setting.name} in the spec, or give {setting.flag} in the vLLM config",
            )
    return merged, found


def _line_config(words: list[str], base: Path, folder: Path, config: Path | None, where: str) -> list[str]:
    """The serve line without its `--config FILE` where that file is the deployment's config
    (read from the spec's `deployment.config`, so that compile reads it from the spec's folder and
    the hook watches it); refused where the line names a config file the spec does not."""
    import os

    at = next((i for i, w in enumerate(words) if w == "--config" or w.startswith("--config=")), None)
    if at is None:
        return words
    named = words[at].partition("=")[2] if "=" in words[at] else (words[at + 1] if at + 1 < len(words) else "")
    if config is None or not named or os.path.realpath(base / named) != os.path.realpath(config):
        raise SpecError(
            f"{where}: the line reads --config {printable(named)[:60]}, which the spec does not name",
            f"name it in the spec as deployment.config: {printable(os.path.relpath(base / named, folder))[:80]} (a "
            "path from the spec's folder), so that compile reads it and a change to it fails --check",
        )
    return words[:at] + words[at + (1 if "=" in words[at] else 2) :]


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


def load_policy(path: Path):
    """A review policy file (`diff --policy`), validated; refused as one line naming the file."""
    from capplan.files import read_yaml
    from capplan.schemas.review import ReviewPolicy

    data = read_yaml(Path(path), "review policy", InputError)
    if data is None:
        data = {}
    try:
        return ReviewPolicy.model_validate(data)
    except ValidationError as exc:
        raise InputError(
            f"{printable(str(path))}: {describe_validation_error(exc, ReviewPolicy)}",
            "thresholds: {MEASURE: {warn: N, deny: N, warn_percent: P, deny_percent: P}}; overrides: "
            "[{fingerprint: sha256:..., reason: WHY}]",
        ) from None
