"""vLLM's server options, release by release, as its own argument parser defines them.

capplan's own reader (capplan.launcher.cmdline, for where vLLM is not importable) needs to know
which option strings each release's parser takes, which of them are switches, and how many
values each takes. Those facts are vLLM's, so they are not written by hand: `DUMP` runs in a
Python where one release's vLLM is importable, builds `vllm serve`'s parser as the server does,
and prints every option; the result is checked in as `capplan/data/vllm_options/RELEASE.json`,
and tests/conformance/test_vllm_options.py builds it again from each release the conformance
oracle carries and compares.

    python -m capplan.launcher.vllm_options PYTHON RELEASE   # write RELEASE.json from PYTHON's vLLM

`PYTHON` must import that release's vLLM (with PYTHONPATH set for the oracle's sources).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from capplan.errors import CapplanError, printable
from capplan.files import write_atomic
from capplan.releases import RELEASES

# Runs in a Python where vLLM is importable: prints {"release": ..., "options": {OPTION: [DEST,
# NARGS]}, "compilation_keys": [...]} for `vllm serve`'s parser (NARGS: 0 for a switch, null for
# one value, "?", "+", "*" or a count, as argparse keeps it) and its compilation config. No
# accelerator: the CPU platform stands in, as in vllm_cli.
DUMP = r"""
import contextlib, io, json, sys
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    import vllm
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.entrypoints.cli import serve as serve_cli
    from vllm import platforms
    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform
        platforms.current_platform = CpuPlatform()
    parser = serve_cli.make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
# every option string the parser matches (vLLM hides some from --help by cutting an action's
# option_strings after registering them: the parser's own map keeps them all)
options = {option: [action.dest, action.nargs] for option, action in parser._option_string_actions.items()}
# the compilation config's keys (-cc): vLLM's config classes forbid any other
import dataclasses
from vllm.config import CompilationConfig
keys = sorted(f.name for f in dataclasses.fields(CompilationConfig))
print(json.dumps({"release": vllm.__version__.split("+")[0], "options": dict(sorted(options.items())),
                  "compilation_keys": keys}))
"""

FOLDER = "vllm_options"


def dump(python: str, env: dict[str, str]) -> dict[str, Any]:
    """`DUMP` run by `python` with `env`: one release's option table."""
    from capplan.launcher.vllm_cli import run_script

    out = run_script(python, DUMP, "", env, 600).strip().splitlines()
    if not out:
        raise RuntimeError(f"{python} printed nothing: is vLLM importable there?")
    data = json.loads(out[-1])
    if not isinstance(data, dict):
        raise ValueError("not an option table")
    return data


@functools.cache
def _checked_in(release: str) -> dict[str, Any] | None:
    """`release`'s checked-in file, read once, or None where none is checked in."""
    try:
        text = resources.files("capplan.data").joinpath(FOLDER).joinpath(f"{release}.json").read_text()
    except (FileNotFoundError, OSError):
        return None
    data: dict[str, Any] = json.loads(text)
    return data


def table(release: str) -> dict[str, tuple[str, Any]] | None:
    """The option table of `release` (option -> (dest, nargs)), or None where none is checked in."""
    data = _checked_in(release)
    return None if data is None else {option: (dest, nargs) for option, (dest, nargs) in data["options"].items()}


@functools.cache
def compilation_keys(release: str) -> frozenset[str]:
    """The keys `release`'s compilation config takes (empty where no table is checked in)."""
    data = _checked_in(release)
    return frozenset(data.get("compilation_keys", [])) if data is not None else frozenset()


@functools.cache
def tables() -> dict[str, dict[str, tuple[str, Any]]]:
    """Every supported release's table that is checked in, by release."""
    return {r: t for r in RELEASES if (t := table(r)) is not None}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-3].strip(), file=sys.stderr)
        return 2
    python, release = argv
    if release not in RELEASES:
        print(f"{release}: not a supported vLLM release ({', '.join(RELEASES)})", file=sys.stderr)
        return 2
    try:
        data = dump(python, dict(os.environ))
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
        print(f"capplan: {printable(python)}: vLLM's parser could not be dumped ({printable(str(exc))[:200]})",
              file=sys.stderr)  # fmt: skip
        return 1
    if not isinstance(data, dict) or not isinstance(data.get("options"), dict):
        print(f"capplan: {printable(python)} printed no option table", file=sys.stderr)
        return 1
    if data.get("release") != release:
        print(f"capplan: {printable(python)} imports vLLM {data.get('release')}, not {release}", file=sys.stderr)
        return 1
    path = Path(__file__).resolve().parents[1] / "data" / FOLDER / f"{release}.json"
    rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(data["options"].items()))
    keys = json.dumps(sorted(data.get("compilation_keys", [])))
    try:
        write_atomic(
            path, f'{{"release": {json.dumps(release)}, "options": {{\n{rows}\n}},\n"compilation_keys": {keys}}}\n'
        )
    except CapplanError as exc:
        print(f"capplan: {exc.message}", file=sys.stderr)
        return 1
    print(f"wrote {path}: {len(data['options'])} options")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
