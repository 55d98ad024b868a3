"""A vLLM server command line as vLLM itself reads it: its argument parser and `EngineArgs`,
run in the command's own Python, where `capplan apply` finds vLLM installed.

vLLM's parser accepts more spellings than any second reader keeps up with: `_` for `-` in
flag names, unambiguous prefixes, `-O0`/`-O 0`/`--optimization-level=0`, a flag given twice
(the last wins), two `-cc` objects, dotted and `+` list keys, and a `--config` YAML file whose
values come before the command line's. So where vLLM is importable, capplan asks it: the values
it resolves, which of them the operator gave (on the command line or in the file), and, for the
JSON configs, which keys. `cmdline` reads those as the plan's settings; `engine_args` compares
them with the plan and adds a setting only where the operator gave nothing. capplan's own
reader stays for where vLLM is absent (`apply --dry-run` on a laptop), says so, and refuses
what it does not read.
"""

from __future__ import annotations

import functools
import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from capplan.errors import CapplanError, printable

# Runs in the command's Python. Reads {"lines": [[...], ...], "fields": [...], "keys": [...]}
# on stdin: each line the arguments of one command as vLLM's entry point gets them (`serve ...`
# for the `vllm` command, whose parser moves `--model` first; the engine arguments alone for the
# api_server module), the EngineArgs fields and compilation-config keys to report; prints
# {"unavailable": why} when vLLM's parser cannot be built there, else {"results": [...]}, one per
# line: {"refused": line} when vLLM's parser refuses it, else the resolution. On a machine without
# an accelerator vLLM infers no device and its parser's defaults cannot be built: the CPU platform
# stands in, as vLLM's own `vllm bench` does (the arguments read are the same).
RESOLVING = r"""
import argparse, contextlib, io, json, sys


LOADED = []


def load_vllm():
    # None when vLLM's parser can be built here, else why not (once per process)
    global FlexibleArgumentParser, serve_cli, EngineArgs
    if LOADED:
        return LOADED[0]
    LOADED.append(None)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from vllm.utils.argparse_utils import FlexibleArgumentParser
            from vllm.entrypoints.cli import serve as serve_cli
            from vllm.engine.arg_utils import EngineArgs
            from vllm import platforms
            if platforms.current_platform.is_unspecified():
                from vllm.platforms.cpu import CpuPlatform
                platforms.current_platform = CpuPlatform()
            serve_cli.make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    except Exception as exc:
        LOADED[0] = f"{type(exc).__name__}: {exc}"[:300]
    return LOADED[0]


def answer(request):
    # {"unavailable": why}, or {"results": [...]}: one resolution (or refusal) per line
    global req
    req = request
    problem = load_vllm()
    if problem is not None:
        return {"unavailable": problem}
    return {"results": [one(args) for args in req["lines"]]}


JSON_DESTS = ("compilation_config", "speculative_config")
try:
    from vllm.engine.arg_utils import _expand_json_human_readable_numbers as expand
except ImportError:
    expand = None
try:  # the cudagraph mode each -O level implies where no mode is given
    from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG as LEVELS
except ImportError:
    LEVELS = {}
raw = {}


def make(record, suppress, serve):
    # vLLM's parser as its entry point builds it: the `vllm` command's with its serve subcommand,
    # or the api_server module's
    if serve:
        top = FlexibleArgumentParser(prog="vllm")
        p = serve_cli.ServeSubcommand().subparser_init(top.add_subparsers(required=False, dest="subparser"))
    else:
        top = p = serve_cli.make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    for a in p._actions:
        if suppress and a.dest != "help":
            a.default = argparse.SUPPRESS
        if record and a.dest in JSON_DESTS and callable(a.type):
            def typed(val, orig=a.type, dest=a.dest):
                try:  # the keys as vLLM reads them (1k and the like expanded first, where vLLM does)
                    got = json.loads(expand(val) if expand is not None else val)
                except Exception:
                    got = None
                raw.setdefault(dest, []).append(sorted(got) if isinstance(got, dict) else None)
                return orig(val)
            a.type = typed
    if suppress:
        p._defaults.clear()
    return top


def parse(p, args, refusals=(SystemExit,)):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return p.parse_args(args), None
    except refusals as exc:
        lines = [line for line in err.getvalue().strip().splitlines() if line.strip()]
        if not isinstance(exc, SystemExit):
            lines.append(f"{type(exc).__name__}: {exc}")
        return None, (lines[-1] if lines else "vLLM's argument parser refused the command")


def plain(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    name = getattr(v, "name", None)
    return name if isinstance(name, str) else str(v)


def one(args):
    raw.clear()
    serve = args[:1] == ["serve"]
    try:
        ns, refused = parse(make(True, False, serve), args)
        if refused:
            return {"refused": refused}
        return resolution(args, ns, serve)
    except Exception as exc:  # vLLM's own classes refuse a value: so would vLLM
        return {"refused": f"{type(exc).__name__}: {exc}"[:300]}


def resolution(args, ns, serve):
    # what the operator gave: parsed again with no defaults, with and without the --config file
    # (vLLM's parser may refuse the line without its file, e.g. a model named only there)
    given_ns, _ = parse(make(False, True, serve), args, (Exception, SystemExit))
    cli_args, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a == "--config":
            skip = True
            continue
        if a.startswith("--config="):
            continue
        cli_args.append(a)
    cli_ns, _ = parse(make(False, True, serve), cli_args, (Exception, SystemExit))  # a refusal, not an exit
    given = sorted(vars(given_ns)) if given_ns is not None else []
    on_cli = set(vars(cli_ns)) if cli_ns is not None else set()  # unknown: all counted as the file's
    if serve and getattr(ns, "model_tag", None) is not None:
        ns.model = ns.model_tag  # as vLLM's serve command does before it builds the engine arguments
    ea = EngineArgs.from_cli_args(ns)
    cc = ea.compilation_config
    sc = ea.speculative_config


    def get(o, k):
        return o.get(k) if isinstance(o, dict) else getattr(o, k, None)


    names, keys = req["fields"], req["keys"]
    given_level = str(plain(getattr(ea, "optimization_level", None)))  # "1", "O1" or the enum until vLLM converts it
    level = next(
        (v for k, v in LEVELS.items() if given_level in (str(getattr(k, "value", k)), getattr(k, "name", ""))), {}
    )
    return {
        "values": {n: plain(getattr(ea, n, None)) for n in names},
        "level_mode": plain(level.get("compilation_config", {}).get("cudagraph_mode")),
        "compilation": {k: plain(get(cc, k)) for k in keys},
        "speculative": None if sc is None else {"num_speculative_tokens": plain(get(sc, "num_speculative_tokens"))},
        "given": given,
        "from_config": sorted(set(given) - on_cli),
        "json_keys": {d: list(raw.get(d, [])) for d in JSON_DESTS},
    }


"""
RESOLVER = RESOLVING + "\nprint(json.dumps(answer(json.load(sys.stdin))))\n"


@dataclass
class Resolved:
    """What vLLM's parser made of a command: values, which the operator gave, and where."""

    values: dict[str, object]
    level_mode: str | None  # the cudagraph mode vLLM's -O level implies where no mode is given
    compilation: dict[str, object]
    speculative: dict[str, object] | None
    given: set[str]
    from_config: set[str]
    json_keys: dict[str, list[list[str] | None]] = field(default_factory=dict)

    def compilation_given(self) -> set[str]:
        """The compilation-config keys the operator gave (in a `-cc`, dotted keys or the file): the
        keys of the last object vLLM's parser read, which replaces any before it."""
        objects = self.json_keys.get("compilation_config", [])
        return set(objects[-1] or []) if objects else set()


def run_script(python: str, script: str, stdin: str, env: dict[str, str], timeout: float) -> str:
    """What `python -c script`, given `stdin`, prints; OSError or subprocess.TimeoutExpired when it
    cannot run or does not end. How the launcher asks vLLM's parser (the conformance tests
    route it through their per-release fork server)."""
    proc = subprocess.run([python, "-c", script], input=stdin, capture_output=True, text=True, env=env, timeout=timeout)
    return proc.stdout


def resolve_lines(
    python: str, lines: list[list[str]], env: dict[str, str], fields: Sequence[str], keys: Sequence[str]
) -> list[dict[str, Any]] | None:
    """vLLM's reading of each command's engine arguments (the EngineArgs `fields` and the
    compilation-config `keys` it resolves), in one run of `python` (vLLM is imported once);
    None when vLLM's parser is not importable there. `resolution_of` reads each result."""
    request = json.dumps({"lines": lines, "fields": list(fields), "keys": list(keys)})
    try:
        data = json.loads(run_script(python, RESOLVER, request, env, 300).strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None
    if not isinstance(data, dict) or "results" not in data:
        return None
    return list(data["results"])


@functools.cache
def _resolving() -> dict[str, Any]:
    """RESOLVING's functions, defined in this process (vLLM is imported by their first call)."""
    space: dict[str, Any] = {"__name__": "capplan.launcher.resolving"}
    exec(compile(RESOLVING, "<capplan: vLLM's parser>", "exec"), space)  # noqa: S102 - capplan's own code, above
    return space


def resolve_here(lines: list[list[str]], fields: Sequence[str], keys: Sequence[str]) -> list[dict[str, Any]] | None:
    """`resolve_lines` in this process: for the server process, where vLLM's parser has already
    run and vLLM is imported, so reading the command again costs no second import."""
    data = _resolving()["answer"]({"lines": lines, "fields": list(fields), "keys": list(keys)})
    return list(data["results"]) if "results" in data else None


def resolution_of(data: dict[str, Any]) -> Resolved:
    """One command's resolution; CapplanError when vLLM's parser refused it."""
    if "refused" in data:
        raise CapplanError(
            f"vLLM's argument parser refuses the command: {printable(str(data['refused']))[:300]}",
            "fix the command: vLLM would not start with it",
        )
    return Resolved(
        data["values"],
        data.get("level_mode"),
        data["compilation"],
        data["speculative"],
        set(data["given"]),
        set(data["from_config"]),
        data["json_keys"],
    )
