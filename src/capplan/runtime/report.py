"""Counters kept while a plan is in force, and the end-of-run report."""

from __future__ import annotations

import atexit
import json
import multiprocessing.util
import os
import sys
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

from capplan.runtime.log import PREFIX, log
from capplan.schemas.plan import Plan

if TYPE_CHECKING:
    from capplan.runtime.recorder import Recorder


class Section(Protocol):
    """A part of the report another module keeps (deferred capture)."""

    def to_json(self) -> dict[str, Any]: ...


class Report:
    """What one engine process did with the plan: graphs captured, dispatch counts, DP
    and trace counters; written to CAPPLAN_REPORT as it goes and printed at exit."""

    _flusher: threading.Thread | None  # keeps the report file at most a second behind, once started

    def __init__(self, plan: Plan, plan_path: str) -> None:
        self.plan = plan
        self.plan_path = plan_path
        self.hits: Counter[int] = Counter()
        self.eager = 0
        self.vllm_planned: int | None = None
        self.capture_seconds = 0.0
        self.graph_memory_bytes: int | None = None
        self.captured: Counter[tuple[str, int]] = Counter()
        self.profiled: Counter[str] = Counter()  # graphs vLLM's memory profiling captured and discarded, per mode
        self.profiling_seconds: float | None = None
        self._t0 = 0.0
        self._free0: int | None = None
        self._finished = False
        self._dirty = False
        self._flusher = None
        self.graph_ids: dict[Any, int] = {}  # vLLM descriptor -> plan graph id
        self.dp: DPCounters | None = None
        self.dp_rank = 0
        self.recorder: Recorder | None = None  # when CAPPLAN_TRACE is set
        self.deferred: Section | None = None  # capplan.runtime.deferred.capture, when the plan defers graphs
        self.identity: dict[str, Any] | None = None  # the deployment this start ran (`identify`)
        # where the graph memory left beside the KV cache came from (hooks.memory): a calibration, or vLLM
        self.graph_budget: dict[str, Any] | None = None
        self.captures: list[dict[str, Any]] | None = None  # one row per capture, where each graph had its own
        self.vllm_estimate_bytes: int | None = None  # vLLM's graph-memory estimate from its profiling pass
        self.kv_cache: dict[str, int] | None = None  # the KV cache vLLM sized, as this process saw it
        # vLLM's workers may be forked processes that leave through os._exit,
        # which skips atexit but runs multiprocessing's finalizers.
        atexit.register(self.finish)
        multiprocessing.util.Finalize(self, self.finish, exitpriority=100)

    def count(self, desc: Any) -> None:
        """One forward pass about to run with this vLLM descriptor."""
        graph_id = self.graph_ids.get(desc, -1) if desc.cg_mode.name != "NONE" else -1
        if graph_id >= 0:
            self.hits[graph_id] += 1
        else:
            self.eager += 1
        self._dirty = True

    def dp_step(self, rank: int, size: int, num_tokens: int, desired: Any, synced: Any, disagreed: bool | None) -> None:
        if self.dp is None:
            self.dp = DPCounters(rank, size)
        self.dp.step(num_tokens, desired, synced, disagreed)

    def planned(self, vllm_planned_count: int) -> None:
        self.vllm_planned = vllm_planned_count

    def identify(self, vllm_config: Any) -> None:
        """The deployment this start runs, read once from vLLM's config (`capplan calibrate-start`
        records it as measured): a field this vLLM does not have is left out, and a failure
        leaves the identity empty (a report must never break the engine)."""
        if self.identity is not None:
            return
        try:
            self.identity = deployment_identity(vllm_config)
        except Exception:  # noqa: BLE001 - a report must never break the engine
            self.identity = {}

    def capture_started(self) -> None:
        self._t0 = time.perf_counter()
        self._free0 = _free_memory()

    def profiling_started(self) -> None:
        self._t0 = time.perf_counter()

    def profiling_finished(self, manager: Any) -> None:
        """vLLM's memory-profiling capture ended: the graphs it captured (a sample of the FULL
        ones, every PIECEWISE one; all discarded) are counted apart from the real capture."""
        self.profiling_seconds = (self.profiling_seconds or 0.0) + time.perf_counter() - self._t0
        for mode, n in _captured(manager).items():
            self.profiled[mode[0]] += n

    def capture_finished(self, manager: Any) -> None:
        self._capture_finished(manager)
        self.write()
        if self.path() and self._flusher is None:
            # vLLM may kill a worker blocked in a collective at shutdown, before
            # any exit hook runs: keep the file at most a second behind.
            self._flusher = threading.Thread(target=self._flush_loop, name="capplan-report", daemon=True)
            self._flusher.start()

    def _flush_loop(self) -> None:
        said = False
        while not self._finished:
            time.sleep(1.0)
            if self._dirty:
                self._dirty = False
                try:
                    self.write()
                except RuntimeError:  # a counter changed size while copied; next second
                    self._dirty = True
                except Exception as exc:  # noqa: BLE001 - the flusher must outlive any one failure
                    self._dirty = True
                    if not said:
                        said = True
                        log.warning(
                            "the report could not be refreshed (%s: %s); retrying every second", type(exc).__name__, exc
                        )

    def _capture_finished(self, manager: Any) -> None:
        self.capture_seconds = time.perf_counter() - self._t0
        free1 = _free_memory()
        if self._free0 is not None and free1 is not None:
            self.graph_memory_bytes = self._free0 - free1
        self.captured.update(_captured(manager))
        self.kv_cache_sized(getattr(manager, "vllm_config", None))

    def captured_one(self, gid: int, seconds: float, used: int) -> None:
        """One graph of the capture measured (CAPPLAN_CAPTURE_EACH): its seconds and the
        pool's growth across it."""
        d = self.plan.graphs[gid].descriptor
        row = {"graph": gid, "cg_mode": d.cg_mode, "num_tokens": d.num_tokens, "lora_case": d.num_active_loras,
               "seconds": round(seconds, 4), "bytes": int(used)}  # fmt: skip
        self.captures = [*(self.captures or []), row]

    def kv_cache_sized(self, vllm_config: Any) -> None:
        """The KV cache vLLM sized (its blocks and block size), where this process's config holds
        them (the engine core's, with the worker in the same process); left out otherwise."""
        try:
            cache = vllm_config.cache_config
            blocks, size = cache.num_gpu_blocks, cache.block_size
        except Exception:  # noqa: BLE001 - a report must never break the engine
            return
        if type(blocks) is int and type(size) is int and blocks > 0 and size > 0:
            self.kv_cache = {"blocks": blocks, "block_size": size, "tokens": blocks * size}

    def changed(self) -> None:
        """Something a section reports changed: the next flush writes it."""
        self._dirty = True

    def deferred_captured(self, desc: Any) -> None:
        """One deferred graph captured while serving."""
        self.captured[(desc.cg_mode.name, desc.num_active_loras)] += 1
        self._dirty = True

    def to_json(self) -> dict[str, Any]:
        planned = Counter((g.descriptor.cg_mode, g.descriptor.num_active_loras) for g in self.plan.graphs)
        rows = [
            {"cg_mode": m, "lora_case": c, "planned": n, "captured": self.captured.get((m, c), 0)}
            for (m, c), n in sorted(planned.items())
        ]
        total = sum(self.hits.values()) + self.eager
        from capplan.schemas.report import REPORT_FORMAT

        return {
            "plan": self.plan_path,
            "report_format": REPORT_FORMAT,
            "fingerprint": self.plan.fingerprint,
            "pid": os.getpid(),
            "graphs": rows,
            "graphs_planned": len(self.plan.graphs),
            "graphs_captured": sum(self.captured.values()),
            "vllm_would_capture": self.vllm_planned,
            "capture_seconds": round(self.capture_seconds, 3),
            "graph_memory_gib": None if self.graph_memory_bytes is None else round(self.graph_memory_bytes / 2**30, 4),
            "captures": self.captures,
            "vllm_estimate_gib": None
            if self.vllm_estimate_bytes is None
            else round(self.vllm_estimate_bytes / 2**30, 4),
            "kv_cache": self.kv_cache,
            "dispatch": {
                "calls": total,
                "graph_hits": sum(self.hits.values()),
                "eager": self.eager,
                "hits_by_graph": {str(k): v for k, v in sorted(self.hits.items())},
            },
            "profiling_capture": None
            if self.profiling_seconds is None
            else {
                "graphs": sum(self.profiled.values()),
                "by_mode": dict(sorted(self.profiled.items())),
                "seconds": round(self.profiling_seconds, 3),
            },
            "dp": None if self.dp is None else self.dp.to_json(),
            "trace": None if self.recorder is None else self.recorder.to_json(),
            "deferred": None if self.deferred is None else self.deferred.to_json(),
            "identity": self.identity,
            "graph_budget": self.graph_budget,
        }

    def path(self) -> str | None:
        path = os.environ.get("CAPPLAN_REPORT")
        if path:
            path = path.replace("{pid}", str(os.getpid())).replace("{rank}", str(self.dp_rank))
        return path or None

    def write(self) -> None:
        """(Re)write CAPPLAN_REPORT atomically."""
        path = self.path()
        if path is None or self.vllm_planned is None:
            return
        from pathlib import Path

        from capplan.files import write_for_runtime

        problem = None
        if not self._owns(path):
            problem = f"{path}: exists and is not a capplan report (or not a regular file); refusing to replace it"
        else:
            problem = write_for_runtime(Path(path), json.dumps(self.to_json(), indent=2))
        if problem is not None:  # a report must never break the engine
            log.warning("could not write the report: %s", problem)

    def _owns(self, path: str) -> bool:
        """Whether the report may replace `path`: a new file, an empty one, or an earlier report
        (never a file the command reads, such as a model's config.json, and never a FIFO: a
        report must not wait for a reader)."""
        from capplan.files import file_head

        try:
            head = file_head(path, 32)
        except OSError:
            return False
        return not head or head.startswith(b'{\n  "plan": ')

    def finish(self) -> None:
        if self._finished or self.vllm_planned is None:
            return  # this process never built a model graph manager
        self._finished = True
        if self.recorder is not None:
            self.recorder.close()
        from capplan.present.report import render_report

        log.info("%s", render_report(self.to_json()).removeprefix(PREFIX))
        self.write()


class DPCounters:
    """What DP synchronisation did to this rank's steps (one rank's view)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.steps = 0  # sync calls with tokens on some rank
        self.idle = 0  # every rank had zero tokens
        self.own_size = 0  # ran at the size this rank's own batch would have used
        self.padded_to_other = 0  # ran at a larger size set by another rank's batch
        self.extra_tokens = 0  # padded tokens added by other ranks' batches
        self.eager_together = 0  # the ranks agreed on eager (some rank could not use a graph)
        self.forced_eager = 0  # ... although this rank alone would have replayed a graph
        self.audited = 0
        self.disagreements = 0

    def step(self, num_tokens: int, desired: Any, synced: Any, disagreed: bool | None) -> None:
        if disagreed is not None:
            self.audited += 1
            self.disagreements += disagreed
        if synced.num_tokens == 0:
            self.idle += 1
            return
        self.steps += 1
        own = desired.num_tokens if desired.cg_mode.name != "NONE" else num_tokens
        if synced.cg_mode.name == "NONE":
            self.eager_together += 1
            self.forced_eager += desired.cg_mode.name != "NONE"
        elif synced.num_tokens > own:
            self.padded_to_other += 1
            self.extra_tokens += synced.num_tokens - own
        else:
            self.own_size += 1

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "size": self.size,
            "steps": self.steps,
            "idle_steps": self.idle,
            "at_own_size": self.own_size,
            "padded_to_other_rank": self.padded_to_other,
            "extra_tokens_from_other_ranks": self.extra_tokens,
            "eager_together": self.eager_together,
            "forced_eager": self.forced_eager,
            "audited_steps": self.audited,
            "token_disagreements": self.disagreements if self.audited else None,
        }


def deployment_identity(vllm_config: Any) -> dict[str, Any]:
    """The model's shape (its hf_config, read with the keys config.json gives), dtype and name,
    the GPU, vLLM and torch versions, the attention backend, the parallel sizes and the LoRA
    rank, as far as this vLLM's config has them."""
    from capplan.calibration.shape import shape_values

    model = getattr(vllm_config, "model_config", None)
    hf = getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None)
    out: dict[str, Any] = {}
    if hf is not None:
        shape = {k: v for k, v in shape_values(lambda key: getattr(hf, key, None)).items() if k != "dtype"}
        if type(shape.get("num_experts")) is not int:
            shape.pop("num_experts", None)
        shape = {k: v for k, v in shape.items() if type(v) is int and v > 0}
        if "num_layers" in shape and "hidden_size" in shape:  # a shape without them prices nothing
            out["shape"] = shape
    dtype = getattr(model, "dtype", None)
    if dtype is not None and "shape" in out:
        out["shape"]["dtype"] = str(dtype).removeprefix("torch.")
    name = getattr(model, "model", None)
    if isinstance(name, str):
        out["model"] = name
    parallel = getattr(vllm_config, "parallel_config", None)
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        value = getattr(parallel, key, None)
        if type(value) is int:
            out[key] = value
    rank = getattr(getattr(vllm_config, "lora_config", None), "max_lora_rank", None)
    if type(rank) is int:
        out["lora_rank"] = rank
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if backend is not None:
        out["attention_backend"] = str(getattr(backend, "name", backend))
    from importlib.metadata import PackageNotFoundError, version

    for package in ("vllm", "torch"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    torch = sys.modules.get("torch")  # the engine imported it; never imported here
    if torch is not None and torch.cuda.is_available():
        out["gpu"] = str(torch.cuda.get_device_name())
    out.update(host())
    return out


def host() -> dict[str, Any]:
    """The host's CPU model and cores: capture is bound by the host, which records the kernels."""
    out: dict[str, Any] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    if name and name.isprintable():
        out["host_cpu"] = name[:200]
    cores = os.cpu_count()
    if cores:
        out["host_cores"] = cores
    return out


def _captured(manager: Any) -> Counter[tuple[str, int]]:
    """The graphs a capture call left on vLLM's manager, per (mode, LoRA case). FULL graphs are
    objects in manager.graphs; PIECEWISE ones live in the compiled model, so the descriptors
    capture walked through count."""
    out: Counter[tuple[str, int]] = Counter()
    for descs in manager._capture_descs.values():
        for d in descs:
            if d.cg_mode.name == "PIECEWISE" or d in manager.graphs:
                out[(d.cg_mode.name, d.num_active_loras)] += 1
    return out


def _free_memory() -> int | None:
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.mem_get_info()[0])
    except Exception:  # noqa: BLE001 - a report must never break the engine
        return None
    return None
