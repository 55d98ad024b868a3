"""The runtime's one logger, `capplan`, beside vLLM's own `vllm` logger.

Every line the runtime says in an engine or worker process goes through it, each with the
prefix "capplan: ". As vLLM does for its logger, capplan configures its own unless
VLLM_CONFIGURE_LOGGING=0 (then its records go to the root logger, for the user's own
configuration), at the level VLLM_LOGGING_LEVEL names (INFO by default), so that quieting vLLM
quiets capplan alike. Lines go to standard error, read as they are written.
"""

from __future__ import annotations

import logging
import os
import sys

PREFIX = "capplan: "

log = logging.getLogger("capplan")


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Standard error as it is when a line is written (a test or a host may replace it)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def _configure() -> None:
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0" or log.handlers:
        return
    handler = _Stderr()
    handler.setFormatter(logging.Formatter(PREFIX + "%(message)s"))
    log.addHandler(handler)
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    log.setLevel(level if isinstance(logging.getLevelName(level), int) else logging.INFO)
    log.propagate = False


_configure()
