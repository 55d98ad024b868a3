"""vLLM's API server loads capplan's plugin while `vllm serve` builds its parser: there the plugin
imports no vLLM module the server would not import without it (the engine's hooks wait for their
modules' imports; before, 517 modules on 0.33.0 with a plan and 138 without one, about 2 s before
vLLM's first line at 8B on an H100). The engine's hooks then go in at those imports, in the
process and in one forked from it, and a hook that does not fit fails that import with capplan's
line. In a fresh process on the oracle's Python (its fork server has imported the engine's
modules already), on the oldest and the newest release."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from capplan.planfile import load_plan
from tests.conformance import oracle_python
from tests.conformance.test_vllm_conformance import _missing, _oracle_ready

CHECK = Path(__file__).with_name("lazy_hooks_check.py")
SPEC = """\
target: {{runner: mrv2, vllm: "{version}"}}
scheduler: {{max_num_seqs: 16, max_num_batched_tokens: 512, max_model_len: 512}}
cudagraph: {{mode: FULL_AND_PIECEWISE}}
lora: {{enabled: true, max_loras: 4, specialize_active: true}}
"""
pytestmark = pytest.mark.conformance


TIERS = "tiers: {ready: full_decode}\n"


@pytest.mark.parametrize("version, tiers", [("0.25.0", False), ("0.33.0", False), ("0.33.0", True)])
def test_the_api_server_imports_nothing_for_capplan_and_the_engine_gets_every_hook(version, tiers, tmp_path):
    if not _oracle_ready(version):
        pytest.skip(_missing(version))
    spec, plan = tmp_path / "spec.yaml", tmp_path / "spec.plan.yaml"
    spec.write_text(SPEC.format(version=version) + (TIERS if tiers else ""))
    subprocess.run(
        [sys.executable, "-m", "capplan", "compile", str(spec), "-o", str(plan)], check=True, capture_output=True
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(oracle_python.python_path(version))}
    env.pop("CAPPLAN_PLAN", None)
    job = subprocess.run(
        [str(oracle_python.PYTHON), str(CHECK), str(plan)], env=env, capture_output=True, text=True, timeout=600
    )
    assert job.returncode == 0, job.stderr[-3000:]
    got = json.loads(job.stdout.strip().splitlines()[-1])
    alone = set(got["alone"]["modules"])
    assert "vllm.v1.worker.gpu.model_runner" not in alone  # what the comparison rests on
    assert sorted(set(got["guard"]["modules"]) - alone) == []
    assert sorted(set(got["plan"]["modules"]) - alone) == []
    assert got["guard"]["guard_in_place"] is True
    graphs = len(load_plan(plan).graphs)
    for where in ("forked", "here"):
        placed = got["plan"][where]
        assert placed["selected"] and placed["in_place"] == placed["selected"], placed
        assert placed["descriptors"] == graphs > 0, placed
    refused = got["refused"]
    assert refused["raised"] == "IncompatibleVllm" and not refused["imported"], refused
    assert refused["line"].startswith("capplan: this vLLM") and "has no parameter no_such" in refused["line"]
