"""Tensor parallel 2 on two GPUs: the plan in force on both ranks, outputs equal to the reference.

Two engines (tests/gpu/engine_run.py, tensor_parallel_size 2): the reference
(specialize_active_lora off, no plan) and the plan (specialize_active_lora on).
Each TP rank's process writes its own report ({pid} in CAPPLAN_REPORT).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
OUT = Path(os.environ.get("CAPPLAN_GPU_OUT", "/tmp/capplan-gpu"))
SPEC = Path(__file__).resolve().parents[2] / "configs" / "h200-tiny-llama-025.yaml"


def _engine(name, model, work, specialize_active, plan=None):
    out = work / f"{name}.json"
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / f"cache-{name}")}
    if plan is not None:
        env["CAPPLAN_PLAN"] = str(plan)
        env["CAPPLAN_REPORT"] = str(work / f"{name}.{{pid}}.report.json")
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "engine_run.py"),
            str(model),
            str(out),
            "--specialize-active",
            str(specialize_active),
            "--engine",
            json.dumps({"tensor_parallel_size": 2}),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    reports = [json.loads(p.read_text()) for p in sorted(work.glob(f"{name}.*.report.json"))]
    return (
        json.loads(out.read_text())["results"],
        reports,
        [line for line in (proc.stdout + proc.stderr).splitlines() if "capplan" in line][-6:],
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch
    import vllm

    from capplan.releases import runs_on

    if torch.cuda.device_count() < 2 or vllm.__version__.split("+")[0] not in runs_on("0.25"):
        pytest.skip("needs two GPUs and vLLM 0.25")
    sys.path.insert(0, str(HERE))
    from make_model import build

    work = tmp_path_factory.mktemp("tp")
    model = work / "model"
    build(model)
    plan = work / "tp.plan.yaml"
    subprocess.run([sys.executable, "-m", "capplan", "compile", str(SPEC), "-o", str(plan)], check=True)
    ref, _, _ = _engine("reference", model, work, 0)
    planned, reports, lines = _engine("planned", model, work, 1, plan)
    a = {(r["batch"], r["req"]): r["tokens"] for r in ref}
    b = {(r["batch"], r["req"]): r["tokens"] for r in planned}
    summary = {
        "requests": len(a),
        "differing": sum(a[k] != b.get(k) for k in a),
        "capplan_lines": lines,
        "reports": [{k: r[k] for k in ("graphs_planned", "graphs_captured", "pid")} for r in reports],
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_tp.json").write_text(json.dumps(summary, indent=2))
    return summary


def test_tp2_plan_in_force_on_both_ranks_and_outputs_equal_reference(runs):
    assert runs["differing"] == 0
    assert len(runs["reports"]) == 2
    assert all(r["graphs_captured"] == r["graphs_planned"] == 78 for r in runs["reports"])
