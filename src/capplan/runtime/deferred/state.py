"""The one state object of deferred capture in a worker process, which its parts share.

`DeferredState` holds the graph sets, the memory estimate, the held block, the ranks' vote,
the vLLM capture call and the start-up capture's arguments; `StartRecord` and `ServingRecord`
what the start and the serving-time captures did, for the report. Start-up
(`deferred.startup`) and serving (`deferred.serving`) act on it; `deferred.section` renders it.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from capplan.errors import EngineRefusal
from capplan.runtime.deferred.estimate import Estimate
from capplan.runtime.deferred.graphs import GraphSets
from capplan.runtime.deferred.held import Hold, TakeBlock
from capplan.runtime.deferred.pauses import Pauses
from capplan.runtime.deferred.ranks import Ranks
from capplan.runtime.deferred.vllm_capture import CaptureOne, VllmCapture
from capplan.runtime.hooking import Call
from capplan.runtime.log import log

if TYPE_CHECKING:
    from capplan.runtime.context import HookContext

RECENT = 8
"""How many of a mode's latest captures the step-pause expectation reads (the slowest of them)."""


@dataclass
class StartRecord:
    """What the captures before the engine was ready did."""

    ready_bytes: list[int] = field(default_factory=list)  # each ready graph's memory, in capture order
    attention_thresholds: list[int] | None = None  # the attention groups' seq_threshold_3D (read once)
    warmed: list[int] = field(default_factory=list)  # deferred graphs made ready for their attention kernels
    profiled: bool = False  # vLLM's profiling pass ran here (0.29.0 on, unless the KV cache size is given)
    profiling_extra: int = 0  # added to vLLM's CUDA-graph memory estimate: the deferred PIECEWISE graphs
    profiled_ids: list[int] = field(default_factory=list)  # deferred graphs captured in the profiling pass
    sampled_ids: list[int] = field(default_factory=list)  # deferred graphs sampled at start (now ready)
    sampled_bytes: list[int] = field(default_factory=list)  # their memory, in capture order
    free_ids: list[int] = field(default_factory=list)  # deferred graphs captured at start taking no memory
    free_bytes: list[int] = field(default_factory=list)  # their memory (the last may be more than none)
    free_seconds: float = 0.0  # what capturing them took


@dataclass
class ServingRecord:
    """What the captures while serving did."""

    step_captures: bool = True  # off with more than one TP or PP rank (set at the ready capture)
    steps: int = 0
    captures: list[dict[str, Any]] = field(default_factory=list)
    landed: list[int] = field(default_factory=list)  # the deferred graphs captured, in order
    deferred_bytes: list[int] = field(default_factory=list)  # each one's memory, in capture order
    longest_step_pause: float = 0.0
    longest_idle_capture: float = 0.0
    left_to_idle: int = 0  # step captures not taken: expected above the step-pause budget
    slow_debt_steps: int = 0  # steps the spacing has still to pass for the slow captures taken (a token bucket)
    recent_seconds: dict[str, deque[float]] = field(default_factory=dict)  # latest captures, per mode ("any": all)


class Seams(TypedDict, total=False):
    """What a check stands in for: vLLM's TP and PP groups (`ranks`), vLLM's capture of one graph
    (`capture_one`), the driver's cudaMalloc (`take_block`) and the operator's pause bounds
    (`pauses`, else read from the environment `capplan apply` set)."""

    ranks: Ranks
    capture_one: CaptureOne
    take_block: TakeBlock
    pauses: Pauses


class DeferredState:
    """Deferred capture in one worker process: what its parts share."""

    def __init__(self, ctx: HookContext, **seams: Unpack[Seams]) -> None:
        plan = ctx.plan
        assert plan.tiers is not None
        self.ctx = ctx
        self.tiers = plan.tiers
        self.graphs = GraphSets(plan)
        self.pauses = seams.get("pauses") or Pauses.from_env(os.environ)
        self.estimate = Estimate()
        self.hold = Hold(seams.get("take_block"))
        self.ranks: Ranks | None = seams.get("ranks")  # None: read from vLLM's graph manager at the first capture
        self.vllm = VllmCapture(ctx)
        self.capture_one: CaptureOne = seams.get("capture_one") or self.vllm
        # DP ranks that pad to one another: whole groups at DP-synced steps, dummy steps counted too
        self.synced = plan.spec.parallel.synced_size > 1
        self.lock = threading.Lock()  # a capture and the async output thread exclude each other
        self.active = False  # set once the ready graphs are captured
        # The start-up capture's, which every deferred capture repeats
        self.manager: Any = None  # vLLM's ModelCudaGraphManager that captured the ready graphs
        self.capture_fn: Any = None  # vLLM's ModelCudaGraphManager.capture
        self.call: Call | None = None  # its arguments, bound by name
        self.block_tables: Any = None  # vLLM's BlockTables, from those arguments
        self.runner: Any = None  # vLLM's model runner, whose LoRA manager warms a deferred LoRA graph
        self.other_processes: int | None = None  # on this GPU as the hold was first taken (None: unknown)
        self.start = StartRecord()
        self.serving = ServingRecord()

    def agreed(self, yes: bool) -> bool:
        """`yes` as the engine's ranks decide it (`Ranks.agreed`). DP ranks that pad to one
        another decide nothing on readings (sampling's `fixed`, and no graph captured at start
        as it takes no memory): answered as given."""
        return yes if self.synced or self.ranks is None else self.ranks.agreed(yes)

    def timed(self, gid: int, seconds: float) -> None:
        for key in (self.graphs.mode(gid), "any"):
            self.serving.recent_seconds.setdefault(key, deque(maxlen=RECENT)).append(seconds)

    def ready_descs(self) -> dict[Any, list[Any]]:
        """vLLM's descriptors of the ready graphs, by mode, in plan order."""
        ready: dict[Any, list[Any]] = {}
        for gid in self.graphs.ready_ids:
            desc = self.ctx.vllm_descs[gid]
            ready.setdefault(desc.cg_mode, []).append(desc)
        return ready

    # -- the held block -------------------------------------------------------------------
    def hold_pending(self, when: str) -> None:
        """Hold one block for the graphs still pending (their estimate), or record that it could
        not be held. At start a shortfall on any rank refuses the start on every rank."""
        import torch

        if not torch.cuda.is_available():  # capplan's CPU checks of the hooks
            return
        if when == "start":
            self.estimate.fix_start_bounds()
        want = self.pending_bound()
        if when == "start":
            memory = self.vllm.memory
            self.shared_gpu(memory.others() if memory is not None else None, want)
        self.take(want, torch.cuda.mem_get_info()[0], when)

    def pending_bound(self) -> int:
        """What the graphs still pending are held."""
        return self.estimate.bound([self.graphs.mode(g) for g in self.graphs.pending])

    def take(self, want: int, free: int, when: str) -> None:
        """Hold `want` bytes of the device's `free`. At start every rank votes on whether it
        holds its own (each reads its own memory), so that all refuse to start together: a rank
        refusing alone would leave the others waiting in their next collective. While serving, a
        block not held again is recorded (`Hold.shortfall`), not refused."""
        held = self.hold.take(want, free)
        if when == "start" and not self.agreed(held):
            self.hold.release()
            short = (
                f"not enough GPU memory left to hold back {want / 2**30:.2f} GiB for its "
                f"{len(self.graphs.pending)} deferred graphs"
                if not held
                else "another rank of this engine has not enough GPU memory left to hold back for its deferred graphs"
            )
            raise EngineRefusal(
                f"capplan: {self.ctx.plan_path}: {short}; refusing to start (lower "
                "--gpu-memory-utilization, or make more graphs ready in the spec's tiers)"
            ) from None
        if not held:
            self.hold.shortfall = True
            return
        self.hold.kept(want)

    def shared_gpu(self, others: int | None, want: int) -> None:
        """Record how many other processes share the GPU as the hold is first taken, and where a
        capture before it was read by the device's memory, say so unless NVML shows this process
        alone: that reading moves with what other processes allocate and free, so the hold is
        then an estimate, not a bound (vLLM's own memory profiling has the same limit). Read by
        this process's own memory, it is not. Captures read by the device later, while serving,
        are counted in the report (`memory_readings`), not said."""
        self.other_processes = others
        by_device = self.vllm.readings["device"]
        if others != 0 and want > 0 and by_device:
            who = (
                f"{others} other process(es) hold memory on this GPU"
                if others
                else "NVML cannot say whether other processes hold memory on this GPU"
            )
            log.warning(
                "%s, and %d capture(s) could not be read by this process's own memory: their readings include "
                "what other processes allocate and free meanwhile, so the %.2f GiB held for the deferred graphs "
                "is an estimate, not a bound (run the engine alone on its GPU for one)",
                who,
                by_device,
                want / 2**30,
            )
