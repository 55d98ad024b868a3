"""Time to healthy and KV cache: `capplan apply` with a calibration against vLLM alone, same command.

    python tests/gpu/start_bench.py WORK OUT.json starts [--pairs N] [--triples K] [--tiers T] [--until SECONDS]
    python tests/gpu/start_bench.py WORK OUT.json summary

Llama-3.1-8B's shape (`configs/llama-3.1-8b.json`) with `--load-format dummy` (times and memory
depend on shapes, not weight values: only config.json and a word-level tokenizer are on disk),
vLLM's OpenAI server with default multiprocessing, max_num_seqs 128, 8192 batched tokens,
max_model_len 4096, max_loras 4 at rank 16 with active-count specialization, vLLM's default
memory path at `--gpu-memory-utilization 0.92`, the attention backend vLLM picks. The arms, on one
command line:
- `vllm`:    vLLM alone;
- `apply`:   `capplan apply PLAN --calibration CAL -- <the same command>`, CAL the calibration
             of this plan's H100 starts whose capture ran first
             (`results/startup/0.33.0-h100/first-capture.calibration.yaml`);
- `startup`: vLLM alone with `VLLM_ENABLE_STARTUP_PLAN=1` (0.27.0 on), booting from the startup
             plan its recording boot saved;
- `tiers`:   `capplan apply TIERS_PLAN -- <the same command> --kv-cache-memory-bytes 50 GiB`: the
             same graphs with one ready and the rest deferred, vLLM's profiling pass skipped (the KV
             cache's size given) so that every capture is a first capture, as the apply arm's; once
             healthy, no traffic, until every deferred graph has landed on the idle turns. Its
             graph memory, every capture counted (the report's `all_graph_memory_gib`), against the
             apply arm's (the full plan's, first capture) from the same run.
Each arm starts once uncounted first (the torch.compile cache warm for it, as an operator's
restart finds it; the plan's fingerprint is in the compile-cache key, so the apply arm compiles
its own artifact; the startup arm's warm-up is its recording boot). Then counted pairs,
interleaved (vllm apply, apply vllm, ...), each followed by a startup start for the first K
pairs, then T tiers starts (the first right after the warm-ups). Every start appends to
WORK/starts.jsonl, so a later call goes on where one stopped.

Each start: the time from launch to /health answering, every output line stamped with its
arrival (the phases come from the log: the first line vLLM writes, weights loaded,
torch.compile, the profiling capture, the KV cache, capture, healthy), the KV-cache tokens, the
graph memory vLLM and capplan measured, and one greedy request's tokens (the server serves).
Every record names the capplan commit, vLLM, torch, the GPU, the host CPU, the attention backend
and the exact command.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from deferred_serve import interval, stop  # noqa: E402
from run_identity import BACKEND_LINE, identity  # noqa: E402
from serve_run import free_port, save_word_tokenizer  # noqa: E402

T0 = time.monotonic()
START_LIMIT_S = 480.0  # a start not healthy by then is recorded as failed
CONFIG = HERE / "configs" / "llama-3.1-8b.json"
# Two starts of this plan whose capture ran first (no profiling pass before it): 1.1914 GiB each.
CALIBRATION = HERE / "results" / "startup" / "0.33.0-h100" / "first-capture.calibration.yaml"
SPEC = """\
# Llama-3.1-8B's shape, four rank-16 adapters, active-count specialization.
target: {{runner: mrv2, vllm: "{release}"}}
scheduler: {{max_num_seqs: 128, max_num_batched_tokens: 8192, max_model_len: 4096}}
cudagraph: {{mode: FULL_AND_PIECEWISE}}
lora: {{enabled: true, max_loras: 4, specialize: true, specialize_active: true}}
"""
TIERS = 'tiers: {ready: ["FULL:1x1@0"], every_steps: 8}\n'  # one graph ready, the other 257 deferred
TIERS_KV_BYTES = 50 * 2**30  # the tiers arm's KV cache, given: vLLM skips its profiling pass
LANDING_LIMIT_S = 120.0  # a tiers start whose deferred graphs have not all landed by then is recorded so
ARMS = ("vllm", "apply", "startup", "tiers")
VLLM_LINE = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:INFO|WARNING|DEBUG|ERROR) \d\d-\d\d ")
# (phase, the line that ends it); the first match of each, but for "captured": the last (vLLM's
# profiling capture, where it runs, writes the same line before the KV cache is sized)
MARKS = {
    "vllm_first_line": VLLM_LINE,
    "weights_loaded": re.compile(r"Model loading took"),
    "compiled": re.compile(r"torch\.compile takes|Directly load (?:the )?compiled|compil\w+ .*took"),
    "kv_memory": re.compile(r"Available KV cache memory"),
    "kv_cache": re.compile(r"GPU KV cache size"),
    "profiling_captured": re.compile(r"Graph capturing finished"),
    "captured": re.compile(r"Graph capturing finished"),
    "engine_ready": re.compile(r"init engine .* took"),
}
NUMBERS = {
    "kv_cache_tokens": re.compile(r"GPU KV cache size: ([\d,]+) tokens"),
    "available_kv_gib": re.compile(r"Available KV cache memory: ([\d.]+) GiB"),
    "load_s": re.compile(r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) seconds"),
    "capture_s": re.compile(r"Graph capturing finished in ([\d.]+) secs?"),
    "capture_gib": re.compile(r"Graph capturing finished in [\d.]+ secs?, took ([\d.-]+) GiB"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
    "pool_actual_gib": re.compile(r"CUDA graph pool memory: ([\d.]+) GiB \(actual\)"),
    "pool_estimated_gib": re.compile(r"CUDA graph pool memory: [\d.]+ GiB \(actual\), ([\d.]+) GiB \(estimated\)"),
}


VLLM_TIME = re.compile(r" (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) ")


def phases(lines: list[tuple[float, str]]) -> dict:
    """Each phase's end, in seconds from launch, from (seconds, line) pairs; "profiling_captured"
    only where the profiling capture ran (a capture finished before the KV cache was sized)."""
    found = {name: [t for t, line in lines if rx.search(line)] for name, rx in MARKS.items()}
    out = {name: round(ts[-1] if name == "captured" else ts[0], 2) if ts else None for name, ts in found.items()}
    sized = out["kv_cache"]
    first = out["profiling_captured"]
    if first is None or sized is None or first > sized:
        out["profiling_captured"] = None
    return out


def log_phases(text: str, first_line_s: float) -> dict:
    """`phases` from a server log alone: vLLM's own timestamps (to the second), placed by the
    arrival of vLLM's first line (as stamped when it ran); capplan's lines carry no time and
    take the time of the vLLM line before them."""
    stamped, at, origin = [], None, None
    for line in text.splitlines():
        m = VLLM_TIME.search(line) if VLLM_LINE.search(line) else None
        if m:
            d, h, mi, sec = int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5))
            when = ((d * 24 + h) * 60 + mi) * 60 + sec
            origin = when if origin is None else origin
            at = first_line_s + when - origin
        if at is not None:
            stamped.append((at, line))
    return phases(stamped)


def host_cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or "unknown"


def prepare(work: Path, release: str) -> tuple[Path, dict]:
    """The model folder (config.json and a tokenizer: dummy weights) and the plan, compiled here."""
    model = work / "model"
    if not (model / "tokenizer.json").exists():
        model.mkdir(parents=True, exist_ok=True)
        config = json.loads(CONFIG.read_text())
        (model / "config.json").write_text(json.dumps(config, indent=2))
        save_word_tokenizer(model, config["vocab_size"])
    plans = {}
    for name, text in (("full", SPEC.format(release=release)), ("tiers", SPEC.format(release=release) + TIERS)):
        spec, plan = work / f"{name}.yaml", work / f"{name}.plan.yaml"
        spec.write_text(text)
        subprocess.run([sys.executable, "-m", "capplan", "compile", str(spec), "-o", str(plan)], check=True)
        plans[name] = str(plan)
    fingerprint = next(line.split('"')[1] for line in Path(plans["full"]).read_text().splitlines()
                       if line.startswith("fingerprint"))  # fmt: skip
    return model, {"plan": plans["full"], "tiers_plan": plans["tiers"], "fingerprint": fingerprint}


def server_command(model: Path, port: int) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",  # `vllm serve`, the bundle has no script
        str(model), "--load-format", "dummy", "--served-model-name", "base", "--port", str(port),
        "--enable-lora", "--max-loras", "4", "--max-lora-rank", "16",
        "--max-num-seqs", "128", "--max-num-batched-tokens", "8192", "--max-model-len", "4096",
        "--gpu-memory-utilization", "0.92", "--dtype", "bfloat16", "--seed", "0", "--specialize-active-lora",
    ]  # fmt: skip


def gpu_released(limit: float = 60.0) -> None:
    """Wait for the stopped server's processes to leave the GPU, so the next start finds it free."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout  # fmt: skip
        if not out.strip():
            return
        time.sleep(1)


def stamped_reader(stream, sink: list, log) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace")
        sink.append((time.perf_counter(), line))
        log.write(line)
    stream.close()


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def until_healthy(proc: subprocess.Popen, port: int, t0: float, limit: float) -> float:
    """Seconds from `t0` until the server at `port` answers /health; RuntimeError where it exits
    first or takes over `limit` seconds."""
    while not healthy(port):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        if time.perf_counter() - t0 > limit:
            raise RuntimeError(f"not healthy in {limit:.0f} s")
        time.sleep(0.25)
    return round(time.perf_counter() - t0, 2)


def one_request(port: int) -> dict:
    body = json.dumps(
        {
            "model": "base",
            "prompt": [11, 12, 13, 14, 15, 16, 17, 18],
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
        }  # fmt: skip
    ).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        data = json.loads(r.read())
    choice = data["choices"][0]
    return {"tokens": (choice.get("logprobs") or {}).get("tokens"), "text": choice.get("text")}


def start_once(arm: str, n: int, work: Path, model: Path, plan: dict, ident: dict, limit: float) -> dict:
    port = free_port()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / "cache"), "PYTHONUNBUFFERED": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.pop("VLLM_ENABLE_STARTUP_PLAN", None)
    cmd = server_command(model, port)
    report = work / f"start{n}-{arm}.report.json"
    if arm == "apply":
        cmd = [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", plan["plan"], "--calibration",
               str(CALIBRATION), "--report", str(report), "--", *cmd]  # fmt: skip
    if arm == "tiers":
        cmd = [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", plan["tiers_plan"], "--report",
               str(report), "--", *cmd, "--kv-cache-memory-bytes", str(TIERS_KV_BYTES)]  # fmt: skip
    if arm == "startup":
        env["VLLM_ENABLE_STARTUP_PLAN"] = "1"
    result: dict = {"arm": arm, "index": n, "command": cmd, **ident}
    if arm == "startup":
        result["env"] = {"VLLM_ENABLE_STARTUP_PLAN": "1"}
    log_path = work / f"start{n}-{arm}.log"
    lines: list = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    with log_path.open("w") as log:
        reader = threading.Thread(target=stamped_reader, args=(proc.stdout, lines, log), daemon=True)
        reader.start()
        try:
            result["healthy_s"] = until_healthy(proc, port, t0, limit)
            if arm == "tiers":
                result["landing"] = landed(report, time.perf_counter())
            result["request"] = one_request(port)
        except Exception as exc:  # noqa: BLE001 - recorded with the start
            result["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            stop(proc)
            reader.join(timeout=10)
            gpu_released()
    text = "".join(line for _, line in lines)
    result["phases_s"] = phases([(t - t0, line) for t, line in lines])
    for name, rx in NUMBERS.items():
        found = rx.findall(text)
        result[name] = float(found[-1].replace(",", "")) if found else None
    result["attention_backend"] = sorted(set(BACKEND_LINE.findall(text)))
    result["capplan_lines"] = [line.strip()[-400:] for _, line in lines if "capplan" in line][-12:]
    result["startup_plan_lines"] = [line.strip()[-300:] for _, line in lines if "startup plan" in line.lower()][-4:]
    result["tracebacks"] = text.count("Traceback")
    result["out_of_memory"] = text.count("OutOfMemory") + text.count("out of memory")
    try:
        rep = json.loads(report.read_text())
        # the runtime's report names no capplan commit: the start's record does, and so the kept file
        report.write_text(json.dumps({"capplan_commit": ident.get("capplan_commit"), **rep}, indent=2) + "\n")
        result["report"] = {k: rep.get(k) for k in ("graphs_planned", "graphs_captured", "capture_seconds",
                                                    "graph_memory_gib", "profiling_capture", "graph_budget")}  # fmt: skip
        if rep.get("deferred"):
            result["report"]["deferred"] = {k: rep["deferred"].get(k) for k in DEFERRED_KEYS}
    except (OSError, ValueError):
        pass
    return result


DEFERRED_KEYS = ("ready", "deferred", "captured", "pending", "all_graph_memory_gib", "all_first_capture",
                 "graph_memory_gib", "ready_graph_memory_gib", "sampled_at_start_mib", "reserved_gib",
                 "reserve_shortfall", "hold_basis", "held_per_graph_mib_at_start", "memory_readings",
                 "capture_seconds", "longest_idle_capture_seconds", "deferred_graph_memory_mib_by_mode")  # fmt: skip


def landed(report: Path, since: float) -> dict:
    """Wait, with no traffic, until the tiers start's report says no deferred graph is pending (the
    runtime rewrites it within a second of a change); the seconds from `since`."""
    pending = None
    while time.perf_counter() - since < LANDING_LIMIT_S:
        try:
            pending = json.loads(report.read_text())["deferred"]["pending"]
        except (OSError, ValueError, KeyError, TypeError):
            pending = None
        if pending == []:
            return {"all_landed": True, "seconds_after_healthy": round(time.perf_counter() - since, 2)}
        time.sleep(0.5)
    return {"all_landed": False, "pending": None if pending is None else len(pending), "waited_s": LANDING_LIMIT_S}


def order(pairs: int, triples: int, tiers: int = 0) -> list[str]:
    """The first start of each arm is uncounted for time (the compile cache warm for it; startup's
    records its plan). The first tiers start (memory only) right after the warm-ups, the pairs
    next; the startup arm, where device time allows, after them; the other tiers starts last."""
    out = ["vllm", "apply"] + ["tiers"] * min(tiers, 1)
    for i in range(pairs):
        out += ["vllm", "apply"] if i % 2 == 0 else ["apply", "vllm"]
    if triples:
        out.append("startup")  # the recording boot
        for i in range(triples):
            out += ["startup", "apply"] if i % 2 == 0 else ["apply", "startup"]
    return out + ["tiers"] * max(tiers - 1, 0)


def warmups(done: list[dict]) -> list[dict]:
    """The first start of each arm."""
    seen: dict[str, dict] = {}
    for d in done:
        seen.setdefault(d["arm"], d)
    return list(seen.values())


def starts(work: Path, out: Path, until: float, pairs: int, triples: int, tiers: int) -> None:
    ident = {**identity(), "host_cpu": host_cpu()}
    release = ident["vllm"].split("+")[0]
    model, plan = prepare(work, release)
    ident["plan_fingerprint"] = plan["fingerprint"]
    record = work / "starts.jsonl"
    done = [json.loads(line) for line in record.open()] if record.exists() else []
    for arm in order(pairs, triples, tiers)[len(done) :]:
        first = warmups(done)
        spent = [d["wall_s"] for d in done if "wall_s" in d and all(d is not w for w in first)]
        expect = max(spent) + 15 if spent else 200
        left = until - (time.monotonic() - T0)
        if left < expect:
            print(f"stopping: {left:.0f} s left, a start takes up to {expect:.0f} s", flush=True)
            break
        t = time.perf_counter()
        result = start_once(arm, len(done), work, model, plan, ident, limit=min(START_LIMIT_S, max(60.0, left - 20)))
        result["wall_s"] = round(time.perf_counter() - t, 1)
        done.append(result)
        with record.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(json.dumps({k: result.get(k) for k in ("arm", "index", "healthy_s", "kv_cache_tokens", "capture_s",
                                                     "pool_estimated_gib", "error")}), flush=True)  # fmt: skip
    summarize(out, done)


def with_log_phases(work: Path, d: dict) -> dict:
    """The start's phases read again from its kept log (gzip or not), where it is in WORK."""
    import gzip

    name = f"start{d['index']}-{d['arm']}.log"
    first = (d.get("phases_s") or {}).get("vllm_first_line")
    for path, read in (
        (work / name, Path.read_text),
        (work / f"{name}.gz", lambda p: gzip.decompress(p.read_bytes()).decode()),
    ):
        if first is not None and path.exists():
            return {**d, "phases_s": log_phases(read(path), first)}
    return d


def summarize(out: Path, done: list[dict]) -> None:
    first = warmups(done)
    counted = [d for d in done if all(d is not w for w in first)]
    by_arm: dict[str, list[dict]] = {a: [] for a in ARMS}
    for d in counted:
        by_arm[d["arm"]].append(d)
    recording = next((d["index"] for d in done if d["arm"] == "startup"), len(done))
    timed = [d for d in counted if d["arm"] != "tiers"]
    paired = [d for d in timed if d["index"] < recording]  # vllm and apply, interleaved
    tripled = [d for d in timed if d["index"] > recording]  # startup and apply, interleaved

    def ratios(starts: list[dict], other: str) -> list[float]:
        out = []
        for a, b in zip(starts[0::2], starts[1::2]):
            pair = {a["arm"]: a, b["arm"]: b}
            if set(pair) == {"apply", other} and all("healthy_s" in p and "error" not in p for p in pair.values()):
                out.append(pair["apply"]["healthy_s"] / pair[other]["healthy_s"])
        return out

    ratio, startup_ratio = ratios(paired, "vllm"), ratios(tripled, "startup")

    def column(arm: str, key: str) -> list:
        return [d.get(key) for d in by_arm[arm]]

    summary = {
        "identity": {
            k: done[0].get(k)
            for k in ("vllm", "torch", "gpu", "host_cpu", "python", "plan_fingerprint", "attention_backend")
        }
        if done
        else {},
        "capplan_commit_by_start": {str(d["index"]): d.get("capplan_commit") for d in done},
        "commands": {d["arm"]: d["command"] for d in first},
        "calibration_by_start": {
            str(d["index"]): d["command"][d["command"].index("--calibration") + 1]
            for d in done
            if "--calibration" in d["command"]
        },
        "healthy_ratio_apply_over_vllm": interval(ratio) if ratio else None,
        "healthy_ratio_apply_over_startup_plan": interval(startup_ratio) if startup_ratio else None,
        "arms": {
            arm: {
                "healthy_s": column(arm, "healthy_s"),
                "kv_cache_tokens": column(arm, "kv_cache_tokens"),
                "available_kv_gib": column(arm, "available_kv_gib"),
                "capture_s": column(arm, "capture_s"),
                "capture_gib": column(arm, "capture_gib"),
                "pool_actual_gib": column(arm, "pool_actual_gib"),
                "pool_estimated_gib": column(arm, "pool_estimated_gib"),
                "vllm_first_line_s": [(d.get("phases_s") or {}).get("vllm_first_line") for d in by_arm[arm]],
                "errors": [d.get("error") for d in by_arm[arm] if d.get("error")],
            }
            for arm in ARMS
        },
        "tiers": tiers_memory(done),
        "phases_s_by_start": {f"{d['index']}-{d['arm']}": d.get("phases_s") for d in done},
        "warmups": [{k: d.get(k) for k in ("index", "arm", "healthy_s", "kv_cache_tokens", "error")} for d in first],
    }
    commits = [d.get("capplan_commit") for d in done]
    summary["capplan_commit"] = max(set(commits), key=commits.count) if commits else None  # most starts'
    out.write_text(json.dumps(summary, indent=2))
    write_run_record(out.parent / "run.json", done)
    print(json.dumps({k: summary[k] for k in ("healthy_ratio_apply_over_vllm",
                                              "healthy_ratio_apply_over_startup_plan")}, indent=1))  # fmt: skip


def tiers_memory(done: list[dict]) -> dict | None:
    """Every tiers start (memory needs no warm cache): its graph memory, all captures counted,
    against the median of the apply arm's (the full plan's, first capture) in the same run."""
    tiers = [d for d in done if d["arm"] == "tiers"]
    full = sorted(g for d in done if d["arm"] == "apply" and (d.get("report") or {}).get("profiling_capture") is None
                  if (g := (d.get("report") or {}).get("graph_memory_gib")) is not None)  # first captures only  # fmt: skip
    if not tiers:
        return None
    full_gib = full[len(full) // 2] if full else None
    starts = []
    for d in tiers:
        dd = ((d.get("report") or {}).get("deferred")) or {}
        total = dd.get("all_graph_memory_gib")
        at_start = (dd.get("ready_graph_memory_gib") or 0) + sum(dd.get("sampled_at_start_mib") or []) / 1024
        at_start += dd.get("reserved_gib") or 0
        starts.append({
            "index": d["index"], "error": d.get("error"), "landing": d.get("landing"),
            "all_first_capture": dd.get("all_first_capture"), "all_graph_memory_gib": total,
            "reserved_gib": dd.get("reserved_gib"), "reserve_shortfall": dd.get("reserve_shortfall"),
            "captured_while_serving": dd.get("captured"), "pending": dd.get("pending"),
            "over_full_plan": round(total / full_gib, 4) if total is not None and full_gib else None,
            # at start: what the graphs captured then took, and the most held for the rest (the report's
            # peak: the block taken at start where no later hold grew past it, as the log's line says)
            "set_aside_at_start_gib": round(at_start, 4),
            "set_aside_at_start_over_full_plan": round(at_start / full_gib, 4) if full_gib else None,
        })  # fmt: skip
    return {"full_plan_graph_memory_gib": full_gib, "full_plan_readings_gib": full, "starts": starts}


def write_run_record(path: Path, done: list[dict]) -> None:
    """What ran behind each file of the run (the runtime's reports name no capplan commit): per
    start, its log and report, the capplan commit, vLLM, torch, the GPU, the host CPU, the
    attention backend and the command; from the starts' records."""
    keys = ("capplan_commit", "vllm", "torch", "gpu", "host_cpu", "attention_backend", "command")
    starts = []
    for d in done:
        files = [f"start{d['index']}-{d['arm']}.log.gz"]
        if d["arm"] in ("apply", "tiers"):
            files.append(f"start{d['index']}-{d['arm']}.report.json")
        starts.append({"files": files, "arm": d["arm"], **{k: d.get(k) for k in keys}})
    commits = [d.get("capplan_commit") for d in done]
    record = {
        "note": "what ran behind each startN-ARM file in this folder, from starts.jsonl",
        "capplan_commit": max(set(commits), key=commits.count) if commits else None,
        "starts": starts,
    }
    path.write_text(json.dumps(record, indent=1) + "\n")


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 3 or args[2] not in ("starts", "summary"):
        raise SystemExit(__doc__)
    work, out = Path(args[0]), Path(args[1])
    work.mkdir(parents=True, exist_ok=True)

    def option(name: str, default: str) -> str:
        return args[args.index(name) + 1] if name in args else default

    if args[2] == "summary":
        record = work / "starts.jsonl"
        summarize(out, [with_log_phases(work, json.loads(line)) for line in record.open()])
        return
    if shutil.which("nvidia-smi") is None:
        raise SystemExit("start_bench.py starts needs a GPU")
    starts(work, out, float(option("--until", "540")), int(option("--pairs", "5")), int(option("--triples", "2")),
           int(option("--tiers", "0")))  # fmt: skip


if __name__ == "__main__":
    main()
