"""Run on the oracle's Python with one release's vLLM sources on the path: the server parsing its
own command under `capplan apply` (capplan.runtime.launch_line), against what `apply --dry-run`
prints for it.

    python launch_line_check.py PLAN COMMAND_JSON

The hook is installed on vLLM's FlexibleArgumentParser as the plugin installs it (CAPPLAN_COMMAND
set); then the server's parser is built as vLLM's entry point builds it (the `vllm` command's with
its serve subcommand, or the api_server module's) and parses its arguments from sys.argv, set as
the server process has them. Prints one JSON object: {"refused": line, "dry_refusal": the dry
run's} when the server stops,
else {"same": bool, "differing": [...], "full": [...]} where `same` says that the namespace vLLM's
parser returned equals, key for key, an unhooked parse of the dry run's completed line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

from capplan.envvars import COMMAND
from capplan.errors import CapplanError
from capplan.launcher.cmdline import parser_args, read_here
from capplan.launcher.engine_args import prepare
from capplan.launcher.vllm_cli import _resolving
from capplan.planfile import load_plan
from capplan.runtime.hooks import config
from capplan.runtime.launch_line import Reading


def main() -> None:
    plan_path, command = sys.argv[1], json.loads(sys.argv[2])
    plan = load_plan(Path(plan_path))
    space = _resolving()
    assert space["load_vllm"]() is None
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    serve = command[1:2] == ["serve"]
    unhooked = FlexibleArgumentParser.parse_args
    try:  # what --dry-run prints
        full, _ = prepare(plan, plan_path, command, resolution=read_here(command))
        expected, dry_refusal = vars(space["make"](False, False, serve).parse_args(parser_args(full))), None
    except CapplanError as exc:
        full, expected, dry_refusal = [], {}, f"capplan: {exc.one_line()}"

    os.environ[COMMAND] = json.dumps(command)
    hook = next(h for h in config.HOOKS if h.name == "config.launch_line")
    ctx = SimpleNamespace(plan=plan, plan_path=plan_path, launch=Reading())
    FlexibleArgumentParser.parse_args = config._parse_args(ctx, hook, unhooked)
    sys.argv = ["/srv/bin/server", *parser_args(command)]  # the server process's own arguments
    try:
        got = vars(space["make"](False, False, serve).parse_args())
    except SystemExit as exc:
        print(json.dumps({"refused": str(exc.code), "dry_refusal": dry_refusal}))
        return
    finally:
        FlexibleArgumentParser.parse_args = unhooked
    # the engine config is made after the parse: the command was read, so nothing is refused there
    if config.launch_line_unread(ctx) is not None:
        print(json.dumps({"unread_after_parse": True}))
        return
    late = SimpleNamespace(plan=plan, plan_path=plan_path, launch=Reading())  # a plugin loaded after the parse
    if config.launch_line_unread(late) is None:
        print(json.dumps({"late_plugin_not_refused": True}))
        return
    differing = sorted(k for k in set(expected) | set(got) if expected.get(k) != got.get(k))
    print(json.dumps({"same": not differing, "differing": differing, "full": full}))


if __name__ == "__main__":
    main()
