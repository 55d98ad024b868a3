"""The plan under `vllm serve` (vLLM's OpenAI server, default multiprocessing), as operators run it.

    python tests/gpu/serve_run.py WORK_DIR OUT.json

Servers, one at a time, on a tiny random Llama with 3 LoRA adapters (max_loras 3):
- reference: specialize_active_lora off (every LoRA graph has the full grid);
- vanilla:   specialize_active_lora on, no plan;
- planned:   specialize_active_lora on, under `capplan apply` with the plan.
Each gets the same groups of concurrent /v1/completions requests: k adapters plus
base requests (k = 1..3), adapters only, base only; a group finishes before the
next starts, so decode steps see exactly that mix. Then the refusals, timed from
launch to exit, with the last lines the operator sees on stderr:
- mismatch: a plan for max_loras 2 on this max_loras 3 server;
- v1: the plan named by CAPPLAN_PLAN on a server forced to vLLM's V1 runner.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPEC = """\
target: {{runner: mrv2, vllm: "0.25"}}
scheduler: {{max_num_seqs: 32, max_num_batched_tokens: 2048, max_model_len: 512}}
cudagraph: {{mode: FULL_AND_PIECEWISE}}
lora: {{enabled: true, max_loras: {max_loras}, specialize: true, specialize_active: true}}
"""
GROUP = 8  # concurrent requests per group


def build(work: Path) -> Path:
    sys.path.insert(0, str(HERE))
    from make_model import build as build_model

    model = work / "model"
    build_model(model)
    base = model / "base"
    if not (base / "tokenizer.json").exists():  # the server needs a tokenizer: one word per token id
        save_word_tokenizer(base, 2048)
    return model


def save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one word ("t<id>") per token id, saved into `folder`: what vLLM's
    server needs beside a random model that is sent token-id prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="t1", eos_token="t2").save_pretrained(
        folder
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model: Path, port: int, specialize_active: bool) -> list[str]:
    cmd = [
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
        "3",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        *[f"a{i}={model / f'lora{i}'}" for i in (1, 2, 3)],
        "--max-num-seqs",
        "32",
        "--max-num-batched-tokens",
        "2048",
        "--max-model-len",
        "512",
        "--gpu-memory-utilization",
        "0.3",
        "--attention-backend",
        "TRITON_ATTN",
        "--dtype",
        "bfloat16",
        "--seed",
        "0",
    ]
    if specialize_active:
        cmd.append("--specialize-active-lora")
    return cmd


def groups() -> list[list[str | None]]:
    """Adapter per request (None: base model), per concurrent group."""
    out = []
    for k in (1, 2, 3):
        out.append([f"a{1 + i % k}" if i % 2 == 0 else None for i in range(GROUP)])  # k adapters + base
        out.append([f"a{1 + i % k}" for i in range(GROUP)])  # k adapters, no base
    out.append([None] * GROUP)  # base only
    return out


def complete(port: int, model: str, prompt: list[int]) -> list[str]:
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


def run_groups(port: int) -> dict:
    """Every group of `groups()`, one after the other, its requests concurrent: the text of
    each request, keyed "group:request"."""
    texts: dict = {}
    for g, adapters in enumerate(groups()):
        out: dict = {}

        def one(i: int, adapter: str | None, g: int = g, out: dict = out) -> None:
            prompt = [(7 * g + 13 * i + t) % 2000 + 10 for t in range(5 + i)]
            out[i] = complete(port, adapter or "base", prompt)

        threads = [threading.Thread(target=one, args=(i, a)) for i, a in enumerate(adapters)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, adapter in enumerate(adapters):
            texts[f"{g}:{i}"] = {"adapter": adapter, "group": g, "text": out.get(i)}
    return texts


def wait_ready(port: int, proc: subprocess.Popen, limit: float = 300) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < limit:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return time.perf_counter() - start
        except OSError:
            time.sleep(1)
    raise RuntimeError("server not ready")


def serve(name: str, model: Path, work: Path, specialize_active: bool, plan: Path | None) -> dict:
    port = free_port()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / f"cache-{name}"), "VLLM_USE_V2_MODEL_RUNNER": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's default: engine core in its own process
    cmd = server_command(model, port, specialize_active)
    report = work / f"{name}.report.json"
    if plan is not None:
        cmd = [
            sys.executable,
            "-m",
            "capplan",
            "apply",
            "--runner",
            "mrv2",
            str(plan),
            "--report",
            str(report),
            "--",
            *cmd,
        ]
    log = (work / f"{name}.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    result: dict = {"name": name}
    try:
        result["ready_s"] = round(wait_ready(port, proc), 1)
        result["texts"] = run_groups(port)
    except Exception as exc:  # noqa: BLE001 - keep what the other servers measured
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["texts"] = {}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    text = (work / f"{name}.log").read_text()
    result["capplan_lines"] = [line for line in text.splitlines() if "capplan" in line][-6:]
    if "error" in result:
        result["log_tail"] = text.splitlines()[-25:]
    if report.exists():
        result["report"] = json.loads(report.read_text())
    return result


def refusal(name: str, model: Path, work: Path, plan: Path, via_apply: bool, extra_env: dict) -> dict:
    port = free_port()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / f"cache-{name}"), **extra_env}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = server_command(model, port, True)
    if via_apply:
        cmd = [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(plan), "--", *cmd]
    else:
        env["CAPPLAN_PLAN"] = str(plan)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    elapsed = time.perf_counter() - start
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return {
        "name": name,
        "returncode": proc.returncode,
        "launch_to_exit_s": round(elapsed, 1),
        "last_stderr_lines": lines[-3:],
        "weights_loaded": "Loading weights took" in proc.stdout + proc.stderr
        or "Model loading took" in proc.stdout + proc.stderr,
    }


def compile_plan(work: Path, name: str, max_loras: int) -> Path:
    spec = work / f"{name}.yaml"
    spec.write_text(SPEC.format(max_loras=max_loras))
    plan = work / f"{name}.plan.yaml"
    subprocess.run([sys.executable, "-m", "capplan", "compile", str(spec), "-o", str(plan)], check=True)
    return plan


def main() -> None:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    model = build(work)
    plan = compile_plan(work, "serve", 3)
    wrong = compile_plan(work, "serve-wrong", 2)
    results: dict = {}
    results["mismatch"] = refusal("mismatch", model, work, wrong, True, {})
    results["v1"] = refusal("v1", model, work, plan, False, {"VLLM_USE_V2_MODEL_RUNNER": "0"})
    results["reference"] = serve("reference", model, work, False, None)
    results["vanilla"] = serve("vanilla", model, work, True, None)
    results["planned"] = serve("planned", model, work, True, plan)
    ref = results["reference"]["texts"]
    for name in ("vanilla", "planned"):
        texts = results[name]["texts"]
        wrong_keys = sorted(k for k in ref if texts.get(k, {}).get("text") != ref[k]["text"])
        results[f"{name}_vs_reference"] = {
            "requests": len(ref),
            "differing": len(wrong_keys),
            "groups": sorted({groups_label(ref[k]["group"]) for k in wrong_keys}),
        }
    for run in ("reference", "vanilla", "planned"):
        results[run].pop("texts")
    out.write_text(json.dumps(results, indent=2))
    print(
        json.dumps({k: v for k, v in results.items() if k.endswith("reference") or k in ("mismatch", "v1")}, indent=1)
    )


def groups_label(g: int) -> str:
    labels = [f"{k} adapter(s){suffix}" for k in (1, 2, 3) for suffix in (" + base", "")] + ["base only"]
    return labels[g]


if __name__ == "__main__":
    main()
