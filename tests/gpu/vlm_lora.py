"""Tower/connector LoRA of a vision-language model on vLLM MRV2, with and without capplan's plan.

    python tests/gpu/vlm_lora.py WORKDIR [--encoder-graphs] [--parallel] [--specialize-active] [--no-hf]
        [--stages a,b,...] [--limit SECONDS]
    python tests/gpu/vlm_lora.py DIR --evaluate

Offline, one shot, on one GPU with a vLLM release capplan supports, set up as tests/gpu/README.md
says (the project installed, so vLLM loads the capplan plugin). Stages, each engine in its own
process (VLLM_USE_V2_MODEL_RUNNER=1, vLLM's default multiprocessing: the engine core in a process
of its own, its log in the engine's WORKDIR/NAME.log; a fresh compile cache; a fixed 512 MiB KV
cache, so no engine runs vLLM's memory profiling, which fails when another process on the GPU
frees memory meanwhile):
- build:     tests/gpu/make_vlm.py: a tiny random Qwen2-VL, adapters lora1 (vision
             tower, merger and language model) and lora2 (tower and merger only), and
             its transformers/peft check;
- plan:      `python -m capplan compile` of a spec matching the engines below, for the
             installed release exactly;
- reference: enforce_eager, enable_tower_connector_lora on, no plan;
- planned:   CUDA graphs (FULL_AND_PIECEWISE, sizes 1, 2, 4, 8) with CAPPLAN_PLAN;
- control:   enforce_eager with enable_tower_connector_lora off: vLLM then wraps no
             tower or merger layer, so the adapters' tower weights are ignored and
             lora2 with an image must answer like the base model;
- graphs_control: the control with the planned engine's graphs (encoder graphs too where
             --encoder-graphs), no plan: against the control, it says whether graphs alone
             change image answers, and whether a graph engine's crash needs tower LoRA;
- vanilla:   the planned engine's graphs, no plan (vLLM alone);
- hf:        transformers + peft greedy tokens of the same requests (no vLLM).
--encoder-graphs (vLLM 0.28.0 and later: capplan's release rule `encoder_graphs`) turns on
MRV2's encoder CUDA graphs in the planned, graphs_control and vanilla engines (`cudagraph_mm_encoder`, token
budgets 16, 32 and 64, at most 4 images a graph) and in the spec; every engine then runs the
tower's attention with TRITON_ATTN (TORCH_SDPA splits by sequence lengths read back to the host,
which a CUDA graph cannot capture). --parallel starts the five engines at once (each its own
share of the GPU), after build and plan.
Every engine gets the same groups of requests (each group one generate() call):
images (random pixels, fixed seeds) with no adapter, lora1 or lora2 side by side,
and text-only requests. Greedy, ignore_eos, 8 tokens, top-2 logprobs. vLLM encodes each
(image, adapter) pair once per run (its encoder cache keys images by adapter too), so the
groups are ordered by what the encoder does with graphs on: one graph batch of same-sized
images first (pair, mixed4), then two images packed smallest first, against the order their
tower LoRA mapping was given in (reorder), then six images, more than one graph takes
(mixed8). A probe in the engine core records each set_active_mm_loras call and each encoder
graph run (graphs captured, items replayed and run eager, item sizes per call).

Results go to $CAPPLAN_GPU_OUT/gpu_vlm.json (default ./out), rewritten after every
stage, so a run cut short still says how far it got; a failed stage keeps its
traceback and the tail of its log, and an engine that fails keeps the groups it answered.
An engine whose engine core process dies without telling its client (a CUDA assert that
aborts it) ends within seconds, its failure and group recorded, instead of waiting in
generate() until its cap. `vlm_lora.py --evaluate DIR` prints the evaluation and summary of
DIR/gpu_vlm.json again, with this script's comparison (it writes nothing).
The summary printed at the end says, per engine, how many requests equal the reference
(tokens), how many differ only after a near-tie of the reference (top-1/top-2 logprob gap
below 0.5), which groups differ, and how many image requests with an adapter differ from the
same image without one.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = Path(os.environ.get("CAPPLAN_GPU_OUT", "out"))
CAPTURE_SIZES = [1, 2, 4, 8]
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256, max_loras=2)
# Encoder graphs (--encoder-graphs): given in full, so that the graphs do not depend on the
# model's own budget range (Qwen2-VL's: 64 up to the scheduler's tokens), and small enough that
# this model's images (4 to 16 tokens) replay each of them.
ENCODER_BUDGETS = [16, 32, 64]
ENCODER_ITEMS = 4
# Each engine's share of the GPU: only checked against the free memory at start, since the KV
# cache is given (KV_CACHE_BYTES; this model needs 1 KiB a token). Small, so that the five engines
# (half the GPU in all) and another test's servers fit on one GPU.
GPU_SHARE = 0.1
KV_CACHE_BYTES = 512 * 2**20
ADAPTER_IDS = {"lora1": 1, "lora2": 2}
MAX_TOKENS = 8
# A reference step whose top-1 and top-2 logprobs are closer than this may flip between two bf16
# paths (eager, compiled, transformers): on this model bf16 against fp32 moves logprobs by up to
# 0.23 on CPU, and 5% of steps have a gap below 0.13.
NEAR_TIE = 0.5
# (image index or None, adapter or None); a group is one generate() call, at most max_num_seqs requests.
# Image tokens by index (make_vlm.make_image): 16, 12, 8, 4, repeating. An image with an adapter has
# its base answer in the same group (same batch), except in reorder, lora2_only (adapters without
# base requests; encoded in mixed8 already) and one (a lone request). With encoder graphs on (budgets
# 16/32/64, 4 images a graph), the images each group brings to the encoder:
# pair 4+4 tokens, one graph; mixed4 3 x 8, one graph; one: none new; reorder: lora1's 12 tokens
# then a base image's 4, packed smallest first into one graph; mixed8: 3 x 16 and 3 x 12, two graphs.
GROUPS = {
    "pair": [(3, None), (3, "lora2")],
    "mixed4": [(2, None), (2, "lora1"), (2, "lora2"), (None, "lora2")],
    "one": [(2, "lora2")],
    "reorder": [(5, "lora1"), (7, None)],
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
    "lora2_only": [(0, "lora2"), (1, "lora2")],
}
# In the order they run: if time runs short, the last ones are skipped (the controls say more
# about tower LoRA than vLLM's graphs without the plan do, so they run before them).
ENGINES = {
    "reference": dict(eager=True, tower=True, plan=False),
    "planned": dict(eager=False, tower=True, plan=True),
    "control": dict(eager=True, tower=False, plan=False),
    # the planned engine's graphs (encoder graphs too), tower LoRA off, no plan: against the control,
    # what graphs alone do to image answers; against planned/vanilla, what tower LoRA under graphs does
    "graphs_control": dict(eager=False, tower=False, plan=False),
    "vanilla": dict(eager=False, tower=True, plan=False),
}
STAGES = ["build", "plan", *ENGINES, "hf"]
STAGE_CAP_S = dict(
    build=150, plan=60, reference=360, planned=400, vanilla=400, control=360, graphs_control=400, hf=120
)  # engines may start beside a release run
# An engine core that died without telling its client leaves generate() waiting for ever: the
# engine's process records the failure ENGINE_CORE_GRACE_S after the engine core is gone (time for
# vLLM's own EngineDeadError to arrive first), and the parent kills an engine whose log says its
# engine core died (or that it failed) and that has not exited PARENT_GRACE_S later.
ENGINE_CORE_GRACE_S = 15.0
PARENT_GRACE_S = 45.0
# Log lines that say an engine is dead: its engine core gone (vLLM's client, a crash), or its own failure printed.
ENGINE_DEAD_MARKERS = ("engine core exited unexpectedly", "EngineDeadError", "Fatal Python error", ": ok=False total")
SPEC = """\
# The engines of tests/gpu/vlm_lora.py: a tiny Qwen2-VL, tower/connector LoRA, vLLM {target} MRV2.
target: {{runner: mrv2, vllm: "{target}"}}
scheduler: {{max_num_seqs: {max_num_seqs}, max_num_batched_tokens: {max_num_batched_tokens}, max_model_len: {max_model_len}}}
cudagraph: {{mode: FULL_AND_PIECEWISE, capture_sizes: {sizes}}}
lora: {{enabled: true, max_loras: {max_loras}, specialize: true, specialize_active: {specialize_active}}}
speculative: {{num_speculative_tokens: 0}}
parallel: {{data_parallel_size: 1}}
multimodal: {{{multimodal}}}
"""
KEY_LINES = (
    "capplan",
    "Graph capturing finished",
    "EncoderCudaGraphManager",
    "Encoder CUDA graph",
    "MMEncoderAttention",
    "tower",
    "Traceback",
    "Error",
    "error:",
    "Killed",
)


def spec_text(target: str, specialize_active: bool, encoder_graphs: bool) -> str:
    """The spec of the planned engine (engine_kwargs("planned", ...)) for vLLM `target`."""
    multimodal = "tower_connector_lora: true, encoder_cudagraphs: false"
    if encoder_graphs:
        multimodal = (
            f"tower_connector_lora: true, encoder_cudagraphs: true, token_budgets: {ENCODER_BUDGETS}, "
            f"max_vision_items_per_batch: {ENCODER_ITEMS}"
        )
    return SPEC.format(
        target=target,
        sizes=CAPTURE_SIZES,
        specialize_active=str(specialize_active).lower(),
        multimodal=multimodal,
        **ENGINE,
    )


def engine_kwargs(name: str, model: Path, specialize_active: bool, encoder_graphs: bool) -> dict:
    """vLLM LLM(...) keywords of one engine (pure: no vLLM import)."""
    cfg = ENGINES[name]
    kwargs = dict(
        model=str(model / "base"),
        enable_lora=True,
        max_lora_rank=8,
        enable_tower_connector_lora=cfg["tower"],
        specialize_active_lora=specialize_active,
        gpu_memory_utilization=GPU_SHARE,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        attention_backend="TRITON_ATTN",
        # The tower's attention: the same kernel in every engine; one a CUDA graph can capture
        # where the encoder has graphs (torch SDPA reads the sequence lengths back to the host).
        mm_encoder_attn_backend="TRITON_ATTN" if encoder_graphs else "TORCH_SDPA",
        dtype="bfloat16",
        seed=0,
        enforce_eager=cfg["eager"],
        # Video off: no video dummy inputs at start-up, only the image path is exercised.
        limit_mm_per_prompt={"image": 1, "video": 0},
        # Every request runs its prefill (no prefix cache hits).
        enable_prefix_caching=False,
        **ENGINE,
    )
    if not cfg["eager"]:
        compilation: dict = {"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": CAPTURE_SIZES}
        if encoder_graphs:
            compilation.update(
                cudagraph_mm_encoder=True,
                encoder_cudagraph_token_budgets=ENCODER_BUDGETS,
                encoder_cudagraph_max_vision_items_per_batch=ENCODER_ITEMS,
            )
        kwargs["compilation_config"] = compilation
    return kwargs


def release_problem(version: str | None, encoder_graphs: bool) -> str | None:
    """Why this script cannot run on vLLM `version` (None: not installed), or None."""
    from capplan.releases import SUPPORTED, installed_release

    if not version:
        return "vLLM is not installed in this Python (no package metadata names it)"
    release = installed_release(version)
    if release is None:
        return f"vLLM {version} is not a release capplan supports ({SUPPORTED})"
    if encoder_graphs and not release.rules.encoder_graphs:
        return f"--encoder-graphs: MRV2 of vLLM {version} captures no encoder graphs (vLLM 0.28.0 and later do)"
    return None


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


def _dump(record: dict, path: Path) -> None:
    """Write what the probe saw so far (atomically: the engine's process may read it any time)."""
    record["pid"] = os.getpid()
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(record))
    part.replace(path)


def _observe_encoder(record: dict, manager, mm_kwargs, before: tuple[int, int]) -> None:
    """One run of vLLM's encoder graph manager: graphs captured, items replayed and run eager."""
    enc = record.setdefault("encoder_graphs", {"execute_calls": 0, "calls": []})
    enc["execute_calls"] += 1
    enc["graphs_captured"] = sum(len(g) for g in getattr(manager, "budget_graphs", {}).values())
    enc["token_budgets"] = list(getattr(manager, "token_budgets", []))
    enc["max_batch_size"] = getattr(manager, "max_batch_size", None)
    enc["max_frames_per_batch"] = getattr(manager, "max_frames_per_batch", None)
    enc["graph_hits"], enc["graph_misses"] = manager.graph_hits, manager.graph_misses
    if len(enc["calls"]) < 40:
        try:  # the items' output tokens in the order given (vLLM packs them smallest first)
            tokens = manager._get_per_item_out_tokens(mm_kwargs)
        except Exception as exc:  # noqa: BLE001 - informative only
            tokens = f"{type(exc).__name__}: {exc}"
        enc["calls"].append(
            {"item_tokens": tokens, "hits": manager.graph_hits - before[0], "misses": manager.graph_misses - before[1]}
        )


def _probe(record: dict, path: Path) -> None:
    """Wrap MRV2's set_active_mm_loras (called before the encoder runs) to see that it is
    reached, with which adapters' requests, and what vLLM wrapped with LoRA (read at the
    first call), and, where the release has encoder graphs, the encoder graph manager's
    execute (what it captured, replayed and ran eager); both only observe. The engine core
    runs in a process of its own (vLLM's default), forked from this one after the wrappers
    are installed: they run there and write what they saw to `path` after each call, which
    this process reads back. A spawned engine core would not carry them, and the probe would
    say 0 calls. capplan hooks the manager's capture, never its execute."""
    import vllm.v1.worker.gpu.model_runner as runner_mod

    original = runner_mod.set_active_mm_loras

    @functools.wraps(original)
    def set_active_mm_loras(*args, **kwargs):
        try:
            _observe(record, kwargs)
            _dump(record, path)
        except Exception as exc:  # noqa: BLE001 - never let the probe change the run
            record["observe_error"] = f"{type(exc).__name__}: {exc}"
        return original(*args, **kwargs)

    runner_mod.set_active_mm_loras = set_active_mm_loras
    try:
        from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager
    except ImportError:
        return  # a release without encoder graphs
    execute = EncoderCudaGraphManager.execute

    @functools.wraps(execute)
    def execute_observed(self, mm_kwargs, *args, **kwargs):
        before = (self.graph_hits, self.graph_misses)
        out = execute(self, mm_kwargs, *args, **kwargs)
        try:
            _observe_encoder(record, self, mm_kwargs, before)
            _dump(record, path)
        except Exception as exc:  # noqa: BLE001 - never let the probe change the run
            record["encoder_observe_error"] = f"{type(exc).__name__}: {exc}"
        return out

    EncoderCudaGraphManager.execute = execute_observed


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


def _child_pids(pid: int) -> list[int]:
    pids: set[int] = set()
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            pids.update(int(x) for x in children.read_text().split())
        except (OSError, ValueError):
            pass
    return sorted(pids)


def _proc_alive(pid: int) -> bool:
    """Running (a zombie, or a process gone, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] not in (["Z"], ["X"])


def _engine_core_pids() -> list[int]:
    """This process's engine core processes (vLLM titles them VLLM::EngineCore), else all its children."""
    pids, cores = _child_pids(os.getpid()), []
    for pid in pids:
        try:
            names = Path(f"/proc/{pid}/comm").read_text() + Path(f"/proc/{pid}/cmdline").read_bytes().decode(
                errors="replace"
            )
        except OSError:
            continue
        if "EngineCor" in names:  # comm keeps 15 characters: VLLM::EngineCor
            cores.append(pid)
    return cores or pids


def _watch_engine_core(
    alive: Callable[[], bool], done: threading.Event, on_dead: Callable[[float], None], grace: float, poll: float = 1.0
) -> None:
    """Until `done` is set: once alive() says False, wait `grace` seconds more for `done` (vLLM's own
    EngineDeadError, raised in generate()), then call on_dead(seconds since the death was seen)."""
    dead_at = None
    while not done.wait(poll):
        if dead_at is None:
            if not alive():
                dead_at = time.monotonic()
        elif time.monotonic() - dead_at >= grace:
            on_dead(time.monotonic() - dead_at)
            return


_FINISHING = threading.Lock()


def _finish(result: dict, out: Path, probe_path: Path, t0: float, update: dict | None = None) -> None:
    """Write the engine's JSON and leave the process (once: the main thread or the engine core watch,
    whichever comes first; the other waits here until os._exit ends both)."""
    _FINISHING.acquire()
    if update:
        result.update(update)
        if "results" in result:
            result["results"] = list(result["results"])  # a snapshot: generate() may still be running
    try:
        if probe_path.exists():  # what the wrappers saw in the engine core's process
            result["probe"] = json.loads(probe_path.read_text())
            result["probe"]["engine_core_pid_differs"] = result["probe"].get("pid") != os.getpid()
    except Exception as exc:  # noqa: BLE001 - informative only
        result["probe_read_error"] = f"{type(exc).__name__}: {exc}"
    result["total_s"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(_stamped(result)))
    print(f"engine {result['engine']}: ok={result['ok']} total {result['total_s']} s", flush=True)
    if not result["ok"]:
        print(f"engine {result['engine']} failed: {result.get('error')}", flush=True)
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


def run_engine(name: str, model: Path, out: Path, specialize_active: bool, encoder_graphs: bool) -> None:
    cfg = ENGINES[name]
    result: dict = {"engine": name, **cfg}
    t0 = time.perf_counter()
    probe_path = out.with_name(out.name + ".probe")
    done = threading.Event()  # no more engine core process expected to live: the groups ended or failed
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
        probe_path.unlink(missing_ok=True)
        try:
            _probe(probe, probe_path)
        except Exception as exc:  # noqa: BLE001 - the probe only observes; the run goes on without it
            probe["error"] = f"{type(exc).__name__}: {exc}"
        kwargs = engine_kwargs(name, model, specialize_active, encoder_graphs)
        result["kwargs"] = kwargs
        t1 = time.perf_counter()
        llm = LLM(**kwargs)
        result["startup_s"] = round(time.perf_counter() - t1, 1)
        result["resolved"] = _resolved(llm)
        # An engine core that aborts (a CUDA device-side assert kills it from C++) sends its client
        # no EngineDeadError: vLLM cleans up, but generate() waits for ever (vanilla on 0.33.0).
        cores = _engine_core_pids()
        result["engine_core_pids"] = cores

        def on_dead(secs: float) -> None:
            group = result.get("group_running")
            _finish(
                result,
                out,
                probe_path,
                t0,
                {
                    "ok": False,
                    "engine_core_died": True,
                    "error": f"EngineCoreDied: the engine core process {cores} is gone (in group {group}); "
                    f"generate() had not returned {secs:.0f} s later",
                },
            )

        if cores:
            watch = threading.Thread(
                target=_watch_engine_core,
                args=(lambda: all(_proc_alive(p) for p in cores), done, on_dead, ENGINE_CORE_GRACE_S),
                daemon=True,
                name="engine-core-watch",
            )
            watch.start()
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, detokenize=False)
        adapters = {n: LoRARequest(n, i, str(model / n)) for n, i in ADAPTER_IDS.items()}
        images = {}
        rows: list[dict] = []
        result["results"] = rows  # the groups answered so far, kept if a later one fails
        t2 = time.perf_counter()
        for group, reqs in GROUPS.items():
            result["group_running"] = group
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
        done.set()  # the shutdown below stops the engine core on purpose
        del result["group_running"]
        result["generate_s"] = round(time.perf_counter() - t2, 1)
        _shutdown(llm)
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - one shot: whatever broke must be in the JSON
        done.set()
        update = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": tail(traceback.format_exc(), 6000)}
        _finish(result, out, probe_path, t0, update)
    _finish(result, out, probe_path, t0)


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
    out.write_text(json.dumps(_stamped(result)))
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
            "command": [sys.executable, *sys.argv],
            "settings": {
                "engine": ENGINE,
                "capture_sizes": CAPTURE_SIZES,
                "max_tokens": MAX_TOKENS,
                "specialize_active_lora": args.specialize_active,
                "encoder_graphs": args.encoder_graphs,
                "encoder_budgets": ENCODER_BUDGETS if args.encoder_graphs else None,
                "encoder_max_items": ENCODER_ITEMS if args.encoder_graphs else None,
                "parallel": args.parallel,
                "gpu_memory_utilization": GPU_SHARE,
                "kv_cache_memory_bytes": KV_CACHE_BYTES,
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
        part = OUT / "gpu_vlm.json.part"
        part.write_text(json.dumps(self.data, indent=1))
        part.replace(OUT / "gpu_vlm.json")

    def launch(self, name: str, cmd: list[str], env: dict, cap: int) -> dict:
        """Start cmd in its own session with its output in WORKDIR/name.log (the engine core,
        vLLM's child process, writes there too); it must end within cap seconds and the run's limit."""
        handle = (self.work / f"{name}.log").open("w")
        proc = subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + max(min(cap, self.args.limit - self.elapsed()), 1)
        return {"name": name, "proc": proc, "handle": handle, "t0": time.monotonic(), "deadline": deadline}

    def reap(self, child: dict) -> tuple[int | None, str, float]:
        """Wait for a launched child; kill its whole process group at the deadline (the engine
        core and torch.compile's workers are in it), or PARENT_GRACE_S after its log says that its
        engine core died or it failed (child["dead_engine_line"]: the line that said so)."""
        proc, log = child["proc"], self.work / f"{child['name']}.log"
        seen, died_at = 0, None
        code: int | None = None
        while True:
            try:
                code = proc.wait(timeout=2)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if died_at is None:
                with log.open("rb") as fh:  # only what was written since the last look
                    fh.seek(max(seen - 200, 0))
                    new = fh.read().decode(errors="replace")
                    seen = fh.tell()
                line = dead_engine_line(new)
                if line:
                    child["dead_engine_line"], died_at = line[:300], now
            if now >= child["deadline"] or (died_at is not None and now - died_at >= PARENT_GRACE_S):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
                child["killed_after_death"] = died_at is not None and now < child["deadline"]
                break
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # an engine core left behind by a child that failed
        except OSError:
            pass  # none left
        child["handle"].close()
        text = (self.work / f"{child['name']}.log").read_text(errors="replace")
        return code, text, time.monotonic() - child["t0"]

    def child(self, name: str, cmd: list[str], env: dict, cap: int) -> tuple[int | None, str, float]:
        return self.reap(self.launch(name, cmd, env, cap))

    def stage(self, name: str, fn) -> dict:
        if name not in self.args.stages:
            return {"skipped": "not in --stages"}
        left = self.args.limit - self.elapsed()
        if left < 30:
            return self.record(name, {"ok": False, "skipped": f"no time left ({left:.0f} s before the run's limit)"})
        self.log(f"{name}: start")
        try:
            info = fn()
        except BaseException as exc:  # noqa: BLE001 - a stage's own failure, not a child's
            info = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": tail(traceback.format_exc())}
        return self.record(name, info)

    def record(self, name: str, info: dict) -> dict:
        self.data["stages"][name] = info
        self.save()
        status = "ok" if info.get("ok") else f"FAILED: {info.get('error') or info.get('skipped', '?')}"
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
            TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
            # Triton's kernels, shared by this run's engines only (not with another test's on the GPU).
            TRITON_CACHE_DIR=str(self.work / "triton-cache"),
            VLLM_USE_V2_MODEL_RUNNER="1",
            PYTHONUNBUFFERED="1",
            PYTHONFAULTHANDLER="1",  # a crashing process (the engine core too) prints its Python stack
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
        import yaml

        from capplan.releases import installed_release

        release = installed_release(self.data["env"].get("vllm") or "")
        assert release is not None  # main() refused the run otherwise
        spec = self.work / "vlm.yaml"
        spec.write_text(spec_text(release.version, self.args.specialize_active, self.args.encoder_graphs))
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
            "target": release.version,
            "spec": spec.read_text(),
            "output": tail(proc.stdout + proc.stderr, 1000),
        }
        if info["ok"]:
            doc = yaml.safe_load(plan.read_text())
            info["graphs"] = len(doc.get("graphs") or [])
            info["encoder"] = doc.get("encoder")
        else:
            info["error"] = f"capplan compile exited {proc.returncode}"
            info["log_tail"] = tail(proc.stderr)
        return info

    def engine_cmd(self, name: str) -> tuple[list[str], Path | None]:
        plan = self.work / "vlm.plan.yaml" if ENGINES[name]["plan"] else None
        cmd = [sys.executable, str(Path(__file__).resolve()), str(self.work), "--engine", name]
        if self.args.specialize_active:
            cmd.append("--specialize-active")
        if self.args.encoder_graphs:
            cmd.append("--encoder-graphs")
        return cmd, plan

    def start_engine(self, name: str) -> dict:
        """A launched engine, or {"info": why it could not start}."""
        cmd, plan = self.engine_cmd(name)
        if plan is not None and not plan.exists():
            return {"info": {"ok": False, "error": "no plan (the plan stage failed or was skipped)"}}
        (self.work / f"{name}.json").unlink(missing_ok=True)
        return self.launch(name, cmd, self.env_for(name, plan), STAGE_CAP_S[name])

    def finish_engine(self, child: dict) -> dict:
        if "info" in child:
            return child["info"]
        name = child["name"]
        code, text, secs = self.reap(child)
        out = self.work / f"{name}.json"
        info: dict = json.loads(out.read_text()) if out.exists() else {"ok": False}
        info["seconds"] = round(secs, 1)
        info["returncode"] = code
        info["log_lines"] = [line[:300] for line in text.splitlines() if any(k in line for k in KEY_LINES)][-25:]
        if child.get("dead_engine_line"):
            info["dead_engine_log_line"] = child["dead_engine_line"]
        if code is None and child.get("killed_after_death"):
            info.update(
                ok=False,
                error=info.get("error")
                or f"engine dead (log: {child['dead_engine_line'][:120]}); the engine's process had not "
                f"exited {PARENT_GRACE_S:.0f} s later: killed after {secs:.0f} s",
            )
        elif code is None:
            info.update(ok=False, error=f"timed out after {secs:.0f} s")
        elif not out.exists():
            info["error"] = f"exited {code} before writing its JSON"
        if not info.get("ok"):
            info["log_tail"] = tail(text)
        if ENGINES[name]["plan"]:
            report = self.work / f"{name}.report.json"
            info["report"] = json.loads(report.read_text()) if report.exists() else None
        return info

    def engine(self, name: str) -> dict:
        return self.finish_engine(self.start_engine(name))

    def engines(self) -> None:
        """Every engine of --stages: one after another, or (--parallel) all started at once."""
        names = [n for n in ENGINES if n in self.args.stages]
        if not self.args.parallel:
            for name in names:
                self.stage(name, lambda name=name: self.engine(name))
            return
        left = self.args.limit - self.elapsed()
        if left < 30:
            for name in names:
                self.record(name, {"ok": False, "skipped": f"no time left ({left:.0f} s before the run's limit)"})
            return
        self.log(f"{', '.join(names)}: start together")
        children = {name: self.start_engine(name) for name in names}
        for name, child in children.items():
            try:
                info = self.finish_engine(child)
            except BaseException as exc:  # noqa: BLE001 - this stage's own failure, not the engine's
                info = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": tail(traceback.format_exc())}
            self.record(name, info)

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


def dead_engine_line(log_text: str) -> str | None:
    """The first line of an engine's log that says its engine core died or it failed, or None."""
    for line in log_text.splitlines():
        if any(k in line for k in ENGINE_DEAD_MARKERS):
            return line.strip()
    return None


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


def _stamped(result: dict) -> dict:
    """An engine's result with the commit under test as its first key, as every kept result has."""
    from run_identity import capplan_commit

    return {"capplan_commit": capplan_commit(), **result}


def environment() -> dict:
    """Versions and the plugin's presence, read without importing torch or vLLM."""
    import importlib.metadata as md
    import importlib.util

    from run_identity import capplan_commit, host_cpu

    env: dict = {"capplan_commit": capplan_commit(), "python": sys.version.split()[0], "host_cpu": host_cpu()}
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
        "differ_by_group": {g: sum(1 for k, d in diffs.items() if k[0] == g and not d.get("near_tie")) for g in GROUPS},
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


def _clear_image_diffs(cmp: dict) -> int:
    return sum(1 for d in cmp["differing"] if d["image"] is not None and not d.get("near_tie"))


def graphs_control_verdict(stages: dict, out: dict) -> dict:
    """What graphs_control (the planned engine's graphs, tower LoRA off) against the control (eager,
    tower LoRA off) says: whether graphs alone change image answers (None where it cannot tell: an
    engine without results, or equal on the groups compared while one of them failed before the
    end), and whether the groups where planned or vanilla died need tower LoRA to die (None where
    graphs_control did not get as far)."""
    verdict: dict = {}
    ctl, gctl = stages.get("control", {}), stages.get("graphs_control", {})
    cmp = out.get("graphs_control_vs_control")
    alone = None
    if cmp is not None:
        if _clear_image_diffs(cmp):
            alone = True  # a clear difference is one, however many groups were compared
        elif ctl.get("ok") and gctl.get("ok"):
            alone = False
        verdict["graphs_control_vs_control_image_requests_differing_clearly"] = (
            f"{_clear_image_diffs(cmp)}/{sum(1 for r in gctl.get('results') or [] if r['image'] is not None)}"
        )
        verdict["graphs_control_vs_control_text_only_equal"] = not any(
            d["image"] is None and not d.get("near_tie") for d in cmp["differing"]
        )
    verdict["encoder_graphs_alone_change_image_outputs"] = alone
    # Where the graph engines with tower LoRA differ from the (eager) reference on image requests:
    # from the graphs themselves if the graphs without tower LoRA differ from the eager control too.
    differing = [
        n
        for n in ("planned", "vanilla")
        if out.get(f"{n}_vs_reference") and _clear_image_diffs(out[f"{n}_vs_reference"])
    ]
    compared = [n for n in ("planned", "vanilla") if out.get(f"{n}_vs_reference")]
    if compared:
        if not differing:
            verb = "equal" if len(compared) > 1 else "equals"
            cause = f"none: {' and '.join(compared)} {verb} the reference on image requests (but near-ties)"
        elif alone is None:
            cause = None
        elif alone:
            cause = "encoder graphs themselves: without tower LoRA, graphs already differ from the eager control"
        else:
            cause = "tower/connector LoRA under graphs: without tower LoRA, graphs equal the eager control"
        verdict["image_differences_cause"] = cause
        verdict["image_differences_in"] = differing
    # The groups where a graph engine with tower LoRA died (an engine core crash, or any failure
    # inside a group), and whether graphs_control got through them.
    died = {
        n: stages[n]["group_running"]
        for n in ("planned", "vanilla")
        if stages.get(n) and not stages[n].get("ok") and stages[n].get("group_running")
    }
    verdict["graph_engines_died_in"] = died
    needs = None
    if died:
        groups = set(died.values())
        answered = {r["group"] for r in gctl.get("results") or []}
        if groups <= answered:
            needs = True  # graphs_control answered every group they died in
        elif not gctl.get("ok") and gctl.get("group_running") in groups:
            needs = False  # graphs_control died in such a group too
        verdict["graphs_control_failed"] = (
            "not run" if not gctl else None if gctl.get("ok") else (gctl.get("error") or gctl.get("skipped"))
        )
    verdict["crash_needs_tower_lora"] = needs
    return verdict


def evaluate(data: dict) -> dict:
    stages = data["stages"]
    # An engine that failed part way keeps the groups it answered: compared on those only.
    rows = {n: stages[n]["results"] for n in (*ENGINES, "hf") if stages.get(n, {}).get("results")}
    out: dict = {
        "engines_with_results": sorted(rows),
        "engines_with_some_groups_only": sorted(n for n in rows if not stages[n].get("ok")),
    }
    for name, r in rows.items():
        out[f"{name}_adapter_effects"] = adapter_effects(r)

    def answered(ref: list[dict], other: list[dict]) -> list[dict]:
        groups = {r["group"] for r in other}
        return [r for r in ref if r["group"] in groups]

    if "reference" in rows:
        for name in ("planned", "vanilla", "control", "graphs_control", "hf"):
            if name in rows:
                out[f"{name}_vs_reference"] = compare_to(answered(rows["reference"], rows[name]), rows[name])
    if "planned" in rows and "vanilla" in rows:
        out["planned_vs_vanilla"] = compare_to(answered(rows["vanilla"], rows["planned"]), rows["planned"])
    if "control" in rows and "graphs_control" in rows:
        # tower LoRA off in both: any difference is the graphs' (decoder and encoder)
        out["graphs_control_vs_control"] = compare_to(
            answered(rows["control"], rows["graphs_control"]), rows["graphs_control"]
        )
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
            image_adapter = [r for r in rows["control"] if r["image"] is not None and r["lora"] is not None]
            changed = sum(1 for d in cmp["differing"] if d["image"] is not None and d["lora"] is not None)
            verdict["control_image_adapter_requests_differing_from_reference"] = f"{changed}/{len(image_adapter)}"
    planned = stages.get("planned", {})
    report = planned.get("report")  # written as the engine went, kept where it failed later
    if report:
        verdict["plan_in_force"] = bool(report.get("graphs_captured")) and report.get("graphs_captured") == report.get(
            "graphs_planned"
        )
        verdict["plan_graphs"] = {k: report.get(k) for k in ("graphs_planned", "graphs_captured", "vllm_would_capture")}
        verdict["plan_dispatch"] = report.get("dispatch")
    elif "planned" in stages:
        verdict["plan_in_force"] = False
    for name in ("planned", "graphs_control", "vanilla"):
        st = stages.get(name, {})
        enc = (st.get("probe") or {}).get("encoder_graphs")
        if data["settings"].get("encoder_graphs") and name in stages:
            verdict[f"{name}_encoder_graphs"] = (
                None
                if enc is None
                else {
                    k: enc.get(k)
                    for k in ("graphs_captured", "token_budgets", "max_batch_size", "graph_hits", "graph_misses")
                }
            )
    plan_encoder = stages.get("plan", {}).get("encoder")
    enc = verdict.get("planned_encoder_graphs")
    if plan_encoder and "planned_encoder_graphs" in verdict:
        # the plan's graphs all captured (none under encoder_lora_eager), and images replayed on them
        planned_graphs = len(plan_encoder.get("graphs") or [])
        verdict["planned_encoder_graphs_captured_as_planned"] = (
            enc is not None and enc["graphs_captured"] == planned_graphs
        ) or (enc is None and planned_graphs == 0)
        verdict["planned_encoder_graph_replays"] = bool(enc and enc["graph_hits"])
    verdict.update(graphs_control_verdict(stages, out))
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
            where = f" (in group {st['group_running']})" if st.get("group_running") else ""
            lines.append(f"  {name:14s} FAILED{where}: {st.get('error') or st.get('skipped')}")
            cmp = ev.get(f"{name}_vs_reference")
            if cmp:  # the groups it answered before it failed
                lines.append(
                    f"  {'':14s} before that: {cmp['equal']}/{cmp['requests']} equal to the reference, "
                    f"{cmp['differ_clearly']} clearly different by group {cmp['differ_by_group']}"
                )
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
            enc = probe.get("encoder_graphs")
            if enc:
                extra += (
                    f"; encoder graphs {enc.get('graphs_captured')} captured {enc.get('token_budgets')}, "
                    f"{enc.get('graph_hits')} images replayed, {enc.get('graph_misses')} eager"
                )
            if cmp and cmp["differ_clearly"]:
                extra += f"; clearly different by group {cmp['differ_by_group']}"
        elif name == "hf":
            cmp = ev.get("hf_vs_reference")
            if cmp:
                extra = (
                    f"vs reference: {cmp['equal']}/{cmp['requests']} equal, {cmp['differ_after_near_tie']} after a "
                    f"near-tie, {cmp['differ_clearly']} clearly different (logprob noise {cmp['max_logprob_diff_on_equal_tokens']})"
                )
        lines.append(f"  {name:14s} ok  {extra}".rstrip())
    for key, value in ev.get("verdict", {}).items():
        lines.append(f"  verdict {key}: {value}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; a bad one stops with one line (argparse's usage and error)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--engine", choices=sorted(ENGINES), help=argparse.SUPPRESS)
    parser.add_argument("--hf", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--evaluate",
        action="store_true",
        help="print the evaluation and summary of WORKDIR/gpu_vlm.json again (runs nothing, writes nothing)",
    )
    parser.add_argument(
        "--specialize-active", action="store_true", help="specialize_active_lora on in every engine and the spec"
    )
    parser.add_argument(
        "--encoder-graphs",
        action="store_true",
        help="MRV2 encoder CUDA graphs in the graph engines and the spec (vLLM 0.28.0 and later)",
    )
    parser.add_argument(
        "--parallel", action="store_true", help="start the engines at once, after build and plan (one GPU, shared)"
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    parser.add_argument(
        "--limit", type=float, default=540, help="seconds from start after which no stage starts or keeps running"
    )
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    args = parser.parse_args(argv)
    if args.engine or args.hf:
        return args
    if args.evaluate:
        if not (args.workdir / "gpu_vlm.json").is_file():
            parser.error(f"--evaluate: no {args.workdir / 'gpu_vlm.json'}")
        return args
    if not args.limit > 0:
        parser.error(f"--limit must be a positive number of seconds, got {args.limit:g}")
    args.stages = [s for s in args.stages.split(",") if s and not (args.no_hf and s == "hf")]
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(unknown)}; known: {', '.join(STAGES)}")
    if not args.stages:
        parser.error(f"--stages names no stage; known: {', '.join(STAGES)}")
    if args.workdir.exists() and not args.workdir.is_dir():
        parser.error(f"{args.workdir}: exists and is not a folder")
    problem = release_problem(environment().get("vllm"), args.encoder_graphs)
    if problem:
        parser.error(problem)
    return args


def main() -> None:
    args = parse_args()
    work = args.workdir.resolve()
    if args.engine:
        model, out = work / "model", work / f"{args.engine}.json"
        run_engine(args.engine, model, out, args.specialize_active, args.encoder_graphs)
        return
    if args.hf:
        run_hf(work / "model", work / "hf.json")
        return
    if args.evaluate:
        data = json.loads((work / "gpu_vlm.json").read_text())
        data["evaluation"] = evaluate(data)
        print("\n".join(summary_lines(data)), flush=True)
        return
    work.mkdir(parents=True, exist_ok=True)
    run = Run(work, args)
    run.log(f"environment: {json.dumps(run.data['env'])}")
    run.save()
    run.stage("build", run.build)
    run.stage("plan", run.plan)
    run.engines()
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
