"""Dummy runs outside capture on vLLM 0.25 MRV2: 8192 tokens over 100 dummy requests with
max_model_len 128 (vLLM alone piles a 173-token request on the last one).

Two engines, one process each: vLLM alone, and the same engine with the plan in force
(dummy_remainder spreads every dummy path). Both are asked the same 72 requests; the
outcome of each (started, crashed, device errors in the log) is saved for the record.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
OUT = Path(os.environ.get("CAPPLAN_GPU_OUT", "/tmp/capplan-gpu"))
ENGINE = {"max_num_seqs": 100, "max_num_batched_tokens": 8192, "max_model_len": 128}
SPEC = """\
target: {runner: mrv2, vllm: "0.25"}
scheduler: {max_num_seqs: 100, max_num_batched_tokens: 8192, max_model_len: 128}
cudagraph: {mode: FULL_AND_PIECEWISE}
lora: {enabled: true, max_loras: 4, specialize: true, specialize_active: false}
"""
DEVICE_ERRORS = re.compile(r"illegal memory access|device-side assert|CUDA error|out of bounds|Segmentation fault")


def _engine(name: str, model: Path, work: Path, plan: Path | None) -> dict:
    out = work / f"{name}.json"
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / f"cache-{name}")}
    env.pop("CAPPLAN_PLAN", None)
    if plan is not None:
        env["CAPPLAN_PLAN"] = str(plan)
        env["CAPPLAN_REPORT"] = str(work / f"{name}.report.json")
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "engine_run.py"),
            str(model),
            str(out),
            "--specialize-active",
            "0",
            "--engine",
            json.dumps(ENGINE),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    text = proc.stdout + proc.stderr
    result = {
        "returncode": proc.returncode,
        "device_errors": sorted(set(DEVICE_ERRORS.findall(text))),
        "log_tail": [line for line in text.splitlines() if "capplan" in line or "Error" in line][-8:],
    }
    if out.exists():
        result["results"] = json.loads(out.read_text())["results"]
    if plan is not None and (work / f"{name}.report.json").exists():
        result["report"] = json.loads((work / f"{name}.report.json").read_text())
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import vllm

    from capplan.runtime.versions import detect_release

    if detect_release(vllm.__version__).rules.spreads_dummy_remainder:
        pytest.skip("vLLM piles the dummy remainder only before 0.27")
    sys.path.insert(0, str(HERE))
    from make_model import build

    work = tmp_path_factory.mktemp("dummy")
    model = work / "model"
    build(model)
    spec = work / "long-dummy.yaml"
    spec.write_text(SPEC)
    plan = work / "long-dummy.plan.yaml"
    subprocess.run([sys.executable, "-m", "capplan", "compile", str(spec), "-o", str(plan)], check=True)
    out = {"vanilla": _engine("vanilla", model, work, None), "planned": _engine("planned", model, work, plan)}
    OUT.mkdir(parents=True, exist_ok=True)
    summary = {name: {k: v for k, v in run.items() if k != "results"} for name, run in out.items()}
    if "results" in out["vanilla"] and "results" in out["planned"]:
        a = {(r["batch"], r["req"]): r["tokens"] for r in out["vanilla"]["results"]}
        b = {(r["batch"], r["req"]): r["tokens"] for r in out["planned"]["results"]}
        summary["requests"] = len(b)
        summary["planned_vs_vanilla_differing"] = sum(a[k] != b[k] for k in b)
    (OUT / "gpu_dummy_runs.json").write_text(json.dumps(summary, indent=2))
    return out


def test_engine_with_the_plan_starts_serves_and_keeps_the_plan_in_force(runs):
    planned = runs["planned"]
    assert planned["returncode"] == 0, planned["log_tail"]
    assert planned["device_errors"] == []
    assert len(planned["results"]) == 72
    report = planned["report"]
    assert report["graphs_captured"] == report["graphs_planned"] > 0
