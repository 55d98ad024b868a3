"""Serve first at production size: tiers against the full plan on an 8B-class Llama under `vllm serve`.

    python tests/gpu/production_serve.py WORK OUT.json starts [--pairs N | --order K,K,...] [--until SECONDS]
    python tests/gpu/production_serve.py WORK OUT.json summary

The model has Llama-3.1-8B's shape (`configs/llama-3.1-8b.json`: 32 layers, hidden 4096,
intermediate 14336, 32 heads, 8 KV heads, vocabulary 128256) with random bf16 weights built on the
GPU (the library's initialisation, std 0.02: logits of a few units, where bfloat16's steps are
small), and four random rank-16 LoRA adapters on q/k/v/o (peft's random initialisation, A and B
each halved: each adapter's weight delta is about an eighth of the weight it adds to). The
adapters' size was fixed on a CPU before any run (`adapter_noise.py`, its output in
`results/production/adapter-noise/`): at this size, bf16-scale noise in every layer (relative
2**-8, and 2**-7) moves the first step's top-5 logprobs of 16 prompts by at most 0.22 and 0.28 nats
with such an adapter, 0.19 and 0.38 without one, while leaving the adapter out moves the top token
out of the other's top-5 on 15 of 16 prompts (the 16th by 0.1 nats). A and B each 8 times larger
(the last run's, x4) are chaotic: noise alone does that on 15 of 16. Capture time and graph memory
depend on shapes, not on weight values. Every server is vLLM's OpenAI server with default
multiprocessing (the engine core in its own process), the attention backend vLLM picks (none is
forced; the log's choice is recorded), and the same fixed KV cache (`--kv-cache-memory-bytes`, 40
GiB): vLLM skips its profiling pass in both arms, so every graph is a first capture and the two
arms' graph memory compares as read. max_loras 4 with active-count specialization: 258 graphs in
the plan.

Starts, one at a time on one compile cache (`VLLM_CACHE_ROOT`), appended to WORK/starts.jsonl so
that a later call goes on where the last one stopped:
- `fault`:   the tiers plan with `faults/sitecustomize.py` on the engine's path: every fallback a
             deferred graph replays is swapped for a captured graph of the next smaller LoRA case
             (one adapter slot too few), the failure deferred capture must never have: the positive
             control for the token comparison. It runs first and compiles the model into the cache
             (its times are not counted).
- `tiers`:   the plan with spec tiers (one graph ready, the rest captured while serving);
- `full`:    `capplan apply` with the plan, every graph captured before /health answers.
Then pairs of counted starts (F T, F T, T F, F T, T F, ...): the third start is the second full
one, so that a run cut short by device time has its null after three.

Each start, from the moment /health answers: the check groups (requests of k adapters with and
without base-model requests, k = 1..4, and base only; 16 greedy tokens, top-5 logprobs kept),
then the sustained traffic (the same requests at the same offsets in every start, from one seed:
14 arrivals a second for 45 s, no idle gap), streamed, every token's arrival and text kept; for
tiers starts, the wait until every deferred graph landed (the graph memory is read then). The
fault start stops after its check (its load would show nothing the tiered starts do not). The
check groups run once: run again, they meet vLLM's prefix cache and prefill other shapes, which
no longer compares with the reference. The runtime's report is read as the traffic starts and as
it ends: the graphs the traffic dispatched to (its `hits_by_graph` grew) that were deferred, and
when each landed (its capture's `landed_unix`) after the first request was sent.

The token comparison: a request is compared with the reference's (the first full-plan start's)
step by step while the greedy tokens agree, through the first step where they differ (until then
both computed the same prefix): at each step, the largest difference of a token's logprob in
both top-5 lists, or no match where either side's top token is outside the other's top-5. A
request differs where that distance exceeds 0.5 nats (fixed before the run). The full starts
against the reference are the null; the fault start's check from /health the positive control.

Every record names the capplan commit (`CAPPLAN_COMMIT`, else `git rev-parse`), the vLLM release,
torch, the GPU, the host CPU, the attention backend from the server's log and the exact command.
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
ADAPTER_SCALE = 0.5  # A and B each: sized by adapter_noise.py (the module's docstring)
SPEC = """\
# Llama-3.1-8B's shape, four rank-16 adapters, active-count specialization.
target: {{runner: mrv2, vllm: "{release}"}}
scheduler: {{max_num_seqs: 128, max_num_batched_tokens: 8192, max_model_len: 4096}}
cudagraph: {{mode: FULL_AND_PIECEWISE}}
lora: {{enabled: true, max_loras: 4, specialize: true, specialize_active: true}}
"""
TIERS = 'tiers: {ready: ["FULL:1x1@0"], every_steps: 8}\n'
KV_BYTES = 40 * 2**30  # both arms: vLLM skips its profiling pass
SEED = 20261206  # the traffic's: the same in every start
LOAD_SECONDS = 45.0
RATE = 14  # arrivals a second
TAU = 0.5  # nats: a request differs from the reference's beyond this (see the docstring)
GROUP = 8
TOPK = 5
CAPTURE_LINE = re.compile(r"Graph capturing finished in ([\d.]+) secs?, took ([\d.-]+) GiB")
ESTIMATE_LINE = re.compile(r"[Ee]stimated CUDA graph memory:? ([\d.]+) GiB")
FAULT_SWAP_LINE = re.compile(r"capplan-fault: swap (\d+)")
FIRST = ("fault",)  # the run's first start compiles the model into the cache: never in a pair


# -- the model --------------------------------------------------------------------------------
def build_model(model: Path) -> None:
    """Random bf16 weights of Llama-3.1-8B's shape, built on the GPU, four random peft adapters
    (rank 16, q/k/v/o, A and B halved: see the module's docstring) and a word-level tokenizer with one
    word per token id."""
    if (model / "done.json").exists():
        return
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in json.loads(CONFIG.read_text()).items() if k != "architectures"})
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = LlamaForCausalLM(config).to(torch.bfloat16)
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
                    param.mul_(ADAPTER_SCALE)
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
        "--kv-cache-memory-bytes", str(KV_BYTES), "--dtype", "bfloat16", "--seed", "0", "--specialize-active-lora",
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


def traffic(seed: int = SEED) -> list[dict]:
    """RATE arrivals a second for LOAD_SECONDS, no idle gap: each request decodes 64-192 tokens
    after a prompt of 64-1024 (log-uniform), 30% on the base model, the rest on one adapter."""
    rng = random.Random(seed)
    out = []
    for i in range(1, int(LOAD_SECONDS * RATE)):
        t = i / RATE
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
    text: list[str] = []
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        for raw in conn.getresponse():
            line = raw.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                choices = json.loads(line[6:]).get("choices")
                if choices:
                    stamps.append(time.perf_counter())
                    text.append(choices[0].get("text") or "")
        conn.close()
    except Exception as exc:  # noqa: BLE001 - counted as a failed request
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["stamps"], out["text"] = stamps, text


def pct(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 2) if values else None


def load(port: int, requests: list[dict]) -> dict:
    """The requests at their arrival times, streamed: the figures, and every request raw (when
    it was sent and each chunk arrived, in ms from the load's start, and each chunk's text)."""
    results: list[dict] = [{} for _ in requests]
    start = time.perf_counter() + 0.2
    start_unix = time.time() + (start - time.perf_counter())
    threads = [threading.Thread(target=stream_one, args=(port, r, start, o)) for r, o in zip(requests, results)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in results if "error" not in r and r["stamps"]]
    itl = [1000 * (b - a) for r in ok for a, b in zip(r["stamps"], r["stamps"][1:])]
    ttft = [1000 * (r["stamps"][0] - r["sent"]) for r in ok]
    end = max((r["stamps"][-1] for r in ok), default=start)
    first = min((r["sent"] for r in results if "sent" in r), default=start)
    ms = lambda t: round(1000 * (t - start), 2)  # noqa: E731
    return {
        "requests": len(requests),
        "failed": len(requests) - len(ok),
        "errors": sorted({r["error"] for r in results if "error" in r})[:5],
        "duration_s": round(end - start, 2),
        "chunks": len(itl) + len(ok),
        "throughput_tok_s": round((len(itl) + len(ok)) / (end - first), 1) if end > first else None,
        "itl_ms": {q: pct(itl, p) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))}
        | {"max": round(max(itl), 2) if itl else None},
        "ttft_ms": {"p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99)},
        "first_sent_unix": round(start_unix + (first - start), 3),
        "raw": [
            {
                "model": q["model"],
                "sent_ms": ms(r["sent"]) if "sent" in r else None,
                "chunk_ms": [ms(t) for t in r.get("stamps", [])],
                "text": r.get("text", []),
                **({"error": r["error"]} if "error" in r else {}),
            }
            for q, r in zip(requests, results)
        ],  # fmt: skip
        "end_s": end,
    }


def dispatch_snapshot(report: Path) -> dict:
    """The runtime's report as it stands: dispatches by graph (plan index) and the graphs pending."""
    time.sleep(1.5)  # the report file is kept at most a second behind
    rep = read_json(report) or {}
    return {
        "hits_by_graph": ((rep.get("dispatch") or {}).get("hits_by_graph")) or {},
        "pending": list((rep.get("deferred") or {}).get("pending") or []),
    }


# -- one start --------------------------------------------------------------------------------
def start_once(kind: str, work: Path, plans: dict, ident: dict) -> dict:
    port = free_port()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / "cache"), "VLLM_USE_V2_MODEL_RUNNER": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = server_command(work / "model", port)
    plan = plans["tiers" if kind in ("tiers", "fault") else "full"]
    n = sum(1 for _ in (work / "starts.jsonl").open()) if (work / "starts.jsonl").exists() else 0
    log_path, report = work / f"start{n}-{kind}.log", work / f"start{n}-{kind}.report.json"
    if kind == "fault":
        env["PYTHONPATH"] = os.pathsep.join([str(HERE / "faults"), env.get("PYTHONPATH", "")])
        env["CAPPLAN_FAULT"] = "fallback-one-slot-short"
    cmd = [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(plan), "--report", str(report),
           "--", *cmd]  # fmt: skip
    report.unlink(missing_ok=True)
    result: dict = {"kind": kind, "index": n, "traffic_seed": SEED, "command": cmd, **ident}
    if kind == "fault":
        result["env"] = {"CAPPLAN_FAULT": env["CAPPLAN_FAULT"], "PYTHONPATH+": str(HERE / "faults")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    try:
        result["healthy_s"] = round(wait_ready(port, proc, limit=540), 2)
        healthy = time.perf_counter()
        result["check"] = run_groups(port)  # from the moment /health answers
        result["check_s"] = round(time.perf_counter() - healthy, 2)
        if kind not in ("fault", "null"):  # a control's part is its check: no load, to spare device time
            result["before_load"] = dispatch_snapshot(report)
            lo = load(port, traffic())
            result["load_end_after_healthy_s"] = round(lo.pop("end_s") - healthy, 2)
            result["load"] = lo
            result["after_load"] = dispatch_snapshot(report)
        if kind == "tiers":
            landed = wait_landed(report, 240)
            result["landed_after_load_s"] = None if landed is None else round(landed, 2)
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
    result["fault_swaps_at_least"] = max((int(n) for n in FAULT_SWAP_LINE.findall(text)), default=0)
    rep = read_json(report)
    if rep is not None:
        result["report"] = rep
    return result


def order(pairs: int) -> list[str]:
    """The kind of every start: the fault control (it compiles the model into the cache), then
    the pairs (F T, F T, T F, F T, T F, ...): the null (a second full start) comes third."""
    out = list(FIRST)
    for i in range(pairs):
        out += ["tiers", "full"] if i > 0 and i % 2 == 0 else ["full", "tiers"]
    return out


KINDS = ("fault", "tiers", "full", "null")  # null: a full start that only runs the check


def starts(work: Path, out: Path, until: float, kinds: list[str]) -> None:
    ident = identity()
    release = ident["vllm"].split("+")[0]
    plans = {
        "full": compile_spec(work, "full", SPEC.format(release=release)),
        "tiers": compile_spec(work, "tiers", SPEC.format(release=release) + TIERS),
    }
    build_model(work / "model")
    record = work / "starts.jsonl"
    done = [json.loads(line) for line in record.open()] if record.exists() else []
    for kind in kinds[len(done) :]:
        spent = [d["wall_s"] for d in done[1:] if "wall_s" in d]
        expect = max(spent) if spent else 300
        if time.monotonic() - T0 + expect > until:
            print(f"stopping: {until - (time.monotonic() - T0):.0f} s left, a start takes up to {expect:.0f} s")
            break
        result = start_once(kind, work, plans, ident)
        done.append(result)
        with record.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(json.dumps({k: result.get(k) for k in ("kind", "index", "healthy_s", "wall_s", "landed_after_load_s",
                                                      "attention_backend", "error")}))  # fmt: skip
    summarize(out, done, work)


# -- summary ----------------------------------------------------------------------------------
def distance(r: dict, o: dict) -> float | None:
    """How far request `o`'s logprobs are from the reference's `r`: the largest difference of a
    token's logprob in both top-5 lists, at every step while the greedy tokens agree and at the
    first step where they differ; None where either side's top token is outside the other's top-5
    (or a side has no output)."""
    a, b = r.get("tokens"), o.get("tokens")
    if not a or not b:
        return None
    worst = 0.0
    for step, (x, y) in enumerate(zip(a, b)):
        ra, ob = (r.get("top") or [])[step] or {}, (o.get("top") or [])[step] or {}
        if not ra or not ob or max(ra, key=ra.get) not in ob or max(ob, key=ob.get) not in ra:
            return None
        worst = max(worst, max(abs(ra[t] - ob[t]) for t in ra if t in ob))
        if x != y:
            break
    return round(worst, 4)


def compare(ref: dict, other: dict) -> dict:
    """Every reference request's distance in `other`; those beyond TAU (or with no match) differ."""
    dist = {key: distance(r, other.get(key) or {}) for key, r in ref.items()}
    differing = sorted(k for k, d in dist.items() if d is None or d > TAU)
    known = [d for d in dist.values() if d is not None]

    def overlap(adapter: bool) -> float | None:
        # the first generated step (both sides computed the same prompt): tokens in both top-5 lists
        got = [
            len(set((r.get("top") or [{}])[0] or {}) & set(((other.get(k) or {}).get("top") or [{}])[0] or {}))
            for k, r in ref.items()
            if (r.get("adapter") is not None) == adapter
        ]
        return round(sum(got) / len(got), 2) if got else None

    return {
        "requests": len(ref),
        "differing": len(differing),
        "differing_requests": differing,
        "max_distance": max(known) if known else None,
        "no_match": sum(d is None for d in dist.values()),
        "tokens_differing": sum((other.get(k) or {}).get("tokens") != r.get("tokens") for k, r in ref.items()),
        "first_token_differing": sum(
            ((other.get(k) or {}).get("tokens") or [None])[0] != (r.get("tokens") or [None])[0] for k, r in ref.items()
        ),
        "first_step_top5_overlap": {"adapter": overlap(True), "base": overlap(False)},
        "distances": dist,
    }


def judge(done: list[dict], ref: dict | None, comparisons: dict) -> dict:
    """The rule fixed before the run, applied: it has power where no null start (a full-plan
    start other than the reference) differs from the reference on any request, and every fault
    start, its fault installed and seen to swap, differs on some; only then does it judge the
    tiered starts, which agree where every one of them ran its check and none of their requests
    differs."""

    def differing(d: dict) -> int | None:
        got = comparisons.get(f"start{d['index']}-{d['kind']}:check")
        return None if got is None else got["differing"]

    def of(kinds: tuple[str, ...]) -> dict:
        return {f"start{d['index']}-{d['kind']}": differing(d) for d in done if d["kind"] in kinds and d is not ref}

    null, fault, tiers = of(("full", "null")), of(("fault",)), of(("tiers",))
    bit = all(d.get("fault_installed") and d.get("fault_swaps_at_least", 0) > 0 for d in done if d["kind"] == "fault")
    power = (
        ref is not None and bool(null) and bool(fault) and bit
        and all(n == 0 for n in null.values()) and all(n for n in fault.values())
    )  # fmt: skip
    return {
        "null_differing": null,
        "fault_differing": fault,
        "fault_bit": bit,
        "tiers_differing": tiers,
        "errors": {f"start{d['index']}-{d['kind']}": d["error"] for d in done if d.get("error")},
        "power": power,
        "tiers_agree": all(n == 0 for n in tiers.values()) if power and tiers else None,
    }


def graph_names(work: Path) -> list[str] | None:
    """The plan's graphs by index (the report's `hits_by_graph` keys), as captures name them."""
    from capplan.planfile.read import load_plan
    from capplan.schemas.plan import address

    path = work / "tiers.plan.yaml"
    return [address(g.descriptor) for g in load_plan(path).graphs] if path.exists() else None


def landing(d: dict, names: list[str]) -> dict | None:
    """The graphs the start's traffic dispatched to that were still deferred when it began, and
    when each landed, in seconds after the first request was sent."""
    before, after = d.get("before_load"), d.get("after_load")
    captures = ((d.get("report") or {}).get("deferred") or {}).get("captures") or []
    if not before or not after or not d.get("load"):
        return None
    first = d["load"]["first_sent_unix"]
    used = {names[int(g)] for g, n in after["hits_by_graph"].items() if n > before["hits_by_graph"].get(g, 0)}
    waiting = used & set(before["pending"])
    landed = {c["graph"]: round(c["landed_unix"] - first, 2) for c in captures if "landed_unix" in c}
    when = {g: landed.get(g) for g in sorted(waiting)}
    times = [t for t in when.values() if t is not None]
    return {
        "graphs_used": len(used),
        "deferred_when_traffic_began": len(waiting),
        "landed_within_30s": sum(t <= 30 for t in times),
        "never_landed": sum(t is None for t in when.values()),
        "last_landed_s": max(times) if times else None,
        "landed_s": when,
    }


def memory(d: dict) -> float | None:
    """The start's graph memory, every graph a first capture (no profiling pass in either arm):
    the full plan's capture, or a tiered start's every capture once all landed."""
    rep = d.get("report") or {}
    deferred = rep.get("deferred")
    if deferred is None:
        return rep.get("graph_memory_gib")
    return (
        deferred.get("all_graph_memory_gib") if deferred.get("all_first_capture") and not deferred["pending"] else None
    )


def summarize(out: Path, done: list[dict], work: Path) -> None:
    # the run's first start compiles the model into the cache: never in a pair, whatever its kind
    counted = [d for d in done[1:] if d["kind"] in ("tiers", "full")]
    ref = next((d for d in done if d["kind"] in ("full", "null") and d.get("check")), None)
    pairs = [
        {a["kind"]: a, b["kind"]: b}
        for a, b in zip(counted[0::2], counted[1::2], strict=False)
        if {a["kind"], b["kind"]} == {"tiers", "full"}
    ]
    figures = {
        "healthy_s": lambda d: d.get("healthy_s"),
        "init_engine_s": lambda d: d.get("init_engine_s"),
        "itl_p50_ms": lambda d: ((d.get("load") or {}).get("itl_ms") or {}).get("p50"),
        "itl_p99_ms": lambda d: ((d.get("load") or {}).get("itl_ms") or {}).get("p99"),
        "itl_max_ms": lambda d: ((d.get("load") or {}).get("itl_ms") or {}).get("max"),
        "ttft_p99_ms": lambda d: ((d.get("load") or {}).get("ttft_ms") or {}).get("p99"),
        "throughput_tok_s": lambda d: (d.get("load") or {}).get("throughput_tok_s"),
        "graph_memory_gib": memory,
    }
    ratios = {}
    for name, get in figures.items():
        rs = [get(p["tiers"]) / get(p["full"]) for p in pairs if get(p["tiers"]) and get(p["full"])]
        ratios[name] = interval(rs) if rs else None
    comparisons: dict = {}
    if ref is not None:
        for d in done:
            if d is not ref and d.get("check"):
                comparisons[f"start{d['index']}-{d['kind']}:check"] = compare(ref["check"], d["check"])
    names = graph_names(work)
    verdict = judge(done, ref, comparisons)
    landings = {
        f"start{d['index']}-{d['kind']}": landing(d, names) for d in done if names and d["kind"] in ("tiers", "fault")
    }
    summary = {
        "identity": {k: done[0].get(k) for k in ("capplan_commit", "vllm", "torch", "gpu", "host_cpu", "python")}
        if done
        else {},
        "attention_backend": sorted({b for d in done for b in d.get("attention_backend", [])}),
        "traffic": {"seed": SEED, "rate_per_s": RATE, "seconds": LOAD_SECONDS, "requests": len(traffic())},
        "reference": None if ref is None else f"start{ref['index']}-{ref['kind']}:check",
        "rule": f"a request differs where its logprob distance from the reference's exceeds {TAU} nats, or no match",
        "verdict": verdict,
        "ratios_tiers_over_full": ratios,
        "pairs": len(pairs),
        "per_start": [
            {
                k: d.get(k)
                for k in (
                    "index",
                    "kind",
                    "healthy_s",
                    "init_engine_s",
                    "wall_s",
                    "kv_cache_tokens",
                    "vllm_capture",
                    "landed_after_load_s",
                    "load_end_after_healthy_s",
                    "fault_installed",
                    "fault_swaps_at_least",
                    "tracebacks",
                    "out_of_memory",
                    "error",
                )
            }
            | {"load": {k: v for k, v in (d.get("load") or {}).items() if k != "raw"}, "graph_memory_gib": memory(d)}
            | {
                "deferred": {
                    k: v
                    for k, v in ((d.get("report") or {}).get("deferred") or {}).items()
                    if k not in ("captures", "pending", "misses_by_graph")
                }
            }
            for d in done
        ],  # fmt: skip
        "landing": landings,
        "comparisons": {
            k: {
                x: v[x]
                for x in (
                    "requests",
                    "differing",
                    "max_distance",
                    "no_match",
                    "tokens_differing",
                    "first_token_differing",
                    "first_step_top5_overlap",
                )
            }  # fmt: skip
            for k, v in comparisons.items()
        },
        "comparison_detail": comparisons,
    }
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("per_start", "comparison_detail")}, indent=1))


def main() -> None:
    work, out, phase = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    args = sys.argv[4:]

    def option(name: str, default: str) -> str:
        if name not in args:
            return default
        if args.index(name) + 1 == len(args):
            raise SystemExit(f"{name} needs a value")
        return args[args.index(name) + 1]

    if phase == "summary":
        record = work / "starts.jsonl"
        summarize(out, [json.loads(line) for line in record.read_text().splitlines() if line.strip()], work)
        return
    if phase != "starts":
        raise SystemExit(f"unknown phase {phase!r}: starts or summary")
    pairs, until = option("--pairs", "3"), option("--until", "560")
    if not pairs.isdigit() or not until.replace(".", "", 1).isdigit():
        raise SystemExit("--pairs: a whole number; --until: seconds")
    kinds = option("--order", "").split(",") if "--order" in args else order(int(pairs))
    if not kinds or any(k not in KINDS for k in kinds):
        raise SystemExit(f"--order: a comma-separated list of {', '.join(KINDS)}")
    work.mkdir(parents=True, exist_ok=True)
    starts(work, out, float(until), kinds)


if __name__ == "__main__":
    main()
