"""Probes against full starts: what `capplan calibrate` measures, and how well it prices another plan.

    python tests/gpu/probe_bench.py WORK OUT.json run [--until SECONDS] [--round pairs|inside|heldout]

Six shapes (`configs/`: Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B, Qwen2.5-7B, Qwen2.5-14B and the
MoE OLMoE-1B-7B, each its published config.json) with `--load-format dummy`, vLLM's OpenAI server under default
multiprocessing, 4 adapters at rank 16 with active-count specialization, max_model_len 4096. Plan
A: max_num_seqs 128, max_loras 4; plan B (the changed plan): max_num_seqs 256, max_loras 8. Jobs,
in this order, each recorded as it ends in WORK/jobs.jsonl (a later call goes on where one
stopped):
- `probe`: `capplan calibrate PLAN_A --model MODEL` (at capplan bbdf3c6, the run kept, each graph
  captured in a vLLM call of its own; since, each read inside vLLM's one capture);
  for the 1B, MODEL is its config.json alone (the probe's own path), else a folder with a
  word-level tokenizer;
- `start`: `capplan apply PLAN --report R -- vllm serve ...` with the same KV cache given as the
  probe's (4 GiB, so that vLLM's profiling pass is skipped and the capture is a first capture,
  as the probe's), to healthy, one greedy request, stopped;
- `profiled`: a start as `start`, but with vLLM's memory profiling (no KV cache given,
  `--gpu-memory-utilization 0.92`): both capture passes, vLLM's graph-memory estimate and the KV
  cache vLLM sized, beside the probe's first-capture figures;
Round `pairs` (the default; run at capplan bbdf3c6): for the 8B and the 1B: probe A, start A,
start B; then probes of A for the 14B and the MoE; then the 8B's profiled start; then starts of B
for the MoE and the 14B. Round `inside` (each graph read inside vLLM's one capture, report format
2): the 8B's probe of A from a cold compile cache, its start of A (the positive control: the
plan's memory as a start captures it, and whether the probe's compile served the start from
vLLM's cache), its probe of A again (a warm cache), then the 1B's probe and start of A. Round
`heldout` (the prices' held-out test; what each job will be priced at is written before the run by
`price_predictions.py`): for the 8B, Qwen2.5-7B and Llama-3.2-3B, a probe of A (the first from a
cold compile cache, as the machine comes) and a start of B; then the 8B's start of A (the machine
spread, and the probe's memory against a start's); then the 14B's probe of A and start of B. Probes
keep vLLM's log (`--keep-log`): each one's phases come from it.
Every record names the capplan commit, vLLM, torch, the GPU, the host CPU and the command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from deferred_serve import stop  # noqa: E402
from run_identity import BACKEND_LINE, identity  # noqa: E402
from serve_run import free_port, save_word_tokenizer  # noqa: E402
from start_bench import gpu_released, host_cpu, one_request, stamped_reader, until_healthy  # noqa: E402

SPEC = """\
target: {{runner: mrv2, vllm: "{release}"}}
scheduler: {{max_num_seqs: {seqs}, max_num_batched_tokens: 8192, max_model_len: 4096}}
cudagraph: {{mode: FULL_AND_PIECEWISE}}
lora: {{enabled: true, max_loras: {loras}, specialize: true, specialize_active: true}}
"""
PLANS = {"A": {"seqs": 128, "loras": 4}, "B": {"seqs": 256, "loras": 8}}
SHAPES = ("llama-3.1-8b", "llama-3.2-1b", "qwen2.5-14b", "olmoe-1b-7b", "qwen2.5-7b", "llama-3.2-3b")
ROUNDS = {
    "pairs": [
        ("llama-3.1-8b", "probe", "A"), ("llama-3.1-8b", "start", "A"), ("llama-3.1-8b", "start", "B"),
        ("llama-3.2-1b", "probe", "A"), ("llama-3.2-1b", "start", "A"), ("llama-3.2-1b", "start", "B"),
        ("qwen2.5-14b", "probe", "A"), ("olmoe-1b-7b", "probe", "A"), ("llama-3.1-8b", "profiled", "A"),
        ("olmoe-1b-7b", "start", "B"), ("qwen2.5-14b", "start", "B"),
    ],
    "inside": [
        ("llama-3.1-8b", "probe", "A"), ("llama-3.1-8b", "start", "A"), ("llama-3.1-8b", "probe-warm", "A"),
        ("llama-3.2-1b", "probe", "A"), ("llama-3.2-1b", "start", "A"),
    ],
    "heldout": [
        ("llama-3.1-8b", "probe", "A"), ("llama-3.1-8b", "start", "B"),
        ("qwen2.5-7b", "probe", "A"), ("qwen2.5-7b", "start", "B"),
        ("llama-3.2-3b", "probe", "A"), ("llama-3.2-3b", "start", "B"),
        ("llama-3.1-8b", "start", "A"), ("qwen2.5-14b", "probe", "A"), ("qwen2.5-14b", "start", "B"),
    ],
}  # fmt: skip
KV_BYTES = 4 << 30  # as the probe gives it
SERVE_ARGS = ["--max-lora-rank", "16", "--max-model-len", "4096", "--dtype", "bfloat16", "--seed", "0",
              "--served-model-name", "base"]  # fmt: skip
START_LIMIT_S = 600.0


def prepare(work: Path, shape: str, release: str) -> tuple[Path, Path, dict[str, Path]]:
    """The shape's model folder (config.json and a tokenizer), its config.json, and plans A and B."""
    folder = work / shape
    config = HERE / "configs" / f"{shape}.json"
    if not (folder / "tokenizer.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        data = json.loads(config.read_text())
        (folder / "config.json").write_text(json.dumps(data, indent=2))
        save_word_tokenizer(folder, data["vocab_size"])
    plans = {}
    for name, values in PLANS.items():
        spec, plan = work / f"plan{name}.yaml", work / f"plan{name}.plan.yaml"
        if not plan.exists():
            spec.write_text(SPEC.format(release=release, **values))
            subprocess.run([sys.executable, "-m", "capplan", "compile", str(spec), "-o", str(plan)], check=True)
        plans[name] = plan
    return folder, config, plans


def plan_args(name: str) -> list[str]:
    """vLLM's serve flags for plan `name`: the scheduler's sizes the plan was compiled for (vLLM
    derives its own from the GPU where none is given, and capplan refuses a mismatch)."""
    return ["--max-num-seqs", str(PLANS[name]["seqs"]), "--max-num-batched-tokens", "8192"]


def probe(work: Path, shape: str, plan: Path, model: Path, ident: dict, job: str = "probe", name: str = "A") -> dict:
    out = work / f"{shape}-{job}.calibration.yaml"
    for old in (out, work / f"{shape}-{job}.calibration.report.json", work / f"{shape}-{job}.calibration.log"):
        old.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "capplan", "calibrate", str(plan), "--model", str(model), "-o", str(out),
           "--keep-log", "--", *SERVE_ARGS, *plan_args(name)]  # fmt: skip
    t0 = time.perf_counter()
    got = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "VLLM_CACHE_ROOT": str(work / "cache")}
    )
    result = {"job": job, "shape": shape, "command": cmd, **ident, "seconds": round(time.perf_counter() - t0, 2),
              "exit": got.returncode, "stdout": got.stdout[-2000:], "stderr": got.stderr[-4000:]}  # fmt: skip
    kept = work / f"{shape}-{job}.calibration.report.json"
    if kept.exists():  # the runtime's report names no capplan commit: the kept file does
        kept.write_text(json.dumps({"capplan_commit": ident.get("capplan_commit"), **json.loads(kept.read_text())},
                                   indent=2) + "\n")  # fmt: skip
    gpu_released()
    return result


def start(work: Path, shape: str, name: str, plan: Path, model: Path, ident: dict, job: str = "start") -> dict:
    port = free_port()
    tag = f"{shape}-{job}{name}"
    report = work / f"{tag}.report.json"
    report.unlink(missing_ok=True)
    memory = ["--gpu-memory-utilization", "0.92"] if job == "profiled" else ["--kv-cache-memory-bytes", str(KV_BYTES)]
    cmd = [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(plan), "--report", str(report), "--",
           sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--load-format", "dummy",
           "--port", str(port), *memory, *SERVE_ARGS, *plan_args(name)]  # fmt: skip
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / "cache")}
    result: dict = {"job": job, "shape": shape, "plan": name, "command": cmd, **ident}
    lines: list = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    with (work / f"{tag}.log").open("w") as log:
        reader = threading.Thread(target=stamped_reader, args=(proc.stdout, lines, log), daemon=True)
        reader.start()
        try:
            result["healthy_s"] = until_healthy(proc, port, t0, START_LIMIT_S)
            result["request"] = one_request(port)
        except Exception as exc:  # noqa: BLE001 - recorded with the start
            result["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            stop(proc)
            reader.join(timeout=10)
            gpu_released()
    text = "".join(line for _, line in lines)
    result["attention_backend"] = sorted(set(BACKEND_LINE.findall(text)))
    result["tracebacks"] = text.count("Traceback")
    try:
        rep = json.loads(report.read_text())
        report.write_text(json.dumps({"capplan_commit": ident.get("capplan_commit"), **rep}, indent=2) + "\n")
        result["report"] = {k: rep.get(k) for k in ("graphs_planned", "graphs_captured", "capture_seconds",
                                                    "graph_memory_gib", "kv_cache", "vllm_estimate_gib",
                                                    "profiling_capture")}  # fmt: skip
    except (OSError, ValueError):
        pass
    return result


def run(work: Path, until: float, round_name: str = "pairs") -> None:
    import vllm

    work.mkdir(parents=True, exist_ok=True)
    record = work / "jobs.jsonl"
    done = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    ident = {**identity(), "host_cpu": host_cpu()}
    t_end = time.monotonic() + until
    for shape, job, name in ROUNDS[round_name]:
        if any(d["shape"] == shape and d["job"] == job and d.get("plan", "A") == name for d in done):
            continue
        if time.monotonic() > t_end:
            break
        folder, config, plans = prepare(work, shape, vllm.__version__.split("+")[0])
        print(f"{shape} {job} {name}", flush=True)
        if job.startswith("probe"):
            model = config if shape == "llama-3.2-1b" else folder
            result = probe(work, shape, plans[name], model, ident, job, name)
        else:
            result = start(work, shape, name, plans[name], folder, ident, job)
        done.append(result)
        with record.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(json.dumps({k: result.get(k) for k in ("shape", "job", "plan", "exit", "seconds", "healthy_s",
                                                        "error", "report")}), flush=True)  # fmt: skip


def main() -> None:
    work, what = Path(sys.argv[1]), sys.argv[3]  # argv[2]: the summary path, for the start bench's form
    until = float(sys.argv[sys.argv.index("--until") + 1]) if "--until" in sys.argv else 1e9
    round_name = sys.argv[sys.argv.index("--round") + 1] if "--round" in sys.argv else "pairs"
    if round_name not in ROUNDS:
        raise SystemExit(f"unknown round {round_name!r}: {', '.join(ROUNDS)}")
    if what == "run":
        run(work, until, round_name)
    else:
        raise SystemExit(f"unknown step {what!r}: run")


if __name__ == "__main__":
    main()
