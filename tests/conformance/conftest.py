"""Fixtures of the conformance tests."""

from __future__ import annotations

import pytest

from tests.conformance import oracle_python


@pytest.fixture
def vllm_parser_in_fork_server(monkeypatch):
    """vLLM's argument parser reached as `capplan apply` and `init` reach it (one run of the
    oracle's Python per corpus), but forked from the run's server for that release and
    environment, which imported vLLM once: `oracle_python.run_script`. Where the environment is
    the other checks' (no package metadata) the server is theirs too."""
    from capplan.launcher import vllm_cli

    monkeypatch.setattr(vllm_cli, "run_script", oracle_python.run_script)
