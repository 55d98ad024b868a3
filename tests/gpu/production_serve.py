"""Serve first at production size: tiers against the full plan on an 8B-class Llama under `vllm serve`.

    python tests/gpu/production_serve.py WORK OUT.json starts [--pairs N] [--until SECONDS]
    python tests/gpu/production_serve.py WORK OUT.json summary

The model has Llama-3.1-8B's shape (`configs/llama-3.1-8b.json`: 32 layers, hidden 4096,
intermediate 14336, 32 heads, 8 KV heads, vocabulary 128256) with random bf16 weights built on the
GPU (lm_head x20, so that greedy tokens are stable), and four random rank-16 LoRA adapters on
q/k/v/o. Capture time and graph memory depend on shapes, not on weight values. Every server is
vLLM's OpenAI server with default multiprocessing (the engine core in its own process), vLLM's
default memory path (its profiling pass sizes the KV cache at `--gpu-memory-utilization 0.92`;
no fixed KV cache) and the attention backend vLLM picks (none is forced; the log's choice is
recorded). max_loras 4 with active-count specialization: 258 graphs in the plan.

Starts, one at a time on one compile cache (`VLLM_CACHE_ROOT`), appended to WORK/starts.jsonl so
that a later call goes on where the last one stopped:
- `full`:    `capplan apply` with the plan, every graph captured before /health answers;
- `tiers`:   the same plan with spec tiers (the rest captured while serving);
- `vanilla`: vLLM alone with `specialize_active_lora` (no plan): its no-LoRA-slot bug is the
             positive control for the token comparison;
- `fault`:   the tiers plan with `faults/sitecustomize.py` on the engine's path: every fallback a
             deferred graph replays is swapped for a captured graph of the next smaller LoRA case
             (one adapter slot too few), the failure deferred capture must never have: the positive
             control for deferred capture itself.
The order: a full start (it compiles the model into the cache, not counted), the two controls,
then pairs of counted starts (T F, F T, ...).

Each start, from the moment /health answers: the check groups (requests of k adapters with and
without base-model requests, k = 1..4, and base only; 16 greedy tokens, top-5 logprobs kept),
then traffic of the start's shape (`sustained`: arrivals at a constant rate, no idle gap; `bursts`:
three bursts with idle gaps; `none`: the check groups alone), streamed, with every inter-token interval; for tiers and fault
starts the check groups again once every deferred graph landed. Every token and top-5 logprob is
kept in the start's record. A request's tokens are compared with the first full start's: any
differing token counts (no near-tie excuse); the controls show whether the rule catches a real
error in the same run.

Every record names the capplan commit (`CAPPLAN_COMMIT`, else `git rev-parse`), the vLLM release,
torch, the GPU, the attention backend from the server's log and the exact command.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import release_run  # noqa: E402
from deferred_serve import compile_spec, interval, log_facts, read_json, stop, wait_landed  # noqa: E402
from run_identity import BACKEND_LINE, identity  # noqa: E402
from serve_run import free_port, save_word_tokenizer, wait_ready  # noqa: E402

T0 = time.monotonic()
CONFIG = HERE / "configs" / "llama-3.1-8b.json"
ADAPTERS = 4
RANK = 16
SPEC = """\
# Llama-3.1-8B's shape, four rank-16 adapters, active-count specialization.
target: {{runner: mrv2, vllm: "{release}"}}
scheduler: {{max_num_seqs: 128, max_num_batched_tokens: 8192, max_model_len: 4096}}
cudagraph: {{mode: FULL_AND_PIECEWISE}}
lora: {{enabled: true, max_loras: 4, specialize: true, specialize_active: true}}
"""
TIERS = 'tiers: {ready: ["FULL:1x1@0"], every_steps: 8}\n'
UTIL = "0.92"
GROUP = 8
TOPK = 5
CAPTURE_LINE = re.compile(r"Graph capturing finished in ([\d.]+) secs?, took ([\d.-]+) GiB")
ESTIMATE_LINE = re.compile(r"[Ee]stimated CUDA graph memory:? ([\d.]+) GiB")
CONTROLS = ("vanilla", "fault")
FIRST = ("full", *CONTROLS)


# -- the model --------------------------------------------------------------------------------
def build_model(model: Path) -> None:
    """Random bf16 weights of Llama-3.1-8B's shape, built on the GPU (lm_head x20), four random
    peft adapters (rank 16, q/k/v/o, x4 so that dropping one changes tokens) and a word-level
    tokenizer with one word per token id."""
    if (model / "done.json").exists():
        return
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in json.loads(CONFIG.read_text()).items() if k != "architectures"})
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        base.lm_head.weight.mul_(20.0)
    base.save_pretrained(model / "base", safe_serialization=True)
    save_word_tokenizer(model / "base", config.vocab_size)
    lora = LoraConfig(
        r=RANK, lora_alpha=2 * RANK, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(base, lora)
    for i in range(1, ADAPTERS + 1):
        torch.manual_seed(100 + i)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    torch.nn.init.kaiming_uniform_(param, a=math.sqrt(5))
                    param.mul_(4.0)
        peft_model.save_pretrained(model / f"lora{i}")
    (model / "done.json").write_text(json.dumps({"config": CONFIG.name, "adapters": ADAPTERS, "rank": RANK}))
    del peft_model, base
    torch.cuda.empty_cache()


# -- servers ----------------------------------------------------------------------------------
def server_command(model: Path, port: int) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model / "base"), "--served-model-name", "base", "--port", str(port),
        "--enable-lora", "--max-loras", str(ADAPTERS), "--max-lora-rank", str(RANK),
        "--lora-modules", *[f"a{i}={model / f'lora{i}'}" for i in range(1, ADAPTERS + 1)],
        "--max-num-seqs", "128", "--max-num-batched-tokens", "8192", "--max-model-len", "4096",
        "--gpu-memory-utilization", UTIL, "--dtype", "bfloat16", "--seed", "0", "--specialize-active-lora",
    ]  # fmt: skip


# -- traffic ----------------------------------------------------------------------------------
def groups() -> list[list[str | None]]:
    """Adapter per request (None: the base model), per concurrent group: k adapters with base
    requests (the no-LoRA slot's class), k adapters alone, k = 1..4, then base only."""
    out = []
    for k in range(1, ADAPTERS + 1):
        out.append([f"a{1 + i % k}" if i % 2 == 0 else None for i in range(GROUP)])
        out.append([f"a{1 + i % k}" for i in range(GROUP)])
    out.append([None] * GROUP)
    return out


def prompt(g: int, i: int) -> list[int]:
    """Request i of group g: 5 to 26 token ids spread over the vocabulary."""
    return [(7919 * g + 104729 * i + 31 * t) % 30000 + 10 for t in range(5 + 3 * i)]


def run_groups(port: int) -> dict:
    """Every group, one after the other, its requests concurrent: tokens and top-5 logprobs of
    each request, keyed "group:request"."""
    return release_run.run_groups(port, groups(), prompt, TOPK)


def traffic(shape: str, seed: int) -> list[dict]:
    """`sustained`: 14 arrivals a second for 25 s, no idle gap (each request decodes 64-192
    tokens, so the engine is never idle while arrivals last); `bursts`: three 4 s bursts at 14 a
    second with 6 s idle gaps."""
    rng = random.Random(seed)
    windows = [(0.0, 25.0)] if shape == "sustained" else [(0.0, 4.0), (10.0, 14.0), (20.0, 24.0)]
    out = []
    for lo, hi in windows:
        t = lo
        while True:
            t += 1 / 14
            if t >= hi:
                break
            plen = int(math.exp(rng.uniform(math.log(64), math.log(1024))))
            adapter = None if rng.random() < 0.3 else f"a{rng.randint(1, ADAPTERS)}"
            out.append(
                {
                    "at": round(t, 4),
                    "prompt": [rng.randint(10, 30000) for _ in range(plen)],
                    "max_tokens": rng.randint(64, 192),
                    "model": adapter or "base",
                }
            )
    return out


def stream_one(port: int, req: dict, start: float, out: dict) -> None:
    delay = start + req["at"] - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    body = json.dumps(
        {"model": req["model"], "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0,
         "ignore_eos": True, "stream": True}
    )  # fmt: skip
    out["sent"] = time.perf_counter()
    stamps: list[float] = []
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        for raw in conn.getresponse():
            line = raw.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]" and json.loads(line[6:]).get("choices"):
                stamps.append(time.perf_counter())
        conn.close()
    except Exception as exc:  # noqa: BLE001 - counted as a failed request
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["stamps"] = stamps


def pct(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 2) if values else None


def load(port: int, requests: list[dict]) -> dict:
    """The requests at their arrival times, streamed; inter-token intervals of every request."""
    results: list[dict] = [{} for _ in requests]
    start = time.perf_counter() + 0.2
    threads = [threading.Thread(target=stream_one, args=(port, r, start, o)) for r, o in zip(requests, results)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in results if "error" not in r and r["stamps"]]
    itl = [1000 * (b - a) for r in ok for a, b in zip(r["stamps"], r["stamps"][1:])]
    ttft = [1000 * (r["stamps"][0] - r["sent"]) for r in ok]
    end = max((r["stamps"][-1] for r in ok), default=start)
    return {
        "requests": len(requests),
        "failed": len(requests) - len(ok),
        "errors": sorted({r["error"] for r in results if "error" in r})[:5],
        "duration_s": round(end - start, 2),
        "chunks": len(itl) + len(ok),
        "itl_ms": {q: pct(itl, p) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))}
        | {"max": round(max(itl), 2) if itl else None},
        "ttft_ms": {"p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99)},
        "end_s": end,
    }


# -- one start --------------------------------------------------------------------------------
def start_once(kind: str, shape: str, work: Path, plans: dict, ident: dict) -> dict:
    port = free_port()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / "cache"), "VLLM_USE_V2_MODEL_RUNNER": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = server_command(work / "model", port)
    plan = None if kind == "vanilla" else plans["full" if kind == "full" else "tiers"]
    n = sum(1 for _ in (work / "starts.jsonl").open()) if (work / "starts.jsonl").exists() else 0
    log_path, report = work / f"start{n}-{kind}.log", work / f"start{n}-{kind}.report.json"
    if kind == "fault":
        env["PYTHONPATH"] = os.pathsep.join([str(HERE / "faults"), env.get("PYTHONPATH", "")])
        env["CAPPLAN_FAULT"] = "fallback-one-slot-short"
    if plan is not None:
        cmd = [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(plan), "--report", str(report),
               "--", *cmd]  # fmt: skip
    report.unlink(missing_ok=True)
    result: dict = {"kind": kind, "index": n, "shape": shape, "command": cmd, **ident}
    if kind == "fault":
        result["env"] = {"CAPPLAN_FAULT": env["CAPPLAN_FAULT"], "PYTHONPATH+": str(HERE / "faults")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    try:
        result["healthy_s"] = round(wait_ready(port, proc, limit=540), 2)
        healthy = time.perf_counter()
        result["check"] = run_groups(port)  # from the moment /health answers
        result["check_s"] = round(time.perf_counter() - healthy, 2)
        during = read_json(report)
        if during and during.get("deferred"):
            result["pending_after_check"] = len(during["deferred"]["pending"])
        if shape != "none":
            lo = load(port, traffic(shape, seed=n))
            result["load_end_after_healthy_s"] = round(lo.pop("end_s") - healthy, 2)
            result["load"] = lo
        if kind in ("tiers", "fault"):
            landed = wait_landed(report, 240)
            result["landed_after_load_s"] = None if landed is None else round(landed, 2)
            result["check_after_landing"] = run_groups(port)
        time.sleep(2)  # the report file is kept at most a second behind
    except Exception as exc:  # noqa: BLE001 - recorded with the start
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        stop(proc)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result.update(log_facts(log_path))
    text = log_path.read_text(errors="replace")
    result["attention_backend"] = sorted(set(BACKEND_LINE.findall(text)))
    result["vllm_capture"] = [[float(a), float(b)] for a, b in CAPTURE_LINE.findall(text)]
    result["vllm_estimate_gib"] = [float(x) for x in ESTIMATE_LINE.findall(text)]
    result["fault_installed"] = "capplan-fault: installed" in text
    rep = read_json(report)
    if rep is not None:
        result["report"] = rep
    return result


def order(pairs: int) -> list[tuple[str, str]]:
    """(kind, traffic shape) of every start: the compiling full start, the two controls, then the
    pairs (T F, F T, ...): the first under sustained load, the second in bursts, the rest with the
    check groups only (`none`: time to healthy, KV cache and memory need no traffic)."""
    out = [("full", "bursts"), ("vanilla", "none"), ("fault", "sustained")]
    for i in range(pairs):
        shape = ("sustained", "bursts")[i] if i < 2 else "none"
        out += [(k, shape) for k in (("tiers", "full") if i % 2 == 0 else ("full", "tiers"))]
    return out


def starts(work: Path, out: Path, until: float, pairs: int) -> None:
    ident = identity()
    release = ident["vllm"].split("+")[0]
    plans = {
        "full": compile_spec(work, "full", SPEC.format(release=release)),
        "tiers": compile_spec(work, "tiers", SPEC.format(release=release) + TIERS),
    }
    build_model(work / "model")
    record = work / "starts.jsonl"
    done = [json.loads(line) for line in record.open()] if record.exists() else []
    for kind, shape in order(pairs)[len(done) :]:
        spent = [d["wall_s"] for d in done[1:] if "wall_s" in d]
        expect = max(spent) if spent else 300
        if time.monotonic() - T0 + expect > until:
            print(f"stopping: {until - (time.monotonic() - T0):.0f} s left, a start takes up to {expect:.0f} s")
            break
        result = start_once(kind, shape, work, plans, ident)
        done.append(result)
        with record.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(json.dumps({k: result.get(k) for k in ("kind", "index", "shape", "healthy_s", "wall_s",
                                                      "kv_cache_tokens", "attention_backend", "error")}))  # fmt: skip
    summarize(out, done)


# -- summary ----------------------------------------------------------------------------------
def compare(ref: dict, other: dict) -> dict:
    """Requests whose tokens differ from the reference's in any position, with the first
    differing step and both sides' top-5 there."""
    differing = []
    for key, r in ref.items():
        o = other.get(key) or {}
        a, b = r.get("tokens"), o.get("tokens")
        if a is not None and a == b:
            continue
        step = next((i for i, (x, y) in enumerate(zip(a or [], b or [])) if x != y), None)
        at = lambda side, s=step: (side.get("top") or [None] * 99)[s] if s is not None else None  # noqa: E731
        differing.append({"request": key, "adapter": r.get("adapter"), "group": r["group"], "step": step,
                          "reference_top": at(r), "other_top": at(o)})  # fmt: skip
    return {"requests": len(ref), "differing": len(differing), "detail": differing}


def summarize(out: Path, done: list[dict]) -> None:
    ref = next((d for d in done if d["kind"] == "full" and d.get("check")), None)
    counted = [d for d in done if d["index"] >= len(FIRST)]
    ratios: dict = {}
    for key in ("healthy_s", "init_engine_s"):
        rs = []
        for a, b in zip(counted[0::2], counted[1::2], strict=False):
            by = {a["kind"]: a, b["kind"]: b}
            if set(by) == {"tiers", "full"} and by["tiers"].get(key) and by["full"].get(key):
                rs.append(by["tiers"][key] / by["full"][key])
        ratios[key] = interval(rs) if rs else None
    comparisons = {}
    if ref is not None:
        for d in done:
            for part in ("check", "check_after_landing"):
                if d is not ref and d.get(part):
                    c = compare(ref["check"], d[part])
                    comparisons[f"start{d['index']}-{d['kind']}:{part}"] = c
    tiers = [d for d in done if d["kind"] in ("tiers", "fault") and d.get("report", {}).get("deferred")]
    summary = {
        "identity": {k: done[0].get(k) for k in ("capplan_commit", "vllm", "torch", "gpu", "python")} if done else {},
        "attention_backend": sorted({b for d in done for b in d.get("attention_backend", [])}),
        "reference": None if ref is None else f"start{ref['index']}-full:check",
        "healthy_ratio_tiers_over_full": ratios["healthy_s"],
        "init_engine_ratio_tiers_over_full": ratios["init_engine_s"],
        "per_start": [
            {
                k: d.get(k)
                for k in (
                    "index",
                    "kind",
                    "shape",
                    "healthy_s",
                    "init_engine_s",
                    "wall_s",
                    "kv_cache_tokens",
                    "vllm_capture",
                    "vllm_estimate_gib",
                    "landed_after_load_s",
                    "load_end_after_healthy_s",
                    "pending_after_check",
                    "fault_installed",
                    "tracebacks",
                    "out_of_memory",
                    "error",
                )
            }
            | {"load": d.get("load")}
            | {
                "deferred": {
                    k: v
                    for k, v in ((d.get("report") or {}).get("deferred") or {}).items()
                    if k not in ("captures", "pending")
                }
            }
            for d in done
        ],  # fmt: skip
        "step_captures": {
            f"start{d['index']}-{d['kind']}": sum(
                1 for c in d["report"]["deferred"]["captures"] if c["trigger"] == "step"
            )
            for d in tiers
        },
        "held_over_used": {
            f"start{d['index']}-{d['kind']}": round(
                d["report"]["deferred"]["reserved_gib"] / d["report"]["deferred"]["graph_memory_gib"], 3
            )
            if d["report"]["deferred"].get("graph_memory_gib")
            else None
            for d in tiers
        },
        "comparisons": {k: {x: v[x] for x in ("requests", "differing")} for k, v in comparisons.items()},
        "comparison_detail": comparisons,
    }
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("per_start", "comparison_detail")}, indent=1))


def main() -> None:
    work, out, phase = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    args = sys.argv[4:]

    def option(name: str, default: str) -> str:
        return args[args.index(name) + 1] if name in args else default

    if phase == "summary":
        record = work / "starts.jsonl"
        summarize(out, [json.loads(line) for line in record.read_text().splitlines() if line.strip()])
        return
    work.mkdir(parents=True, exist_ok=True)
    if phase == "starts":
        starts(work, out, float(option("--until", "560")), int(option("--pairs", "5")))
    else:
        raise SystemExit(f"unknown phase {phase!r}: starts or summary")


if __name__ == "__main__":
    main()
