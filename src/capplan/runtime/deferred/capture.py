"""Deferred capture on Model Runner V2: the plan's ready graphs before the engine reports
ready, the deferred ones one at a time while it serves (spec `tiers`).

What makes it safe, and where each piece lives:

- Only captured graphs are ever dispatched. The dispatch hook replays, for a batch whose
  graph is not captured yet, the first captured graph of its chain (`planner.tiers`),
  which `capplan verify` proves replays the batch, LoRA grid included, in every state.
- Capture happens between model-runner steps, never inside one: as a step starts, before
  its inputs are prepared, one graph before every `every_steps`-th step; and while the
  engine core is idle (no work, no step in its batch queue, not asleep), one graph per idle
  turn, through `collective_rpc`, so every worker captures in the same order. The previous
  step's GPU work is ordered before the capture by the capture stream's wait on the
  current stream and the device synchronization of `torch.cuda.graph` (and capplan's own
  after each capture).
- vLLM captures with CUDA's global capture mode, under which another thread's CUDA calls
  fail. The only other thread of a worker that touches CUDA while serving is the async
  output thread (`AsyncOutput.get_output` waits on its copy event); it and a capture
  exclude each other through one lock.
- The LoRA mapping a capture warms with is set on the punica wrapper alone, with no adapter
  loaded or evicted, and the next step sets its own (its last mapping is forgotten).
- Memory: MRV2 allocates the KV cache before any capture, so no capture can take it. After
  the ready capture, an estimate of what the deferred graphs need (the ready capture's
  memory per graph, times the deferred count) is allocated as one block and held; a start
  without that much left stops there. Each deferred capture gives the block back, and the
  estimate for the graphs still pending is held again after it (`reserve_shortfall` in the
  report when that failed). The estimate is an estimate: the report shows it beside the
  memory the captures took.
- One capture stream: vLLM's `graph_capture` makes a new stream per call, and the caching
  allocator keeps blocks per stream, so every deferred capture would open a new segment of
  the graph pool (34 MiB each on a 2-layer model); every capture runs on one stream.

Refused where it cannot be made safe: data parallel (ranks pad to one graph, so they would
have to agree on which exist at every step), speculative decoding (vLLM captures the
drafter's graphs with the model's), tensor or pipeline parallel (not run yet), and vLLM
releases whose model runner this was not built for (`releases.Release.deferred_capture`).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from capplan.errors import EngineRefusal
from capplan.planner.tiers import replayed
from capplan.runtime.hooking import Call, Hook, PlanNotInForce, check_attributes
from capplan.runtime.hooks.lora import dummy_mapping, layout_for
from capplan.schemas.plan import address

if TYPE_CHECKING:
    from capplan.runtime.context import Engine

DUMMY_TABLES_HOOK = Hook(
    "deferred.dummy_tables",
    "vllm.v1.worker.gpu.block_table:BlockTables.get_dummy_block_tables",
    "the dummy rows are zeroed first (the null block, as at start-up), so a warm-up never reads or updates "
    "a live request's blocks or state",
    attributes=("input_block_tables",),
)


class DeferredCapture:
    """The deferred-capture state of one worker process, and its captures."""

    def __init__(self, engine: Engine) -> None:
        plan = engine.plan
        assert plan.tiers is not None
        self.engine = engine
        self.tiers = plan.tiers
        self.pending: list[int] = list(plan.tiers.deferred)
        self.captured: set[int] = set(range(len(plan.graphs))) - set(self.pending)
        self.ready_ids = sorted(self.captured)
        self.lock = threading.Lock()
        self.active = False  # set once the ready graphs are captured
        self.manager: Any = None  # vLLM's ModelCudaGraphManager that captured the ready graphs
        self.capture_fn: Any = None  # vLLM's ModelCudaGraphManager.capture
        self.call: Call | None = None  # the start-up capture's arguments, bound by name
        self.runner: Any = None
        self.block_tables: Any = None  # vLLM's BlockTables, from the start-up capture's arguments
        self.reserve: Any = None  # one held block: the estimate for the graphs still pending
        self.reserve_bytes = 0  # the estimate for every deferred graph, held at start
        self.per_graph_bytes = 0
        self.reserve_shortfall = False  # a capture took more than its share: less could be held again
        self.steps = 0
        self.fallback_steps = 0
        self.captures: list[dict[str, Any]] = []
        self.memory_bytes = 0
        self.longest_step_pause = 0.0
        self.longest_idle_capture = 0.0

    # -- dispatch -------------------------------------------------------------------------
    def resolve(self, graph_id: int) -> int:
        """The graph a batch dispatched to `graph_id` replays now (-1: eager)."""
        if graph_id in self.captured:
            return graph_id
        self.fallback_steps += 1
        return replayed(self.tiers, graph_id, self.captured)

    # -- start-up -------------------------------------------------------------------------
    def ready_only(self, manager: Any) -> None:
        """Before the start-up capture: the manager's capture list becomes the ready graphs."""
        if manager.tp_size > 1 or not (manager.is_first_pp_rank and manager.is_last_pp_rank):
            raise PlanNotInForce(
                f"capplan: {self.engine.plan_path} defers graphs (spec tiers), which capplan does not do under "
                "tensor or pipeline parallelism yet; refusing before any graph is captured (remove tiers from "
                "the spec and recompile)"
            )
        ready: dict[Any, list[Any]] = {}
        for gid in self.ready_ids:  # plan order: PIECEWISE then FULL, largest first
            desc = self.engine.vllm_descs[gid]
            ready.setdefault(desc.cg_mode, []).append(desc)
        manager._capture_descs = ready

    def started(self, manager: Any, capture_fn: Any, call: Call, ready_bytes: int | None) -> None:
        """The ready graphs are captured: keep what a later capture needs, hold back its memory."""
        self.manager, self.capture_fn, self.call = manager, capture_fn, call.copy()
        self.block_tables = call["block_tables"]
        check_attributes(DUMMY_TABLES_HOOK, self.block_tables)
        if self.pending and ready_bytes:
            import torch

            self.per_graph_bytes = -(-ready_bytes // max(len(self.ready_ids), 1))
            self.reserve_bytes = self.per_graph_bytes * len(self.pending)
            try:
                self.reserve = torch.empty(self.reserve_bytes, dtype=torch.uint8, device=manager.device)
            except torch.OutOfMemoryError:
                self.reserve = None
                raise EngineRefusal(
                    f"capplan: {self.engine.plan_path}: not enough GPU memory left to hold back "
                    f"{self.reserve_bytes / 2**30:.2f} GiB for its {len(self.pending)} deferred graphs; refusing "
                    "to start (lower --gpu-memory-utilization, or make more graphs ready in the spec's tiers)"
                ) from None
        self.active = True
        print(
            f"capplan: {len(self.ready_ids)} ready graphs captured; {len(self.pending)} deferred graphs will be "
            f"captured while serving (one every {self.tiers.every_steps} steps, and one after another while idle)",
            file=sys.stderr,
        )

    # -- capture --------------------------------------------------------------------------
    def before_step(self, runner: Any) -> None:
        """Called as a real model-runner step starts: capture one deferred graph before every
        every_steps-th step, between steps only."""
        if not self.pending or not self.active:
            return
        self.runner = runner
        if runner.execute_model_state is not None:
            return  # a step's sampling is still pending: not between steps
        self.steps += 1
        if self.steps % self.tiers.every_steps == 0:
            seconds = self.capture_next("step")
            self.longest_step_pause = max(self.longest_step_pause, seconds)

    def capture_idle(self) -> int:
        """One deferred capture while the engine core is idle (no step in flight: its batch queue
        is empty); the graphs still pending, 0 when this process defers none."""
        if self.pending and self.active:
            seconds = self.capture_next("idle")
            self.longest_idle_capture = max(self.longest_idle_capture, seconds)
        return len(self.pending) if self.active else 0

    def capture_next(self, trigger: str) -> float:
        """Capture the next deferred graph (plan order); its seconds."""
        import torch
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed

        cuda = torch.cuda.is_available()  # False only in capplan's CPU checks of the hooks
        engine = self.engine
        gid = self.pending[0]
        desc = engine.vllm_descs[gid]
        manager = self.manager
        assert self.call is not None
        with self.lock, gpu_sync_allowed():
            started = time.perf_counter()
            # The warm-up pass really runs: its dummy block-table rows are the persistent ones,
            # which hold the last batch's blocks. Zeroed they point at the null block, as at
            # start-up, so no live request's blocks (or a hybrid model's state) are touched.
            for table in self.block_tables.input_block_tables:
                table.zero_()
            if self.reserve is not None:  # the held block goes back to the driver for this capture
                self.reserve = None
                torch.cuda.empty_cache()
            free0 = torch.cuda.mem_get_info()[0] if cuda else 0
            kept = manager._capture_descs
            manager._capture_descs = {desc.cg_mode: [desc]}
            call = self.call.copy()
            if call["lora_capture_hook"] is not None:
                call["lora_capture_hook"] = self._lora_hook()
            try:
                call.run(self.capture_fn)
            except Exception as exc:
                raise RuntimeError(
                    f"capplan: deferred capture of graph {address(engine.plan.graphs[gid].descriptor)} failed "
                    f"({type(exc).__name__}: {exc}); the engine stops rather than serve from a graph pool in an "
                    "unknown state"
                ) from exc
            finally:
                manager._capture_descs = kept
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            used = free0 - torch.cuda.mem_get_info()[0] if cuda else 0
            # Hold the estimate for the graphs still pending again. One block, not one per graph:
            # blocks under 10 MiB share the caching allocator's 20 MiB segments, so freeing one
            # would give nothing back (seen: 389 blocks of 7.3 MiB held 3.9 GiB).
            left = self.per_graph_bytes * (len(self.pending) - 1)
            if cuda and left > 0:
                try:
                    self.reserve = torch.empty(left, dtype=torch.uint8, device=manager.device)
                except torch.OutOfMemoryError:
                    self.reserve_shortfall = True
        self.pending.pop(0)
        self.captured.add(gid)
        self.memory_bytes += max(used, 0)
        self.captures.append(
            {
                "graph": address(engine.plan.graphs[gid].descriptor),
                "seconds": round(seconds, 4),
                "trigger": trigger,
                "memory_mib": round(used / 2**20, 2),
            }
        )
        engine.report.deferred_captured(desc)
        if not self.pending:
            print(
                f"capplan: all {len(self.captures)} deferred graphs captured "
                f"({sum(c['seconds'] for c in self.captures):.2f} s in all, longest step pause "
                f"{self.longest_step_pause * 1000:.0f} ms)",
                file=sys.stderr,
            )
        return seconds

    def _lora_hook(self) -> Any:
        """Warm a LoRA graph with the plan's dummy mapping set on the punica wrapper only:
        no adapter is loaded, activated or evicted. The wrapper maps adapter ids to slots
        through lora_index_to_id; for the capture it reads slot i as adapter i + 1 (the
        plan's dummy ids are 1..max_loras), and the next step maps its own batch again."""
        from vllm.lora.layers import LoRAMapping

        engine = self.engine
        manager = self.runner.lora_manager._adapter_manager

        def hook(num_active_loras: int, num_reqs: int, num_tokens: int) -> None:
            prompt, token = dummy_mapping(layout_for(engine, num_active_loras, num_reqs, num_tokens), num_reqs)
            live = manager.lora_index_to_id
            manager.lora_index_to_id = list(range(1, len(live) + 1))
            try:
                manager._set_adapter_mapping(LoRAMapping(tuple(token), tuple(prompt), is_prefill=True))
            finally:
                manager.lora_index_to_id = live
                manager._last_mapping = None  # the next step sets its batch's mapping again

        return hook

    def to_json(self) -> dict[str, Any]:
        return {
            "ready": len(self.ready_ids),
            "deferred": len(self.tiers.deferred),
            "captured": len(self.captures),
            "pending": [address(self.engine.plan.graphs[g].descriptor) for g in self.pending],
            "every_steps": self.tiers.every_steps,
            "steps_seen": self.steps,
            "fallback_steps": self.fallback_steps,
            "longest_step_pause_seconds": round(self.longest_step_pause, 4),
            "longest_idle_capture_seconds": round(self.longest_idle_capture, 4),
            "capture_seconds": round(sum(c["seconds"] for c in self.captures), 3),
            "reserved_gib": round(self.reserve_bytes / 2**30, 4),
            "reserve_shortfall": self.reserve_shortfall,
            "graph_memory_gib": round(self.memory_bytes / 2**30, 4),
            "captures": self.captures,
        }
