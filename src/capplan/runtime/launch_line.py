"""The server command checked and completed against the plan in the server process itself.

`capplan apply` used to read a `vllm serve` line with vLLM's parser in a subprocess before the
launch: one more import of vLLM, about 20 s before vLLM's first log line at production size.
Now the launcher passes the command (CAPPLAN_COMMAND) and the plugin reads it where vLLM has
already parsed it, in the process that builds the engine's config
(`EngineArgs.create_engine_config`, before any engine process is spawned or weight loaded): the
same parser, the same `prepare` as `apply --dry-run`. A flag that contradicts the plan stops the
server with one line; what the plan determines and the command leaves out is set on the engine
arguments exactly as if the operator had typed it (vLLM's parser reads the completed line), and
the line that says so goes to the log.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from capplan.schemas.plan import Plan


def command_of(text: str) -> list[str] | None:
    """The command CAPPLAN_COMMAND carries (a JSON list of strings), or None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, list) and value and all(isinstance(a, str) for a in value):
        return value
    return None


def this_process_runs(command: list[str], argv: list[str] | None = None) -> bool:
    """Whether this process is the server `command` starts: its arguments are the command's."""
    from capplan.launcher.cmdline import parser_args, server_start

    if server_start(command) is None:
        return False
    return (sys.argv if argv is None else argv)[1:] == parser_args(command)


def complete_engine_args(plan: Plan, plan_path: str, engine_args: Any, command: list[str]) -> list[str]:
    """Check `command` against the plan with vLLM's parser, here, and set on `engine_args` what
    the plan adds to it; the lines to log. CapplanError when a flag contradicts the plan."""
    from capplan.launcher.cmdline import parser_args, read_here
    from capplan.launcher.engine_args import prepare
    from capplan.launcher.vllm_cli import engine_args_here

    resolution = read_here(command)
    if resolution is None:
        return ["capplan: vLLM's parser could not be built in the server process: the engine's config check decides"]
    full, said = prepare(plan, plan_path, command, resolution=resolution)
    if full != command:
        before, after = engine_args_here(parser_args(command)), engine_args_here(parser_args(full))
        for f in dataclasses.fields(after):
            value = getattr(after, f.name)
            if value != getattr(before, f.name):
                setattr(engine_args, f.name, value)
    return said
