"""How a rank process of the multi-process checks ends."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable


def run_then_leave(main: Callable[[], object]) -> None:
    """Run `main`, then leave without tearing the gloo groups down: when another rank has already
    gone, the teardown can abort in C++ ("terminate called without an active exception") after
    the rank's result was written. The result file and the exit code (1 where `main` raised, its
    traceback on stderr) are what the test reads."""
    code = 0
    try:
        main()
    except BaseException:  # noqa: BLE001 - report it, exit non-zero
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
