"""`capplan compile`: which plan each spec writes, compile them all, then check,
show or write each plan."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from capplan.commands import Notes, no_notes
from capplan.errors import CapplanError, SpecError, StalePlansError, UsageError, printable
from capplan.planfile.paths import default_plan_path, regenerate_command, relative
from capplan.schemas.plan import Plan


@dataclass(frozen=True)
class CompileOptions:
    """How `compile` treats its specs (the command line's options)."""

    output: Path | None = None
    plan_dir: Path | None = None
    dry_run: bool = False
    check: bool = False
    skip_non_specs: bool = False


@dataclass(frozen=True)
class Compiled:
    """One spec compiled: the plan, the file's text and its content as data."""

    spec: Path
    plan_path: Path
    plan: Plan
    text: str
    data: dict[str, Any] = field(repr=False)


Action = Literal["up to date", "stale", "dry run", "unchanged", "wrote"]


@dataclass(frozen=True)
class CompileOutcome:
    """What became of one compiled plan; `stale` is the line saying why and what to run."""

    compiled: Compiled
    action: Action
    stale: str | None = None


def compile_specs(specs: Sequence[Path], options: CompileOptions, notes: Notes = no_notes) -> list[Compiled]:
    """Every spec compiled, nothing written: one bad spec writes nothing. Refuses two specs
    writing one plan, an output that would replace an input, and a plan no command could load."""
    return [compile_target(spec, plan_path) for spec, plan_path in plan_targets(specs, options, notes)]


def plan_targets(specs: Sequence[Path], options: CompileOptions, notes: Notes = no_notes) -> list[tuple[Path, Path]]:
    """(spec, plan path) for each spec to compile, in order."""
    from capplan.files import check_output

    if options.output is not None and (len(specs) > 1 or options.plan_dir is not None):
        raise UsageError("-o names one plan: give one spec and no --plan-dir")
    targets: list[tuple[Path, Path]] = []
    written: dict[str, Path] = {}  # real path of each plan -> the spec writing it
    for spec in specs:
        kind = yaml_kind(spec) if options.skip_non_specs else "spec"
        if kind != "spec":
            notes(f"{printable(str(spec))}: skipped, {SKIPPED[kind]}")
            continue
        plan_path = options.output or default_plan_path(spec)
        if options.plan_dir is not None:
            plan_path = options.plan_dir / default_plan_path(spec).name
        other = written.setdefault(os.path.realpath(plan_path), spec)
        if other is not spec:
            raise UsageError(
                f"{printable(str(other))} and {printable(str(spec))} would both be written to "
                f"{printable(str(plan_path))}",
                "compile them one at a time with -o",
            )
        if not options.check and not options.dry_run:
            check_output(plan_path, specs)
        targets.append((spec, plan_path))
    return targets


def compile_target(spec: Path, plan_path: Path) -> Compiled:
    """The plan file `spec` compiles to when written at `plan_path`."""
    from capplan.loading import load_spec
    from capplan.planfile.write import plan_file_data, render_plan
    from capplan.planner import compile_plan

    plan = compile_plan(load_spec(spec))
    folder = plan_path.parent
    data = plan_file_data(plan)
    text = render_plan(plan, relative(spec, folder), regenerate_command(spec, plan_path, folder), data)
    refuse_unloadable(spec, text, data)
    return Compiled(spec, plan_path, plan, text, data)


def settle(job: Compiled, options: CompileOptions, specs: Sequence[Path] = ()) -> CompileOutcome:
    """Check the plan file (--check), leave it (--dry-run, or it already holds this
    text), or write it atomically (never over one of `specs`)."""
    from capplan.files import write_atomic
    from capplan.planfile.compare import stale_reason

    if options.check:
        why = stale_reason(job.plan_path, job.data)
        if why is None:
            return CompileOutcome(job, "up to date")
        command = regenerate_command(job.spec, job.plan_path, Path.cwd())
        return CompileOutcome(job, "stale", f"plan is stale ({why}): run {command}")
    if options.dry_run:
        return CompileOutcome(job, "dry run")
    try:  # text mode: a CRLF checkout of the same plan is unchanged
        unchanged = job.plan_path.read_text(encoding="utf-8") == job.text
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, UnicodeDecodeError):
        unchanged = False
    if unchanged:
        return CompileOutcome(job, "unchanged")
    write_atomic(job.plan_path, job.text, specs)
    return CompileOutcome(job, "wrote")


def refuse_stale(outcomes: Sequence[CompileOutcome]) -> None:
    """--check's answer: StalePlansError naming every stale plan, else nothing."""
    lines = [o.stale for o in outcomes if o.stale is not None]
    if lines:
        raise StalePlansError(lines)


def refuse_unloadable(spec: Path, text: str, data: dict[str, Any]) -> None:
    """Refuse a spec whose plan file (`text`, its content `data`) no command could load."""
    from capplan.planfile.compare import size_problem

    problem = size_problem(text, data)
    if problem is not None:
        raise CapplanError(
            f"{spec}: the plan would be {problem}, so no command could load it",
            "capture fewer sizes or LoRA cases: set cudagraph.capture_sizes or max_capture_size",
        )


def compile_spec(spec: Path) -> Plan:
    """The plan a spec compiles to, refused like `capplan compile` refuses it when no
    command could load its file (for commands that compare specs in memory)."""
    from capplan.loading import load_spec
    from capplan.planfile.write import plan_file_data, render_plan
    from capplan.planner import compile_plan

    plan = compile_plan(load_spec(spec))
    data = plan_file_data(plan)
    refuse_unloadable(spec, render_plan(plan, spec.name, None, data), data)
    return plan


SKIPPED = {
    "plan": "a capplan plan (checked through the spec it is compiled from)",
    "other": "not a capplan spec or plan (no spec section: another tool's YAML)",
}


def yaml_kind(path: Path) -> Literal["spec", "plan", "other"]:
    """What a YAML file is, for `compile --skip-non-specs` (the pre-commit hook and the example
    CI job pass every YAML file): a capplan spec, a capplan plan, or another tool's file."""
    if looks_like_plan(path):
        return "plan"
    return "spec" if looks_like_spec(path) else "other"


def looks_like_plan(path: Path) -> bool:
    """Whether a YAML file is a capplan plan: its first lines are a plan file's header and keys."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", "replace")
    except OSError:
        return False
    lines = [line for line in head.splitlines() if line.strip() and not line.startswith("#")]
    return bool(lines) and lines[0].startswith("format_version:") and "\nfingerprint:" in head


def looks_like_spec(path: Path) -> bool:
    """Whether a YAML file has any of a spec's top-level sections (else it is skipped, with a note)."""
    from capplan.files import read_text, read_yaml
    from capplan.schemas.spec import Spec

    try:
        data = read_yaml(path, "spec", SpecError)
    except SpecError:
        # Not YAML capplan reads (several documents, custom tags, YAML 1.1 numbers, a
        # template): a spec only if a line starts one of a spec's sections, so a misspelt
        # spec still fails while a Kubernetes manifest or a playbook is skipped.
        try:
            text = read_text(path, "spec", SpecError)
        except SpecError:
            return True  # not readable at all: let the real load say why
        sections = tuple(f"{name}:" for name in Spec.model_fields)
        if any(line.startswith(sections) for line in text.splitlines()):
            return True
        names = "|".join(Spec.model_fields)
        if text.lstrip().startswith("{") and re.search(rf'[{{,]\s*["\']?(?:{names})["\']?\s*:', text):
            return True  # a spec in flow (JSON) style
        data = None
    if not isinstance(data, dict) or "graphs" in data or not set(data) & set(Spec.model_fields):
        return False
    # A vLLM config file (`vllm serve --config`) shares `model` with a spec, as a string: with
    # vLLM's dashed option names and no spec section holding a mapping it is not a spec.
    dashed = any(isinstance(k, str) and "-" in k for k in data)
    holds_section = any(isinstance(v, (dict, list)) for k, v in data.items() if k in Spec.model_fields)
    return holds_section or not dashed
