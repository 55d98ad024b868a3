"""`capplan init`: a spec from an existing vLLM deployment (its `--config` YAML file and/or its
serve line), read as vLLM reads them.

The deployment is read by the launcher's readers (capplan.launcher.cmdline): vLLM's own parser
where vLLM is importable, capplan's own reader otherwise, which refuses what it does not read.
Which option sets which spec field is capplan.settings' table; what the deployment gives that
the plan cannot hold is what `capplan apply` would refuse in it (engine_args.contradictions),
so there is one rule for both. Everything else it gives is named as not part of the plan.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from capplan.commands import Notes, inputs, no_notes
from capplan.errors import CapplanError, UsageError, printable
from capplan.schemas.spec import Spec, Target

# The EngineArgs fields vLLM's parser reports that are no setting of their own here: the model
# (spec.model.name), the config file itself, and the JSON configs and shorthands the launcher's
# reading already turned into the plan's settings.
_READ_ELSEWHERE = {
    "model", "model_tag", "config", "subparser", "dispatch_function", "compilation_config",
    "speculative_config", "optimization_level", "spec_tokens", "spec_method",
}  # fmt: skip
NOT_IN_PLAN = (
    "no setting of the plan: keep it in your vLLM config (each engine still checks the plan against what vLLM resolves)"
)


@dataclass(frozen=True)
class InitRequest:
    """`capplan init`'s arguments: where the deployment's settings are, and where the spec goes."""

    config: Path | None
    command: list[str]
    output: Path | None = None
    vllm: str | None = None
    moe: bool | None = None
    force: bool = False
    python: str | None = None  # the Python whose vLLM reads the line (default: the line's own)
    env: dict[str, str] | None = None


@dataclass
class Initialized:
    """The spec made, its text, and what was carried into it and what not."""

    spec: Spec
    text: str
    carried: list[str] = field(default_factory=list)
    not_carried: list[str] = field(default_factory=list)
    defaults: list[str] = field(default_factory=list)
    reader: str = ""


def _argv(request: InitRequest) -> tuple[list[str], str]:
    """The vLLM server command to read, and how messages name the deployment."""
    from capplan.launcher.deployment import server_argv

    return server_argv(request.config, request.command)


def _other_settings(argv: list[str], start: int, config: Path | None, cmd: Any) -> list[str]:
    """What the command gives that no plan setting is: by vLLM's own reading where it read the
    command (every option the operator gave, shown as written where capplan finds it), else
    every other flag of the line and the file."""
    from capplan.launcher.cmdline import COMPILATION, RESOLVED

    where = f" (in --config {printable(str(config))})" if config is not None else ""
    resolved = cmd.resolved
    if resolved is None:
        return [text for _, text in _written(argv, start, config)]
    try:
        written = dict(_written(argv, start, config))
    except CapplanError:  # a file capplan's reader refuses, which vLLM's read: named without values
        written = {}
    out = []
    for dest in sorted(resolved.given - set(RESOLVED) - _READ_ELSEWHERE):
        flag = f"--{dest.replace('_', '-')}"
        out.append(written.get(flag, flag + (where if dest in resolved.from_config else "")))
    for key in sorted(resolved.compilation_given() - set(COMPILATION)):
        out.append(written.get(f"compilation {key}", f"--compilation-config {key}"))
    objects = resolved.json_keys.get("speculative_config") or [None]
    for key in sorted(set(objects[-1] or []) - {"num_speculative_tokens"}):
        out.append(written.get(f"speculative {key}", f"--speculative-config {key}"))
    return out


def _written(argv: list[str], start: int, config: Path | None) -> list[tuple[str, str]]:
    """Every flag of the line and the file no plan setting is, and each JSON config key no plan
    setting is: (the flag as vLLM names it, or `compilation KEY`; how the operator wrote it)."""
    from capplan.launcher.cmdline import JSON_ARGS, KNOWN, SHORT, config_args

    where = f" (in --config {printable(str(config))})" if config is not None else ""
    words = [(a, "") for i, a in enumerate(argv) if i >= start and a != "--config" and argv[i - 1] != "--config"]
    if config is not None:
        words = [(a, where) for a in config_args(str(config))] + words
    out = []
    for k, (word, origin) in enumerate(words):
        if not word.startswith("-") or word[1:2].isdigit():
            continue
        name, eq, inline = word.partition("=")
        name = SHORT.get(name, name)
        head = name.split(".", 1)[0]
        normalized = head[:2] + head[2:].replace("_", "-") if head.startswith("--") else head
        if normalized in JSON_ARGS:
            dotted = normalized + name[len(head) :]
            keys = _json_keys(dotted, word, words, k)
            out += [(f"{JSON_ARGS[normalized]} {key}", f"{printable(head)[:40]} {key}{origin}") for key in keys]
            continue
        if normalized in KNOWN:
            continue
        following = words[k + 1][0] if k + 1 < len(words) else "-"
        value = inline if eq else ("" if following.startswith("-") else following)  # shown only, never read
        out.append((normalized, f"{printable(name)[:60]}{' ' + printable(value)[:40] if value else ''}{origin}"))
    return out


def _json_keys(flag: str, word: str, words: list[tuple[str, str]], k: int) -> list[str]:
    """The keys of a JSON config argument (its object, or its dotted key) that no plan setting is."""
    from capplan.launcher.cmdline import COMPILATION, JSON_ARGS, SPECULATIVE

    head, dot, key = flag.partition(".")
    known = set(COMPILATION) if JSON_ARGS[head] == "compilation" else {SPECULATIVE.speculative}
    if dot:
        keys = [key.partition(".")[0].removesuffix("+")]
    else:
        raw = word.partition("=")[2] if "=" in word else (words[k + 1][0] if k + 1 < len(words) else "")
        try:
            data = json.loads(raw)
        except ValueError:
            return []  # the reader has said what is wrong with it
        keys = [str(x) for x in data] if isinstance(data, dict) else []
    return [printable(x)[:40] for x in keys if x not in known]


def init(request: InitRequest, notes: Notes = no_notes) -> Initialized:
    """The spec a vLLM deployment's settings make, written to `request.output` when given."""
    from capplan.files import check_output, write_atomic
    from capplan.launcher.cmdline import short
    from capplan.launcher.deployment import config_of, is_spec_field, read_settings
    from capplan.launcher.engine_args import contradictions
    from capplan.launcher.launch import target_python
    from capplan.loading import spec_from_data, target_releases
    from capplan.planfile.write import render_spec
    from capplan.planner.compiler import compile_plan
    from capplan.schemas.validation import describe_validation_error
    from capplan.settings import BY_NAME, line_values

    r = request
    out = r.output
    if out is not None:
        check_output(out, inputs(r.config, config_of(r.command)))
        if os.path.lexists(out) and not r.force:
            raise UsageError(f"{printable(str(out))}: exists; refusing to replace a spec", "give --force to replace it")
    argv, source = _argv(r)
    python = r.python or target_python(argv) or sys.executable
    target = r.vllm or _installed_vllm(notes)
    found = read_settings(
        argv, source, python, dict(os.environ) if r.env is None else r.env,
        "spell it out, or run capplan init where vLLM is installed", target_releases({"target": {"vllm": target}}),
    )  # fmt: skip
    cmd, reader, start, config = found.cmd, found.reader, found.start, found.config
    data: dict[str, Any] = {section: dict(values) for section, values in found.data.items()}
    carried = list(found.carried)
    if r.moe is not None:
        data.setdefault("parallel", {})["moe"] = r.moe
    data["target"] = {"vllm": target}
    try:
        Spec.model_validate(data)
    except ValidationError as exc:
        loc = ".".join(str(p) for p in exc.errors(include_url=False)[0]["loc"])
        how = cmd.flags.get(loc)
        if loc == "target.vllm":
            raise UsageError(f"--vllm: {describe_validation_error(exc, Spec)}") from None
        if loc == "parallel.moe" or "parallel.moe" in str(exc):
            raise UsageError(
                f"{source}: data parallelism needs to know whether the model is a mixture of experts "
                "(vLLM keeps only MoE ranks in lockstep)",
                "give --moe or --dense",
            ) from None
        said = f"{printable(how)}: " if how else ""
        raise CapplanError(f"{source}: {said}{describe_validation_error(exc, Spec)}") from None
    spec = spec_from_data(data, source)
    plan = compile_plan(spec)
    not_carried = [f"{u}: vLLM takes it from the model (give the model's value in the spec)" for u in cmd.unread]
    not_carried += cmd.ignored  # spellings vLLM ignores, each saying so
    not_carried += contradictions(plan, cmd)
    if cmd.values.get("speculative.present") and "speculative.num_speculative_tokens" not in cmd.values:
        not_carried.append("a speculative config without num_speculative_tokens: the spec plans none")
    not_carried += [f"{o}: {NOT_IN_PLAN}" for o in _other_settings(argv, start, config, cmd)]
    pinned = line_values(plan)
    defaults = [
        f"{name} {short(pinned[name])}"
        + (
            f" (vLLM derives it from {BY_NAME[name].derived_from}: `capplan apply` leaves it to vLLM, and the engine "
            f"refuses to start where vLLM's differs; set vLLM's here, or give {BY_NAME[name].flag})"
            if BY_NAME[name].derived_from
            else ""
        )
        for name in pinned
        if name not in cmd.values and is_spec_field(name) and name in BY_NAME
    ]
    text = _header(r, source, reader, carried, not_carried, defaults) + render_spec(spec)
    if out is not None:
        write_atomic(out, text, inputs(config))
    return Initialized(spec, text, carried, not_carried, defaults, reader)


def _installed_vllm(notes: Notes) -> str:
    """The installed vLLM's release where capplan plans for it, else the spec's default."""
    from importlib.metadata import PackageNotFoundError, version

    from capplan.releases import TARGETS

    default = Target().vllm
    try:
        found = version("vllm")
    except PackageNotFoundError:
        return default
    if found in TARGETS:
        return found
    notes(f"note: the installed vLLM {printable(found)[:40]} is no release capplan plans for: target.vllm {default}")
    return default


def _header(
    r: InitRequest, source: str, reader: str, carried: list[str], not_carried: list[str], defaults: list[str]
) -> str:
    said = f"--config {printable(str(r.config))}" if r.config is not None else ""
    if r.command:
        said = (said + " -- " if said else "-- ") + printable(shlex.join(r.command))[:200]
    lines = [f"# capplan init {said}", f"# The deployment's settings ({source}), {reader}."]
    if carried:
        lines.append("# Carried into this spec:")
        lines += [f"#   {printable(c)}" for c in carried]
    if not_carried:
        lines.append("# Not carried (and why):")
        lines += [f"#   {printable(n)}" for n in not_carried]
    if defaults:
        lines.append(
            "# Not given, the spec's default (`capplan apply` passes it to vLLM unless said; edit it where yours "
            "differs):"
        )
        lines += [f"#   {printable(d)}" for d in defaults]
    return "\n".join(lines) + "\n"
