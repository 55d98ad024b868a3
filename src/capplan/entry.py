"""Console entry point `capplan`: the typer app, with a typer-free fast path for `dispatch`."""

from __future__ import annotations

import sys


def main() -> None:  # pragma: no cover - exercised through subprocess tests
    argv = sys.argv[1:]
    if argv[:1] == ["dispatch"]:
        from capplan.dispatch_cli import fast_dispatch

        code = fast_dispatch(argv[1:])
        if code is not None:
            raise SystemExit(code)
    from capplan.cli import main as typer_main

    typer_main()
