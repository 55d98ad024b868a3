"""Deferred capture under `vllm serve` on the installed release (default multiprocessing).

    python tests/gpu/deferred_serve.py WORK OUT.json check [--seqs N]
    python tests/gpu/deferred_serve.py WORK OUT.json starts [--until SECONDS] [--pairs N] [--order K,K,...]
    python tests/gpu/deferred_serve.py WORK OUT.json summary [--release V]

`check`: the tiny random Llama of serve_run.py (peaked logits) with 3 LoRA adapters,
max_loras 3, max_num_seqs N (default 256: 338 graphs, enough deferred ones that they are
still landing while the first pass runs; at 32 all 46 landed before its first request). Four
servers at once, each with a fixed KV cache, traffic (k adapters plus base
requests, k = 1..3, adapters only, base only; logprobs) from the moment /health answers:
- reference: vLLM alone, specialize_active_lora off (every LoRA graph has the full grid);
- vanilla:   vLLM alone, specialize_active_lora on (vLLM's no-LoRA-slot bug: the positive
             control the comparison must catch);
- full:      `capplan apply` with the plan, every graph captured before ready;
- tiers:     the same plan with spec tiers (FULL:1x1@0 named; capplan adds the largest graph
             of each mode and LoRA case and of each kernel class), the rest captured while
             serving, one before every step and back to back while idle. It gets the traffic
             again once every deferred graph landed.
Each pass is compared with the reference request by request; where tokens differ, the
reference's top-2 logprob margin at the first differing token tells a bf16 near-tie (< 0.5)
from a real difference.

`starts`: the ~0.9B Llama of served_loop.py (16 layers, 4 adapters, 418-graph plan) at
`--gpu-memory-utilization 0.92`, vLLM's memory profiling on, one server at a time on one
shared compile cache: two warm-up starts, not counted (`WARMUP`: a full-plan start compiles the
model into the cache, a tiers start is the first to load it from there; `--pairs 0` runs them
alone, and `--util` sets their memory share, so that they can run beside `check`), then pairs of
starts, full plan and tiers, the order alternating (T F, F T, ...). Each start gets a
Poisson burst of served_loop's chat-like requests from the moment /health answers; for tiers
the run waits until every deferred graph landed. Per start: launch to healthy, the KV cache
vLLM sized (its log), the tiers report (longest step pause, memory held against memory the
deferred graphs took, whether anything ran short). Starts are appended to WORK/starts.jsonl,
so a later call goes on where the last stopped; `--until` stops before a start that would
not end in time; `--order tiers,tiers` (say) runs those starts instead, for their memory and
step facts (the first then warms the cache, and no ratio is formed from them). The summary: the
ratio tiers/full per pair of time to healthy and of vLLM's engine init (its log's "init engine"
line: memory profiling, KV cache, capture), each ratio's geometric mean with a 95% t-interval
over pairs. `summary` writes it again from WORK's starts.jsonl and start logs, without vLLM.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from release_run import FIXED_KV, MAIN, NEAR_TIE, command, compare, run_groups  # noqa: E402
from release_run import SPEC as TINY_SPEC  # noqa: E402
from serve_run import build, free_port, wait_ready  # noqa: E402

T0 = time.monotonic()
TIERS = 'tiers: {{ready: ["FULL:1x1@0"], every_steps: {every}}}\n'
KV_LINE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
INIT_LINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
WARMUP = ("full", "tiers")
KINDS = ("full", "tiers")
"""The starts not counted, before the pairs: one of each arm. With a single full-plan warm-up,
the first counted start was always a tiers start, and it ran slow (H200, vLLM 0.33.0, 0.9B
Llama): its profiling pass took 19.5 s against 4.2-7.4 s for the later tiers starts of its host
(16.2 s on a host with no later tiers start); on a third host its first model run took 5.6 s
against 0.07-0.11 s for the later full-plan starts, and 15 s more passed between the KV cache and
the capture. Whether that is the first load from the shared compile cache or something of the
tiers path alone, an operator restarting an engine finds the cache warm from that engine's own
last start, which is what warming each arm once reproduces."""
T975 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def compile_spec(work: Path, name: str, text: str) -> Path:
    spec = work / f"{name}.yaml"
    spec.write_text(text)
    plan = work / f"{name}.plan.yaml"
    subprocess.run([sys.executable, "-m", "capplan", "compile", str(spec), "-o", str(plan)], check=True)
    return plan


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def wait_landed(report: Path, limit: float) -> float | None:
    """Seconds until the report says no deferred graph is pending (None: not within limit)."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit:
        rep = read_json(report)
        if rep is not None and rep.get("deferred") and not rep["deferred"]["pending"]:
            return time.perf_counter() - start
        time.sleep(0.25)
    return None


def launch(cmd: list[str], env: dict, log_path: Path, plan: Path | None, report: Path) -> subprocess.Popen:
    if plan is not None:
        cmd = [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(plan), "--report", str(report),
               "--", *cmd]  # fmt: skip
    report.unlink(missing_ok=True)
    return subprocess.Popen(cmd, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def log_facts(log_path: Path) -> dict:
    lines = log_path.read_text(errors="replace").splitlines()
    kv = [int(m.group(1).replace(",", "")) for line in lines if (m := KV_LINE.search(line))]
    init = [float(m.group(1)) for line in lines if (m := INIT_LINE.search(line))]
    return {
        "kv_cache_tokens": kv[-1] if kv else None,
        "init_engine_s": init[-1] if init else None,  # vLLM's engine init: profiling, KV cache, capture
        "capplan_lines": [line[-300:] for line in lines if "capplan" in line][-10:],
        "tracebacks": sum("Traceback" in line for line in lines),
        "out_of_memory": sum("OutOfMemory" in line or "out of memory" in line for line in lines),
    }


# -- check ------------------------------------------------------------------------------------
def check_server(name: str, model: Path, work: Path, specialize: bool, plan: Path | None, sched: dict) -> dict:
    port = free_port()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / f"cache-{name}"), "VLLM_USE_V2_MODEL_RUNNER": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    log_path, report = work / f"{name}.log", work / f"{name}.report.json"
    proc = launch(command(model, port, specialize, sched, True), env, log_path, plan, report)
    result: dict = {"name": name}
    try:
        result["ready_s"] = round(wait_ready(port, proc, limit=480), 1)
        result["outputs"] = run_groups(port)  # from the moment /health answers
        during = read_json(report)
        if during is not None and during.get("deferred"):
            d = during["deferred"]
            result["after_first_pass"] = {k: d[k] for k in ("captured", "fallback_steps", "steps_seen")}
            landed = wait_landed(report, 120)
            result["landed_after_first_pass_s"] = None if landed is None else round(landed, 2)
            result["outputs_after_landing"] = run_groups(port)
        time.sleep(2)  # the report file is kept at most a second behind
    except Exception as exc:  # noqa: BLE001 - keep what the other servers measured
        result["error"] = f"{type(exc).__name__}: {exc}"
        result.setdefault("outputs", {})
    finally:
        stop(proc)
    result.update(log_facts(log_path))
    rep = read_json(report)
    if rep is not None:
        result["report"] = rep
    return result


def check(work: Path, out: Path, release: str, seqs: int) -> None:
    model = build(work)
    sched = {**MAIN, "seqs": seqs}
    base = TINY_SPEC.format(release=release, max_loras=3, **sched)
    full = compile_spec(work, "full", base)
    tiers = compile_spec(work, "tiers", base + TIERS.format(every=1))
    jobs = {
        "reference": lambda: check_server("reference", model, work, False, None, sched),
        "vanilla": lambda: check_server("vanilla", model, work, True, None, sched),
        "full": lambda: check_server("full", model, work, True, full, sched),
        "tiers": lambda: check_server("tiers", model, work, True, tiers, sched),
    }
    results: dict = {
        "release": release,
        "scheduler": sched,
        "near_tie_below": NEAR_TIE,
        "fixed_kv_bytes": int(FIXED_KV),
    }
    threads = [threading.Thread(target=lambda n=n, f=f: results.__setitem__(n, f())) for n, f in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ref = results["reference"]["outputs"]
    results["vanilla_vs_reference"] = compare(ref, results["vanilla"]["outputs"])
    results["full_vs_reference"] = compare(ref, results["full"]["outputs"])
    results["tiers_during_capture_vs_reference"] = compare(ref, results["tiers"]["outputs"])
    results["tiers_after_landing_vs_reference"] = compare(ref, results["tiers"].get("outputs_after_landing", {}))
    for name in jobs:
        results[name].pop("outputs", None)
        results[name].pop("outputs_after_landing", None)
    out.write_text(json.dumps(results, indent=1))
    brief: dict = {"release": release}
    for k in ("vanilla", "full", "tiers_during_capture", "tiers_after_landing"):
        c = results[f"{k}_vs_reference"]
        brief[k] = {x: c[x] for x in ("requests", "differing", "differ_clearly", "differ_after_near_tie")}
    for name in jobs:
        brief[name] = {
            k: results[name].get(k)
            for k in (
                "ready_s",
                "error",
                "tracebacks",
                "out_of_memory",
                "after_first_pass",
                "landed_after_first_pass_s",
            )
        }
    d = (results["tiers"].get("report") or {}).get("deferred") or {}
    brief["deferred"] = {k: v for k, v in d.items() if k not in ("captures", "pending")}
    brief["slowest_captures"] = sorted(d.get("captures", []), key=lambda c: -c["seconds"])[:5]
    print(json.dumps(brief, indent=1))


# -- starts -----------------------------------------------------------------------------------
def start_once(kind: str, work: Path, plan: Path, requests: list[dict], util: str) -> dict:
    from served_loop import load, server_command

    port = free_port()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / "cache-starts"), "VLLM_USE_V2_MODEL_RUNNER": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = server_command(work / "model", port)
    cmd[cmd.index("--gpu-memory-utilization") + 1] = util
    n = sum(1 for _ in (work / "starts.jsonl").open()) if (work / "starts.jsonl").exists() else 0
    log_path, report = work / f"start{n}-{kind}.log", work / f"start{n}-{kind}.report.json"
    t0 = time.perf_counter()
    proc = launch(cmd, env, log_path, plan, report)
    result: dict = {"kind": kind, "index": n, "gpu_memory_utilization": util}
    try:
        result["healthy_s"] = round(wait_ready(port, proc, limit=480), 2)
        result["load"] = load(port, requests)  # from the moment /health answers
        if kind == "tiers":
            landed = wait_landed(report, 180)
            result["landed_after_load_s"] = None if landed is None else round(landed, 2)
        time.sleep(2)
    except Exception as exc:  # noqa: BLE001 - recorded with the start
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        stop(proc)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result.update(log_facts(log_path))
    rep = read_json(report)
    if rep is not None:
        result["capture_seconds"] = rep.get("capture_seconds")
        result["graph_memory_gib"] = rep.get("graph_memory_gib")
        result["profiling"] = rep.get("profiling_capture")
        d = rep.get("deferred")
        if d:
            result["deferred"] = {k: v for k, v in d.items() if k not in ("captures", "pending")}
            result["deferred"]["pending"] = len(d["pending"])
            result["slowest_captures"] = sorted(d["captures"], key=lambda c: -c["seconds"])[:5]
            steps = [c["seconds"] for c in d["captures"] if c["trigger"] == "step"]
            result["step_captures"] = len(steps)
    return result


def start_order(pairs: int) -> list[str]:
    """The warm-up starts, then `pairs` pairs of a full-plan and a tiers start, alternating which
    comes first (T F, F T, ...), so that neither arm always follows the other."""
    return [*WARMUP, *(k for i in range(pairs) for k in (("tiers", "full") if i % 2 == 0 else ("full", "tiers")))]


def counted_starts(done: list[dict]) -> list[dict]:
    """The starts a ratio is formed from: every one not marked a warm-up (a WORK begun before
    there were two warm-ups marks none: only its first start warmed)."""
    return [d for i, d in enumerate(done) if not d.get("warmup", i == 0)]


def pair_ratios(counted: list[dict], key: str = "healthy_s") -> list[float]:
    """`key` (time to healthy, or vLLM's engine init), tiers over full, of each pair of counted
    starts (in order, two by two); a pair with a failed start or two of one kind gives none."""
    ratios = []
    for a, b in zip(counted[0::2], counted[1::2], strict=False):
        kinds = {a["kind"]: a, b["kind"]: b}
        if set(kinds) == {"tiers", "full"} and kinds["tiers"].get(key) and kinds["full"].get(key):
            ratios.append(kinds["tiers"][key] / kinds["full"][key])
    return ratios


def interval(ratios: list[float]) -> dict:
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    mean = sum(logs) / n
    if n < 2:
        return {"pairs": n, "geomean": round(math.exp(mean), 4)}
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = T975.get(n - 1, 2.0) * sd / math.sqrt(n)
    return {
        "pairs": n,
        "geomean": round(math.exp(mean), 4),
        "ci95": [round(math.exp(mean - half), 4), round(math.exp(mean + half), 4)],
        "ratios": [round(r, 4) for r in ratios],
    }


def starts(work: Path, out: Path, release: str, until: float, pairs: int, util: str, order: list[str]) -> None:
    from served_loop import SPEC as BIG_SPEC
    from served_loop import build_model, sample

    model = work / "model"
    base = BIG_SPEC.replace('vllm: "0.25"', f'vllm: "{release}"')
    plans = {
        "full": compile_spec(work, "big-full", base),
        "tiers": compile_spec(work, "big-tiers", base + TIERS.format(every=8)),
    }
    requests = [r for r in sample(7) if r["at"] < 8.0]  # 8 s of chat-like arrivals at 30 per second
    warmups = 1 if order else len(WARMUP)
    order = order or start_order(pairs)
    done = [json.loads(line) for line in (work / "starts.jsonl").open()] if (work / "starts.jsonl").exists() else []
    for kind in order[len(done) :]:
        spent = [d["wall_s"] for d in done[1:] if "wall_s" in d]  # the first start compiled, the others did not
        expect = max(spent) if spent else 240
        if time.monotonic() - T0 + expect > until:
            print(f"stopping: {until - (time.monotonic() - T0):.0f} s left, a start takes up to {expect:.0f} s")
            break
        if not (model / "lora4").exists():
            build_model(model)
        result = start_once(kind, work, plans[kind], requests, util)
        result["warmup"] = len(done) < warmups
        done.append(result)
        with (work / "starts.jsonl").open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(
            json.dumps({k: result.get(k) for k in ("kind", "index", "healthy_s", "wall_s", "kv_cache_tokens", "error")})
        )
    summarize(work, out, release, done)


def summarize(work: Path, out: Path, release: str, done: list[dict]) -> None:
    """The summary of the starts in WORK (see the module's docstring), written to `out`."""
    for d in done:  # starts recorded before the engine init was read: from their logs
        log = work / f"start{d['index']}-{d['kind']}.log"
        if "init_engine_s" not in d and log.exists():
            d["init_engine_s"] = log_facts(log)["init_engine_s"]
    counted = counted_starts(done)
    ratios = pair_ratios(counted)
    init_ratios = pair_ratios(counted, "init_engine_s")
    tiers_runs = [d for d in done if d["kind"] == "tiers"]  # memory and step facts: every tiers start
    kinds = sorted({d["kind"] for d in done})
    summary = {
        "release": release,
        "starts": done,
        "healthy_ratio_tiers_over_full": interval(ratios) if ratios else None,
        "init_engine_ratio_tiers_over_full": interval(init_ratios) if init_ratios else None,
        "kv_cache_tokens": {
            k: sorted({d.get("kv_cache_tokens") for d in counted if d["kind"] == k} - {None}) for k in kinds
        },
        "longest_step_pause_s": max(
            (d["deferred"]["longest_step_pause_seconds"] for d in tiers_runs if d.get("deferred")), default=None
        ),
        "held_over_used": [
            round(d["deferred"]["reserved_gib"] / d["deferred"]["graph_memory_gib"], 3)
            if d.get("deferred") and d["deferred"]["graph_memory_gib"]
            else None
            for d in tiers_runs
        ],
    }
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "starts"}, indent=1))


def summary_phase(work: Path, out: Path, release: str) -> int:
    """`summary`: 0, or 1 with one line on stderr where WORK holds no readable starts or OUT is
    one of WORK's inputs (never replaced)."""
    record = work / "starts.jsonl"
    if out.resolve() == record.resolve() or (out.resolve().parent == work.resolve() and out.suffix == ".log"):
        print(f"error: {out}: that is one of WORK's inputs; write the summary elsewhere", file=sys.stderr)
        return 1
    try:
        done = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
        if not all(isinstance(d, dict) and d.get("kind") in KINDS and type(d.get("index")) is int for d in done):
            raise ValueError("a line that is not a start (kind full or tiers, an index)")
    except (OSError, ValueError) as exc:
        print(f"error: {record}: no starts to sum up ({exc})", file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    summarize(work, out, release, done)
    return 0


def main() -> None:
    work, out, phase = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    args = sys.argv[4:]

    def option(name: str, default: str) -> str:
        return args[args.index(name) + 1] if name in args else default

    if phase == "summary":  # the starts already in WORK, summed up again (no GPU, no vLLM)
        raise SystemExit(summary_phase(work, out, option("--release", "unknown")))
    work.mkdir(parents=True, exist_ok=True)
    release = version("vllm").split("+")[0]
    if phase == "check":
        check(work, out, release, int(option("--seqs", "256")))
    elif phase == "starts":
        until, pairs, util = float(option("--until", "560")), int(option("--pairs", "3")), option("--util", "0.92")
        order = [k for k in option("--order", "").split(",") if k]
        if set(order) - {"full", "tiers"}:
            raise SystemExit("--order: a comma-separated list of full and tiers")
        starts(work, out, release, until, pairs, util, order)
    else:
        raise SystemExit(f"unknown phase {phase!r}: check, starts or summary")


if __name__ == "__main__":
    main()
