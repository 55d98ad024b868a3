"""Tower/connector LoRA of a vision-language model on vLLM MRV2, with and without capplan's plan.

    python tests/gpu/vlm_lora.py WORKDIR [--specialize-active] [--no-hf] [--stages a,b,...]

Offline, one shot, for an H200 with vLLM 0.25.x set up as tests/gpu/README.md says
(the project installed with `pip install -e .`, so vLLM loads the capplan plugin).
Stages, each engine in its own process (VLLM_USE_V2_MODEL_RUNNER=1, vLLM's default
multiprocessing: the engine core in a process of its own; a fresh compile cache):
- build:     tests/gpu/make_vlm.py: a tiny random Qwen2-VL, adapters lora1 (vision
             tower, merger and language model) and lora2 (tower and merger only), and
             its transformers/peft check;
- plan:      `python -m capplan compile` of a spec matching the engines below;
- reference: enforce_eager, enable_tower_connector_lora on, no plan;
- planned:   CUDA graphs (FULL_AND_PIECEWISE, sizes 1, 2, 4, 8) with CAPPLAN_PLAN;
- control:   enforce_eager with enable_tower_connector_lora off: vLLM then wraps no
             tower or merger layer, so the adapters' tower weights are ignored and
             lora2 with an image must answer like the base model;
- vanilla:   the planned engine's graphs, no plan (vLLM alone);
- hf:        transformers + peft greedy tokens of the same requests (no vLLM).
Every engine gets the same groups of requests (each group one generate() call):
images (random pixels, fixed seeds) with no adapter, lora1 or lora2 side by side,
and text-only requests. Greedy, ignore_eos, 8 tokens, top-2 logprobs.

Results go to $CAPPLAN_GPU_OUT/gpu_vlm.json (default ./out), rewritten after every
stage, so a run cut short still says how far it got; a failed stage keeps its
traceback and the tail of its log. The summary printed at the end says, per engine,
how many requests equal the reference (tokens), how many differ only after a near-tie
of the reference (top-1/top-2 logprob gap below 0.5), and how many image requests
with an adapter differ from the same image without one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = Path(os.environ.get("CAPPLAN_GPU_OUT", "out"))
CAPTURE_SIZES = [1, 2, 4, 8]
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256, max_loras=2)
ADAPTER_IDS = {"lora1": 1, "lora2": 2}
MAX_TOKENS = 8
# A reference step whose top-1 and top-2 logprobs are closer than this may flip between two bf16
# paths (eager, compiled, transformers): on this model bf16 against fp32 moves logprobs by up to
# 0.23 on CPU, and 5% of steps have a gap below 0.13.
NEAR_TIE = 0.5
# (image index or None, adapter or None); a group is one generate() call, at most max_num_seqs requests.
# An image with an adapter has its base answer in the same group (same batch), except in the
# last two groups: adapters without base requests (lora2_only) and a lone request (one).
GROUPS = {
    "mixed8": [
        (0, None),
        (0, "lora1"),
        (0, "lora2"),
        (1, None),
        (1, "lora1"),
        (1, "lora2"),
        (None, None),
        (None, "lora1"),
    ],
    "mixed4": [(2, None), (2, "lora1"), (2, "lora2"), (None, "lora2")],
    "pair": [(3, None), (3, "lora2")],
    "lora2_only": [(0, "lora2"), (1, "lora2")],
    "one": [(2, "lora2")],
}
# In the order they run: if time runs short, the last ones are skipped (the control says more
# about tower LoRA than vLLM's graphs without the plan do, so it runs before them).
ENGINES = {
    "reference": dict(eager=True, tower=True, plan=False),
    "planned": dict(eager=False, tower=True, plan=True),
    "control": dict(eager=True, tower=False, plan=False),
    "vanilla": dict(eager=False, tower=True, plan=False),
}
STAGES = ["build", "plan", *ENGINES, "hf"]
STAGE_CAP_S = dict(build=150, plan=60, reference=200, planned=240, vanilla=240, control=200, hf=120)
SPEC = """\
# The engines of tests/gpu/vlm_lora.py: a tiny Qwen2-VL, tower/connector LoRA, vLLM 0.25 MRV2.
target: {{runner: mrv2, vllm: "{version}"}}
scheduler: {{max_num_seqs: {max_num_seqs}, max_num_batched_tokens: {max_num_batched_tokens}, max_model_len: {max_model_len}}}
cudagraph: {{mode: FULL_AND_PIECEWISE, capture_sizes: {sizes}}}
lora: {{enabled: true, max_loras: {max_loras}, specialize: true, specialize_active: {specialize_active}}}
speculative: {{num_speculative_tokens: 0}}
parallel: {{data_parallel_size: 1}}
multimodal: {{tower_connector_lora: true, encoder_cudagraphs: false}}
"""
KEY_LINES = ("capplan", "Graph capturing finished", "tower", "Traceback", "Error", "error:", "Killed")


def requests() -> list[dict]:
    return [
        {"group": g, "req": j, "image": image, "lora": lora}
        for g, reqs in GROUPS.items()
        for j, (image, lora) in enumerate(reqs)
    ]


def tail(text: str, chars: int = 3000) -> str:
    return text[-chars:]


# ---------------------------------------------------------------- child: one engine


def _observe(record: dict, kwargs: dict) -> None:
    record["calls"] += 1
    inputs = kwargs.get("scheduled_encoder_inputs") or {}
    if inputs:
        record["calls_with_encoder_inputs"] += 1
        index, state = kwargs.get("req_id_to_index") or {}, kwargs.get("lora_state")
        if state is not None:
            ids = {int(state.lora_ids[index[r]]) for r in inputs if r in index}
            record["adapter_ids_seen"] = sorted(set(record["adapter_ids_seen"]) | ids)
    manager = kwargs.get("lora_manager")
    if manager is not None and "supports_tower_connector_lora" not in record:
        inner = manager._adapter_manager
        record["supports_tower_connector_lora"] = bool(manager.supports_tower_connector_lora())
        record["punica_wrappers"] = sorted(getattr(inner, "punica_wrapper_mapping", {}))
        parts: dict[str, int] = {}
        for name in getattr(inner, "modules", {}):
            part = "language"
            if name.startswith("visual."):
                part = "connector" if name.startswith("visual.merger.") else "tower"
            parts[part] = parts.get(part, 0) + 1
        record["lora_layers"] = parts


def _probe(record: dict, path: Path) -> None:
    """Wrap MRV2's set_active_mm_loras (called before the encoder runs) to see that it is
    reached, with which adapters' requests, and what vLLM wrapped with LoRA (read at the
    first call); it only observes. The engine core runs in a process of its own (vLLM's
    default), forked from this one after the wrapper is installed: the wrapper runs there
    and writes what it saw to `path` after each call, which this process reads back. A
    spawned engine core would not carry the wrapper, and the probe would say 0 calls."""
    import vllm.v1.worker.gpu.model_runner as runner_mod

    original = runner_mod.set_active_mm_loras

    def set_active_mm_loras(*args, **kwargs):
        try:
            _observe(record, kwargs)
            record["pid"] = os.getpid()
            part = path.with_name(path.name + ".part")
            part.write_text(json.dumps(record))
            part.replace(path)
        except Exception as exc:  # noqa: BLE001 - never let the probe change the run
            record["observe_error"] = f"{type(exc).__name__}: {exc}"
        return original(*args, **kwargs)

    runner_mod.set_active_mm_loras = set_active_mm_loras


def _resolved(llm) -> dict:
    """What the engine made of its arguments (the runner, graph mode and sizes, LoRA)."""
    try:
        cfg = llm.llm_engine.vllm_config
        comp, lora = cfg.compilation_config, cfg.lora_config
        return {
            "use_v2_model_runner": bool(cfg.use_v2_model_runner),
            "cudagraph_mode": str(comp.cudagraph_mode),
            "cudagraph_capture_sizes": list(comp.cudagraph_capture_sizes or []),
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "enable_tower_connector_lora": bool(getattr(lora, "enable_tower_connector_lora", False)),
            "specialize_active_lora": bool(getattr(lora, "specialize_active_lora", False)),
        }
    except Exception as exc:  # noqa: BLE001 - informative only
        return {"error": f"{type(exc).__name__}: {exc}"}


def _shutdown(llm) -> None:
    """Stop the engine core process as vLLM does at exit (its SIGTERM handler lets capplan's
    report be written there), before this process leaves through os._exit."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001 - the results are written either way
        print(f"engine core shutdown: {type(exc).__name__}: {exc}", flush=True)


def run_engine(name: str, model: Path, out: Path, specialize_active: bool) -> None:
    cfg = ENGINES[name]
    result: dict = {"engine": name, **cfg}
    t0 = time.perf_counter()
    try:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        sys.path.insert(0, str(HERE))
        from make_vlm import make_image, prompt

        result["vllm"] = vllm.__version__
        result["import_s"] = round(time.perf_counter() - t0, 1)
        probe = {"calls": 0, "calls_with_encoder_inputs": 0, "adapter_ids_seen": []}
        result["probe"] = probe
        probe_path = out.with_name(out.name + ".probe")
        probe_path.unlink(missing_ok=True)
        try:
            _probe(probe, probe_path)
        except Exception as exc:  # noqa: BLE001 - the probe only observes; the run goes on without it
            probe["error"] = f"{type(exc).__name__}: {exc}"
        kwargs = dict(
            model=str(model / "base"),
            enable_lora=True,
            max_lora_rank=8,
            enable_tower_connector_lora=cfg["tower"],
            specialize_active_lora=specialize_active,
            gpu_memory_utilization=0.3,
            attention_backend="TRITON_ATTN",
            # The tower's attention: plain torch SDPA, the same kernel in every engine.
            mm_encoder_attn_backend="TORCH_SDPA",
            dtype="bfloat16",
            seed=0,
            enforce_eager=cfg["eager"],
            # Video off: no video dummy inputs at start-up, only the image path is exercised.
            limit_mm_per_prompt={"image": 1, "video": 0},
            # Every request runs its prefill and its encoder input (no prefix cache hits).
            enable_prefix_caching=False,
            **ENGINE,
        )
        if not cfg["eager"]:
            kwargs["compilation_config"] = {
                "cudagraph_mode": "FULL_AND_PIECEWISE",
                "cudagraph_capture_sizes": CAPTURE_SIZES,
            }
        t1 = time.perf_counter()
        llm = LLM(**kwargs)
        result["startup_s"] = round(time.perf_counter() - t1, 1)
        result["resolved"] = _resolved(llm)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, detokenize=False)
        adapters = {n: LoRARequest(n, i, str(model / n)) for n, i in ADAPTER_IDS.items()}
        images = {}
        rows = []
        t2 = time.perf_counter()
        for group, reqs in GROUPS.items():
            prompts, loras = [], []
            for image, lora in reqs:
                item = {"prompt": prompt(image is not None)}
                if image is not None:
                    if image not in images:
                        images[image] = make_image(image)
                    item["multi_modal_data"] = {"image": images[image]}
                prompts.append(item)
                loras.append(adapters[lora] if lora else None)
            outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
            for j, ((image, lora), o) in enumerate(zip(reqs, outs)):
                comp = o.outputs[0]
                top = [
                    [
                        [int(t), round(float(lp.logprob), 5)]
                        for t, lp in sorted(d.items(), key=lambda x: -x[1].logprob)[:2]
                    ]
                    for d in (comp.logprobs or [])
                ]
                rows.append(
                    {
                        "group": group,
                        "req": j,
                        "image": image,
                        "lora": lora,
                        "prompt_tokens": len(o.prompt_token_ids or []),
                        "tokens": list(comp.token_ids),
                        "top": top,
                    }
                )
        result["generate_s"] = round(time.perf_counter() - t2, 1)
        result["results"] = rows
        if probe_path.exists():  # what the wrapper saw in the engine core's process
            result["probe"] = {**json.loads(probe_path.read_text()), "engine_core_pid_differs": None}
            result["probe"]["engine_core_pid_differs"] = result["probe"].get("pid") != os.getpid()
        _shutdown(llm)
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - one shot: whatever broke must be in the JSON
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = tail(traceback.format_exc(), 6000)
    result["total_s"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(result))
    print(f"engine {name}: ok={result['ok']} total {result['total_s']} s", flush=True)
    # Leave at once (vLLM's teardown of an engine can hang after the JSON is
    # written), but first let capplan write its final report, which atexit would have done.
    try:
        from capplan.runtime.registry import installed

        state = installed()
        if state is not None:
            state.report.finish()
    except Exception as exc:  # noqa: BLE001
        print(f"capplan report not finished: {exc}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["ok"] else 1)


def run_hf(model: Path, out: Path) -> None:
    result: dict = {"engine": "hf"}
    t0 = time.perf_counter()
    try:
        import torch

        sys.path.insert(0, str(HERE))
        from make_vlm import greedy

        device = "cuda" if torch.cuda.is_available() else "cpu"
        result["device"] = device
        reqs = requests()
        rows = greedy(model, [(r["image"], r["lora"]) for r in reqs], MAX_TOKENS, device)
        keep = ("prompt_tokens", "tokens", "top")
        result["results"] = [{**r, **{k: v for k, v in row.items() if k in keep}} for r, row in zip(reqs, rows)]
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = tail(traceback.format_exc(), 6000)
    result["total_s"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


# ---------------------------------------------------------------- parent: stages and comparison


class Run:
    def __init__(self, work: Path, args) -> None:
        self.work = work
        self.args = args
        self.t0 = time.monotonic()
        self.data: dict = {
            "script": "tests/gpu/vlm_lora.py",
            "workdir": str(work),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "settings": {
                "engine": ENGINE,
                "capture_sizes": CAPTURE_SIZES,
                "max_tokens": MAX_TOKENS,
                "specialize_active_lora": args.specialize_active,
                "groups": {g: [list(r) for r in reqs] for g, reqs in GROUPS.items()},
            },
            "env": environment(),
            "stages": {},
        }

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():5.0f}s] {msg}", flush=True)

    def save(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "gpu_vlm.json").write_text(json.dumps(self.data, indent=1))

    def child(self, name: str, cmd: list[str], env: dict, cap: int) -> tuple[int | None, str, float]:
        """Run cmd in its own session with its output in WORKDIR/name.log; kill its whole
        process group at the deadline (torch.compile may leave worker processes)."""
        timeout = min(cap, self.args.limit - self.elapsed())
        log_path = self.work / f"{name}.log"
        t0 = time.monotonic()
        with log_path.open("w") as handle:
            proc = subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code: int | None = proc.wait(timeout=max(timeout, 1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
        return code, log_path.read_text(errors="replace"), time.monotonic() - t0

    def stage(self, name: str, fn) -> dict:
        if name not in self.args.stages:
            return {"skipped": "not in --stages"}
        left = self.args.limit - self.elapsed()
        if left < 30:
            info = {"ok": False, "skipped": f"no time left ({left:.0f} s before the run's limit)"}
            self.data["stages"][name] = info
            self.save()
            self.log(f"{name}: skipped, no time left")
            return info
        self.log(f"{name}: start")
        try:
            info = fn()
        except BaseException as exc:  # noqa: BLE001 - a stage's own failure, not a child's
            info = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": tail(traceback.format_exc())}
        self.data["stages"][name] = info
        self.save()
        status = "ok" if info.get("ok") else f"FAILED: {info.get('error', '?')}"
        self.log(f"{name}: {status} ({info.get('seconds', 0):.0f} s)")
        if not info.get("ok") and (info.get("traceback") or info.get("log_tail")):
            print(tail(info.get("traceback") or info["log_tail"], 1500), flush=True)
        return info

    def env_for(self, name: str, plan: Path | None) -> dict:
        env = {**os.environ}
        env.pop("CAPPLAN_PLAN", None)
        env.pop("CAPPLAN_REPORT", None)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the default: engine core in its own process
        cache = self.work / f"cache-{name}"
        shutil.rmtree(cache, ignore_errors=True)  # a fresh torch.compile cache: no artifact of another engine
        # MRV2, and vLLM's default multiprocessing: the engine core in a process of its own, as operators run it.
        env.update(
            VLLM_CACHE_ROOT=str(cache),
            VLLM_USE_V2_MODEL_RUNNER="1",
            PYTHONUNBUFFERED="1",
        )
        for key, value in dict(
            VLLM_USE_FLASHINFER_SAMPLER="0",  # flashinfer is not in the device bundle
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        ).items():
            env.setdefault(key, value)
        if plan is not None:
            env["CAPPLAN_PLAN"] = str(plan)
            env["CAPPLAN_REPORT"] = str(self.work / f"{name}.report.json")
            (self.work / f"{name}.report.json").unlink(missing_ok=True)
        return env

    # -- stages

    def build(self) -> dict:
        model = self.work / "model"
        cmd = [sys.executable, str(HERE / "make_vlm.py"), str(model), "--check"]
        code, text, secs = self.child("build", cmd, self.env_for("build", None), STAGE_CAP_S["build"])
        info: dict = {"ok": code == 0 and (model / "done.json").exists(), "seconds": round(secs, 1), "returncode": code}
        chunks = _json_objects(text)
        if chunks:
            info["built"] = chunks[0]
        if len(chunks) > 1:
            info["transformers_check"] = chunks[1]
        if not info["ok"]:
            info["error"] = "timed out" if code is None else f"make_vlm.py exited {code}"
            info["log_tail"] = tail(text)
        return info

    def plan(self) -> dict:
        version = self.data["env"].get("vllm") or ""
        # This script is meant for 0.25.x; an unreadable version is taken as that.
        semantics = "0.33" if version and not version.startswith("0.25") else "0.25"
        spec = self.work / "vlm.yaml"
        spec.write_text(
            SPEC.format(
                version=semantics,
                sizes=CAPTURE_SIZES,
                specialize_active=str(self.args.specialize_active).lower(),
                **ENGINE,
            )
        )
        plan = self.work / "vlm.plan.yaml"
        plan.unlink(missing_ok=True)
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "capplan", "compile", str(spec), "-o", str(plan)],
            capture_output=True,
            text=True,
            timeout=STAGE_CAP_S["plan"],
        )
        info = {
            "ok": proc.returncode == 0 and plan.exists(),
            "seconds": round(time.monotonic() - t0, 1),
            "semantics": semantics,
            "spec": spec.read_text(),
            "output": tail(proc.stdout + proc.stderr, 1000),
        }
        if not info["ok"]:
            info["error"] = f"capplan compile exited {proc.returncode}"
            info["log_tail"] = tail(proc.stderr)
        return info

    def engine(self, name: str) -> dict:
        cfg = ENGINES[name]
        plan = self.work / "vlm.plan.yaml" if cfg["plan"] else None
        if plan is not None and not plan.exists():
            return {"ok": False, "error": "no plan (the plan stage failed or was skipped)"}
        out = self.work / f"{name}.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), str(self.work), "--engine", name]
        if self.args.specialize_active:
            cmd.append("--specialize-active")
        code, text, secs = self.child(name, cmd, self.env_for(name, plan), STAGE_CAP_S[name])
        info: dict = json.loads(out.read_text()) if out.exists() else {"ok": False}
        info["seconds"] = round(secs, 1)
        info["returncode"] = code
        info["log_lines"] = [line[:300] for line in text.splitlines() if any(k in line for k in KEY_LINES)][-25:]
        if code is None:
            info.update(ok=False, error=f"timed out after {secs:.0f} s")
        elif not out.exists():
            info["error"] = f"exited {code} before writing its JSON"
        if not info.get("ok"):
            info["log_tail"] = tail(text)
        if plan is not None:
            report = self.work / f"{name}.report.json"
            info["report"] = json.loads(report.read_text()) if report.exists() else None
        return info

    def hf(self) -> dict:
        out = self.work / "hf.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), str(self.work), "--hf"]
        code, text, secs = self.child("hf", cmd, self.env_for("hf", None), STAGE_CAP_S["hf"])
        info: dict = json.loads(out.read_text()) if out.exists() else {"ok": False}
        info["seconds"] = round(secs, 1)
        if code is None:
            info.update(ok=False, error=f"timed out after {secs:.0f} s")
        if not info.get("ok"):
            info["log_tail"] = tail(text)
        return info


def _json_objects(text: str) -> list[dict]:
    """The top-level JSON objects printed by make_vlm.py, in order (log lines around them ignored)."""
    decoder, found, i = json.JSONDecoder(), [], 0
    while (i := text.find("{\n", i)) >= 0:
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        found.append(obj)
        i = end
    return found


def environment() -> dict:
    """Versions and the plugin's presence, read without importing torch or vLLM."""
    import importlib.metadata as md
    import importlib.util

    env: dict = {"python": sys.version.split()[0]}
    for pkg in ("vllm", "torch", "transformers", "peft", "tokenizers", "torchvision", "pillow", "capplan"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env[pkg] = None
    try:
        env["vllm_general_plugins"] = sorted(ep.name for ep in md.entry_points(group="vllm.general_plugins"))
    except Exception as exc:  # noqa: BLE001
        env["vllm_general_plugins"] = f"unreadable: {exc}"
    spec = importlib.util.find_spec("capplan")
    env["capplan_module"] = spec.origin if spec else None
    return env


# ---------------------------------------------------------------- comparison


def _key(row: dict) -> tuple:
    return (row["group"], row["req"])


def _divergence(ref: dict, other: dict) -> dict | None:
    """None if the token sequences are equal, else where they part and the reference's top-1/top-2 gap there."""
    a, b = ref["tokens"], other["tokens"]
    if a == b:
        return None
    step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    top = ref.get("top") or []
    gap = None
    if step < len(top) and len(top[step]) >= 2:
        gap = round(top[step][0][1] - top[step][1][1], 4)
    return {"step": step, "ref_gap": gap, "near_tie": gap is not None and gap < NEAR_TIE}


def compare_to(ref_rows: list[dict], rows: list[dict]) -> dict:
    ref = {_key(r): r for r in ref_rows}
    other = {_key(r): r for r in rows}
    diffs, noise = {}, 0.0
    for k, r in ref.items():
        if k not in other:
            diffs[k] = {"missing": True, "near_tie": False}
            continue
        d = _divergence(r, other[k])
        if d is not None:
            diffs[k] = d
            continue
        # Same tokens: how far the two paths' logprobs of them still are (the noise a near-tie must beat).
        for a, b in zip(r.get("top") or [], other[k].get("top") or []):
            if a and b:
                noise = max(noise, abs(a[0][1] - b[0][1]))
    return {
        "max_logprob_diff_on_equal_tokens": round(noise, 5),
        "requests": len(ref),
        "equal": len(ref) - len(diffs),
        "differ_after_near_tie": sum(1 for d in diffs.values() if d.get("near_tie")),
        "differ_clearly": sum(1 for d in diffs.values() if not d.get("near_tie")),
        "differing": [
            {"group": k[0], "req": k[1], "image": ref[k]["image"], "lora": ref[k]["lora"], **d}
            for k, d in sorted(diffs.items())
        ],
    }


def adapter_effects(rows: list[dict]) -> dict:
    """Within one engine: each request with an adapter against the same input without one
    (from the same generate() call where there is one, so the batches match too)."""
    same_group, any_group = {}, {}
    for r in rows:
        if r["lora"] is None:
            same_group.setdefault((r["group"], r["image"]), r)
            any_group.setdefault(r["image"], r)
    out: dict = {"image_adapter_requests": 0, "image_adapter_differ": 0, "text_lora2_equal_base": None, "pairs": []}
    text_lora2 = []
    for r in rows:
        base = same_group.get((r["group"], r["image"])) or any_group.get(r["image"])
        if r["lora"] is None or base is None:
            continue
        d = _divergence(base, r)
        out["pairs"].append(
            {
                "group": r["group"],
                "req": r["req"],
                "image": r["image"],
                "lora": r["lora"],
                "base_from_group": base["group"],
                "differs_from_base": d is not None,
                # Parted only where the base answer was a near-tie: bf16 noise can do that too.
                "near_tie_only": d is not None and d["near_tie"],
            }
        )
        if r["image"] is not None:
            out["image_adapter_requests"] += 1
            out["image_adapter_differ"] += d is not None
        elif r["lora"] == "lora2":
            text_lora2.append(d is None or d["near_tie"])
    for name in ADAPTER_IDS:
        with_image = [p for p in out["pairs"] if p["lora"] == name and p["image"] is not None]
        out[f"image_{name}_differ"] = f"{sum(p['differs_from_base'] for p in with_image)}/{len(with_image)}"
    # Pairs answered in one batch: there any difference is the adapter's (rows do not mix).
    out["lora2_image_pairs_same_batch"] = [
        p
        for p in out["pairs"]
        if p["lora"] == "lora2" and p["image"] is not None and p["base_from_group"] == p["group"]
    ]
    if text_lora2:
        out["text_lora2_equal_base"] = all(text_lora2)  # lora2 has no language-model weights
    return out


def evaluate(data: dict) -> dict:
    stages = data["stages"]
    rows = {
        n: stages[n]["results"] for n in (*ENGINES, "hf") if stages.get(n, {}).get("ok") and stages[n].get("results")
    }
    out: dict = {"engines_with_results": sorted(rows)}
    for name, r in rows.items():
        out[f"{name}_adapter_effects"] = adapter_effects(r)
    if "reference" in rows:
        for name in ("planned", "vanilla", "control", "hf"):
            if name in rows:
                out[f"{name}_vs_reference"] = compare_to(rows["reference"], rows[name])
    if "planned" in rows and "vanilla" in rows:
        out["planned_vs_vanilla"] = compare_to(rows["vanilla"], rows["planned"])
    verdict: dict = {}
    ref = out.get("reference_adapter_effects")
    if ref:
        lora2 = ref["lora2_image_pairs_same_batch"]
        # lora2 reaches the output only through the tower and connector.
        verdict["tower_lora_changes_output_in_reference"] = bool(lora2) and all(p["differs_from_base"] for p in lora2)
        verdict["lora2_text_only_equals_base"] = ref["text_lora2_equal_base"]
    for name in ("planned", "vanilla"):
        cmp = out.get(f"{name}_vs_reference")
        if cmp:
            verdict[f"{name}_equals_reference"] = cmp["equal"] == cmp["requests"]
            verdict[f"{name}_equals_reference_but_near_ties"] = cmp["differ_clearly"] == 0
        eff = out.get(f"{name}_adapter_effects")
        if eff:
            lora2 = eff["lora2_image_pairs_same_batch"]
            verdict[f"{name}_tower_lora_changes_output"] = bool(lora2) and all(p["differs_from_base"] for p in lora2)
    ctl = out.get("control_adapter_effects")
    if ctl:
        # Tower LoRA off: lora2 must be invisible (exactly, beside its base request in one batch;
        # up to a near-tie against a base answered in another batch), and lora1's image answers
        # change against the reference.
        lora2 = [p for p in ctl["pairs"] if p["lora"] == "lora2" and p["image"] is not None]
        verdict["control_lora2_image_equals_base"] = bool(lora2) and all(
            not p["differs_from_base"] or (p["near_tie_only"] and p["base_from_group"] != p["group"]) for p in lora2
        )
        cmp = out.get("control_vs_reference")
        if cmp:
            # Everything the tower LoRA does not touch must equal the reference (both eager).
            untouched = [d for d in cmp["differing"] if (d["image"] is None or d["lora"] is None) and not d["near_tie"]]
            verdict["control_equals_reference_without_image_adapters"] = not untouched
            image_adapter = [r for r in ctl["pairs"] if r["image"] is not None]
            changed = sum(1 for d in cmp["differing"] if d["image"] is not None and d["lora"] is not None)
            verdict["control_image_adapter_requests_differing_from_reference"] = f"{changed}/{len(image_adapter)}"
    planned = stages.get("planned", {})
    report = planned.get("report") if planned.get("ok") else None
    if report:
        verdict["plan_in_force"] = bool(report.get("graphs_captured")) and report.get("graphs_captured") == report.get(
            "graphs_planned"
        )
        verdict["plan_graphs"] = {k: report.get(k) for k in ("graphs_planned", "graphs_captured", "vllm_would_capture")}
        verdict["plan_dispatch"] = report.get("dispatch")
    elif "planned" in stages:
        verdict["plan_in_force"] = False
    cmp = out.get("hf_vs_reference")
    if cmp:
        verdict["hf_equals_reference_but_near_ties"] = cmp["differ_clearly"] == 0
        # The same processor outputs on both sides: as many prompt tokens per request (image tokens included).
        ref_len = {_key(r): r.get("prompt_tokens") for r in rows["reference"]}
        verdict["hf_prompt_tokens_equal_reference"] = all(
            ref_len.get(_key(r)) == r.get("prompt_tokens") for r in rows["hf"]
        )
    out["verdict"] = verdict
    return out


def summary_lines(data: dict) -> list[str]:
    stages, ev = data["stages"], data.get("evaluation", {})
    lines = [
        f"vlm_lora: vLLM {data['env'].get('vllm')}, transformers {data['env'].get('transformers')}, {data.get('elapsed_s')} s"
    ]
    for name in STAGES:
        st = stages.get(name)
        if st is None:
            continue
        if not st.get("ok"):
            lines.append(f"  {name:9s} FAILED: {st.get('error') or st.get('skipped')}")
            continue
        extra = ""
        if name in ENGINES:
            probe = st.get("probe", {})
            extra = (
                f"MRV2 {st.get('resolved', {}).get('use_v2_model_runner')}, startup {st.get('startup_s')} s; "
                f"tower LoRA in vLLM {probe.get('supports_tower_connector_lora')}; "
                f"set_active_mm_loras {probe.get('calls_with_encoder_inputs')} calls with images, "
                f"adapters {probe.get('adapter_ids_seen')}, LoRA layers {probe.get('lora_layers')}"
            )
            eff = ev.get(f"{name}_adapter_effects")
            if eff:
                extra += f"; image+adapter != image+base: {eff['image_adapter_differ']}/{eff['image_adapter_requests']}"
                extra += f" (lora1 {eff['image_lora1_differ']}, lora2 {eff['image_lora2_differ']})"
            cmp = ev.get(f"{name}_vs_reference")
            if cmp:
                extra += (
                    f"; vs reference: {cmp['equal']}/{cmp['requests']} equal, {cmp['differ_after_near_tie']} after a near-tie, "
                    f"{cmp['differ_clearly']} clearly different (logprob noise {cmp['max_logprob_diff_on_equal_tokens']})"
                )
            if st.get("report"):
                rep = st["report"]
                extra += f"; plan: {rep.get('graphs_captured')}/{rep.get('graphs_planned')} graphs"
        elif name == "hf":
            cmp = ev.get("hf_vs_reference")
            if cmp:
                extra = (
                    f"vs reference: {cmp['equal']}/{cmp['requests']} equal, {cmp['differ_after_near_tie']} after a "
                    f"near-tie, {cmp['differ_clearly']} clearly different (logprob noise {cmp['max_logprob_diff_on_equal_tokens']})"
                )
        lines.append(f"  {name:9s} ok  {extra}".rstrip())
    for key, value in ev.get("verdict", {}).items():
        lines.append(f"  verdict {key}: {value}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--engine", choices=sorted(ENGINES), help=argparse.SUPPRESS)
    parser.add_argument("--hf", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--specialize-active", action="store_true", help="specialize_active_lora on in every engine and the spec"
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    parser.add_argument(
        "--limit", type=float, default=540, help="seconds from start after which no stage starts or keeps running"
    )
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    args = parser.parse_args()
    work = args.workdir.resolve()
    if args.engine:
        run_engine(args.engine, work / "model", work / f"{args.engine}.json", args.specialize_active)
        return
    if args.hf:
        run_hf(work / "model", work / "hf.json")
        return
    args.stages = [s for s in args.stages.split(",") if s and not (args.no_hf and s == "hf")]
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stage(s) {unknown}; known: {STAGES}")
    work.mkdir(parents=True, exist_ok=True)
    run = Run(work, args)
    run.log(f"environment: {json.dumps(run.data['env'])}")
    run.save()
    run.stage("build", run.build)
    run.stage("plan", run.plan)
    for name in ENGINES:
        run.stage(name, lambda name=name: run.engine(name))
    run.stage("hf", run.hf)
    try:
        run.data["evaluation"] = evaluate(run.data)
    except Exception as exc:  # noqa: BLE001
        run.data["evaluation"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": tail(traceback.format_exc())}
    lines = summary_lines(run.data)
    run.data["summary"] = lines
    run.save()
    print("\n".join(lines), flush=True)
    print(f"results: {(OUT / 'gpu_vlm.json').resolve()}", flush=True)


if __name__ == "__main__":
    main()
