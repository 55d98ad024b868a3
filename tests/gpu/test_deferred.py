"""Deferred capture under vLLM's OpenAI server with default multiprocessing
(tests/gpu/deferred_serve.py): outputs while the deferred graphs are being captured and
once they landed equal the reference engine's, and the final graph set is the plan's."""

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
def served(tmp_path_factory):
    import vllm

    from capplan.releases import RELEASES

    if RELEASES.get(vllm.__version__.split("+")[0]) is None:
        pytest.skip(f"vLLM {vllm.__version__} is not a release capplan supports")
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / "gpu_deferred.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "deferred_serve.py"), str(tmp_path_factory.mktemp("deferred")), str(out)],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_outputs_during_and_after_deferred_capture_equal_the_reference(served):
    assert served["full_vs_reference"]["differing"] == 0
    assert served["tiers_during_capture_vs_reference"]["differing"] == 0
    assert served["tiers_after_landing_vs_reference"]["differing"] == 0
    assert served["tiers"]["after_first_pass"]["fallback_steps"] > 0  # the window was exercised


def test_every_deferred_graph_landed_and_the_final_set_is_the_plan(served):
    report = served["tiers"]["report"]
    deferred = report["deferred"]
    assert deferred["pending"] == [] and deferred["captured"] == deferred["deferred"] > 0
    assert report["graphs_captured"] == report["graphs_planned"]
    assert len(deferred["captures"]) == deferred["deferred"]
    assert deferred["longest_step_pause_seconds"] > 0
