"""What each `capplan` command does, as library calls: typed arguments in, a result
object out, nothing printed. The command line (`capplan.cli`) parses, calls one of
these, renders the result with `capplan.present` and maps errors to exit codes.

A diagnostic that must appear while the work goes on (a file skipped, a note on a
trace) is handed to the caller's `Notes` callback, in order.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

Notes = Callable[[str], None]


def no_notes(_: str) -> None:
    """A `Notes` sink that drops every note."""


def inputs(*paths: Path | None) -> tuple[Path, ...]:
    """A command's input files (an optional one, such as --calibration, may be None): no
    output of the command may overwrite them."""
    return tuple(p for p in paths if p is not None)
