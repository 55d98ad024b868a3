"""The server command checked and completed against the plan in the server process itself.

`capplan apply` used to read a `vllm serve` line with vLLM's parser in a subprocess before the
launch: one more import of vLLM, about 20 s before vLLM's first log line at production size.
Now the launcher passes the command (CAPPLAN_COMMAND) and the plugin, which vLLM loads while it
builds its server parser (`AsyncEngineArgs.add_cli_args`, in every release), wraps that parser's
`parse_args`: when the server parses its own arguments, they are the command's, and the plugin
reads the command with vLLM's parser in this process (vLLM is imported already) and `prepare`,
as `apply --dry-run` does. A flag that contradicts the plan stops the server with one line,
before any engine process or weight; otherwise vLLM's parser parses the completed line itself,
so that everything vLLM derives from the arguments (the API servers, data parallelism, the engine
arguments) follows what the plan adds, exactly as if the operator had typed it; the line that
says what was added goes to the log.
"""

from __future__ import annotations

import json
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


def its_arguments(command: list[str], args: list[str]) -> bool:
    """Whether `args`, what a parser of this process is about to parse, are `command`'s: this
    process is the server the command starts, parsing its own line."""
    from capplan.launcher.cmdline import parser_args, server_start

    return server_start(command) is not None and list(args) == parser_args(command)


def completed(plan: Plan, plan_path: str, command: list[str]) -> tuple[list[str], list[str]]:
    """(the arguments vLLM's server parser should parse: the command's, completed from the plan;
    the lines to log). CapplanError when a flag contradicts the plan."""
    from capplan.launcher.cmdline import parser_args, read_here
    from capplan.launcher.engine_args import prepare

    try:
        resolution = read_here(command)
    except Exception as exc:  # noqa: BLE001 - vLLM's parser failed on the line: said, not a traceback
        raise ParserFailed(f"{type(exc).__name__}: {exc}") from None
    if resolution is None:
        return parser_args(command), [
            "capplan: vLLM's parser could not be built in the server process: the engine's config check decides"
        ]
    full, said = prepare(plan, plan_path, command, resolution=resolution)
    return parser_args(full), said


class ParserFailed(Exception):
    """vLLM's own parser failed on the server's command (not a refusal of it)."""


class Reading:
    """The one reading of the server's own command in this process: the command CAPPLAN_COMMAND
    carries (None without one), read once; reentrant parser calls, those of the reading itself
    among them, pass through."""

    def __init__(self) -> None:
        import os

        from capplan.envvars import COMMAND

        self.command = command_of(os.environ.get(COMMAND, ""))
        self.busy = False
        self.done = False

    def arguments(self, plan: Plan, plan_path: str, args: list[str]) -> tuple[list[str], Any]:
        """(the arguments to parse, the lines to log or None when this call is not the server's own)."""
        command = self.command
        if command is None or self.busy or self.done or not its_arguments(command, args):
            return args, None
        self.busy = True
        try:
            full, said = completed(plan, plan_path, command)
        finally:
            self.busy = False
        self.done = True
        return full, said

    def unread(self, argv: list[str]) -> bool:
        """Whether this process is the server of the command and its parser ran without the reading
        (the plugin was loaded after it)."""
        return self.command is not None and not self.done and its_arguments(self.command, argv)
