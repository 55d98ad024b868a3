"""`capplan dispatch`: the command body, and a fast path that starts without typer.

`dispatch` runs in scripts and loops ("which graph serves this batch?"), so
its process start matters (issue #5: under 300 ms). Building typer's
parser costs more than the whole dispatch, so the console entry point
(`capplan.entry:main`) parses a plain `capplan dispatch ...` with argparse
and calls the same `run_dispatch` as the typer command. Anything the fast
parser does not accept exactly (--help, a global option, a typo, a bad
value) falls back to typer, so help text and usage errors stay typer's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from capplan.errors import CapplanError, UsageError


def run_dispatch(plan: Path, reqs: int | None, tokens: int | None, loras: int, base: bool, uniform: int | None,
                 max_query_len: int | None, has_prefill: bool, queries: Path | None, as_json: bool,
                 echo: Callable[[str], None]) -> None:
    from capplan.dispatch_cache import load_dispatcher
    from capplan.planner.queries import batch_from_args, read_queries

    if queries is not None:
        if reqs is not None or tokens is not None:
            raise UsageError("--queries replaces --reqs/--tokens; give one or the other")
        batches = read_queries(queries)
        dispatcher = load_dispatcher(plan)
        out = sys.stdout
        for batch in batches:
            out.write(json.dumps(dispatcher.dispatch(batch).descriptor()) + "\n")
        return
    if reqs is None or tokens is None:
        raise UsageError("give --reqs and --tokens (or --queries FILE.jsonl)")
    batch = batch_from_args(reqs, tokens, max_query_len, loras, base, has_prefill, uniform)
    dispatcher = load_dispatcher(plan)
    trace: list[str] = []
    desc = dispatcher.explain(batch, trace)
    if as_json:
        echo(json.dumps(desc.descriptor()))
        return
    if desc.cg_mode == "NONE":
        echo(f"eager (cg_mode NONE): {batch.num_tokens} tokens, no graph replay")
    else:
        padding = desc.num_tokens - batch.num_tokens
        echo(
            f"graph #{desc.graph_id}: {desc.cg_mode} num_tokens={desc.num_tokens} "
            f"num_reqs={desc.num_reqs} uniform_token_count={desc.uniform_token_count} "
            f"num_active_loras={desc.num_active_loras} (pads {padding} token(s))"
        )
    for line in trace:
        echo(f"  - {line}")


class _Fallback(Exception):
    """The fast parser declines; typer takes over."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D401 - argparse hook
        raise _Fallback(message)


def _parser() -> _Parser:
    p = _Parser(prog="capplan dispatch", add_help=False, allow_abbrev=False)
    p.add_argument("plan", type=Path)
    p.add_argument("--reqs", type=int)
    p.add_argument("--tokens", type=int)
    p.add_argument("--loras", type=int, default=0)
    p.add_argument("--base", action="store_true")
    p.add_argument("--uniform", type=int)
    p.add_argument("--max-query-len", type=int)
    p.add_argument("--has-prefill", action="store_true")
    p.add_argument("--queries", type=Path)
    p.add_argument("--json", dest="as_json", action="store_true")
    return p


def fast_dispatch(args: list[str]) -> int | None:
    """Run `capplan dispatch ARGS` without typer; None when typer should handle it."""
    if any(a in ("--help", "-h") or a.startswith("--help") for a in args):
        return None
    try:
        ns = _parser().parse_args(args)
    except _Fallback:
        return None

    def echo(text: str) -> None:
        sys.stdout.write(text + "\n")

    try:
        run_dispatch(ns.plan, ns.reqs, ns.tokens, ns.loras, ns.base, ns.uniform, ns.max_query_len, ns.has_prefill,
                     ns.queries, ns.as_json, echo)
    except CapplanError as exc:
        sys.stderr.write(f"error: {exc.one_line()}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("interrupted: nothing was written\n")
        return 130
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        sys.stderr.write(f"error: {where}{exc.strerror or exc}\n")
        return 1
    sys.stdout.flush()
    return 0
