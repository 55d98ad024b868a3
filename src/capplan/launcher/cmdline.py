"""The vLLM command line a plan was compiled for, read: which of the plan's settings it gives,
how, and where `complete` can add to its compilation config.

Where vLLM is importable, vLLM's own parser reads the line (capplan.launcher.vllm_cli) and
`read_resolved` takes its reading. Elsewhere (a dry run on a laptop) capplan's own reader reads
`vllm serve MODEL ...` and `python -m vllm.entrypoints.openai.api_server ...` in the exact
forms vLLM's parser reads (`--flag value`, `--flag=value`, `_` for `-` in a flag's name, the
switches' off forms, JSON and dotted keys for `-cc`/`-sc` of which vLLM keeps the last, a
`--config FILE` whose values come before the line's, the human-readable integers 1k/1K), and
refuses what it does not read (optimization levels, abbreviated flags), so that nothing is
ever added after a part it did not read. Which flag and key sets which setting is
capplan.settings' table. Nothing here imports vLLM: what only vLLM resolves (a model's own
defaults) is left to the in-engine check.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from capplan.errors import CapplanError, printable
from capplan.files import json_depth
from capplan.launcher.vllm_cli import Resolved, resolve_lines
from capplan.launcher.vllm_options import compilation_keys, tables
from capplan.limits import MAX_DEPTH, MAX_INT_DIGITS
from capplan.settings import COMPILATION_FLAGS, SETTINGS, SPECULATIVE_FLAGS, Kind, Setting

SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main")

# The table's command-line spellings, by kind: flag -> its setting.
SCALARS = {s.flag: s for s in SETTINGS if s.flag is not None and s.kind == "int"}
SWITCHES = {s.flag: s for s in SETTINGS if s.flag is not None and s.kind == "bool"}
LISTS = {s.flag: s for s in SETTINGS if s.flag is not None and s.kind == "int_list"}
CHOICES = {s.flag: s for s in SETTINGS if s.flag is not None and s.kind == "choice"}
SHORT = {alias: s.flag for s in SETTINGS if s.flag is not None for alias in s.aliases}
COMPILATION = {s.compilation: s for s in SETTINGS if s.compilation is not None}  # compilation-config key -> setting
SPECULATIVE = next(s for s in SETTINGS if s.speculative is not None)
JSON_ARGS = {**dict.fromkeys(COMPILATION_FLAGS, "compilation"), **dict.fromkeys(SPECULATIVE_FLAGS, "speculative")}


def _resolved_order(item: tuple[int, Setting]) -> tuple[int, bool, int]:
    # flags, switches, lists; within each, a flag that is also a compilation-config key (the
    # capture ceiling) after the rest: the order contradictions are named in
    at, s = item
    return ("int", "bool", "int_list", "choice").index(s.kind), s.compilation is not None, at


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
    if suffix.isupper() and "." in number:  # vLLM refuses decimals with a binary suffix (1.5K)
        raise ValueError(text)
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
    dotted: dict[str, str] = field(default_factory=dict)  # JSON args given as dotted keys -> the flag vLLM keeps
    in_file: set[str] = field(default_factory=set)  # JSON args whose object comes from the --config file
    unread: list[str] = field(default_factory=list)  # values left to the model (`--max-model-len auto`)
    ignored: list[str] = field(default_factory=list)  # spellings vLLM ignores, each with why (`--config=FILE`)
    from_model: set[str] = field(default_factory=set)  # settings the command leaves to the model (auto): never added
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
    """The arguments vLLM's entry point parses from a server command: `serve ...` for the `vllm`
    command (its parser moves `--model` to the model's place, so it must see `serve`), the
    engine arguments for the api_server module."""
    if Path(argv[0]).name == "vllm":
        return argv[1:]
    at = argv.index("-m")
    return argv[at + 2 :]


# What capplan's own reader does not read, where vLLM is not importable, is refused, never
# completed around: a flag appended after a part it did not read could replace the operator's value.
OWN_READER = "capplan's own reader (vLLM is not importable here)"
CHECK_WITH_VLLM = (
    "spell it out as `capplan flags PLAN` does, or run the dry run where vLLM is installed: its own parser reads it"
)
SPEC_FLAGS = ("--spec-tokens", "--spec-method", "--spec-model")  # vLLM's speculative shorthands
LEVEL = "--optimization-level"


def off_forms(flag: str, releases: Sequence[str] | None = None) -> dict[str, set[str]]:
    """Each spelling that turns switch `flag` off in a release's parser (`--no-X`, or `--disable-Y`
    where vLLM's action pairs them), with the releases (default: every supported one) that take
    it: read from vLLM's option tables (capplan.launcher.vllm_options), never guessed."""
    out: dict[str, set[str]] = {}
    for release, table in tables().items():
        if releases is not None and release not in releases:
            continue
        if flag not in table:
            continue
        dest = table[flag][0]
        for option, (d, nargs) in table.items():
            if d == dest and nargs == 0 and option != flag and option.startswith(("--no-", "--disable-")):
                out.setdefault(option, set()).add(release)
    return out


def _off(releases: Sequence[str] | None = None) -> dict[str, str]:
    """Off form -> its switch, for the forms every one of `releases` takes."""
    wanted = set(tables()) if releases is None else set(releases) & set(tables())
    return {form: f for f in SWITCHES for form, have in off_forms(f, releases).items() if have >= wanted}


OFF = _off()  # a switch's off forms that every supported release takes
SOME = {form: f for f in SWITCHES for form in off_forms(f) if form not in OFF}  # taken by some releases only
# every option some supported release's parser takes (an abbreviation of one is vLLM's to resolve)
ALL_OPTIONS = {option for table in tables().values() for option in table}
# options whose number of values every supported release agrees on: how many arguments they take
NARGS = {
    option: got.pop()
    for option in ALL_OPTIONS
    if len(got := {table[option][1] for table in tables().values() if option in table}) == 1
}


KNOWN = {*SCALARS, *SWITCHES, *OFF, *SOME, *LISTS, *CHOICES, *JSON_ARGS, *SPEC_FLAGS, LEVEL, "--config", "--model"}


@dataclass(frozen=True)
class _Arg:
    text: str  # as vLLM's parser reads it (`_` in a flag's name read as `-`)
    at: int | None  # its index in the command; None: from the --config file


def _refuse(what: str, why: str) -> CapplanError:
    return CapplanError(f"{printable(what)[:60]}: {OWN_READER} {why}", CHECK_WITH_VLLM)


def _normalized(text: str) -> str:
    """A `--flag` as vLLM's parser reads it: `_` as `-` in its name, up to a `.` or `=`."""
    if not text.startswith("--"):
        return text
    key, eq, value = text.partition("=")
    head, dot, rest = key.partition(".")
    return head.replace("_", "-") + dot + rest + eq + value


def _engine_args(argv: list[str], start: int) -> tuple[list[_Arg], str | None]:
    """The engine arguments in the order vLLM's parser reads them (a `--config FILE`'s values
    first, the command line's after them, so that the command line wins), and the file."""
    rest = list(range(start, len(argv)))
    named = [i for i in rest if argv[i] == "--config"]
    if not named:
        return [_Arg(_normalized(argv[i]), i) for i in rest], None
    if len(named) > 1:
        raise CapplanError("--config is given twice: vLLM refuses the command", "give one config file")
    at = named[0]
    if at + 1 >= len(argv):
        raise CapplanError("--config needs a file: vLLM refuses the command", "give the YAML file after --config")
    path = argv[at + 1]
    given = config_args(path)
    model = argv[start - 1] != "serve" or any(re.match(r"^--model(=.+|$)", a) for a in argv[start:])
    if Path(argv[0]).name == "vllm" or "vllm.entrypoints.cli.main" in argv:
        if not model and "--model" not in given:
            raise CapplanError(
                f"`serve --config {printable(path)}` names no model: vLLM refuses the command",
                "give the model after `serve`, or as `model:` in the file",
            )
    from_file = [_Arg(_normalized(text), None) for text in given]
    return from_file + [_Arg(_normalized(argv[i]), i) for i in rest if i not in (at, at + 1)], path


def config_args(path: str) -> list[str]:
    """A vLLM `--config` YAML file as the arguments vLLM's parser reads from it: each key a flag
    (`--KEY`), a true switch alone, a list's items after it, a mapping as its JSON, anything
    else as its text. yaml.safe_load reads it, as vLLM does. A false switch vLLM's releases read
    differently (dropped, or `--no-KEY`): refused where it is a flag this reader reads."""
    from capplan.files import check_shape, read_text

    name = printable(path)
    if path.split(".")[-1] not in ("yaml", "yml"):
        raise CapplanError(f"--config {name}: vLLM reads only a .yaml or .yml config file", "rename it")
    text = read_text(Path(path), "vLLM config file", CapplanError)
    try:
        data = yaml.safe_load(text)
        check_shape(data, f"--config {name}")
    except yaml.YAMLError as exc:
        raise CapplanError(f"--config {name}: not YAML ({printable(str(exc).splitlines()[0])[:80]})") from None
    except RecursionError:
        raise CapplanError(f"--config {name}: nested too deeply") from None
    except ValueError:  # an integer of over 4300 digits: Python refuses to read it (and vLLM with it)
        raise CapplanError(
            f"--config {name}: holds an integer of over 4300 digits, which Python (and so vLLM) does not read"
        ) from None
    if not isinstance(data, dict):
        raise CapplanError(f"--config {name}: not a YAML mapping of flags to values", "vLLM refuses it too")
    out: list[str] = []
    for key, value in data.items():
        if not isinstance(key, str):
            raise CapplanError(f"--config {name}: the key {printable(repr(key))[:40]} is not a flag name")
        flag = _normalized("--" + key)
        if isinstance(value, bool):
            if not value and (flag in SWITCHES or flag in OFF or flag in SOME):
                raise _refuse(f"--config {name}: {key}: false", "does not read a false switch in a config file")
            out += [flag] if value else []
        elif isinstance(value, list):
            out += [flag, *map(str, value)] if value else []
        elif isinstance(value, dict):
            try:
                out += [flag, json.dumps(value)]
            except (TypeError, ValueError):
                raise CapplanError(
                    f"--config {name}: {printable(key)[:40]}: not JSON data", "vLLM refuses it too"
                ) from None
        else:
            out += [flag, str(value)]
    return out


def json_places(args: list[_Arg]) -> dict[str, tuple[int | None, str]]:
    """Where vLLM's parser takes each JSON config ("compilation", "speculative") from: (the index
    in `args` of the last JSON object given, its flag), or (None, the flag) where dotted keys
    are given. vLLM gathers dotted keys by their flag as written (`-cc.x` and
    `--compilation-config.y` apart) and gives each gathering as one more JSON object at the
    end, in the order its flag first appears: the last one replaces every other."""
    places: dict[str, tuple[int | None, str]] = {}
    heads: dict[str, list[str]] = {}
    for k, arg in enumerate(args):
        name, eq, _ = arg.text.partition("=")
        head = name.split(".", 1)[0]
        if head in JSON_ARGS and "." in name:
            order = heads.setdefault(JSON_ARGS[head], [])
            order += [] if head in order else [head]
        elif name in JSON_ARGS and (eq or k + 1 < len(args)):
            places[JSON_ARGS[name]] = (k if eq else k + 1, name)
    for which, order in heads.items():
        places[which] = (None, order[-1])
    return places


def _prefix_of_known(name: str) -> bool:
    """Whether vLLM's parser could read `name` as an abbreviation of one of its options (of any
    supported release) or of a flag this reader reads."""
    if name.startswith("--"):
        return name not in ALL_OPTIONS and any(k.startswith(name) and k != name for k in {*KNOWN, *ALL_OPTIONS})
    shorts = {*SHORT, *(f for f in {*JSON_ARGS, *ALL_OPTIONS} if not f.startswith("--"))}
    return len(name) > 1 and name[1].isalpha() and name not in shorts and any(k.startswith(name) for k in shorts)


def _dotted_value(raw: str, plus: bool) -> object:
    """A dotted key's value as vLLM's parser reads it: `+` items split at commas, else JSON,
    else a human-readable integer, else the text."""
    if plus:
        return raw.split(",")
    try:
        return _json("-cc", raw)
    except ValueError:
        try:
            return human_int(raw)
        except ValueError:
            return raw


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    """vLLM's merge of dotted keys: mappings merge, lists concatenate, anything else is replaced."""
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        elif isinstance(v, list) and isinstance(into.get(k), list):
            into[k] = into[k] + v
        else:
            into[k] = v


def read_command(argv: list[str], releases: Sequence[str] | None = None) -> Command | None:
    """The plan settings a vLLM server command sets, or None when `argv` is not a vLLM server command.
    CapplanError names a flag whose value vLLM itself would refuse, or a part of the command this
    reader does not read (an optimization level, an abbreviated flag, a switch's off form that
    not every one of `releases` takes: default, every supported release), which it never completes."""
    releases = releases or None  # none named: every supported release
    unknown = [r for r in releases or () if r not in tables()]
    if unknown:
        raise CapplanError(
            f"{OWN_READER}: no option table of vLLM {', '.join(unknown)}: it cannot read the line for it",
            CHECK_WITH_VLLM,
        )
    off = OFF if releases is None else _off(releases)
    some = {form: (f, have) for f in SWITCHES for form, have in off_forms(f, releases).items() if form not in off}
    start = server_start(argv)
    if start is None:
        return None
    cmd = Command(list(argv), start)
    serve = Path(argv[0]).name == "vllm" or "vllm.entrypoints.cli.main" in argv
    if not serve and start < len(argv) and not argv[start].startswith("-"):
        raise CapplanError(
            f"{printable(argv[start])[:40]}: the api_server module takes no positional argument: vLLM refuses the "
            "command",
            "give the model as --model MODEL",
        )
    if serve and not argv[start - 1].startswith("-") and argv[start - 1] != "serve":
        twice = next((a for a in argv[start:] if re.match(r"^--model(=.+|$)", a)), None)
        if twice is not None:
            raise CapplanError(
                f"`serve {printable(argv[start - 1])[:40]} ... {printable(twice)[:40]}` names the model twice: "
                "vLLM's parser moves --model to the model's place and refuses the command",
                "give the model once, after `serve`",
            )
    args, config = _engine_args(argv, start)
    where = f" (in --config {printable(config)})" if config is not None else ""
    json_objects: dict[int, tuple[dict[str, Any], str]] = {}  # index in args -> a JSON object, its flag
    dotted: dict[str, dict[str, Any]] = {}  # flag as written -> its dotted keys, merged
    dotted_in_file: set[str] = set()  # flags with dotted keys from the --config file: complete() cannot add to them
    # vLLM's parser takes one positional argument, the model, where none is given before the flags
    # (`vllm serve` moves --model there); an argument after a flag of this reader's is that or too many
    model_given = serve and (argv[start - 1] != "serve" or any(re.match(r"^--model(=.+|$)", a) for a in argv))
    free = 0 if model_given else 1
    if serve and not model_given and config is None:
        named = next((a for a in argv if re.match(r"^--served[-_]model[-_]name(=.+|$)", a)), None)
        if named is not None:
            raise CapplanError(
                f"`serve {printable(named)[:40]}` with no model: vLLM's parser refuses it",
                "give the model after `serve`",
            )
    i = 0
    while i < len(args):
        arg = args[i]
        token = arg.text
        name, eq, inline = token.partition("=")
        name = SHORT.get(name, name)
        said = argv[arg.at].partition("=")[0] if arg.at is not None else name  # as the user wrote it (-tp)
        origin = "" if arg.at is not None else where

        def value(name: str = name, eq: str = eq, inline: str = inline, i: int = i) -> str:
            if eq:
                return inline
            if i + 1 >= len(args):
                raise CapplanError(f"{printable(name)} needs a value")
            return args[i + 1].text

        step = 1 if eq else 2
        if token == "--":
            raise _refuse("--", "does not read past a bare `--` (vLLM's parser takes what follows as positionals)")
        if token.startswith("-O") or name == LEVEL:
            raise _refuse(
                token, "does not read vLLM's optimization levels (each release's table sets the cudagraph mode)"
            )
        if name in SCALARS:
            setting = SCALARS[name]
            raw = value()
            if setting.from_model and raw in ("auto", "-1"):
                cmd.unread.append(f"{name} {raw}")
                cmd.values.pop(setting.name, None)  # the last one given counts, as in vLLM
                cmd.from_model.add(setting.name)
            else:
                cmd.from_model.discard(setting.name)
                cmd.unread = [u for u in cmd.unread if not u.startswith(f"{name} ")]
                number = _integer(name, raw, setting.human)
                cmd.values[setting.name] = number
                shown = f"{said} {raw}" + (f" (vLLM reads {number})" if raw.strip() != str(number) else "")
                cmd.flags[setting.name] = shown + origin
            i += step
        elif name in some:
            switch, have = some[name]
            others = [f"{_span(by)} {form}" for form, by in off_forms(switch, releases).items() if form != name]
            raise _refuse(
                token,
                f"does not read it: not every vLLM release the line is read for takes it (vLLM {_span(have)} "
                f"{'does' if len(have) == 1 else 'do'}"
                + (f"; for {switch}'s off form, {'; '.join(others)})" if others else ")"),
            )
        elif name in SWITCHES or name in off:
            if eq:
                raise CapplanError(f"{printable(token)[:60]}: {name} takes no value: vLLM refuses the command")
            setting = SWITCHES[off.get(name) or name]
            cmd.values[setting.name] = name not in off
            cmd.flags[setting.name] = name + origin
            i += 1
        elif name in CHOICES:
            setting = CHOICES[name]
            raw = value()
            if raw not in setting.choices:
                raise CapplanError(
                    f"{printable(name)} {printable(raw)[:40]}: not one of {', '.join(setting.choices)}: vLLM's parser "
                    "refuses the command"
                )
            cmd.values[setting.name] = raw
            cmd.flags[setting.name] = f"{said} {raw}" + origin
            i += step
        elif name in LISTS:
            setting = LISTS[name]
            j = i + 1
            items = [inline] if eq else []
            while not eq and j < len(args) and not re.match(r"-[^\d]", args[j].text):
                items.append(args[j].text)  # vLLM's parser takes every argument up to the next flag
                j += 1
            if not items:
                raise CapplanError(f"{name} needs one or more token counts")
            numbers: list[Any] = [_integer(name, s, False) for s in items]
            cmd.values[setting.name] = setting.canon(numbers) if setting.canon is not None else numbers
            cmd.flags[setting.name] = f"{name} {' '.join(items)}" + origin
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
            json_objects[i if eq else i + 1] = (data, name)
            i += step
        elif "." in name and name.split(".", 1)[0] in JSON_ARGS:
            head, _, key = name.partition(".")
            if key.count(".") >= MAX_DEPTH:
                raise CapplanError(f"{printable(name)[:60]}...: dotted key deeper than {MAX_DEPTH} levels")
            if "" in key.removesuffix("+").split("."):
                raise CapplanError(f"{printable(name)[:60]}: an empty key: vLLM refuses the command")
            plus = key.endswith("+")
            got: Any = _dotted_value(value(), plus)
            for part in reversed(key.removesuffix("+").split(".")):
                got = {part: got}
            _merge(dotted.setdefault(head, {}), got)
            if arg.at is None:
                dotted_in_file.add(head)
            i += step
        elif name in SPEC_FLAGS:
            raw = value()
            cmd.values["speculative.present"] = True
            if name == "--spec-tokens":
                cmd.values[SPECULATIVE.name] = _integer(name, raw, False)
                cmd.flags[SPECULATIVE.name] = f"{name} {raw}" + origin
            i += step
        elif name == "--model":
            i += step
        elif name == "--config":
            cmd.ignored.append(f"--config={inline} (vLLM reads a config file only as `--config FILE`: it ignores it)")
            i += 1
        elif token.startswith("-") and _prefix_of_known(name.split(".", 1)[0]):
            raise _refuse(token, "does not resolve abbreviated flags (vLLM's parser reads a flag's unambiguous prefix)")
        elif name in ("-h", "--help"):
            raise CapplanError(f"{name}: vLLM prints its help and exits: no server starts", "remove it")
        elif name in NARGS:  # another option of vLLM's: as many values as its parser takes
            lacking = {r for r in releases or tables() if r in tables() and name not in tables()[r]}
            if lacking:
                raise CapplanError(
                    f"{printable(name)[:60]}: no option of vLLM {_span(lacking)}: its parser refuses the command",
                    "remove it, or target a release that takes it",
                )
            if eq and NARGS[name] == 0:
                raise CapplanError(f"{printable(token)[:60]}: {name} takes no value: vLLM refuses the command")
            i += 1 if eq else _values_taken(name, NARGS[name], args, i + 1) + 1
        elif token.startswith("-") and "." in name and name.split(".", 1)[0] in NARGS:
            raise _refuse(token, "does not read dotted keys of this option")
        elif name[:1] == "-" and name[1:2] != "-" and name[:2] in ALL_OPTIONS and len(name) > 2:
            raise _refuse(token, f"does not read a value glued to a short option ({name[:2]} {name[2:]})")
        elif _option_like(token):
            raise CapplanError(
                f"{printable(name)[:60]}: no flag of vLLM's (no supported release's parser takes it): vLLM's parser "
                "refuses the command",
                "remove it, or spell it as `vllm serve --help` does",
            )
        elif free:
            free, i = 0, i + 1  # the model
        else:
            raise CapplanError(
                f"{printable(token)[:60]}: an argument no flag takes: vLLM's parser refuses the command",
                "remove it, or give the flag it belongs to",
            )
    places = json_places(args)
    if any(flag not in dotted if place is None else place not in json_objects for place, flag in places.values()):
        raise _refuse(
            next(flag for _, flag in places.values()), "does not read a JSON config flag given where a value goes"
        )
    for which, (place, flag) in places.items():
        if place is None:
            cmd.dotted[which] = flag
            if flag in dotted_in_file:
                cmd.in_file.add(which)
            _read_json(cmd, which, dotted[flag], flag, releases or tuple(tables()), dotted=True)
        else:
            data, name = json_objects[place]
            at = args[place].at
            if at is not None:
                cmd.json_at[which] = at
            else:
                cmd.in_file.add(which)
            _read_json(cmd, which, data, name, releases or tuple(tables()), origin="" if at is not None else where)
    if "speculative" in places:
        if any(a.text.partition("=")[0] in SPEC_FLAGS for a in args):
            raise _refuse("--spec-tokens", "does not decide between --spec-* flags and a speculative config")
    return cmd


READ_KEYS = (*COMPILATION, "mode")  # the compilation-config keys and EngineArgs fields vLLM's parser reports
READ_FIELDS = (*RESOLVED, "optimization_level", "spec_tokens", "spec_method")


def _option_like(text: str) -> bool:
    """Whether argparse reads `text` as an option, not a value: it starts with `-` and is no
    negative integer, a lone `-` or a text with a space (vLLM rewrites `-0.5`, having a `.`, as a
    dotted key: an option too)."""
    return text.startswith("-") and text != "-" and " " not in text and not re.fullmatch(r"-\d+", text)


def _values_taken(name: str, nargs: Any, args: list[_Arg], at: int) -> int:
    """How many of `args` from `at` argparse gives option `name` of `nargs` (0 for a switch, None
    one value, "?" one if one follows, "+"/"*" up to the next option, a count that many);
    CapplanError where too few follow, as vLLM's parser refuses the command."""
    following = 0
    while at + following < len(args) and not _option_like(args[at + following].text):
        following += 1
    need, take = {None: (1, 1), "?": (0, 1), "+": (1, following), "*": (0, following)}.get(nargs, (nargs, nargs))
    if following < int(need):
        raise CapplanError(f"{printable(name)[:60]} needs a value: vLLM's parser refuses the command")
    return min(int(take), following)


def _span(releases: set[str]) -> str:
    """Releases as the messages name them: the first to the last, or one."""
    ordered = [r for r in tables() if r in releases]
    return ordered[0] if len(ordered) == 1 else f"{ordered[0]} to {ordered[-1]}"


def read_with_vllm(python: str, argvs: list[list[str]], env: dict[str, str]) -> list[dict[str, Any]] | None:
    """vLLM's own reading of server commands (one run of `python`, vLLM imported once); None
    when vLLM is not importable there. Each result goes to `prepare(..., resolution=)`."""
    return resolve_lines(python, [parser_args(a) for a in argvs], env, READ_FIELDS, READ_KEYS)


def read_here(argv: list[str]) -> dict[str, Any] | None:
    """vLLM's own reading of one server command in this process (the server's, where vLLM is
    imported), for `prepare(..., resolution=)`; None when vLLM's parser cannot be built."""
    from capplan.launcher.vllm_cli import resolve_here

    results = resolve_here([parser_args(argv)], READ_FIELDS, READ_KEYS)
    return None if results is None else results[0]


def read_resolved(argv: list[str], resolved: Resolved) -> Command:
    """The plan settings the operator gave, as vLLM's own parser resolved the command (a
    `--config` file included): only what the operator gave counts, each named by its flag and,
    for a value from the file, the file."""
    start = server_start(argv)
    assert start is not None
    cmd = Command(list(argv), start)
    # where the command's own JSON sits, for complete() to merge into (the file's are vLLM's to report)
    line = [_Arg(_normalized(a), i) for i, a in enumerate(argv) if i >= start]
    if any(a.text == "--config" for a in line):
        skip = next(k for k, a in enumerate(line) if a.text == "--config")
        line = line[:skip] + line[skip + 2 :]
    for which, (place, flag) in json_places(line).items():
        found = None if place is None else line[place].at
        if place is None:
            cmd.dotted[which] = flag
        elif found is not None:
            cmd.json_at[which] = found
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
            cmd.from_model.add(setting.name)
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
        cmd.ignored.append("--config=FILE (vLLM reads a config file only as `--config FILE`: it ignores this one)")
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
    """`got` as vLLM's config reads it, where it has a type vLLM gives the key (null: vLLM's
    default; true and false stand for 1 and 0 where vLLM takes an integer, as its pydantic
    models read them); else CapplanError naming the key, before anything starts."""
    if got is None:
        return None

    def number(v: object) -> bool:
        return type(v) is int or type(v) is bool

    def item(v: object) -> bool:  # a list's `KEY+=8,16` form gives strings; pydantic reads a string of digits
        return number(v) or (isinstance(v, str) and re.fullmatch(r"[+-]?[0-9]+", v) is not None)

    ok = {
        "mode": isinstance(got, (str, int, float)),  # a name, or a value (bool and 2.0 too, as pydantic reads it)
        "int_list": isinstance(got, list) and all(item(v) for v in got),
        "int": number(got),
        "bool": isinstance(got, bool),
    }[kind]
    if not ok:
        raise CapplanError(
            f"{where}: must be {_KIND_WORDS[kind]} (got {printable(json.dumps(got))[:40]})",
            "give it so in the command (where vLLM is installed, its own parser reads the line)",
        )
    if kind == "int_list" and isinstance(got, list):
        return [int(v) for v in got]
    if kind == "mode":
        return _mode(where, got)
    return int(got) if kind == "int" and isinstance(got, bool) else got


# vLLM's CUDAGraphMode: its names, and the values of those with a single one (vllm/config/compilation.py)
MODE_VALUES = {0: "NONE", 1: "PIECEWISE", 2: "FULL"}
MODE_NAMES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def _mode(where: str, got: object) -> str:
    """A cudagraph mode as vLLM's CompilationConfig reads it: a name in any case
    (`CUDAGraphMode[value.upper()]`, its validator), or a value of the enum (0, 1, 2; true and
    false, 2.0, equal to them, are read as them). tests/conformance/test_mode_values.py asks vLLM."""
    name = str(got).upper() if isinstance(got, str) else MODE_VALUES.get(got)  # type: ignore[call-overload]
    if name not in MODE_NAMES:
        raise CapplanError(
            f"{where}: {printable(json.dumps(got))[:40]} is no cudagraph mode vLLM reads",
            f"give one of {', '.join(MODE_NAMES)} (any case) or 0, 1, 2",
        )
    return name


def _read_json(
    cmd: Command,
    which: str,
    data: dict[str, Any],
    flag: str,
    releases: Sequence[str],
    dotted: bool = False,
    origin: str = "",
) -> None:
    def shown(key: str) -> str:
        return f"{flag}.{key}" if dotted else f"{flag} {key}"

    if which == "compilation":  # vLLM's config classes forbid any other key (its option tables)
        for given in data:
            lacking = {r for r in releases if given not in compilation_keys(r)}
            if lacking:
                raise CapplanError(
                    f"{shown(printable(str(given))[:40])}: no key of vLLM {_span(lacking)}'s compilation config: it "
                    "refuses the command",
                    "remove it, or spell it as vLLM's CompilationConfig does",
                )

    if which == "speculative":
        key = SPECULATIVE.speculative
        if key is not None and key in data:
            got = _typed(shown(key), SPECULATIVE.kind, data[key])
            cmd.values[SPECULATIVE.name] = got
            cmd.flags[SPECULATIVE.name] = shown(key) + origin
        cmd.values.setdefault("speculative.present", True)
        return
    for key, setting in COMPILATION.items():
        if key in data:
            got = _typed(shown(key), setting.kind, data[key])
            if setting.canon is not None and isinstance(got, list):
                got = setting.canon(got)
            cmd.values[setting.name] = got
            cmd.flags[setting.name] = f"{shown(key)} {short(got)}" + origin
