"""The plan in force under `vllm serve` on whichever release is installed (tests/gpu/release_run.py)."""

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
def run(tmp_path_factory):
    from importlib.metadata import version

    from capplan.releases import installed_release

    if installed_release(version("vllm")) is None:
        pytest.skip(f"vLLM {version('vllm')} is not a release capplan supports")
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / "release_run.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "release_run.py"), str(tmp_path_factory.mktemp("release")), str(out)],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_plan_is_in_force_once_and_captures_every_planned_graph_once(run):
    for name in ("planned", "dummy"):
        server = run[name]
        # no traceback the reference server (same bundle, same settings, no plan) did not log too: a
        # bundle's optional-module probe (DeepGEMM on 0.32.0's) logs one in every server
        assert "error" not in server and server["tracebacks"] <= run["reference"]["tracebacks"], server.get("log_tail")
        report = server["report"]
        assert report["graphs_captured"] == report["graphs_planned"] > 0
        assert server["in_force_lines"] == 1


def test_vllm_alone_shows_the_no_lora_slot_bug_and_the_plan_does_not(run):
    assert run["vanilla_vs_reference"]["differ_clearly"] > 0  # the comparison catches a real error
    assert run["planned_vs_reference"]["differ_clearly"] == 0


def test_a_mismatched_plan_is_refused_before_weights_load(run):
    mismatch = run["mismatch"]
    assert mismatch["returncode"] not in (0, None) and not mismatch["weights_loaded"]
    assert "--max-loras 3: the plan has lora.max_loras 2" in mismatch["last_stderr_lines"][-1]
    v1 = run["v1"]
    assert v1["returncode"] not in (0, None) and "V1 model runner" in v1["last_stderr_lines"][-1]


def test_the_profiling_capture_is_reported_where_the_release_has_one(run):
    from capplan.releases import RELEASES

    profiled = run["planned"]["report"]["profiling_capture"]
    if RELEASES[run["release"]].profiling_capture:
        assert profiled is not None and profiled["graphs"] > 0
    else:
        assert profiled is None
