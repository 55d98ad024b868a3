"""A vLLM deployment's own settings (its `--config` YAML file and/or its serve line), read as
vLLM reads them, as the spec fields they set.

The one reading for `capplan init` (which writes them into a standalone spec) and for a spec's
`deployment` section (which `capplan compile` reads them from). vLLM's own parser where vLLM is
importable, capplan's own reader otherwise, which refuses what it does not read.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from capplan.errors import CapplanError, UsageError, printable
from capplan.launcher.cmdline import Command

VLLM_PARSER = "read by vLLM's own argument parser"
OWN_READER = "read by capplan's own reader (vLLM is not importable here)"


@dataclass
class DeploymentSettings:
    """What a deployment's vLLM config sets, as spec fields."""

    argv: list[str]
    start: int
    label: str  # how messages name the deployment: "vllm.yaml and the serve line"
    config: Path | None
    cmd: Command
    reader: str
    data: dict[str, dict[str, Any]] = field(default_factory=dict)  # spec section -> field -> value
    carried: list[str] = field(default_factory=list)  # "FLAG VALUE -> section.field", one per field
    script: Path | None = None  # the file the serve line was read from, where one was

    def fields(self) -> dict[str, Any]:
        """Every spec field the deployment sets ("lora.max_loras" -> 4)."""
        return {f"{s}.{k}": v for s, values in self.data.items() for k, v in values.items()}

    def said(self, name: str) -> str:
        """How the deployment sets one field: its flag as written, else the field's name."""
        return self.cmd.flags.get(name, name)


def server_argv(
    config: Path | None, command: list[str], command_label: str = "the serve line"
) -> tuple[list[str], str]:
    """The vLLM server command to read (the serve line, with `--config FILE` added where a config
    file is given), and how messages name the deployment."""
    from capplan.launcher.cmdline import server_start

    argv = list(command)
    if not argv and config is None:
        raise UsageError(
            "give the deployment: --config vllm.yaml, or its serve line after --",
            "e.g. capplan init --config vllm.yaml -o deploy.yaml",
        )
    if argv and server_start(argv) is None:
        raise UsageError(
            f"{printable(' '.join(argv))[:60]}: not a `vllm serve` or `python -m vllm.entrypoints.openai.api_server` "
            "command",
            "give the line that starts vLLM",
        )
    if config is not None:
        if any(a == "--config" or a.startswith("--config=") for a in argv):
            raise UsageError(f"{command_label} gives --config too", "give the config file once")
        argv = (argv or ["vllm", "serve"]) + ["--config", str(config)]
    label = " and ".join(
        ([printable(str(config))] if config is not None else []) + ([command_label] if command else [])
    )
    return argv, label


def config_of(argv: list[str]) -> Path | None:
    """The `--config FILE` of a server command (vLLM reads no other spelling of it)."""
    at = next((i for i, a in enumerate(argv) if a == "--config"), None)
    return Path(argv[at + 1]) if at is not None and at + 1 < len(argv) else None


def served_model(argv: list[str], start: int, config: Path | None) -> str | None:
    """The model the command serves: `serve MODEL`, else the last `--model` on the line, else the file's."""
    from capplan.launcher.cmdline import config_args

    serve = Path(argv[0]).name == "vllm" or "vllm.entrypoints.cli.main" in argv
    if serve and argv[start - 1] != "serve" and not argv[start - 1].startswith("-"):
        return argv[start - 1]
    line = [a for i, a in enumerate(argv) if i >= start and not (a == "--config" or argv[i - 1] == "--config")]
    for words in (line, config_args(str(config)) if config is not None else []):
        found = None
        for i, a in enumerate(words):
            if a == "--model" and i + 1 < len(words):
                found = words[i + 1]
            elif a.startswith("--model="):
                found = a.split("=", 1)[1]
        if found is not None:
            return found
    return None


def is_spec_field(name: str) -> bool:
    """Whether a setting's name (`lora.max_loras`) is a field of the spec."""
    from capplan.schemas.spec import Spec

    model: type[BaseModel] | None = Spec
    for part in name.split("."):
        if model is None or part not in model.model_fields:
            return False
        annotation = model.model_fields[part].annotation
        args = [a for a in getattr(annotation, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)]
        model = (
            annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else next(iter(args), None)
        )
    return True


def read_settings(
    argv: list[str],
    label: str,
    python: str,
    env: dict[str, str],
    refused_hint: str = "spell it out, or run capplan where vLLM is installed",
    releases: Sequence[str] | None = None,
) -> DeploymentSettings:
    """The spec fields a server command (`server_argv`) sets: by vLLM's parser run with `python`
    where vLLM is importable there, else by capplan's own reader for `releases` (default: every
    supported one), which refuses what it does not read, with `refused_hint`."""
    from capplan.launcher.cmdline import CHECK_WITH_VLLM, read_command, read_resolved, read_with_vllm, server_start
    from capplan.launcher.vllm_cli import resolution_of
    from capplan.settings import BY_NAME, DTYPE_NAMES

    start = server_start(argv)
    assert start is not None
    results = read_with_vllm(python, [argv], env)
    if results is not None:
        cmd = read_resolved(argv, resolution_of(results[0]))
        reader = VLLM_PARSER
    else:
        try:
            own = read_command(argv, releases)
        except CapplanError as exc:
            if exc.hint != CHECK_WITH_VLLM:
                raise
            raise CapplanError(exc.message, refused_hint) from None
        assert own is not None
        cmd = own
        reader = OWN_READER
    config = config_of(argv)
    found = DeploymentSettings(argv, start, label, config, cmd, reader)
    for name, value in cmd.values.items():
        if name not in BY_NAME or not is_spec_field(name):
            continue
        if name == "model.dtype":  # vLLM's synonyms as one name; `auto` is the model's own (not carried)
            if value == "auto":
                continue
            value = DTYPE_NAMES.get(str(value), value)
        section, _, key = name.partition(".")
        found.data.setdefault(section, {})[key] = value
        found.carried.append(f"{cmd.flags.get(name, name)} -> {name}")
    if "lora" in found.data and "enabled" not in found.data["lora"]:
        found.data["lora"]["enabled"] = False  # vLLM serves no adapter without --enable-lora
        cmd.flags.setdefault("lora.enabled", "no --enable-lora (vLLM serves no adapter without it)")
    model = served_model(argv, start, config)
    if model is not None:
        found.data.setdefault("model", {})["name"] = model
        found.carried.insert(0, f"model {printable(model)} -> model.name")
    return found


def serve_line_of(text: str, where: str, fail: Callable[[str, str | None], Exception]) -> list[str]:
    """The one line of a shell script (`text`, named `where`) that starts vLLM, as a shell splits
    it: backslash continuations joined, comments dropped, an `exec` and leading `NAME=value`
    assignments skipped. `fail(message, hint)` makes the error for a script with none, or two."""
    from capplan.launcher.cmdline import server_start

    found: list[list[str]] = []
    for logical in text.replace("\\\r\n", "").replace("\\\n", "").splitlines():  # as the shell joins them
        try:
            lexer = shlex.shlex(logical, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            tokens = list(lexer)
        except ValueError as exc:
            if "vllm" in logical:
                raise fail(f"{where}: a line naming vllm does not split as a shell line ({exc})", None) from None
            continue
        commands: list[list[str]] = [[]]  # the line's commands, apart at ;, &&, ||, | and &
        for token in tokens:
            if token and set(token) <= set(";&|"):
                commands.append([])
            else:
                commands[-1].append(token)
        for words in map(without_prefixes, commands):
            if words and server_start(words) is not None:
                found.append(words)
    if not found:
        raise fail(
            f"{where}: no line starts vLLM (`vllm serve ...` or `python -m vllm.entrypoints.openai.api_server ...`)",
            "name the script that starts vLLM, or give deployment.command",
        )
    if len(found) > 1:
        raise fail(
            f"{where}: {len(found)} lines start vLLM; capplan reads one",
            "give the line itself as deployment.command",
        )
    unexpanded(found[0], where, fail)
    return found[0]


def without_prefixes(words: list[str]) -> list[str]:
    """A shell line without what comes before the command it runs: `exec` and `NAME=value`."""
    while words and (words[0] == "exec" or ("=" in words[0] and words[0].split("=", 1)[0].isidentifier())):
        words = words[1:]
    return words


def unexpanded(words: list[str], where: str, fail: Callable[[str, str | None], Exception]) -> None:
    """Refuse a line whose words the shell would still expand at launch (`$ARGS`, `${MODEL}`,
    `$(...)`, backquotes): what they stand for is not in the file, so it cannot be read."""
    for word in words:
        if "$" in word or "`" in word:
            raise fail(
                f"{where}: {printable(word)[:60]}: the shell expands it when the server starts, so its value is not "
                "in the file",
                "write the value out in the line, or give the deployment's vllm.yaml as deployment.config",
            )
