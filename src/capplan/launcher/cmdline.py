"""The vLLM command line a plan was compiled for, read: which of the plan's settings it gives,
how, and where `complete` can add to its compilation config.

Reads the flags of `vllm serve MODEL ...` and `python -m vllm.entrypoints.openai.api_server
...` the way vLLM's argument parser does (`--flag value`, `--flag=value`, `--no-flag`,
JSON for `--compilation-config`/`-cc` and `--speculative-config`/`-sc`, dotted keys such
as `-cc.cudagraph_mode=FULL`, the human-readable integers 1k/1K of the token limits), or
takes vLLM's own parser's reading (capplan.launcher.vllm_cli) where vLLM is importable.
Which flag and key sets which setting is capplan.settings' table. Nothing here imports
vLLM: what only vLLM resolves (a model's own defaults) is left to the in-engine check.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capplan.errors import CapplanError, printable
from capplan.files import json_depth
from capplan.launcher.vllm_cli import Resolved, resolve_lines
from capplan.limits import MAX_DEPTH, MAX_INT_DIGITS
from capplan.settings import COMPILATION_FLAGS, SETTINGS, SPECULATIVE_FLAGS, Kind, Setting

SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main")

# The table's command-line spellings, by kind: flag -> its setting.
SCALARS = {s.flag: s for s in SETTINGS if s.flag is not None and s.kind == "int"}
SWITCHES = {s.flag: s for s in SETTINGS if s.flag is not None and s.kind == "bool"}
LISTS = {s.flag: s for s in SETTINGS if s.flag is not None and s.kind == "int_list"}
SHORT = {alias: s.flag for s in SETTINGS if s.flag is not None for alias in s.aliases}
COMPILATION = {s.compilation: s for s in SETTINGS if s.compilation is not None}  # compilation-config key -> setting
SPECULATIVE = next(s for s in SETTINGS if s.speculative is not None)
JSON_ARGS = {**dict.fromkeys(COMPILATION_FLAGS, "compilation"), **dict.fromkeys(SPECULATIVE_FLAGS, "speculative")}


def _resolved_order(item: tuple[int, Setting]) -> tuple[int, bool, int]:
    # flags, switches, lists; within each, a flag that is also a compilation-config key (the
    # capture ceiling) after the rest: the order contradictions are named in
    at, s = item
    return ("int", "bool", "int_list").index(s.kind), s.compilation is not None, at


# EngineArgs field -> the setting its flag sets (vLLM names each field after its flag).
RESOLVED: dict[str, Setting] = {
    s.dest: s for _, s in sorted(((at, s) for at, s in enumerate(SETTINGS) if s.flag), key=_resolved_order) if s.dest
}


def human_int(text: str) -> int:
    """vLLM's human-readable integers: 4096, 1k (1000), 1K (1024), 25.6k."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)", text.strip())
    if not match or len(match.group(1)) > MAX_INT_DIGITS:
        raise ValueError(text)
    number, suffix = match.groups()
    if not suffix:
        return int(number)
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}.get(suffix) or 2 ** (10 * "KMGT".index(suffix) + 10)
    return int(float(number) * scale)


def short(value: object) -> str:
    """A value as the launcher's messages show it (JSON for lists and booleans, at most 50 characters)."""
    text = json.dumps(value) if isinstance(value, list | bool) else str(value)
    return text if len(text) <= 50 else text[:47] + "..."


@dataclass
class Command:
    """A vLLM server command line as capplan reads it."""

    argv: list[str]
    start: int  # index of the first engine argument (after `serve MODEL` or `-m MODULE`)
    values: dict[str, object] = field(default_factory=dict)  # plan setting -> the command's value
    flags: dict[str, str] = field(default_factory=dict)  # plan setting -> how the command set it
    json_at: dict[str, int] = field(default_factory=dict)  # "compilation"/"speculative" -> index of its JSON
    dotted: set[str] = field(default_factory=set)  # JSON args given as dotted keys
    unread: list[str] = field(default_factory=list)  # what capplan did not read (e.g. --config FILE)
    resolved: Resolved | None = None  # vLLM's own reading of the command, when vLLM was importable


def server_start(argv: list[str]) -> int | None:
    """Where the engine arguments begin in a vLLM server command, or None when `argv` is not one."""
    if not argv:
        return None
    name = Path(argv[0]).name
    if name == "vllm" and len(argv) > 1 and argv[1] == "serve":
        return 3 if len(argv) > 2 and not argv[2].startswith("-") else 2
    if name.startswith("python") and "-m" in argv:
        at = argv.index("-m")
        if at + 1 < len(argv) and argv[at + 1] in SERVER_MODULES:
            rest = at + 2
            if argv[at + 1] == "vllm.entrypoints.cli.main":
                if rest >= len(argv) or argv[rest] != "serve":
                    return None
                rest += 1
                return rest + 1 if rest < len(argv) and not argv[rest].startswith("-") else rest
            return rest
    return None


def parser_args(argv: list[str]) -> list[str]:
    """The arguments vLLM's server parser reads from a server command (`vllm serve`'s model first)."""
    name = Path(argv[0]).name
    if name == "vllm":
        return argv[2:]
    at = argv.index("-m")
    rest = argv[at + 2 :]
    return rest[1:] if argv[at + 1] == "vllm.entrypoints.cli.main" else rest


def read_command(argv: list[str]) -> Command | None:
    """The plan settings a vLLM server command sets, or None when `argv` is not a vLLM server command.
    CapplanError names a flag whose value vLLM itself would refuse."""
    start = server_start(argv)
    if start is None:
        return None
    cmd = Command(list(argv), start)
    i = start
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        name = SHORT.get(name, name)

        def value(name: str = name, eq: str = eq, inline: str = inline, i: int = i) -> str:
            if eq:
                return inline
            if i + 1 >= len(argv):
                raise CapplanError(f"{printable(name)} needs a value")
            return argv[i + 1]

        step = 1 if eq else 2
        if name in SCALARS:
            setting = SCALARS[name]
            raw = value()
            if setting.from_model and raw in ("auto", "-1"):
                cmd.unread.append(f"{name} {raw}")
            else:
                number = _integer(name, raw, setting.human)
                cmd.values[setting.name] = number
                written = token.partition("=")[0]  # as the user wrote it (-tp, not --tensor-parallel-size)
                shown = f"{written} {raw}" + (f" (vLLM reads {number})" if raw.strip() != str(number) else "")
                cmd.flags[setting.name] = shown
            i += step
        elif name in SWITCHES or (name.startswith("--no-") and "--" + name[5:] in SWITCHES):
            on = not name.startswith("--no-")
            setting = SWITCHES[name if on else "--" + name[5:]]
            cmd.values[setting.name] = on
            cmd.flags[setting.name] = name
            i += 1
        elif name in LISTS:
            setting = LISTS[name]
            j = i + 1
            items = [inline] if eq else []
            while not eq and j < len(argv) and re.fullmatch(r"\d+", argv[j]):
                items.append(argv[j])
                j += 1
            if not items:
                raise CapplanError(f"{name} needs one or more token counts")
            numbers: list[Any] = [_integer(name, s, False) for s in items]
            cmd.values[setting.name] = setting.canon(numbers) if setting.canon is not None else numbers
            cmd.flags[setting.name] = f"{name} {' '.join(items)}"
            i = j if not eq else i + 1
        elif name in JSON_ARGS:
            which = JSON_ARGS[name]
            raw = value()
            try:
                data = _json(name, raw)
            except ValueError:
                raise CapplanError(f"{name}: not JSON ({printable(raw[:60])})", "give a JSON object") from None
            if not isinstance(data, dict):
                raise CapplanError(f"{name}: not a JSON object", "give a JSON object")
            cmd.json_at[which] = i + (0 if eq else 1)
            _read_json(cmd, which, data, name)
            i += step
        elif "." in name and name.split(".", 1)[0] in JSON_ARGS:
            head, _, key = name.partition(".")
            which = JSON_ARGS[head]
            if key.count(".") >= MAX_DEPTH:
                raise CapplanError(f"{printable(name)[:60]}...: dotted key deeper than {MAX_DEPTH} levels")
            raw = value()
            try:
                parsed: object = _json(name, raw)
            except ValueError:
                parsed = raw
            cmd.dotted.add(which)
            _read_json(cmd, which, {key: parsed}, head, dotted=True)
            i += step
        elif name == "--config":
            cmd.unread.append(f"--config {value()}")
            i += step
        elif token.startswith("-") and not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            i += 2  # another flag with its value (--port 8000)
        else:
            i += 1
    return cmd


def read_with_vllm(python: str, argvs: list[list[str]], env: dict[str, str]) -> list[dict[str, Any]] | None:
    """vLLM's own reading of server commands (one run of `python`, vLLM imported once); None
    when vLLM is not importable there. Each result goes to `prepare(..., resolution=)`."""
    keys = (*COMPILATION, "mode")
    fields = (*RESOLVED, "optimization_level", "spec_tokens", "spec_method")
    return resolve_lines(python, [parser_args(a) for a in argvs], env, fields, keys)


def read_resolved(argv: list[str], resolved: Resolved) -> Command:
    """The plan settings the operator gave, as vLLM's own parser resolved the command (a
    `--config` file included): only what the operator gave counts, each named by its flag and,
    for a value from the file, the file."""
    start = server_start(argv)
    assert start is not None
    cmd = Command(list(argv), start)
    try:  # where the command's own JSON sits, for complete() to merge into it
        syntax = read_command(argv)
    except CapplanError:
        syntax = None
    if syntax is not None:
        cmd.json_at, cmd.dotted = syntax.json_at, syntax.dotted
    config = next((a.split("=", 1)[1] if "=" in a else argv[i + 1] for i, a in enumerate(argv)
                   if (a == "--config" and i + 1 < len(argv)) or a.startswith("--config=")), None)  # fmt: skip

    def where(dest: str) -> str:
        return f" (in --config {printable(config or '?')})" if dest in resolved.from_config else ""

    for dest, setting in RESOLVED.items():
        if dest not in resolved.given:
            continue
        value = resolved.values.get(dest)
        if setting.from_model and (not isinstance(value, int) or value < 0):
            cmd.unread.append(f"{setting.flag} {value}")  # vLLM takes it from the model
            continue
        if setting.canon is not None and isinstance(value, list):
            value = setting.canon(value)
        cmd.values[setting.name] = value
        cmd.flags[setting.name] = f"{setting.flag} {short(value)}{where(dest)}"
    cc_where = where("compilation_config")
    given = resolved.compilation_given()
    for key, setting in COMPILATION.items():
        value = resolved.compilation.get(key) if key in given else None
        if value is None:
            continue
        if setting.canon is not None and isinstance(value, list):
            value = setting.canon(value)
        cmd.values[setting.name] = value
        cmd.flags[setting.name] = f"{COMPILATION_FLAGS[0]} {key} {short(value)}{cc_where}"
    level = resolved.values.get("optimization_level")
    if "optimization_level" in resolved.given and resolved.level_mode and "cudagraph.mode" not in cmd.values:
        # an -O level sets the cudagraph mode where none is given: the operator's choice, as vLLM reads it
        cmd.values["cudagraph.mode"] = resolved.level_mode
        cmd.flags["cudagraph.mode"] = (
            f"-O{str(level).lstrip('O')} (vLLM's optimization level: cudagraph mode {resolved.level_mode})"
            + where("optimization_level")
        )
    spec, spec_key = SPECULATIVE.name, str(SPECULATIVE.speculative)
    if "spec_tokens" in resolved.given or "spec_method" in resolved.given:
        cmd.values["speculative.present"] = True
        k = resolved.values.get("spec_tokens")
        if k is not None:
            cmd.values[spec] = k
            cmd.flags[spec] = f"--spec-tokens {k}{where('spec_tokens')}"
    if "speculative_config" in resolved.given and resolved.speculative is not None:
        cmd.values["speculative.present"] = True
        k = resolved.speculative.get(spec_key)
        if k is not None:
            cmd.values[spec] = k
            cmd.flags[spec] = f"{SPECULATIVE_FLAGS[0]} {spec_key} {k}{where('speculative_config')}"
    if any(a.startswith("--config=") for a in argv):
        cmd.unread.append("--config=FILE (vLLM reads a config file only as `--config FILE`: it ignores this one)")
    cmd.resolved = resolved
    return cmd


def _integer(flag: str, raw: str, human: bool) -> int:
    try:
        if len(raw.strip()) > MAX_INT_DIGITS + 1:
            raise ValueError(raw)
        return human_int(raw) if human else int(raw)
    except ValueError:
        raise CapplanError(
            f"{flag} {printable(raw)[:40]}: not an integer of at most {MAX_INT_DIGITS} digits",
            "give a count, e.g. 4096" + (" or 4k" if human else ""),
        ) from None


def _json(flag: str, raw: str) -> object:
    """A JSON value of the command line, bounded as capplan's readers bound JSON (nesting,
    integer digits); ValueError when it is not JSON. Duplicate keys keep the last, as vLLM's
    json.loads does."""
    if raw.count("[") + raw.count("{") > MAX_DEPTH and json_depth(raw) > MAX_DEPTH:
        raise CapplanError(f"{flag}: JSON nested deeper than {MAX_DEPTH} levels", "give a flat JSON object")
    try:
        return _BOUNDED_JSON.decode(raw)
    except RecursionError:
        raise CapplanError(f"{flag}: JSON nested too deeply", "give a flat JSON object") from None
    except CapplanError as exc:
        raise CapplanError(f"{printable(flag)[:60]}: {exc.message}", exc.hint) from None


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise CapplanError(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})", "give a count")
    return int(text)


_BOUNDED_JSON = json.JSONDecoder(parse_int=_bounded_int)

_KIND_WORDS: dict[Kind, str] = {
    "mode": "a cudagraph mode name or number",
    "int_list": "a list of integers",
    "int": "an integer",
    "bool": "true or false",
}


def _typed(where: str, kind: Kind, got: object) -> object:
    """`got`, when it has the type vLLM gives the key (null: vLLM's default); else CapplanError:
    a wrong type is refused by vLLM too, so it is refused here, naming the key, before anything starts."""
    if got is None:
        return None

    def is_int(v: object) -> bool:
        return type(v) is int

    ok = {
        "mode": isinstance(got, str) or is_int(got),
        "int_list": isinstance(got, list) and all(is_int(v) for v in got),
        "int": is_int(got),
        "bool": isinstance(got, bool),
    }[kind]
    if not ok:
        raise CapplanError(
            f"{where}: must be {_KIND_WORDS[kind]} (got {printable(json.dumps(got))[:40]})",
            "vLLM refuses this value too; fix it in the command",
        )
    return got


def _read_json(cmd: Command, which: str, data: dict[str, Any], flag: str, dotted: bool = False) -> None:
    def shown(key: str) -> str:
        return f"{flag}.{key}" if dotted else f"{flag} {key}"

    if which == "speculative":
        key = SPECULATIVE.speculative
        if key is not None and key in data:
            got = _typed(shown(key), SPECULATIVE.kind, data[key])
            cmd.values[SPECULATIVE.name] = got
            cmd.flags[SPECULATIVE.name] = shown(key)
        cmd.values.setdefault("speculative.present", True)
        return
    for key, setting in COMPILATION.items():
        if key in data:
            got = _typed(shown(key), setting.kind, data[key])
            if setting.canon is not None and isinstance(got, list):
                got = setting.canon(got)
            cmd.values[setting.name] = got
            cmd.flags[setting.name] = f"{shown(key)} {short(got)}"
