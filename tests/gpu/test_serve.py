"""The plan under vLLM's OpenAI server with default multiprocessing (tests/gpu/serve_run.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
OUT = Path(os.environ.get("CAPPLAN_GPU_OUT", "/tmp/capplan-gpu"))


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    import vllm

    from capplan.releases import runs_on

    if vllm.__version__.split("+")[0] not in runs_on("0.25"):
        pytest.skip("the serve test's plan targets vLLM 0.25")
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / "gpu_serve.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "serve_run.py"), str(tmp_path_factory.mktemp("serve")), str(out)],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_mismatched_plan_is_refused_before_the_engine_starts_with_one_last_line(serve):
    run = serve["mismatch"]
    assert run["returncode"] != 0 and not run["weights_loaded"]
    last = run["last_stderr_lines"][-1]
    assert "does not match this engine" in last and "lora.max_loras: plan 2, engine 3" in last
    assert sum("does not match this engine" in line for line in run["last_stderr_lines"]) == 1


def test_v1_runner_is_refused(serve):
    run = serve["v1"]
    assert run["returncode"] != 0 and not run["weights_loaded"]
    assert "V1 model runner" in run["last_stderr_lines"][-1]


def test_served_outputs_with_the_plan_equal_the_reference(serve):
    assert serve["planned_vs_reference"]["differing"] == 0
    assert serve["vanilla_vs_reference"]["differing"] > 0  # the bug the plan fixes, under the server
    report = serve["planned"]["report"]
    assert report["graphs_captured"] == report["graphs_planned"] > 0
    assert sum("in force" in line for line in serve["planned"]["capplan_lines"]) == 1
