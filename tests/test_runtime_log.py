"""The runtime's one logger, `capplan`, as an engine process configures it: its lines on
standard error with the "capplan: " prefix, at the level vLLM's logging is set to, and left to
the user's own configuration where vLLM's is (VLLM_CONFIGURE_LOGGING=0)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SAY = (
    "import logging, sys; from capplan.runtime.log import log; "
    "logging.basicConfig(stream=sys.stdout, format='root %(name)s %(message)s') if len(sys.argv) > 1 else None; "
    "log.info('plan %s in force', 'p.plan.yaml'); log.warning('could not write the report: %s', 'full')"
)


def said(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    return subprocess.run(
        [sys.executable, "-c", SAY, *args], env={**clean, **env}, capture_output=True, text=True, timeout=60
    )


def test_lines_go_to_stderr_with_the_prefix_at_info():
    run = said({})
    assert run.stderr.splitlines() == [
        "capplan: plan p.plan.yaml in force",
        "capplan: could not write the report: full",
    ]
    assert run.stdout == ""


@pytest.mark.parametrize(("level", "lines"), [("WARNING", 1), ("error", 0), ("DEBUG", 2), ("nonsense", 2)])
def test_the_level_follows_vllms(level, lines):
    assert len(said({"VLLM_LOGGING_LEVEL": level}).stderr.splitlines()) == lines


def test_with_vllms_logging_left_to_the_user_the_records_reach_the_root_logger():
    run = said({"VLLM_CONFIGURE_LOGGING": "0"}, "root")
    assert run.stderr == ""
    assert run.stdout.splitlines() == ["root capplan could not write the report: full"]  # the root's own level
