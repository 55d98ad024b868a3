"""A traffic-optimized plan on the H200: fewer graphs, less capture time and memory, same outputs.

The trace is the workload engine_run.py serves (9 batches of 8 requests: one
prefill step, then 15 uniform decode steps each; k = 0..4 adapters, with and
without base requests). `capplan optimize` chooses sizes per LoRA case under
a 24-graph budget; the optimized engine (vLLM started with the optimized
spec's capture sizes) and the default planned engine both run the workload
with specialize_active_lora on, and must produce identical tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.gpu import engine_run
from tests.gpu.test_lora_graphs import OUT, _differing, run_engine
from tests.gpu.test_lora_graphs import setup as setup  # noqa: F401  (a module fixture used by name)


def _trace(path: Path) -> None:
    lines = []
    for b, (k, base) in enumerate(engine_run.BATCHES):
        prompts = engine_run.prompts_for(b)
        tokens = sum(len(p) for p in prompts)
        lines.append(
            {
                "num_reqs": 8,
                "num_tokens": tokens,
                "max_query_len": max(map(len, prompts)),
                "adapters": k,
                "base": base and k > 0,
                "has_prefill": True,
            }
        )
        lines.append(
            {"num_reqs": 8, "num_tokens": 8, "max_query_len": 1, "adapters": k, "base": base and k > 0, "count": 15}
        )
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_optimized_plan_captures_less_and_answers_the_same(setup):
    work, model, default_plan, version = setup
    trace = work / "workload.jsonl"
    _trace(trace)
    spec = work / "tiny.yaml"
    opt_spec = work / "tiny.optimized.yaml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "capplan.cli",
            "optimize",
            str(spec),
            str(trace),
            "--max-graphs",
            "24",
            "-o",
            str(opt_spec),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    opt_plan = work / "tiny.optimized.plan.yaml"
    subprocess.run([sys.executable, "-m", "capplan.cli", "compile", str(opt_spec), "-o", str(opt_plan)], check=True)
    import yaml

    sizes = yaml.safe_load(opt_spec.read_text())["cudagraph"]["capture_sizes"]
    default = run_engine("default_planned", model, work, 1, work / "cache-default", plan=default_plan)
    optimized = run_engine(
        "optimized",
        model,
        work,
        1,
        work / "cache-opt",
        plan=opt_plan,
        extra=["--capture-sizes", ",".join(map(str, sizes))],
    )
    diff = _differing(default, optimized)
    summary = {
        "optimize_stdout": proc.stdout[-1500:],
        "capture_sizes": sizes,
        "default": default["report"],
        "optimized": optimized["report"],
        "differing_requests": len(diff),
        "default_startup_s": default["startup_s"],
        "optimized_startup_s": optimized["startup_s"],
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_optimized.json").write_text(json.dumps(summary, indent=2))
    assert diff == [], f"{len(diff)} requests differ: {diff[:8]}"
    d, o = default["report"], optimized["report"]
    assert o["graphs_captured"] == o["graphs_planned"] <= 24 < d["graphs_captured"]
    assert o["capture_seconds"] < d["capture_seconds"]
    assert o["dispatch"]["graph_hits"] > 0
