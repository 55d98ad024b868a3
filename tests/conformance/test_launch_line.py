"""The server command read in the server process (capplan.runtime.launch_line): with vLLM's own
parser, where vLLM is already imported, so `capplan apply` imports no vLLM before the launch. A
flag against the plan stops the server with the dry run's line; otherwise the server's own parse
of its arguments (`FlexibleArgumentParser.parse_args` as vLLM's entry point calls it, from
sys.argv) returns, key for key, what vLLM's parser makes of the completed line `apply --dry-run`
prints. On the parsers of 0.25.0, 0.29.0 and 0.33.0 (the oracle's sources)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conformance import oracle_python
from tests.conformance.test_vllm_conformance import _missing, _oracle_ready

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"  # max_num_seqs 256, 8192 tokens, max_loras 8
CHECK = Path(__file__).with_name("launch_line_check.py")
VERSIONS = ("0.25.0", "0.29.0", "0.33.0")
pytestmark = [pytest.mark.conformance, pytest.mark.usefixtures("vllm_parser_in_fork_server")]

API = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "M"]
SERVE = ["vllm", "serve", "M"]
LINES = [
    # (the command, a substring of the refusal, or None: completed)
    ([*SERVE, "--enable-lora"], None),
    ([*API, "--max-loras", "8", "--max-num-seqs", "256", "-cc", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'], None),
    ([*SERVE, "--max_loras", "8", "-O", "3"], None),
    ([*API, "--max-loras", "4"], "--max-loras 4: the plan has lora.max_loras 8"),
    ([*SERVE, "--enforce-eag"], "--enforce-eager runs no CUDA graph"),
    ([*API, "--bogus-flag", "1"], "vLLM's argument parser refuses the command"),
]


def _check(version: str, command: list[str]) -> dict:
    job = oracle_python.run([str(CHECK), str(PLAN), json.dumps(command)], version=version, timeout=600)
    assert job.returncode == 0, job.stderr[-3000:]
    return json.loads(job.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("command, refusal", LINES)
def test_the_server_completes_its_own_command_as_the_dry_run_prints_it(version, command, refusal):
    if not _oracle_ready(version):
        pytest.skip(_missing(version))
    got = _check(version, command)
    if refusal is not None:
        assert refusal in got["refused"], got
        assert got["refused"] == got["dry_refusal"] and "\n" not in got["refused"], got
        return
    assert got["same"], got["differing"]
    assert got["full"][:3] == command[:3] and len(got["full"]) > len(command)
