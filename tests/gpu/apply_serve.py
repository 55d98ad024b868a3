"""`capplan apply` on a server launched with only the model and no engine flags: the flags
the plan determines are added by apply; the plan must be in force, and a contradicting
flag (--max-loras 16) refused at once.

    python3 tests/gpu/apply_serve.py OUTDIR

Run from the repo root with PYTHONPATH=/tmp/vsite:$PWD and the offline env set.
Writes OUTDIR/apply_serve.json plus logs.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import serve_run  # noqa: E402  (build(), free_port(), wait_ready())

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
work = Path("/tmp/t2")
work.mkdir(parents=True, exist_ok=True)
res: dict = {}

t0 = time.perf_counter()
model = serve_run.build(work)  # tiny Llama + lora1..4 + WordLevel tokenizer in base/
res["model_build_s"] = round(time.perf_counter() - t0, 1)
base = model / "base"

plan = Path("/tmp/p.plan.yaml")
comp = subprocess.run(
    [sys.executable, "-m", "capplan", "compile", "configs/h200-tiny-llama-025.yaml", "-o", str(plan)],
    capture_output=True,
    text=True,
)
res["compile"] = {"returncode": comp.returncode, "stdout": comp.stdout[-1500:], "stderr": comp.stderr[-1500:]}
(out / "p.plan.yaml").write_text(plan.read_text() if plan.exists() else "")

port = serve_run.free_port()
report = Path("/tmp/r.json")
report.unlink(missing_ok=True)
server = [
    "python3",
    "-m",
    "vllm.entrypoints.openai.api_server",
    "--model",
    str(base),
    "--port",
    str(port),
    "--lora-modules",
    *[f"a{i}={model / f'lora{i}'}" for i in (1, 2, 3, 4)],
    "--gpu-memory-utilization",
    "0.3",
    "--attention-backend",
    "TRITON_ATTN",
]
cmd = ["python3", "-m", "capplan", "apply", "--runner", "mrv2", str(plan), "--report", str(report), "--", *server]
res["command"] = shlex.join(cmd)
env = {**os.environ, "VLLM_CACHE_ROOT": str(work / "cache")}
env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
env.pop("CAPPLAN_PLAN", None)
logp = out / "server.log"
log = logp.open("w")
start = time.perf_counter()
proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
try:
    res["time_to_healthy_s"] = round(serve_run.wait_ready(port, proc, limit=330), 1)

    def complete(model_name: str, prompt: list[int]) -> dict:
        body = json.dumps(
            {"model": model_name, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            data = json.loads(resp.read())
        return {"text": data["choices"][0]["text"], "usage": data.get("usage")}

    names = [str(base), "a1", "a2", "a3", "a4"]
    prompt = [10 + t for t in range(6)]
    res["sequential"] = {n: complete(n, prompt) for n in names}
    # one concurrent group: adapters + base requests (the specialize_active_lora bug case)
    group = ["a1", None, "a2", None, "a3", None, "a4", None]
    got: dict = {}

    def one(i: int, a: str | None) -> None:
        try:
            got[i] = {
                "model": a or "base",
                **complete(a or str(base), [(13 * i + t) % 2000 + 10 for t in range(5 + i)]),
            }
        except Exception as exc:  # noqa: BLE001
            got[i] = {"model": a or "base", "error": repr(exc)}

    threads = [threading.Thread(target=one, args=(i, a)) for i, a in enumerate(group)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    res["concurrent_group"] = [got[i] for i in range(len(group))]
    res["requests_ok"] = sum("text" in v for v in res["concurrent_group"]) + len(res["sequential"])
    res["adapter_texts_differ_from_base"] = {
        n: res["sequential"][n]["text"] != res["sequential"][str(base)]["text"] for n in names[1:]
    }
except Exception as exc:  # noqa: BLE001
    res["error"] = f"{type(exc).__name__}: {exc}"
finally:
    res["server_alive_before_stop"] = proc.poll() is None
    proc.terminate()
    try:
        res["server_exit"] = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        res["server_exit"] = "killed"
    log.close()
text = logp.read_text(errors="replace")
lines = text.splitlines()
res["added_line"] = [line for line in lines if "capplan: added from the plan" in line]
res["capplan_lines"] = [line for line in lines if "capplan" in line][-10:]
res["vllm_args_lines"] = [line for line in lines if "non-default args" in line or "vLLM API server version" in line][:4]
res["capture_lines"] = [line for line in lines if "Graph capturing finished" in line]
res["error_lines"] = [line for line in lines if "Error" in line or "Traceback" in line][:15]
if "error" in res:
    res["log_tail"] = lines[-40:]
if report.exists():
    res["report"] = json.loads(report.read_text())
    (out / "r.json").write_text(report.read_text())

# refusal: --max-loras 16 against a max_loras 4 plan
ref_cmd = [
    "python3",
    "-m",
    "capplan",
    "apply",
    "--runner",
    "mrv2",
    str(plan),
    "--",
    "python3",
    "-m",
    "vllm.entrypoints.openai.api_server",
    "--model",
    str(base),
    "--max-loras",
    "16",
]
t = time.perf_counter()
p = subprocess.run(ref_cmd, env=env, capture_output=True, text=True, timeout=120)
res["refusal"] = {
    "command": shlex.join(ref_cmd),
    "returncode": p.returncode,
    "launch_to_exit_s": round(time.perf_counter() - t, 3),
    "stdout": p.stdout[-2000:],
    "stderr": p.stderr[-2000:],
}
(out / "apply_serve.json").write_text(json.dumps(res, indent=2))
summary = {k: v for k, v in res.items() if k not in ("report",)}
if "report" in res:
    summary["report"] = {
        k: res["report"].get(k)
        for k in (
            "graphs_planned",
            "graphs_captured",
            "vllm_would_capture",
            "capture_seconds",
            "graph_memory_gib",
            "dispatch",
        )
    }
print(json.dumps(summary, indent=1)[-9000:])
