"""Run on the oracle's Python with one release's vLLM sources on the path: what the server process
does with the command `capplan apply` passes it (capplan.runtime.launch_line), against what
`apply --dry-run` prints for it.

    python launch_line_check.py PLAN COMMAND_JSON

Prints one JSON object: {"refused": line} when the command contradicts the plan, else
{"said": [...], "same": bool, "differing": [...]} where `same` says that every EngineArgs field
completed in place equals what vLLM's parser builds from the dry run's completed line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from capplan.errors import CapplanError
from capplan.launcher.cmdline import parser_args, read_here
from capplan.launcher.engine_args import prepare
from capplan.launcher.vllm_cli import engine_args_here
from capplan.planfile import load_plan
from capplan.runtime.launch_line import complete_engine_args, this_process_runs


def main() -> None:
    plan_path, command = sys.argv[1], json.loads(sys.argv[2])
    plan = load_plan(Path(plan_path))
    assert this_process_runs(command, [command[0], *parser_args(command)])
    engine_args = engine_args_here(parser_args(command))  # what the server built before the hook
    try:
        said = complete_engine_args(plan, plan_path, engine_args, command)
    except CapplanError as exc:
        print(json.dumps({"refused": exc.one_line()}))
        return
    full, _ = prepare(plan, plan_path, command, resolution=read_here(command))
    expected = engine_args_here(parser_args(full))
    differing = [
        f.name for f in dataclasses.fields(expected) if getattr(expected, f.name) != getattr(engine_args, f.name)
    ]
    print(json.dumps({"said": said, "same": not differing, "differing": differing, "full": full}))


if __name__ == "__main__":
    main()
