"""The real-traffic loop, served: record, calibrate, optimize, serve again, compare.

    python tests/gpu/served_loop.py WORK OUT [--stop-after SECONDS]

On a ~0.9B random Llama (hidden 2048, 16 layers, bf16) with 4 LoRA adapters,
max_loras 4, specialize_active_lora on, served by vLLM's OpenAI server with
default multiprocessing. A load generator sends a chat-like mix: Poisson
arrivals, prompts 32-1024 tokens (log-uniform), outputs 16-512 tokens
(uniform, ignore_eos), 30% base requests and 70% spread over the adapters,
streamed (TTFT and TPOT per request from the stream).

Stages (each one's result is kept in WORK, so a later call resumes):
1. model:     build the model, adapters and a tokenizer;
2. record:    serve sample A under the spec's default plan with `capplan apply --trace`;
3. calibrate: `capplan calibrate-steps` (capture cost of three plans, decode step times);
4. optimize:  `capplan optimize` on trace A with that calibration, at most 40% of
              the graphs vLLM alone captures; `capplan simulate` predictions;
5. vllm / default / optimized: serve sample B (another seed of the same
              distribution) with vLLM alone, the default plan and the optimized plan;
6. summary:   the comparison table, the calibration's fit error (predicted vs
              measured step time on sample B), the recorder's overhead.
Results land in OUT/served_loop.json (and .md).

More plans can be served on sample B beside these, each a stage of its own:
`--plan NAME=SPEC` (repeatable) compiles SPEC and serves it as stage NAME;
`--stages a,b,...` runs only the stages named (with a fresh WORK, `model` first);
`--calibration PATH` is the step model the summary predicts with (default: the
one the calibrate stage wrote).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

SPEC = """\
# A ~0.9B Llama with 4 LoRA adapters behind vLLM's OpenAI server.
target: {runner: mrv2, vllm: "0.25"}
scheduler: {max_num_seqs: 256, max_num_batched_tokens: 8192, max_model_len: 2048}
cudagraph: {mode: FULL_AND_PIECEWISE}
lora: {enabled: true, max_loras: 4, specialize: true, specialize_active: true}
"""
REQUESTS = 1000
RATE = 30.0  # requests per second (Poisson)
ADAPTERS = 4
LLM_ARGS = {"attention_backend": "TRITON_ATTN", "gpu_memory_utilization": 0.5, "max_lora_rank": 8, "dtype": "bfloat16"}
CAPTURE_LINE = re.compile(r"Graph capturing finished in ([\d.]+) secs?, took ([\d.]+) GiB")
T0 = time.monotonic()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_run import free_port, save_word_tokenizer  # noqa: E402

# Seconds each stage took on the H200 (or a guess), so a call with a time limit stops between stages.
EXPECTED_S = dict(model=90, record=170, calibrate=330, optimize=30, vllm=170, default=170, optimized=130, summary=20)


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.0f}s] {msg}", flush=True)


def capplan(*args: str, env: dict | None = None) -> str:
    proc = subprocess.run([sys.executable, "-m", "capplan", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"capplan {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def build_model(model: Path) -> None:
    """Random bf16 weights built on the GPU, peft adapters on q/k/v/o, a word-level tokenizer."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = LlamaForCausalLM(config).to(torch.bfloat16)
    base.save_pretrained(model / "base", safe_serialization=True)
    save_word_tokenizer(model / "base", 32000)
    lora = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(base, lora)
    for i in range(1, ADAPTERS + 1):
        torch.manual_seed(100 + i)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.normal_(0, 0.02)
        peft_model.save_pretrained(model / f"lora{i}")


def sample(seed: int) -> list[dict]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(REQUESTS):
        t += rng.expovariate(RATE)
        plen = int(math.exp(rng.uniform(math.log(32), math.log(1024))))
        adapter = None if rng.random() < 0.3 else f"a{rng.randint(1, ADAPTERS)}"
        out.append(
            {
                "at": t,
                "prompt": [rng.randint(10, 31000) for _ in range(plen)],
                "max_tokens": rng.randint(16, 512),
                "model": adapter or "base",
            }
        )
    return out


def server_command(model: Path, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model / "base"),
        "--served-model-name",
        "base",
        "--port",
        str(port),
        "--enable-lora",
        "--max-loras",
        "4",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        *[f"a{i}={model / f'lora{i}'}" for i in range(1, ADAPTERS + 1)],
        "--max-num-seqs",
        "256",
        "--max-num-batched-tokens",
        "8192",
        "--max-model-len",
        "2048",
        "--gpu-memory-utilization",
        "0.5",
        "--attention-backend",
        "TRITON_ATTN",
        "--dtype",
        "bfloat16",
        "--seed",
        "0",
        "--specialize-active-lora",
    ]


def one_request(port: int, req: dict, start: float, out: dict) -> None:
    delay = start + req["at"] - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    body = json.dumps(
        {
            "model": req["model"],
            "prompt": req["prompt"],
            "max_tokens": req["max_tokens"],
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                now = time.perf_counter()
                first = first or now
                last = now
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        conn.close()
    except Exception as exc:  # noqa: BLE001 - counted as a failed request
        out["error"] = f"{type(exc).__name__}: {exc}"
    out.update(sent=sent, first=first, last=last, tokens=tokens)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def stream_stats(results: list[dict], seconds: float) -> dict:
    """Output tokens per second, TTFT and TPOT percentiles of streamed requests."""
    ok = [r for r in results if "error" not in r and r.get("first") is not None]
    ttft = [1000 * (r["first"] - r["sent"]) for r in ok]
    tpot = [1000 * (r["last"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    out_tokens = sum(r["tokens"] for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "output_tokens": out_tokens,
        "duration_s": round(seconds, 2),
        "output_tok_per_s": round(out_tokens / seconds, 1),
        "ttft_ms_p50": round(pct(ttft, 0.5), 2),
        "ttft_ms_p99": round(pct(ttft, 0.99), 2),
        "tpot_ms_p50": round(pct(tpot, 0.5), 3),
        "tpot_ms_p99": round(pct(tpot, 0.99), 3),
    }


def load(port: int, requests: list[dict]) -> dict:
    results = [{} for _ in requests]
    start = time.perf_counter() + 0.5
    threads = [threading.Thread(target=one_request, args=(port, r, start, o)) for r, o in zip(requests, results)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = max(r["last"] for r in results if "error" not in r and r.get("first") is not None)
    return stream_stats(results, end - start)


def wait_ready(port: int, proc: subprocess.Popen, limit: float = 420) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < limit:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not ready")


def serve(name: str, work: Path, requests: list[dict], plan: Path | None, trace: Path | None) -> dict:
    port = free_port()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / f"cache-{name}"), "VLLM_USE_V2_MODEL_RUNNER": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's default: engine core in its own process
    cmd = server_command(work / "model", port)
    report = work / f"{name}.report.json"
    if plan is not None:
        sizes = json.loads(capplan("show", str(plan), "--json"))["capture_sizes"]
        cmd += ["--compilation-config", json.dumps({"cudagraph_capture_sizes": sizes})]  # what the plan captures
        wrap = [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(plan), "--report", str(report)]
        if trace is not None:
            wrap += ["--trace", str(trace)]
        cmd = [*wrap, "--", *cmd]
    log_path = work / f"{name}.log"
    result: dict = {"name": name, "plan": plan.name if plan else None}
    with log_path.open("w") as log_file:
        launched = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            result["engine_start_s"] = round(wait_ready(port, proc), 1)
            log(f"{name}: ready in {result['engine_start_s']} s; sending {len(requests)} requests")
            result.update(load(port, requests))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        result["wall_s"] = round(time.perf_counter() - launched, 1)
    text = log_path.read_text(errors="replace")
    captured = CAPTURE_LINE.findall(text)
    if captured:
        result["vllm_capture_s"], result["vllm_graph_gib"] = float(captured[-1][0]), float(captured[-1][1])
    if report.exists():
        rep = json.loads(report.read_text())
        result["graphs"] = rep["graphs_captured"]
        result["vllm_alone_graphs"] = rep["vllm_would_capture"]
        result["capture_s"] = rep["capture_seconds"]
        result["graph_gib"] = rep["graph_memory_gib"]
        result["eager_steps"] = rep["dispatch"]["eager"]
        result["graph_steps"] = rep["dispatch"]["graph_hits"]
        result["trace"] = rep.get("trace")
    result["capplan_lines"] = [line for line in text.splitlines() if "capplan" in line][-4:]
    return result


def busy_step_seconds(trace: Path, gap: float = 0.1) -> tuple[float, int]:
    """Measured step time: the sum of intervals between consecutive recorded steps, leaving
    out idle gaps (> `gap` s); and the number of steps counted."""
    times = []
    for line in trace.read_text().splitlines():
        if line.startswith("{"):
            times.append(json.loads(line)["t"])
    deltas = [b - a for a, b in zip(times, times[1:]) if b - a <= gap]
    return sum(deltas), len(deltas)


def option(name: str, default: str | None = None) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main() -> None:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    stop_after = float(option("--stop-after", "1e9"))
    extra = dict(arg.split("=", 1) for flag, arg in zip(sys.argv, sys.argv[1:]) if flag == "--plan")
    calibration = option("--calibration")
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    state_path = work / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    spec = work / "llama1b.yaml"
    spec.write_text(SPEC)
    os.environ["CAPPLAN_SMOKE_LLM_ARGS"] = json.dumps(LLM_ARGS)

    def done(stage: str, value) -> None:
        state[stage] = value
        state_path.write_text(json.dumps(state, indent=2))
        (out / "served_loop.json").write_text(json.dumps(state, indent=2))

    stages = ["model", "record", "calibrate", "optimize", "vllm", "default", "optimized", *extra, "summary"]
    only = option("--stages")
    if only:
        stages = [s for s in stages if s in only.split(",")]
    for stage in stages:
        if stage in state and stage != "summary":
            continue
        if time.monotonic() - T0 + EXPECTED_S.get(stage, 140) > stop_after:
            log(f"stopping before {stage} (it would pass --stop-after); run again to resume")
            return
        log(f"stage {stage}")
        if stage == "model":
            build_model(work / "model")
            capplan("compile", str(spec), "-o", str(work / "default.plan.yaml"))
            done(stage, {"params_b": 0.86})
        elif stage == "record":
            done(stage, serve("record", work, sample(1), work / "default.plan.yaml", work / "traceA.jsonl"))
        elif stage == "calibrate":
            env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # vLLM's default
            t = time.perf_counter()
            capplan(
                "calibrate-steps", str(spec), "--model", str(work / "model"), "-o", str(work / "h200.yaml"), env=env
            )
            (out / "h200-calibration.yaml").write_text((work / "h200.yaml").read_text())
            done(stage, {"seconds": round(time.perf_counter() - t, 1)})
        elif stage == "optimize":
            vllm_graphs = state["record"]["vllm_alone_graphs"]
            budget = int(0.4 * vllm_graphs)
            cal = str(work / "h200.yaml")
            text = capplan(
                "optimize", str(spec), str(work / "traceA.jsonl"), "--calibration", cal,
                "--max-graphs", str(budget), "-o", str(work / "optimized.yaml"),
            )  # fmt: skip
            capplan("compile", str(work / "optimized.yaml"), "-o", str(work / "optimized.plan.yaml"))
            (out / "optimize.txt").write_text(text)
            (out / "optimized.yaml").write_text((work / "optimized.yaml").read_text())
            done(stage, {"budget_graphs": budget, "vllm_alone_graphs": vllm_graphs})
        elif stage == "vllm":
            done(stage, serve("vllm", work, sample(2), None, None))
        elif stage == "default":
            done(stage, serve("default", work, sample(2), work / "default.plan.yaml", work / "traceB-default.jsonl"))
        elif stage == "optimized":
            done(stage, serve("optimized", work, sample(2), work / "optimized.plan.yaml", work / "traceB-opt.jsonl"))
        elif stage in extra:
            plan = work / f"{stage}.plan.yaml"
            capplan("compile", extra[stage], "-o", str(plan))
            done(stage, serve(stage, work, sample(2), plan, work / f"traceB-{stage}.jsonl"))
        elif stage == "summary":
            done(stage, summary(work, out, state, calibration or str(work / "h200.yaml")))
    log("all stages done")


LABELS = {"vllm": "vLLM alone", "default": "default plan", "optimized": "optimized plan"}


def summary(work: Path, out: Path, state: dict, cal: str) -> dict:
    """The comparison table of every serve of sample B, the step model's fit on each plan's
    trace of sample B, and the cost model's estimates of each plan."""
    served = [name for name in state if name not in ("model", "record", "calibrate", "optimize", "summary")]
    planned = [name for name in served if state[name].get("plan")]
    # What vLLM alone captures, as the default plan's runtime report counted it (a plan with
    # other capture sizes reports what vLLM would capture for those sizes, not for the spec's).
    vllm_graphs = next((state[n]["vllm_alone_graphs"] for n in ("default", "record") if n in state), None)
    fit, cost = {}, {}
    for name in planned:
        plan, trace = work / f"{name}.plan.yaml", work / f"traceB-{name}.jsonl"
        if name == "default":
            trace = work / "traceB-default.jsonl"
        elif name == "optimized":
            trace = work / "traceB-opt.jsonl"
        sim = json.loads(capplan("simulate", str(plan), str(trace), "--calibration", cal, "--json"))
        measured, counted = busy_step_seconds(trace)
        fit[name] = {
            "steps": sim["steps"],
            "predicted_step_s": sim["predicted_step_seconds"],
            "measured_busy_step_s": round(measured, 3),
            "busy_intervals": counted,
            "eager_steps_simulated": sim["eager_steps"],
        }
        shown = json.loads(capplan("show", str(plan), "--calibration", cal, "--json"))
        cost[name] = {
            "estimate": shown["estimate"],
            "measured_capture_s": state[name].get("vllm_capture_s"),
            "measured_graph_gib": state[name].get("vllm_graph_gib"),
        }
    table = []
    for name in served:
        r = state[name]
        table.append(
            {
                "run": LABELS.get(name, f"{name} plan"),
                "engine_start_s": r.get("engine_start_s"),
                "graphs": r.get("graphs", vllm_graphs if name == "vllm" else None),
                "capture_s": r.get("vllm_capture_s"),
                "graph_gib": r.get("vllm_graph_gib"),
                "output_tok_per_s": r.get("output_tok_per_s"),
                "ttft_ms_p50": r.get("ttft_ms_p50"),
                "ttft_ms_p99": r.get("ttft_ms_p99"),
                "tpot_ms_p50": r.get("tpot_ms_p50"),
                "tpot_ms_p99": r.get("tpot_ms_p99"),
                "eager_steps": r.get("eager_steps"),
                "recorder_us_per_step": (r.get("trace") or {}).get("overhead_us_per_step"),
                "failed": r.get("failed"),
            }
        )
    keys = list(table[0])
    md = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    md += ["| " + " | ".join(str(row[k]) for k in keys) + " |" for row in table]
    (out / "served_loop.md").write_text("\n".join(md) + "\n")
    return {"calibration": Path(cal).name, "table": table, "fit": fit, "estimates": cost}


if __name__ == "__main__":
    main()
