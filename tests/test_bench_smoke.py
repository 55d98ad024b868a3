"""Keeps bench/ from rotting: a tiny capplan-only run (no timing is asserted)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_runs_on_a_tiny_spec(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--capplan-only",
            "--quick",
            "--specs",
            "small",
            "--queries",
            "2000",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "compile (spec -> plan)" in proc.stdout and "dispatch per call" in proc.stdout
    data = json.loads(out.read_text())
    small = data["specs"]["small"]
    assert small["load_verify"]["verify_ok"] is True
    assert small["dispatch"]["queries"] == 2000
    assert data["cli"].get("heavy_modules_imported", []) == []


def test_traffic_bench_runs_and_meets_its_targets(tmp_path):
    out = tmp_path / "traffic.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.traffic", "--capplan-only", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert set(rows) == {"bursty", "chat", "multitenant"}
    for row in rows.values():
        assert row["optimized_plans_verify"] and row["capplan_sim_of_vllm_plan_agrees"]
        assert row["met_60pct_no_more_padding"] or row["met_half_padding_same_graphs"]
