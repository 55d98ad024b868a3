"""Served A/B: vLLM alone against a capplan plan, arms interleaved, ratios with intervals.

    python tests/gpu/served_ab.py WORK OUT --plan PLAN [--plan-a PLAN_A] [--repeats 5] [--seconds 60]
        [--shapes throughput,arrival] [--concurrency 64] [--rate 30] [--gpu-util 0.4]

Both arms serve the same ~0.9B random Llama with 4 LoRA adapters through vLLM's
OpenAI server with default multiprocessing (served_loop.py builds it in
WORK/model): arm A is vLLM alone (or `capplan apply` with PLAN_A), arm B is
`capplan apply --runner mrv2 PLAN`. An arm whose plan defers graphs (spec
tiers) is measured once every deferred graph landed: after both started, the
harness waits for its report to list none pending (and records how long that took).
The two servers are started one after the other (so neither start-up or
capture shares the GPU with the other), then both stay up and the load
alternates between them: repeat r runs A then B when r is even, B then A when
odd, each run `--seconds` long, in two shapes:

- throughput: `--concurrency` closed-loop clients, each sending its next
  request when the last one finished (the server is saturated);
- arrival:    Poisson arrivals at `--rate` requests per second (open loop),
  the same arrival sequence for both arms of a repeat.

Requests: prompts 32-1024 tokens (log-uniform), outputs 16-256 tokens
(ignore_eos), 30% base and 70% spread over the adapters, streamed (TTFT and
TPOT from the stream). A request still running at the end of a window is
waited for and counted.

For each metric (output tok/s, TTFT p50/p99, TPOT p50/p99) the harness pairs
the arms' runs of a repeat and reports the median ratio B/A with a 95%
bootstrap interval (resampling the pairs). Start-up, capture time and graph
memory come from one start per arm: no interval. Raw runs go to
OUT/served_ab.json, the table to OUT/served_ab.md.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_run import free_port  # noqa: E402
from served_loop import CAPTURE_LINE, build_model, load, one_request, server_command, stream_stats, wait_ready  # noqa: E402,E501

ADAPTERS = 4
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.0f}s] {msg}", flush=True)


def option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def request(rng: random.Random) -> dict:
    plen = int(math.exp(rng.uniform(math.log(32), math.log(1024))))
    adapter = None if rng.random() < 0.3 else f"a{rng.randint(1, ADAPTERS)}"
    return {
        "at": 0.0,
        "prompt": [rng.randint(10, 31000) for _ in range(plen)],
        "max_tokens": rng.randint(16, 256),
        "model": adapter or "base",
    }


def start(name: str, work: Path, plan: Path | None, util: float) -> tuple[subprocess.Popen, int, dict]:
    port = free_port()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / f"cache-{name}"), "VLLM_USE_V2_MODEL_RUNNER": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's default: engine core in its own process
    cmd = server_command(work / "model", port)
    cmd[cmd.index("--gpu-memory-utilization") + 1] = str(util)
    report = work / f"{name}.report.json"
    if plan is not None:
        shown = subprocess.run(
            [sys.executable, "-m", "capplan", "show", str(plan), "--json"], capture_output=True, text=True, check=True
        )
        sizes = json.loads(shown.stdout)["capture_sizes"]
        cmd += ["--compilation-config", json.dumps({"cudagraph_capture_sizes": sizes})]
        wrap = [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(plan), "--report", str(report)]
        cmd = [*wrap, "--", *cmd]
    log_file = (work / f"{name}.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    info: dict = {"name": name, "plan": str(plan) if plan else None, "start_s": round(wait_ready(port, proc), 1)}
    text = (work / f"{name}.log").read_text(errors="replace")
    captured = CAPTURE_LINE.findall(text)
    if captured:
        info["capture_s"], info["graph_gib"] = float(captured[-1][0]), float(captured[-1][1])
    if report.exists():
        rep = json.loads(report.read_text())
        info |= {"graphs": rep["graphs_captured"], "vllm_alone_graphs": rep["vllm_would_capture"]}
        info |= {"capplan_capture_s": rep["capture_seconds"], "capplan_graph_gib": rep["graph_memory_gib"]}
    log(f"{name}: ready in {info['start_s']} s ({info})")
    info["report"] = str(report) if plan is not None else None
    return proc, port, info


def wait_deferred(info: dict, limit: float = 150.0) -> None:
    """For an arm whose plan defers graphs: wait until its report lists none pending."""
    if not info.get("report"):
        return
    path, started = Path(info["report"]), time.perf_counter()
    while time.perf_counter() - started < limit:
        try:
            deferred = json.loads(path.read_text()).get("deferred")
        except (OSError, ValueError):
            deferred = {}
        if deferred is None:
            return  # the plan defers nothing
        if deferred and not deferred["pending"]:
            info["deferred_waited_s"] = round(time.perf_counter() - started, 1)
            info["deferred"] = {k: v for k, v in deferred.items() if k != "captures"}
            log(f"{info['name']}: deferred graphs landed ({info['deferred']})")
            return
        time.sleep(1.0)
    raise RuntimeError(f"{info['name']}: deferred graphs still pending after {limit:.0f} s")


def throughput(port: int, seconds: float, concurrency: int, seed: int) -> dict:
    """Closed loop: each client sends its next request as soon as the last one finished."""
    rng = random.Random(seed)
    pool = [request(rng) for _ in range(20 * concurrency)]
    results: list[dict] = []
    lock = threading.Lock()
    t0 = time.perf_counter()
    deadline = t0 + seconds

    def client(k: int) -> None:
        i = k
        while time.perf_counter() < deadline:
            out: dict = {}
            one_request(port, pool[i % len(pool)], time.perf_counter(), out)
            with lock:
                results.append(out)
            i += concurrency

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return stream_stats(results, time.perf_counter() - t0)


def arrival(port: int, seconds: float, rate: float, seed: int) -> dict:
    """Open loop: Poisson arrivals for `seconds`; every request is waited for."""
    rng = random.Random(seed)
    reqs, t = [], rng.expovariate(rate)
    while t < seconds:
        reqs.append({**request(rng), "at": t})
        t += rng.expovariate(rate)
    return load(port, reqs)


def interval(ratios: list[float], resamples: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """Median ratio and a 95% percentile-bootstrap interval of the median."""
    rng = random.Random(seed)
    ordered = sorted(ratios)
    median = ordered[len(ordered) // 2] if len(ordered) % 2 else sum(ordered[len(ordered) // 2 - 1 :][:2]) / 2
    stats = []
    for _ in range(resamples):
        sample = sorted(rng.choice(ratios) for _ in ratios)
        n = len(sample)
        stats.append(sample[n // 2] if n % 2 else (sample[n // 2 - 1] + sample[n // 2]) / 2)
    stats.sort()
    return median, stats[int(0.025 * resamples)], stats[int(0.975 * resamples) - 1]


METRICS = ("output_tok_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99")


def main() -> None:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    plan = Path(option("--plan", ""))
    plan_a = Path(option("--plan-a", "")) if "--plan-a" in sys.argv else None
    repeats, seconds = int(option("--repeats", "5")), float(option("--seconds", "60"))
    shapes = option("--shapes", "throughput,arrival").split(",")
    concurrency, rate = int(option("--concurrency", "64")), float(option("--rate", "30"))
    util = float(option("--gpu-util", "0.4"))
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if not (work / "model" / "lora4").exists():
        log("building the model")
        build_model(work / "model")
    arms: dict = {}
    procs = []
    try:
        for name, arm_plan in (("vllm", plan_a), ("plan", plan)):
            proc, port, info = start(name, work, arm_plan, util)
            procs.append(proc)
            arms[name] = {"port": port, "start": info}
        for name in ("vllm", "plan"):
            wait_deferred(arms[name]["start"])
        for port in (arms["vllm"]["port"], arms["plan"]["port"]):  # one warm-up window each, not counted
            throughput(port, min(10.0, seconds), concurrency, seed=999)
        runs: list[dict] = []
        for shape in shapes:
            for r in range(repeats):
                order = ("vllm", "plan") if r % 2 == 0 else ("plan", "vllm")
                for name in order:
                    port = arms[name]["port"]
                    if shape == "throughput":
                        result = throughput(port, seconds, concurrency, seed=r)
                    else:
                        result = arrival(port, seconds, rate, seed=r)
                    runs.append({"shape": shape, "repeat": r, "arm": name, **result})
                    log(f"{shape} {r} {name}: {result}")
                    (out / "served_ab.json").write_text(json.dumps({"arms": arms, "runs": runs}, indent=2))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    summary: dict = {}
    lines = [
        f"# Served A/B: {plan_a.name if plan_a else 'vLLM alone'} (A) vs {plan.name} (B), {repeats} interleaved "
        f"repeats of {seconds:g} s per arm",
        "",
        "| shape | metric | median B/A | 95% interval |",
        "|---|---|---:|---|",
    ]
    for shape in shapes:
        for metric in METRICS:
            ratios = []
            for r in range(repeats):
                a = next(x for x in runs if x["shape"] == shape and x["repeat"] == r and x["arm"] == "vllm")
                b = next(x for x in runs if x["shape"] == shape and x["repeat"] == r and x["arm"] == "plan")
                if a[metric]:
                    ratios.append(b[metric] / a[metric])
            med, lo, hi = interval(ratios)
            summary[f"{shape}.{metric}"] = {"median": round(med, 4), "lo": round(lo, 4), "hi": round(hi, 4)}
            lines.append(f"| {shape} | {metric} | {med:.3f} | {lo:.3f} - {hi:.3f} |")
    a, b = arms["vllm"]["start"], arms["plan"]["start"]
    lines += [
        "",
        "One start per arm (no interval):",
        f"- start to healthy: A {a['start_s']} s, B {b['start_s']} s",
        f"- capture (vLLM's log): A {a.get('capture_s')} s / {a.get('graph_gib')} GiB, "
        f"B {b.get('capture_s')} s / {b.get('graph_gib')} GiB; B's graphs {b.get('graphs')} "
        f"(vLLM alone would capture {b.get('vllm_alone_graphs')})",
    ]
    for label, arm in (("A", a), ("B", b)):
        if arm.get("deferred"):
            d = arm["deferred"]
            lines.append(
                f"- {label}: {d['ready']} graphs ready at start, {d['captured']} deferred captured while serving "
                f"in {d['capture_seconds']} s (landed {arm['deferred_waited_s']} s after both were healthy; "
                f"longest idle capture {d['longest_idle_capture_seconds']} s, longest step pause "
                f"{d['longest_step_pause_seconds']} s), graph memory {d['graph_memory_gib']} GiB "
                f"(held back {d['reserved_gib']} GiB)"
            )
    (out / "served_ab.json").write_text(json.dumps({"arms": arms, "runs": runs, "summary": summary}, indent=2))
    (out / "served_ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
