"""The vLLM command line against the plan: refuse what contradicts it, add what the plan
determines and the command leaves out, and print it for other launchers (`capplan flags`).

The command is read by capplan.launcher.cmdline (by vLLM's own parser where vLLM is
importable); which settings the plan pins, how each is compared and how it is spelled are
capplan.settings' table. Nothing here imports vLLM (its parser runs in the command's own
Python), and everything is checked before anything starts. What only vLLM resolves (a model's
own defaults) is left to the in-engine check, which still refuses a mismatch before capture.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Any

from capplan.envvars import PLAN as PLAN_ENV
from capplan.errors import CapplanError, printable
from capplan.launcher.cmdline import Command, read_command, read_resolved, read_with_vllm, server_start, short
from capplan.launcher.launch import target_python
from capplan.launcher.vllm_cli import resolution_of
from capplan.releases import runs_on
from capplan.schemas.plan import Plan
from capplan.settings import BY_NAME, COMPILATION_FLAGS, SETTINGS, Setting, line_values


def contradictions(plan: Plan, cmd: Command) -> list[str]:
    """Each flag of the command that contradicts the plan, as 'FLAG sets X, the plan Y'."""
    want = line_values(plan)
    out = []
    for key, have in cmd.values.items():
        setting = BY_NAME.get(key)
        if setting is None:
            continue  # not a setting of its own (that a speculative config is given)
        if setting.conflict is not None:
            problem = setting.conflict(plan, have, cmd.flags.get(key, key))
            if problem:
                out.append(problem)
        elif setting.only is not None and have != setting.value(plan):
            out.append(f"{cmd.flags.get(key, key)}: {setting.only}")
        elif key in want and have != want[key]:
            out.append(f"{cmd.flags.get(key, key)}: the plan has {key} {short(want[key])}")
    for setting in SETTINGS:
        if setting.unpinned is not None and setting.name in cmd.values and setting.name not in want:
            problem = setting.unpinned(plan, cmd.values[setting.name], cmd.flags.get(setting.name, setting.name))
            if problem:
                out.append(problem)
    for setting in SETTINGS:
        if setting.if_absent is not None and setting.name not in cmd.values:
            problem = setting.if_absent(plan)
            if problem:
                out.append(problem)
    return out


def _by_flag(setting: Setting) -> bool:
    """Whether `complete` adds it as its flag (else as its compilation-config key)."""
    return setting.flag is not None and setting.kind in ("int", "bool", "choice")


def left_to_vllm(plan: Plan, cmd: Command) -> list[Setting]:
    """The plan's settings that vLLM derives where the command leaves them out (`max_model_len`
    from the model's config.json, `max_num_seqs` from the GPU): never added to an operator's
    command (that would change the deployment: a 128k model served at the spec's 4k); the engine
    compares vLLM's own value with the plan's and refuses a difference before any weight loads."""
    want = line_values(plan)
    return [
        s
        for s in SETTINGS
        if s.derived_from and s.name in want and s.name not in cmd.values and s.name not in cmd.from_model
    ]  # (`auto` or -1 on the line: the operator left it to vLLM already)


def complete(plan: Plan, cmd: Command, fill_model: bool = False) -> tuple[list[str], list[str]]:
    """(the command with what the plan determines and it leaves out, what was added). What vLLM
    derives (from the model, from the GPU) is added only with `fill_model` (`flags`: a line built
    from the plan alone, where there is no operator's value to keep)."""
    want = line_values(plan)
    argv = list(cmd.argv)
    added: list[str] = []
    to_model = set() if fill_model else {s.name for s in left_to_vllm(plan, cmd)}
    needed = [
        s
        for s in SETTINGS
        if s.name in want and s.name not in cmd.values and s.name not in cmd.from_model and s.name not in to_model
    ]
    for s in needed:
        if s.flag is not None and s.kind in ("int", "choice"):
            added += [s.flag, str(want[s.name])]
    for s in needed:
        if s.flag is not None and s.kind == "bool" and (want[s.name] or s.negatable):
            added.append(s.flag if want[s.name] else "--no-" + s.flag[2:])
    missing: dict[str, Any] = {
        s.compilation: want[s.name]
        for s in needed
        if s.compilation is not None and not _by_flag(s) and not any(u in cmd.values for u in s.unless)
    }  # (`unless`: vLLM derives the sizes from the ceiling given)
    merged: list[str] = []  # keys put into the command's own --compilation-config JSON
    given = cmd.resolved.json_keys.get("compilation_config", []) if cmd.resolved is not None else []
    from_file = "compilation" in cmd.in_file or (
        cmd.resolved is not None and "compilation_config" in cmd.resolved.from_config
    )
    here = "compilation" in cmd.json_at or "compilation" in cmd.dotted  # capplan's reader found it on the line
    if missing and (from_file or (given and not here)):
        # vLLM keeps the last compilation config it is given: one more would replace the operator's, so
        # capplan merges only into the last JSON object (or the dotted keys) it finds on the line
        raise CapplanError(
            f"the plan needs {', '.join(f'{k} {short(v)}' for k, v in missing.items())} in the compilation config, "
            "which the command gives "
            + ("in its --config file" if from_file else "in a spelling capplan does not merge into"),
            "add them where the command sets its compilation config (capplan never replaces it)",
        )
    if missing and "compilation" in cmd.json_at:
        at = cmd.json_at["compilation"]
        head, eq, text = argv[at].partition("=") if argv[at].startswith("-") else ("", "", argv[at])
        joined = json.dumps({**json.loads(text), **missing}, separators=(",", ":"))
        argv[at] = f"{head}={joined}" if eq else joined
        merged = [f"{k} (in {head or argv[at - 1]})" for k in missing]
    elif missing and "compilation" in cmd.dotted:
        flag = cmd.dotted["compilation"]  # the flag whose dotted keys vLLM keeps
        added += [f"{flag}.{k}={json.dumps(v, separators=(',', ':'))}" for k, v in missing.items()]
    elif missing:
        added += [COMPILATION_FLAGS[0], json.dumps(missing, separators=(",", ":"))]
    return argv + added, added + merged


def flags_for(plan: Plan) -> list[str]:
    """The vLLM engine arguments that match a plan, in `vllm serve` form."""
    return complete(plan, Command(["vllm", "serve", "MODEL"], 3), fill_model=True)[0][3:]


def render(plan: Plan, form: str, plan_path: str = "PLAN") -> str:
    """`capplan flags`: the arguments as `vllm serve`, `python -m ...api_server` or JSON (one
    entry per argument, for manifests). The two command forms are whole shell lines: the
    spec's model (MODEL when it names none) and CAPPLAN_PLAN, which puts the plan in force."""
    args = flags_for(plan)
    note = ""
    k = plan.spec.speculative.num_speculative_tokens
    if k:
        note = f'# and --speculative-config with your draft method and "num_speculative_tokens": {k}\n'
    if form == "json":
        return json.dumps(args, indent=2)
    if form == "yaml":
        return config_yaml(args, plan_path, note)
    model = plan.spec.model.name if plan.spec.model is not None and plan.spec.model.name else "MODEL"
    env = [f"{PLAN_ENV}={plan_path}"]
    if form == "python":
        return note + shlex.join([*env, "python", "-m", "vllm.entrypoints.openai.api_server", "--model", model, *args])
    return note + shlex.join([*env, "vllm", "serve", model, *args])


def config_yaml(args: list[str], plan_path: str, note: str = "") -> str:
    """`flags` arguments as the keys of a `vllm serve --config` YAML file, in the form vLLM's
    config-file loader turns back into them (0.25 to 0.33 alike): a flag's value under its
    dashed name, a true switch as `true`, the compilation config as a mapping (the loader
    passes it on as its JSON). A false switch is left out: 0.25's loader drops it and later
    ones read it as `--no-KEY`, so only vLLM's default (off) reads the same in every release."""
    import yaml

    from capplan.launcher.cmdline import OFF, SCALARS, SWITCHES

    data: dict[str, Any] = {}
    left_out: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i]
        if flag in SCALARS:
            data[flag[2:]] = int(args[i + 1])
            i += 2
        elif flag in COMPILATION_FLAGS:
            data[COMPILATION_FLAGS[0][2:]] = json.loads(args[i + 1])
            i += 2
        elif flag in SWITCHES:
            data[flag[2:]] = True
            i += 1
        elif flag in OFF:
            left_out.append(OFF[flag][2:])
            i += 1
        else:
            raise AssertionError(f"flags_for gave {flag!r}, which no config-file key spells")
    name = printable(plan_path)
    head = (
        f"# vLLM settings of {name}, as `vllm serve --config` file keys: merge them into your config file,\n"
        f"# and start vLLM with CAPPLAN_PLAN={name} in its environment (that puts the plan in force).\n"
    )
    if left_out:
        off = ", ".join(left_out)
        head += f"# Off, vLLM's default, so left out (a false switch reads differently across releases): {off}\n"
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)
    return head + note + str(body).rstrip("\n")


def prepare(
    plan: Plan,
    plan_path: str,
    argv: list[str],
    python: str | None = None,
    resolution: dict[str, Any] | None = None,
) -> tuple[list[str], list[str]]:
    """`capplan apply`'s launch: (the command to run, the lines to tell the user). CapplanError,
    before anything starts, when a value the command gives (on its line or in its --config
    file) contradicts the plan. The command is read by vLLM's own parser, run with `python`
    (default: the command's interpreter), where vLLM is importable; by capplan's reader else."""
    if server_start(argv) is None:
        return argv, [
            "capplan: not a `vllm serve` or `python -m vllm.entrypoints.openai.api_server` command: its flags "
            "are not read here (each engine still checks the plan before it captures)"
        ]
    python = python or target_python(argv) or sys.executable
    if resolution is None:
        results = read_with_vllm(python, [argv], dict(os.environ))
        resolution = None if results is None else results[0]
    resolved = None if resolution is None else resolution_of(resolution)
    reader: list[str] = []
    own = None if resolved is not None else read_command(argv, runs_on(plan.spec.target.vllm))
    cmd = read_resolved(argv, resolved) if resolved is not None else own
    assert cmd is not None  # a server command (server_start above)
    if own is not None:
        reader = [
            f"capplan: vLLM's argument parser could not be run with {printable(python)} (vLLM is not importable "
            "there): the flags were read by capplan's own reader, which refuses what it does not read"
        ]
    problems = contradictions(plan, cmd)
    if problems:
        raise CapplanError(
            f"the command contradicts {printable(plan_path)}: {'; '.join(problems)}",
            "change the flag, or the spec and recompile; `capplan flags PLAN` prints the matching arguments",
        )
    full, added = complete(plan, cmd)
    lines = [*reader, f"capplan: added from the plan: {shlex.join(added)}"] if added else list(reader)
    for s in left_to_vllm(plan, cmd):
        value = line_values(plan)[s.name]
        lines.append(
            f"capplan: {s.flag} left to vLLM, which derives it from {s.derived_from} (the plan has "
            f"{short(value)}); the engine refuses to start before loading weights if vLLM's differs "
            f"(give {s.flag} {short(value)} to serve the plan's)"
        )
    if cmd.unread or cmd.ignored:
        lines.append(f"capplan: not read here, checked by the engine: {shlex.join([*cmd.unread, *cmd.ignored])}")
    return full, lines
