"""`capplan compile`: which plan each spec writes, compile them all, then check,
show or write each plan."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from capplan.commands import Notes, no_notes
from capplan.errors import CapplanError, SpecError, StalePlansError, UsageError, printable
from capplan.planfile.paths import default_plan_path, regenerate_command, relative
from capplan.schemas.plan import Plan

if TYPE_CHECKING:
    from capplan.launcher.deployment import DeploymentSettings


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
    deployment: DeploymentSettings | None = field(default=None, repr=False)


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
    queue = list(specs)
    given = {os.path.realpath(s) for s in specs}  # and the specs that read a vLLM config given in their place
    index: dict[str, list[Path]] | None = None  # a vLLM config or script -> the specs whose deployment reads it
    while queue:
        spec = queue.pop(0)
        kind = yaml_kind(spec) if options.skip_non_specs else "spec"
        if options.skip_non_specs and kind != "plan":
            index = deployment_index() if index is None else index
            readers = index.get(_real(spec), [])
            if readers:  # a vLLM config (or launch script) a spec reads, whatever else it looks like
                notes(f"{printable(str(spec))}: checked through {', '.join(printable(str(r)) for r in readers)} "
                      "(whose deployment reads it)")  # fmt: skip
                queue += [r for r in readers if os.path.realpath(r) not in given]
                given.update(os.path.realpath(r) for r in readers)
                continue
        if kind != "spec":
            yaml_file = spec.name.endswith((".yaml", ".yml"))
            why = SKIPPED[kind] if yaml_file else "not YAML, and no spec's deployment reads it"
            notes(f"{printable(str(spec))}: skipped, {why}")
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
    from capplan.planfile.write import plan_file_data, render_plan

    plan, found = _compiled(spec)
    if found is not None:
        for source in (found.config, found.script):
            if source is not None and os.path.realpath(source) == os.path.realpath(plan_path):
                raise CapplanError(
                    f"{printable(str(plan_path))}: is the deployment's "
                    f"{'vLLM config' if source == found.config else 'launch script'} {printable(str(spec))} reads; "
                    "refusing to replace it with a plan",
                    "give the plan another name with -o",
                )
    folder = plan_path.parent
    data = plan_file_data(plan)
    text = render_plan(plan, relative(spec, folder), regenerate_command(spec, plan_path, folder), data)
    refuse_unloadable(spec, text, data)
    return Compiled(spec, plan_path, plan, text, data, found)


def _compiled(spec: Path) -> tuple[Plan, DeploymentSettings | None]:
    """The plan a spec compiles to, and what its deployment's vLLM config sets; refused where
    that config gives a value the plan cannot hold (what `capplan apply` would refuse in it)."""
    from capplan.launcher.engine_args import complete, contradictions
    from capplan.loading import load_deployed_spec
    from capplan.planner import compile_plan

    loaded, found = load_deployed_spec(spec)
    plan = compile_plan(loaded)
    if found is not None:
        problems = contradictions(plan, found.cmd)
        if problems:
            raise SpecError(
                f"{printable(str(spec))}: {found.label}: {printable(problems[0])}",
                "change the vLLM config: capplan apply would refuse to start it with this plan",
            )
        try:  # what apply adds to the line, it must be able to add
            complete(plan, found.cmd)
        except CapplanError as exc:
            raise SpecError(f"{printable(str(spec))}: {found.label}: {exc.message}", exc.hint) from None
    return plan, found


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
        moved = _deployment_moves(job)
        if moved:
            return CompileOutcome(job, "stale", f"plan is stale ({job.plan_path}: {moved}): run {command}")
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


def _deployment_moves(job: Compiled) -> str | None:
    """The settings the deployment's vLLM config now gives that the plan file holds otherwise
    ("vllm.yaml now sets lora.max_loras 10 (--max-loras 10), the plan has 4"), or None."""
    from capplan.files import read_yaml
    from capplan.launcher.cmdline import short

    found = job.deployment
    if found is None:
        return None
    try:
        current = read_yaml(job.plan_path, "plan", CapplanError)
    except CapplanError:
        return None
    held = current.get("spec") if isinstance(current, dict) else None
    if not isinstance(held, dict):
        return None
    moves = []
    for name in found.fields():
        section, _, key = name.partition(".")
        want = job.data["spec"].get(section, {}).get(key)
        have = held.get(section, {}).get(key, "nothing") if isinstance(held.get(section), dict) else "nothing"
        if have != want:
            said = re.sub(r" \(in --config [^)]*\)$", "", printable(found.said(name)))
            moves.append(f"{name} {short(want)} ({said}), the plan has {short(have)}")
    if not moves:
        return None
    return f"{found.label} now set{'' if ' and ' in found.label else 's'} " + "; ".join(moves)


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
    from capplan.planfile.write import plan_file_data, render_plan

    plan, _ = _compiled(spec)
    data = plan_file_data(plan)
    refuse_unloadable(spec, render_plan(plan, spec.name, None, data), data)
    return plan


SEARCH_LIMIT = 20000  # YAML files looked at for specs reading a changed vLLM config
SEARCH_BYTES = 1 << 20  # a larger file is no spec


def _real(path: Path | str) -> str:
    try:
        return os.path.realpath(path)
    except (OSError, ValueError):
        return ""


def deployment_index(root: Path | None = None) -> dict[str, list[Path]]:
    """Every vLLM config and launch script a spec under `root` (default: the working directory,
    where the pre-commit hook and the CI job run) reads through its `deployment` section, by real
    path, with those specs (relative to `root`). Only regular files are read (a fifo or a device
    named *.yaml is passed over, never opened); hidden folders and virtual environments are not
    searched."""
    import stat

    from capplan.files import read_yaml

    root = root or Path(".")
    index: dict[str, list[Path]] = {}
    seen = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("node_modules", "venv", "__pycache__"))
        for name in sorted(files):
            if not name.endswith((".yaml", ".yml")) or name.endswith((".plan.yaml", ".plan.yml")):
                continue
            seen += 1
            if seen > SEARCH_LIMIT:
                return index
            candidate = Path(folder) / name
            try:
                info = os.lstat(candidate)
                if not stat.S_ISREG(info.st_mode) or info.st_size > SEARCH_BYTES:
                    continue
                with open(candidate, "rb") as f:
                    if b"deployment" not in f.read(SEARCH_BYTES):
                        continue
                data = read_yaml(candidate, "spec", SpecError)
            except (OSError, SpecError):
                continue
            source = data.get("deployment") if isinstance(data, dict) else None
            if not isinstance(source, dict):
                continue
            for key in ("config", "script"):
                named = source.get(key)
                if isinstance(named, str) and named and "\x00" not in named:
                    real = _real(candidate.parent / named)
                    if real:
                        index.setdefault(real, []).append(Path(os.path.normpath(candidate)))
    return index


SKIPPED = {
    "plan": "a capplan plan (checked through the spec it is compiled from)",
    "other": "not a capplan spec or plan (no spec section: another tool's YAML)",
}


def yaml_kind(path: Path) -> Literal["spec", "plan", "other"]:
    """What a YAML file is, for `compile --skip-non-specs` (the pre-commit hook and the example
    CI job pass every YAML file): a capplan spec, a capplan plan, or another tool's file."""
    import stat

    if not path.name.endswith((".yaml", ".yml")):
        return "other"  # a script the hook passes: checked through the specs that read it, if any
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        regular = False
    if not regular:
        return "spec"  # a fifo, a device, a folder or nothing: the spec loader refuses it, never waits on it
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
    if holds_section:
        return True
    # No section holds a mapping: a vLLM config in vLLM's own names (`model: NAME`, `max_num_seqs: 128`,
    # dashed or not) unless every key is a spec section and none is a model named as text.
    others = any(k not in Spec.model_fields for k in data)
    return not (dashed or others or isinstance(data.get("model"), str))
