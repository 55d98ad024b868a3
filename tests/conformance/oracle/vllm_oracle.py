#!/usr/bin/env python3
"""Test oracle: run vLLM's own Model Runner V2 CUDA-graph planning on CPU.

Standalone on purpose: imports only the standard library, vLLM, torch and
numpy (never capplan), so its answers come from vLLM's code alone.

Usage (one vLLM version per run, chosen by PYTHONPATH):

    PYTHONPATH=CACHE/src/0.33.0 CACHE/venv/bin/python vllm_oracle.py \
        --input IN.json --output OUT.json

IN.json:  {"specs": [{"name": str, "spec": SPEC, "queries": [[num_reqs,
          num_tokens, max_query_len, num_adapters, has_prefill], ...]}, ...]}
OUT.json: {"vllm_version": "0.33.0", "results": [...]}; see _run_spec for
          the per-spec fields, or {"name": ..., "error": "Type: msg"} when
          vLLM rejects the spec.

What is real vLLM code here: CompilationConfig, LoRAConfig, SchedulerConfig
(when it accepts the values), VllmConfig._set_cudagraph_sizes (called unbound
on a namespace carrying the attributes it reads; it ends by calling
CompilationConfig.post_init_cudagraph_sizes), CompilationConfig.
resolve_cudagraph_mode_and_sizes (attention backend support ALWAYS,
use_v2_model_runner=True), get_lora_capture_cases, CudaGraphManager
(__init__, _build_lora_dispatch_map, _init_candidates, dispatch),
get_uniform_token_count (0.25) / get_uniform_decode_token_count (0.33),
InputBatch.make_dummy + InputBuffers, create_lora_capture_hook and
LoRAModelRunnerMixin.maybe_select_dummy_loras.  What is faked: the VllmConfig
object handed to the manager (a namespace), the pipeline-parallel group, the
CUDA graph pool, the platform's Blackwell check, and the LoRA worker manager.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
import time
import traceback
from types import SimpleNamespace

_T0 = time.monotonic()


def _log(msg: str) -> None:
    print(f"[vllm_oracle {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# Keep vLLM quiet and on CPU before it is imported.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The breakable-graph switch only decides how PIECEWISE graphs are run, not
# which ones exist; pin it off so the environment cannot change anything.
os.environ.pop("VLLM_USE_BREAKABLE_CUDAGRAPH", None)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402
import vllm.platforms  # noqa: E402
import vllm.v1.worker.gpu.cudagraph_utils as cg_utils  # noqa: E402
from vllm.config import (  # noqa: E402
    CompilationConfig,
    LoRAConfig,
    SchedulerConfig,
    VllmConfig,  # noqa: E402
)
from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers  # noqa: E402
from vllm.v1.worker.gpu.lora_utils import (  # noqa: E402
    create_lora_capture_hook,
    get_lora_capture_cases,
)
from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin  # noqa: E402

CudaGraphManager = cg_utils.CudaGraphManager
current_platform = vllm.platforms.current_platform


def _detect_version() -> str:
    version = getattr(vllm, "__version__", None)
    if version and re.match(r"^\d+\.\d+", str(version)):
        return str(version)
    # Fall back on the source path (CACHE/src/<version>/vllm/__init__.py).
    m = re.search(r"(\d+\.\d+\.\d+)", os.path.dirname(os.path.dirname(vllm.__file__)))
    if m:
        return m.group(1)
    return str(version)


VLLM_VERSION = _detect_version()
IS_V033 = hasattr(cg_utils.BatchExecutionDescriptor, "__dataclass_fields__") and (
    "max_query_len" in cg_utils.BatchExecutionDescriptor.__dataclass_fields__
)

if IS_V033:
    from vllm.v1.worker.utils import get_uniform_decode_token_count  # noqa: E402

    get_uniform_token_count = None
else:
    get_uniform_token_count = cg_utils.get_uniform_token_count
    get_uniform_decode_token_count = None


def _uniform_decode(num_reqs: int, num_tokens: int, max_query_len: int, has_prefill: bool):
    """get_uniform_decode_token_count: its last parameter is `has_prefill` (0.28 to 0.30) or
    `decode_graph_eligible` (0.31+), the same fact stated the other way round."""
    if "has_prefill" in _UNIFORM_PARAMS:
        return get_uniform_decode_token_count(num_reqs, num_tokens, max_query_len, has_prefill)
    return get_uniform_decode_token_count(num_reqs, num_tokens, max_query_len, not has_prefill)


_UNIFORM_PARAMS = set(inspect.signature(get_uniform_decode_token_count).parameters) if IS_V033 else set()
_MANAGER_PARAMS = set(inspect.signature(CudaGraphManager.__init__).parameters)
_DISPATCH_PARAMS = set(inspect.signature(CudaGraphManager.dispatch).parameters)
_RESOLVE_PARAMS = set(inspect.signature(CompilationConfig.resolve_cudagraph_mode_and_sizes).parameters)
_MAKE_DUMMY_PARAMS = set(inspect.signature(InputBatch.make_dummy).parameters)

# --------------------------------------------------------------------------
# Patches: the module-level names CudaGraphManager.__init__ reaches for.
# --------------------------------------------------------------------------
_PP_GROUP = SimpleNamespace(is_first_rank=True, is_last_rank=True, world_size=1)
cg_utils.get_pp_group = lambda: _PP_GROUP
# Instance attribute shadows the (classmethod/method) on the platform class.
current_platform.get_global_graph_pool = lambda: None


def _set_blackwell(blackwell: bool) -> None:
    """Make current_platform.is_device_capability_family(100) answer `blackwell`
    (and every other family False), whatever machine this runs on."""

    def is_device_capability_family(capability: int, device_id: int = 0) -> bool:
        return bool(blackwell) and capability // 10 == 10

    current_platform.is_device_capability_family = is_device_capability_family


# --------------------------------------------------------------------------
# Fake LoRA runner: the real mixin method bound to a stand-in object.
# --------------------------------------------------------------------------
class _FakeLoraRunner:
    def __init__(self) -> None:
        self.lora_manager = SimpleNamespace(name="oracle-dummy-lora-manager")
        self.last_hook_num_scheduled: list[int] | None = None
        self.calls: list[dict] = []

    def maybe_select_dummy_loras(self, lora_config, num_scheduled_tokens, *args, **kwargs):
        # Record what the capture hook passed, then run vLLM's real code.
        self.last_hook_num_scheduled = [int(x) for x in np.asarray(num_scheduled_tokens)]
        return LoRAModelRunnerMixin.maybe_select_dummy_loras(self, lora_config, num_scheduled_tokens, *args, **kwargs)

    def _set_active_loras(self, prompt_lora_mapping, token_lora_mapping, lora_requests, mapping_type=None) -> None:
        self.calls.append(
            {
                "prompt": [int(x) for x in prompt_lora_mapping],
                "num_token_entries": len(token_lora_mapping),
                "token_ids": sorted({int(x) for x in token_lora_mapping}),
                "request_ids": sorted(int(r.lora_int_id) for r in lora_requests),
            }
        )


# --------------------------------------------------------------------------
# Spec -> vLLM objects
# --------------------------------------------------------------------------
def _scheduler_config(sched: dict, notes: list[str]):
    kwargs = dict(
        max_num_seqs=int(sched["max_num_seqs"]),
        max_num_batched_tokens=int(sched["max_num_batched_tokens"]),
        max_model_len=int(sched["max_model_len"]),
    )
    try:
        sc = SchedulerConfig(is_encoder_decoder=False, **kwargs)
        if sc.max_num_seqs == kwargs["max_num_seqs"] and sc.max_num_batched_tokens == kwargs["max_num_batched_tokens"]:
            sc.max_model_len = kwargs["max_model_len"]  # InitVar: not kept
            return sc
        notes.append("SchedulerConfig changed the values; using a namespace")
    except Exception as e:  # noqa: BLE001
        msg = " ".join(str(e).split())
        notes.append(f"SchedulerConfig rejected the values ({type(e).__name__}: {msg}); using a namespace")
    return SimpleNamespace(**kwargs)


def _compilation_config(cg: dict, lora: dict) -> CompilationConfig:
    kwargs = {
        "cudagraph_mode": CUDAGraphMode[cg["mode"]],
        "cudagraph_specialize_lora": bool(lora["specialize"]),
    }
    if cg.get("capture_sizes") is not None:
        kwargs["cudagraph_capture_sizes"] = [int(x) for x in cg["capture_sizes"]]
    if cg.get("max_capture_size") is not None:
        kwargs["max_cudagraph_capture_size"] = int(cg["max_capture_size"])
    return CompilationConfig(**kwargs)


def _lora_config(lora: dict) -> LoRAConfig | None:
    if not lora["enabled"]:
        return None
    return LoRAConfig(
        max_loras=int(lora["max_loras"]),
        specialize_active_lora=bool(lora["specialize_active"]),
    )


def _desc_list(d) -> list:
    return [
        d.cg_mode.name,
        d.num_tokens,
        d.num_reqs,
        d.uniform_token_count,
        getattr(d, "max_query_len", None),
        d.num_active_loras,
    ]


# Global caches (make_dummy / hook results depend only on their arguments).
_DUMMY_CACHE: dict[tuple, list[int] | str] = {}
_HOOK_CACHE: dict[tuple, tuple] = {}
_BUFFERS: dict[tuple[int, int], InputBuffers] = {}


def _buffers(max_num_reqs: int, max_num_tokens: int) -> InputBuffers:
    key = (max_num_reqs, max_num_tokens)
    buf = _BUFFERS.get(key)
    if buf is None:
        _BUFFERS.clear()
        buf = _BUFFERS[key] = InputBuffers(max_num_reqs, max_num_tokens, torch.device("cpu"))
    return buf


def _make_dummy_tokens(desc, num_reqs: int, max_num_seqs: int, max_num_tokens: int):
    num_tokens = desc.num_tokens
    kwargs = {}
    if "max_query_len" in _MAKE_DUMMY_PARAMS:
        # As prepare_inputs_to_capture (0.33) calls it.
        mql = getattr(desc, "max_query_len", None) or desc.uniform_token_count
        if desc.cg_mode == CUDAGraphMode.FULL and mql is None:
            mql = num_tokens
        kwargs["max_query_len"] = mql
    key = (num_reqs, num_tokens, kwargs.get("max_query_len"))
    hit = _DUMMY_CACHE.get(key)
    if hit is None:
        try:
            buf = _buffers(max(max_num_seqs, num_reqs), max(max_num_tokens, num_tokens))
            batch = InputBatch.make_dummy(num_reqs, num_tokens, buf, **kwargs)
            hit = [int(x) for x in batch.num_scheduled_tokens]
        except Exception as e:  # noqa: BLE001
            hit = f"{type(e).__name__}: {e}"
        _DUMMY_CACHE[key] = hit
    return hit


def _run_hook(lora_config, max_loras_key, desc, num_reqs: int):
    key = (max_loras_key, desc.num_active_loras, num_reqs, desc.num_tokens)
    hit = _HOOK_CACHE.get(key)
    if hit is None:
        runner = _FakeLoraRunner()
        hook = create_lora_capture_hook(lora_config, runner)
        hook(desc.num_active_loras, num_reqs, desc.num_tokens)
        call = runner.calls[-1] if runner.calls else None
        hit = (runner.last_hook_num_scheduled, call)
        _HOOK_CACHE[key] = hit
    return hit


def build_manager(spec: dict, notes: list[str] | None = None) -> SimpleNamespace:
    """vLLM's own startup planning for one spec: configs, capture sizes, mode
    resolution, LoRA capture cases and a CudaGraphManager ready to dispatch.
    Also used by bench/ to time vLLM building the same tables capplan plans."""
    notes = [] if notes is None else notes

    target = spec.get("target") or {}
    want = str(target.get("vllm", ""))
    if want and not (VLLM_VERSION == want or VLLM_VERSION.startswith(want + ".")):
        notes.append(f"spec targets vLLM {want} but this oracle runs {VLLM_VERSION}")
    if target.get("runner", "mrv2") != "mrv2":
        notes.append(f"spec targets runner {target.get('runner')!r}; oracle models MRV2 only")

    sched = _scheduler_config(spec["scheduler"], notes)
    max_num_seqs = int(spec["scheduler"]["max_num_seqs"])
    max_num_batched_tokens = int(spec["scheduler"]["max_num_batched_tokens"])
    cg = spec["cudagraph"]
    lora = spec["lora"]
    num_spec_tokens = int(spec["speculative"]["num_speculative_tokens"])
    dp_size = int(spec["parallel"]["data_parallel_size"])
    decode_query_len = 1 + num_spec_tokens

    compilation_config = _compilation_config(cg, lora)
    lora_config = _lora_config(lora)
    parallel_config = SimpleNamespace(
        tensor_parallel_size=1,
        data_parallel_size=dp_size,
        pipeline_parallel_size=1,
    )
    _set_blackwell(bool(target.get("blackwell", False)))

    # VllmConfig._set_cudagraph_sizes, unbound, on a namespace "self".
    fake_self = SimpleNamespace(
        # ModelConfig.is_moe: the spec says it (DP ranks of an MoE model pad to one another)
        model_config=SimpleNamespace(enforce_eager=False, is_moe=bool(spec["parallel"].get("moe"))),
        compilation_config=compilation_config,
        scheduler_config=sched,
        parallel_config=parallel_config,
        speculative_config=None,
        num_speculative_tokens=num_spec_tokens,
        uniform_decode_query_len=decode_query_len,
        performance_mode=cg.get("performance_mode", "balanced"),
        lora_config=lora_config,
    )
    VllmConfig._set_cudagraph_sizes(fake_self)

    # What the MRV2 runner does before building its manager.
    resolve_kwargs = {"use_v2_model_runner": True, "max_num_reqs": max_num_seqs}
    if "tensor_parallel_size" in _RESOLVE_PARAMS:
        resolve_kwargs["tensor_parallel_size"] = 1
    if "piecewise_capture_available" in _RESOLVE_PARAMS:
        resolve_kwargs["piecewise_capture_available"] = True
    cudagraph_mode = compilation_config.resolve_cudagraph_mode_and_sizes(
        AttentionCGSupport.ALWAYS, "oracle-always", decode_query_len, **resolve_kwargs
    )

    lora_capture_cases = get_lora_capture_cases(lora_config, compilation_config)

    vllm_config_like = SimpleNamespace(
        scheduler_config=sched,
        compilation_config=compilation_config,
        parallel_config=parallel_config,
        speculative_config=None,
        num_speculative_tokens=num_spec_tokens,
        lora_config=lora_config,
        cache_config=SimpleNamespace(use_kda_recoverssm=False),
        model_config=fake_self.model_config,
    )
    mgr_kwargs = {"decode_query_len": decode_query_len, "lora_capture_cases": lora_capture_cases}
    if "varlen_decode" in _MANAGER_PARAMS:
        mgr_kwargs["varlen_decode"] = False
    if "ubatch_runner" in _MANAGER_PARAMS:
        mgr_kwargs["ubatch_runner"] = None
    manager = CudaGraphManager(vllm_config_like, torch.device("cpu"), cudagraph_mode, **mgr_kwargs)
    manager._graphs_captured = True
    return SimpleNamespace(
        manager=manager,
        compilation_config=compilation_config,
        cudagraph_mode=cudagraph_mode,
        lora_config=lora_config,
        lora_capture_cases=lora_capture_cases,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )


def uniform_rule():
    """The runner's uniform-decode rule for this version, as f(reqs, tokens, max_query_len, has_prefill)."""
    if IS_V033:
        return lambda r, t, q, prefill: _uniform_decode(r, t, q, prefill)
    return lambda r, t, q, prefill: get_uniform_token_count(r, t, q)


def _run_spec(entry: dict) -> dict:
    name = entry["name"]
    spec = entry["spec"]
    queries = entry.get("queries") or []
    notes: list[str] = []
    built = build_manager(spec, notes)
    manager, compilation_config = built.manager, built.compilation_config
    cudagraph_mode, lora_config = built.cudagraph_mode, built.lora_config
    lora_capture_cases = built.lora_capture_cases
    max_num_seqs, max_num_batched_tokens = built.max_num_seqs, built.max_num_batched_tokens

    # Descriptors in capture order and the dummy batch each is captured with.
    descriptors: list = []
    dummies: list = []
    max_loras_key = (lora_config.max_loras if lora_config else None,)
    for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
        for desc in manager._capture_descs.get(mode, []):
            descriptors.append(_desc_list(desc))
            num_reqs = desc.num_reqs or min(desc.num_tokens, manager.max_num_reqs)
            dummy = {
                "num_reqs": num_reqs,
                "tokens_per_req": _make_dummy_tokens(desc, num_reqs, max_num_seqs, max_num_batched_tokens),
                "lora_ids": None,
                "hook_tokens_per_req": None,
            }
            if lora_config is not None:
                hook_sched, call = _run_hook(lora_config, max_loras_key, desc, num_reqs)
                dummy["hook_tokens_per_req"] = hook_sched
                dummy["lora_ids"] = call["prompt"] if call else None
                dummy["lora_request_ids"] = call["request_ids"] if call else None
            dummies.append(dummy)

    # Runtime dispatch, as execute_model derives its arguments.
    dispatch: list = []
    uniform: list = []
    has_mql = "max_query_len" in _DISPATCH_PARAMS
    for q in queries:
        try:
            num_reqs, num_tokens, max_query_len, num_adapters, has_prefill = q
            num_reqs = int(num_reqs)
            num_tokens = int(num_tokens)
            max_query_len = int(max_query_len)
            num_adapters = int(num_adapters)
            has_prefill = bool(has_prefill)
            if IS_V033:
                u = _uniform_decode(num_reqs, num_tokens, max_query_len, has_prefill)
            else:
                u = get_uniform_token_count(num_reqs, num_tokens, max_query_len)
            if has_mql:
                d = manager.dispatch(
                    num_reqs,
                    num_tokens,
                    u,
                    num_active_loras=num_adapters,
                    max_query_len=None if has_prefill else max_query_len,
                )
            else:
                d = manager.dispatch(num_reqs, num_tokens, u, num_active_loras=num_adapters)
        except Exception as e:  # noqa: BLE001 - a query vLLM itself cannot take
            uniform.append(None)
            dispatch.append(f"{type(e).__name__}: {e}")
            continue
        uniform.append(u)
        dispatch.append(_desc_list(d))

    result = {
        "name": name,
        "cudagraph_mode": cudagraph_mode.name,
        "capture_sizes": list(compilation_config.cudagraph_capture_sizes or []),
        "max_capture_size": int(compilation_config.max_cudagraph_capture_size or 0),
        "lora_capture_cases": list(lora_capture_cases),
        "lora_dispatch_map": {str(k): v for k, v in manager._lora_dispatch_map.items()},
        "descriptors": descriptors,
        "dummies": dummies,
        "dispatch": dispatch,
        "uniform": uniform,
    }
    if notes:
        result["notes"] = notes
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", required=True, help="IN.json")
    ap.add_argument("--output", required=True, help="OUT.json")
    args = ap.parse_args(argv)

    _log(f"vLLM {VLLM_VERSION} from {os.path.dirname(vllm.__file__)} (imports took {time.monotonic() - _T0:.1f}s)")
    with open(args.input) as f:
        doc = json.load(f)
    specs = doc["specs"]

    results = []
    t_specs = time.monotonic()
    for i, entry in enumerate(specs):
        t = time.monotonic()
        name = entry.get("name", f"spec{i}")
        try:
            res = _run_spec(entry)
        except Exception as e:  # noqa: BLE001 - vLLM rejected the spec
            msg = str(e).strip()
            res = {"name": name, "error": f"{type(e).__name__}: {msg}"}
            if os.environ.get("VLLM_ORACLE_TRACEBACK"):
                traceback.print_exc()
        results.append(res)
        status = res.get("error") or (f"{len(res['descriptors'])} descriptors, {len(res['dispatch'])} queries")
        _log(f"[{i + 1}/{len(specs)}] {name}: {status} ({time.monotonic() - t:.2f}s)")

    out = {"vllm_version": VLLM_VERSION, "results": results}
    tmp = args.output + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    os.replace(tmp, args.output)
    _log(f"wrote {args.output}: {len(results)} specs in {time.monotonic() - t_specs:.1f}s after import")
    return 0


if __name__ == "__main__":
    sys.exit(main())
