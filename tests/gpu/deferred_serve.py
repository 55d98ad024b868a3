"""Deferred capture under `vllm serve` (vLLM's OpenAI server, default multiprocessing).

    python tests/gpu/deferred_serve.py WORK_DIR OUT.json

The tiny random Llama of serve_run.py (peaked logits: greedy outputs are stable across
graph sizes), 3 LoRA adapters, max_loras 3, specialize_active_lora on. Three servers,
one at a time:
- reference: vLLM alone with specialize_active_lora off (every LoRA graph has the full grid);
- full:      `capplan apply` with the plan, every graph captured before ready;
- tiers:     the same plan with spec tiers: only FULL:1x1@0 and the largest graph of each
             mode and LoRA case ready, the rest captured while serving, one before every step.
Each gets serve_run's groups of concurrent requests (k adapters plus base requests, k = 1..3,
adapters only, base only) right after /health answers, so the tiers server serves them while
its deferred graphs are still being captured (its report says how many steps ran on a
fallback); the tiers server then gets the groups again once every deferred graph landed.
Every pass is compared with the reference, request by request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_run import SPEC, build, free_port, groups_label, run_groups, server_command, wait_ready  # noqa: E402

TIERS = 'tiers: {ready: ["FULL:1x1@0"], every_steps: 1}\n'


def compile_plan(work: Path, name: str, extra: str) -> Path:
    spec = work / f"{name}.yaml"
    spec.write_text(SPEC.format(max_loras=3) + extra)
    plan = work / f"{name}.plan.yaml"
    subprocess.run([sys.executable, "-m", "capplan", "compile", str(spec), "-o", str(plan)], check=True)
    return plan


def read_report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def serve(name: str, model: Path, work: Path, specialize_active: bool, plan: Path | None) -> dict:
    port = free_port()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / f"cache-{name}"), "VLLM_USE_V2_MODEL_RUNNER": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = server_command(model, port, specialize_active)
    report = work / f"{name}.report.json"
    report.unlink(missing_ok=True)
    if plan is not None:
        cmd = [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(plan), "--report", str(report),
               "--", *cmd]  # fmt: skip
    log = (work / f"{name}.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    result: dict = {"name": name}
    try:
        result["ready_s"] = round(wait_ready(port, proc), 1)
        started = time.perf_counter()
        result["texts"] = run_groups(port)
        result["groups_s"] = round(time.perf_counter() - started, 2)
        during = read_report(report)
        if during is not None and during.get("deferred") is not None:
            d = during["deferred"]
            result["after_first_pass"] = {k: d[k] for k in ("captured", "fallback_steps", "steps_seen")}
            deadline = time.perf_counter() + 120
            while time.perf_counter() < deadline:
                rep = read_report(report)
                if rep is not None and not rep["deferred"]["pending"]:
                    break
                time.sleep(0.5)
            result["landed_after_s"] = round(time.perf_counter() - started, 2)
            result["texts_after_landing"] = run_groups(port)
    except Exception as exc:  # noqa: BLE001 - keep what the other servers measured
        result["error"] = f"{type(exc).__name__}: {exc}"
        result.setdefault("texts", {})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    text = (work / f"{name}.log").read_text(errors="replace")
    result["capplan_lines"] = [line for line in text.splitlines() if "capplan" in line][-8:]
    if "error" in result:
        result["log_tail"] = text.splitlines()[-40:]
    rep = read_report(report)
    if rep is not None:
        result["report"] = rep
    return result


def compare(ref: dict, texts: dict) -> dict:
    wrong = sorted(k for k in ref if texts.get(k, {}).get("text") != ref[k]["text"])
    return {
        "requests": len(ref),
        "differing": len(wrong),
        "groups": sorted({groups_label(ref[k]["group"]) for k in wrong}),
    }


def main() -> None:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    model = build(work)
    full = compile_plan(work, "full", "")
    tiers = compile_plan(work, "tiers", TIERS)
    results: dict = {}
    results["reference"] = serve("reference", model, work, False, None)
    results["full"] = serve("full", model, work, True, full)
    results["tiers"] = serve("tiers", model, work, True, tiers)
    ref = results["reference"]["texts"]
    results["full_vs_reference"] = compare(ref, results["full"]["texts"])
    results["tiers_during_capture_vs_reference"] = compare(ref, results["tiers"]["texts"])
    results["tiers_after_landing_vs_reference"] = compare(ref, results["tiers"].get("texts_after_landing", {}))
    for run in ("reference", "full", "tiers"):
        results[run].pop("texts", None)
        results[run].pop("texts_after_landing", None)
    out.write_text(json.dumps(results, indent=2))
    short = {k: v for k, v in results.items() if k.endswith("reference")}
    short["ready_s"] = {k: results[k].get("ready_s") for k in ("reference", "full", "tiers")}
    short["tiers"] = {k: results["tiers"].get(k) for k in ("after_first_pass", "landed_after_s", "error")}
    deferred = (results["tiers"].get("report") or {}).get("deferred")
    if deferred:
        short["deferred"] = {k: v for k, v in deferred.items() if k != "captures"}
    print(json.dumps(short, indent=1))


if __name__ == "__main__":
    main()
