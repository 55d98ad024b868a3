"""The plan in force under `vllm serve` on the installed release, against vLLM alone, in one run.

    python tests/gpu/release_run.py WORK_DIR OUT.json [--together]

The release is the one installed (`vllm`'s package metadata); the plan targets it exactly. Servers
(vLLM's OpenAI server, default multiprocessing: the engine core in its own process) on a tiny
random Llama with 3 LoRA adapters, max_loras 3:
- planned:   specialize_active_lora on, under `capplan apply` with the plan, a report and a trace;
- reference: specialize_active_lora off (every LoRA graph has the full grid);
- vanilla:   specialize_active_lora on, no plan (the no-LoRA-slot bug the plan fixes);
- dummy:     the plan in force on an engine whose dummy batches vLLM alone would build past
             max_model_len (8192 batched tokens, 100 sequences, max_model_len 128);
- mismatch:  a plan for max_loras 2 on this max_loras 3 server, timed from launch to exit;
- v1:        CAPPLAN_PLAN on a server forced to vLLM's V1 runner.
Every server starts alone, one after another, its KV cache sized by vLLM's memory profiling (and,
from 0.29, its profiling capture of CUDA graphs), so that every arm runs under the same settings
and none measures another's memory. With --together every server starts at once, each with a
fixed KV cache (`--kv-cache-memory-bytes`; the graph memory the report measures then includes the
other servers' allocations). The result keeps every server's tokens and top-2 logprobs, its
command and attention backend, and the run's identity (capplan commit, vLLM, torch, GPU). Outputs
are compared request by request; where two differ, the reference's top-2 logprob margin at the
first differing token is recorded beside the difference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run_identity import BACKEND_LINE, identity  # noqa: E402
from serve_run import GROUP, build, free_port, groups, groups_label, server_command, wait_ready  # noqa: E402

NEAR_TIE = 0.5  # a reference top-2 logprob margin below this at the first differing token is a near-tie
SPEC = """\
target: {{runner: mrv2, vllm: "{release}"}}
scheduler: {{max_num_seqs: {seqs}, max_num_batched_tokens: {tokens}, max_model_len: {model_len}}}
cudagraph: {{mode: FULL_AND_PIECEWISE}}
lora: {{enabled: true, max_loras: {max_loras}, specialize: true, specialize_active: true}}
"""
MAIN = {"seqs": 32, "tokens": 2048, "model_len": 512}
DUMMY = {"seqs": 100, "tokens": 8192, "model_len": 128}
FIXED_KV = str(2 * 2**30)
LOG_KEYS = ("Graph capturing finished", "CUDA graph", "cudagraph", "KV cache", "capplan", "memory")


def compile_plan(work: Path, name: str, release: str, max_loras: int, sched: dict) -> Path:
    spec = work / f"{name}.yaml"
    spec.write_text(SPEC.format(release=release, max_loras=max_loras, **sched))
    plan = work / f"{name}.plan.yaml"
    subprocess.run([sys.executable, "-m", "capplan", "compile", str(spec), "-o", str(plan)], check=True)
    return plan


def command(model: Path, port: int, specialize_active: bool, sched: dict, fixed_kv: bool) -> list[str]:
    cmd = server_command(model, port, specialize_active)
    for flag, key in (
        ("--max-num-seqs", "seqs"),
        ("--max-num-batched-tokens", "tokens"),
        ("--max-model-len", "model_len"),
    ):
        cmd[cmd.index(flag) + 1] = str(sched[key])
    if fixed_kv:
        cmd += ["--kv-cache-memory-bytes", FIXED_KV]
    return cmd


def complete(port: int, model: str, prompt: list[int], logprobs: int = 2) -> dict:
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": logprobs}
    ).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        choice = json.loads(resp.read())["choices"][0]
    lp = choice.get("logprobs") or {}
    return {"tokens": lp.get("tokens") or [], "top": lp.get("top_logprobs") or [], "text": choice["text"]}


def tiny_prompt(g: int, i: int) -> list[int]:
    """Request i of group g: token ids within the tiny model's vocabulary."""
    return [(7 * g + 13 * i + t) % 2000 + 10 for t in range(5 + i)]


def run_groups(
    port: int, group_list: list[list[str | None]] | None = None, prompt=tiny_prompt, logprobs: int = 2
) -> dict:
    """Every group (default `groups()`), one after the other, its requests concurrent: tokens and
    top logprobs of each request (or the error it met), keyed "group:request"."""
    out: dict = {}
    for g, adapters in enumerate(group_list or groups()):
        got: dict = {}

        def one(i: int, adapter: str | None, g: int = g, got: dict = got) -> None:
            try:
                got[i] = complete(port, adapter or "base", prompt(g, i), logprobs)
            except Exception as exc:  # noqa: BLE001 - recorded with the request
                got[i] = {"tokens": None, "error": f"{type(exc).__name__}: {exc}"}

        threads = [threading.Thread(target=one, args=(i, a)) for i, a in enumerate(adapters)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, adapter in enumerate(adapters):
            out[f"{g}:{i}"] = {"adapter": adapter, "group": g, **(got.get(i) or {"tokens": None})}
    return out


def serve(
    name: str, model: Path, work: Path, specialize_active: bool, plan: Path | None, sched: dict, fixed_kv: bool
) -> dict:
    port = free_port()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / f"cache-{name}"), "VLLM_USE_V2_MODEL_RUNNER": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = command(model, port, specialize_active, sched, fixed_kv)
    report, trace = work / f"{name}.report.json", work / f"{name}.trace.jsonl"
    if plan is not None:
        cmd = [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(plan), "--report", str(report),
               "--trace", str(trace), "--", *cmd]  # fmt: skip
    log_path = work / f"{name}.log"
    start = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        result: dict = {"name": name}
        try:
            result["ready_s"] = round(wait_ready(port, proc, limit=420), 1)
            result["outputs"] = run_groups(port)
            time.sleep(3)  # the report file is kept at most a second behind: let it catch up
        except Exception as exc:  # noqa: BLE001 - keep what the other servers measured
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["outputs"] = {}
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    result["wall_s"] = round(time.perf_counter() - start, 1)
    result["command"] = cmd
    text = log_path.read_text(errors="replace")
    result["attention_backend"] = sorted(set(BACKEND_LINE.findall(text)))
    lines = text.splitlines()
    result["capplan_lines"] = [line for line in lines if "capplan" in line]
    result["in_force_lines"] = sum("in force" in line for line in lines if "capplan" in line)
    result["log_lines"] = [line[-400:] for line in lines if any(k in line for k in LOG_KEYS)][-60:]
    result["tracebacks"] = sum("Traceback" in line for line in lines)
    if "error" in result or result["tracebacks"]:
        result["log_tail"] = [line[-400:] for line in lines[-40:]]
    if report.exists():
        result["report"] = json.loads(report.read_text())
    if trace.exists():
        result["trace_lines"] = sum(1 for _ in trace.open())
    return result


def refusal(name: str, model: Path, work: Path, plan: Path, via_apply: bool, extra_env: dict) -> dict:
    port = free_port()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / f"cache-{name}"), **extra_env}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = command(model, port, True, MAIN, True)
    if via_apply:
        cmd = [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(plan), "--", *cmd]
    else:
        env["CAPPLAN_PLAN"] = str(plan)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return {"name": name, "returncode": None, "launch_to_exit_s": round(time.perf_counter() - start, 1)}
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    both = proc.stdout + proc.stderr
    return {
        "name": name,
        "returncode": proc.returncode,
        "launch_to_exit_s": round(time.perf_counter() - start, 1),
        "last_stderr_lines": [line[-600:] for line in lines[-3:]],
        "weights_loaded": "Loading weights took" in both or "Model loading took" in both,
    }


def margin(top: dict | None) -> float | None:
    if not top or len(top) < 2:
        return None
    a, b = sorted(top.values(), reverse=True)[:2]
    return round(a - b, 4)


def compare(ref: dict, other: dict) -> dict:
    """Requests whose tokens differ from the reference's, each with the reference's top-2 margin at
    the first differing token (below NEAR_TIE: a bf16 near-tie; above: a real difference)."""
    differing = []
    for key, r in ref.items():
        o = other.get(key) or {}
        a, b = r.get("tokens"), o.get("tokens")
        if a == b and a is not None:
            continue
        step = next((i for i, (x, y) in enumerate(zip(a or [], b or [])) if x != y), None)
        gap = margin(r["top"][step]) if step is not None and step < len(r.get("top") or []) else None
        differing.append({"request": key, "group": groups_label(r["group"]), "step": step, "ref_margin": gap,
                          "near_tie": gap is not None and gap < NEAR_TIE})  # fmt: skip
    return {
        "requests": len(ref),
        "differing": len(differing),
        "differ_clearly": sum(1 for d in differing if not d["near_tie"]),
        "differ_after_near_tie": sum(1 for d in differing if d["near_tie"]),
        "groups_clearly": sorted({d["group"] for d in differing if not d["near_tie"]}),
        "detail": differing,
    }


def main() -> None:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    release = version("vllm").split("+")[0]
    model = build(work)
    plan = compile_plan(work, "serve", release, 3, MAIN)
    wrong = compile_plan(work, "serve-wrong", release, 2, MAIN)
    dummy = compile_plan(work, "dummy", release, 3, DUMMY)
    results: dict = {"release": release, "requests_per_group": GROUP, "near_tie_below": NEAR_TIE}
    t0 = time.perf_counter()
    results["identity"] = identity()
    together = "--together" in sys.argv  # every server at once, each with a fixed KV cache (no profiling capture)
    results["server_settings"] = "together, fixed KV cache" if together else "one at a time, vLLM's memory profiling"
    jobs = {
        "planned": lambda: serve("planned", model, work, True, plan, MAIN, together),
        "reference": lambda: serve("reference", model, work, False, None, MAIN, together),
        "vanilla": lambda: serve("vanilla", model, work, True, None, MAIN, together),
        "dummy": lambda: serve("dummy", model, work, True, dummy, DUMMY, together),
        "mismatch": lambda: refusal("mismatch", model, work, wrong, True, {}),
        "v1": lambda: refusal("v1", model, work, plan, False, {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    }
    if together:
        threads = [threading.Thread(target=lambda n=n, f=f: results.__setitem__(n, f())) for n, f in jobs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:  # every arm under the same settings: alone on the GPU, its KV cache sized by vLLM's profiling
        for name, job in jobs.items():
            results[name] = job()
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    for name in ("planned", "dummy"):  # each kept report names the code that wrote it, as the other harnesses do
        kept = work / f"{name}.report.json"
        if kept.exists():
            rep = json.loads(kept.read_text())
            kept.write_text(json.dumps({"capplan_commit": results["identity"].get("capplan_commit"), **rep}, indent=2))
    ref = results["reference"]["outputs"]
    for name in ("vanilla", "planned"):
        results[f"{name}_vs_reference"] = compare(ref, results[name]["outputs"])
    results["dummy_vs_reference"] = {"note": "other engine limits; served requests answered",
                                     "answered": sum(1 for o in results["dummy"]["outputs"].values() if o.get("tokens"))}  # fmt: skip
    out.write_text(json.dumps(results, indent=1))
    brief = {
        k: v for k, v in results.items() if k.endswith("_vs_reference") or k in ("release", "mismatch", "v1", "wall_s")
    }
    for k in ("vanilla_vs_reference", "planned_vs_reference"):
        brief[k] = {x: y for x, y in brief[k].items() if x != "detail"}
    for name in ("planned", "dummy"):
        rep = results[name].get("report") or {}
        brief[name] = {"ready_s": results[name].get("ready_s"), "error": results[name].get("error"),
                       "in_force_lines": results[name]["in_force_lines"], "tracebacks": results[name]["tracebacks"],
                       "planned": rep.get("graphs_planned"), "captured": rep.get("graphs_captured"),
                       "vllm_would": rep.get("vllm_would_capture"), "capture_s": rep.get("capture_seconds"),
                       "mem_gib": rep.get("graph_memory_gib"), "dispatch": rep.get("dispatch", {}).get("calls")}  # fmt: skip
    print(json.dumps(brief, indent=1))


if __name__ == "__main__":
    main()
