"""Deferred capture on Model Runner V2: the plan's ready graphs before the engine reports
ready, the deferred ones one at a time while it serves (spec `tiers`).

What makes it safe, and where each piece lives:

- Only captured graphs are ever dispatched. The dispatch hook replays, for a batch whose
  graph is not captured yet, the first captured graph of its chain (`planner.tiers`),
  which `capplan verify` proves replays the batch, LoRA grid included, in every state.
- Capture happens between model-runner steps, never inside one: as a step starts, before
  its inputs are prepared, one graph before every `every_steps`-th step, when it is expected
  to take at most `STEP_PAUSE_BUDGET_S` (else it waits for an idle turn); and while the
  engine core is idle (no work, no step in its batch queue, not asleep), one graph per idle
  turn, through `collective_rpc`, so every worker captures in the same order. The previous
  step's GPU work is ordered before the capture by the capture stream's wait on the
  current stream and the device synchronization of `torch.cuda.graph` (and capplan's own
  after each capture).
- Tensor and pipeline parallel: every rank must capture the same graph at the same moment
  (a TP capture runs the model's all-reduces, and vLLM's `graph_capture` registers the
  custom all-reduce's graph buffers across the group as it exits), and every rank must
  replay the same graph for a step. A step capture decided on a rank-local time could
  differ between ranks, so with more than one rank in the TP or PP group no step captures:
  every deferred graph is captured on the engine core's idle turns, where one
  `collective_rpc` reaches every worker at the same point of the step sequence (vLLM's
  executor broadcasts steps and calls in one order), and every rank's captured set, hence
  every dispatch, is the same after each.
- Data parallel where the ranks pad to one another (an MoE model's): capturing a graph runs
  the expert all-to-all across every DP rank, and each rank replays, for the DP-agreed batch,
  the graph its own LoRA count dispatches to. So the ranks capture in lockstep at DP-synced
  steps: every model-runner step (a DP rank with no work runs vLLM's dummy batch, through the
  same `execute_model`) counts on every rank alike, and before every `every_steps`-th one each
  rank captures the next group of graphs, every LoRA case of one size and shape
  (`planner.tiers.case_groups`; the ready set is closed the same way), on no rank-local
  time. With every case of a size captured or none, every rank's fallback for the agreed batch
  is a graph of one size. No idle captures there: each DP rank's engine core idles on its own.
- vLLM captures with CUDA's global capture mode, under which another thread's CUDA calls
  fail. The only other thread of a worker that touches CUDA while serving is the async
  output thread (`AsyncOutput.get_output` waits on its copy event); it and a capture
  exclude each other through one lock.
- The LoRA mapping a capture warms with is set on the punica wrapper alone, with no adapter
  loaded or evicted, and the next step sets its own (its last mapping is forgotten).
- Memory: MRV2 allocates the KV cache before any capture, so no capture can take it (from
  0.29.0 vLLM's memory profiling sizes it with the whole plan's graphs, which it captures on a
  throwaway pool before the ready capture). What the deferred graphs are held is measured, per
  mode (PIECEWISE, FULL): captures that each measure one graph's memory (each in a call of its
  own), `per_graph_bound` of them, times the graphs of that mode pending. The measured
  captures are one pass made before the engine is ready: the ready graphs and a spread sample
  of the deferred ones (`sample_deferred`; none at the start-up capture of DP ranks that pad
  to one another). From 0.29.0 that pass is vLLM's profiling pass, made in a process that has
  captured nothing yet (the ready captures after it read near nothing, and are not readings);
  before 0.29.0, or with the KV cache's size given, it is the start-up capture, and the
  sampled deferred graphs stay captured (they become ready graphs: nothing is captured twice).
  After a profiling pass the start-up capture goes on, past the ready graphs, with the
  deferred graphs in plan order up to the first that takes memory (`_free_at_start`; not for
  DP ranks that pad to one another): the profiling pass leaves the process memory its
  discarded graphs held, which the next captures take first, and a hold for graphs that take
  it would hold memory for nothing. With several TP or PP ranks each rank reads its own
  memory, and every decision a reading feeds (another round of samples, another graph at
  start) is every rank's at once (`agreed`: an all-reduce over the groups' CPU side), so the
  ranks capture the same graphs. A mode is held by its deferred graphs' readings once it has
  `SAMPLES_MIN`, by the ready ones' with them before that. Each mode's first capture is left
  out: it allocates the pool's base. The bound is held as one block; a start without that much
  left stops there. Each deferred capture gives the block back and joins its mode's readings,
  and the bound is held again for the graphs still pending (`reserve_shortfall` in the report
  when it could not be). The report shows the most held beside what the deferred captures
  took. A capture's memory is read from this process's own device memory (`device_memory`), so
  other processes on the GPU do not enter it.
- One capture stream: vLLM's `graph_capture` makes a new stream per call, and the caching
  allocator keeps blocks per stream, so every deferred capture would open a new segment of
  the graph pool (34 MiB each on a 2-layer model); every capture runs on one stream.

Refused where it cannot be made safe: speculative decoding (vLLM captures the drafter's
graphs with the model's), and DP ranks that pad to one another under pipeline parallelism.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from capplan.errors import EngineRefusal
from capplan.planner.tiers import attention_warm, case_groups, replayed
from capplan.releases import CUDART
from capplan.runtime.deferred.device_memory import ProcessMemory, growth, in_use, open_for_current_device
from capplan.runtime.hooking import Call, Hook, check_attributes
from capplan.runtime.hooks.lora import dummy_mapping, layout_for
from capplan.schemas.plan import address

if TYPE_CHECKING:
    from capplan.runtime.context import Engine

STEP_PAUSE_BUDGET_S = 0.05
"""The longest a step may wait on a deferred capture. A capture expected to take longer (one of
the last `RECENT` captures of its mode took longer) is left to the engine's idle turns. On the
H200 a capture of the 16-layer 0.9B model took 40-120 ms whatever its size (median 68 ms), of
the 2-layer model 5-20 ms. Rank-local, so only a single-rank engine captures on step turns."""
RECENT = 8
"""How many of a mode's latest captures the step-pause expectation reads (the slowest of them)."""
SAMPLES_MIN = 24
"""How many deferred graphs of each mode are captured before the engine is ready, at the least,
as samples of what the deferred graphs take (all of them where a mode has fewer; at the start-up
capture at most half, and none for DP ranks that pad to one another; see `capture_ready`), and
the size of each round of samples. Every rank of an engine captures the same ones; each costs
one capture before the engine is ready (40-120 ms on the H200 for a 0.9B model, 5-20 ms for a
2-layer one)."""
SAMPLES_MAX = 128
"""The most deferred graphs of one mode sampled by their spread (see `sampled_enough`), and the most
the start-up capture takes after a profiling pass as they take no memory (`_free_at_start`)."""
SAMPLE_SPREAD = 10
"""A mode is sampled until its largest reading is at most 1/SAMPLE_SPREAD of their total (with
several TP or PP ranks, on every rank: `agreed`; not by DP ranks that pad to one another), so
that the bound (`per_graph_bound`: the total plus the largest, over the count) is at most 1.1
times the readings' mean. Memory moves in 2 MiB steps on the H200, so graphs that take less than
a step each need many readings: a 2-layer model's FULL graphs took 0.19 MiB on average, and 19
readings held them at 0.42 MiB each."""

RANKS_HOOKS = tuple(
    Hook(
        f"deferred.ranks_{group}",
        f"vllm.distributed.parallel_state:get_{group}_group",
        "an engine of several TP or PP ranks decides what it captures before it is ready on every rank's "
        "memory readings at once (an all-reduce over the group's CPU side), so no rank captures apart",
        attributes=("cpu_group", "world_size"),
    )
    for group in ("tp", "pp")
)

DUMMY_TABLES_HOOK = Hook(
    "deferred.dummy_tables",
    "vllm.v1.worker.gpu.block_table:BlockTables.get_dummy_block_tables",
    "the dummy rows are zeroed first (the null block, as at start-up), so a warm-up never reads or updates "
    "a live request's blocks or state",
    attributes=("input_block_tables",),
)

HELD_BLOCK_HOOK = Hook(
    "deferred.held_block",
    f"{CUDART}.cudaMalloc",
    "the memory held for the deferred graphs is device memory outside PyTorch's caching allocator, given "
    "back to the driver for each capture without emptying the serving steps' cached blocks",
    attributes=("lib",),  # the runtime library, whose last error a refused cudaMalloc leaves set
)


def _one_rank(manager: Any) -> bool:
    """Whether vLLM's graph manager is the engine's only rank of its TP and PP groups."""
    return bool(manager.tp_size == 1 and manager.is_first_pp_rank and manager.is_last_pp_rank)


def per_graph_bound(sizes: Sequence[int]) -> int:
    """What each of many more graphs of one mode is held: the measured captures' total plus the
    largest single one, over their count (memory given back counts as none; 0 with none). A
    capture's memory moves in whole allocation granules (on the H200: 0, 2, 4 or 6 MiB for one
    graph of a 0.9B model, 2.3-2.6 MiB on average), so one graph's reading says little but a run
    of them sums to within one granule of what they took: the largest reading covers that
    granule. An upper confidence limit from the readings' spread is looser for such readings (they
    are not independent: a graph that opens a granule leaves room for the next ones)."""
    use = [max(size, 0) for size in sizes]
    if not use:
        return 0
    return int(math.ceil((sum(use) + max(use)) / len(use)))


def spread_sample(ids: Sequence[int], k: int) -> list[int]:
    """`k` of `ids` (all of them where there are no more), evenly spaced over them, in order."""
    if len(ids) <= k:
        return list(ids)
    return [ids[(i * len(ids)) // k] for i in range(k)]


def sampled_enough(sizes: Sequence[int], fixed: bool) -> bool:
    """Whether a mode's readings so far are enough to hold its deferred graphs: `SAMPLES_MIN` of
    them; unless `fixed`, also the largest at most 1/`SAMPLE_SPREAD` of their total (all of them
    none counts as that), up to `SAMPLES_MAX`. `fixed` (DP ranks that pad to one another, whose
    readings no collective of capplan's joins): `SAMPLES_MIN`, whatever they read."""
    if len(sizes) < SAMPLES_MIN:
        return False
    if fixed or len(sizes) >= SAMPLES_MAX:
        return True
    use = [max(size, 0) for size in sizes]
    return max(use) * SAMPLE_SPREAD <= sum(use)


class HeldBlock:
    """Device memory held for the deferred graphs, outside PyTorch's caching allocator
    (vLLM's `CudaRTLibrary`: cudaMalloc, cudaFree). Given back, it goes straight to the
    driver, where the graph pool can take it. Held as a PyTorch tensor it could be given
    back only through `torch.cuda.empty_cache()`, which also hands back every cached block
    of the serving steps, which the steps after it then take from the driver again (a
    cudaMalloc in a step). On the H200 the deferred graphs' memory measured the same either
    way (718 MiB for a 0.9B model's 374)."""

    def __init__(self, library: Any, pointer: Any, size: int) -> None:
        self.library, self.pointer, self.size = library, pointer, size

    @classmethod
    def take(cls, size: int, free: int, library: Any = None) -> HeldBlock | None:
        """`size` bytes of device memory, or None where `free` (the device's free bytes now)
        is less or the driver refuses; a refusal leaves no CUDA error behind (PyTorch reads
        the runtime's last error after each kernel launch)."""
        if size > free:
            return None
        if library is None:
            from vllm.distributed.device_communicators.cuda_wrapper import CudaRTLibrary

            library = CudaRTLibrary()
            check_attributes(HELD_BLOCK_HOOK, library)
        try:
            return cls(library, library.cudaMalloc(size), size)
        except RuntimeError:
            library.lib.cudaGetLastError()  # cudaErrorMemoryAllocation, cleared
            return None

    def give_back(self) -> None:
        self.library.cudaFree(self.pointer)


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
        self.reserve: HeldBlock | None = None  # the estimate for the graphs still pending
        self.held_bytes = 0  # its size now
        self.held_peak_bytes = 0  # the most ever held (at start, unless a capture raised the estimate)
        self.reserve_shortfall = False  # the estimate could not be held again while serving
        self.other_processes: int | None = None  # on this GPU as the hold was first taken (None: unknown)
        self.memory: ProcessMemory | None = None  # NVML's view of this process's memory (None: the device's)
        self.memory_opened = False
        self.readings = {"process": 0, "device": 0}  # captures measured by this process's memory, by the device's
        self.ready_bytes: list[int] = []  # each ready graph's memory, in capture order
        self.deferred_bytes: list[int] = []  # each deferred graph's, in capture order
        self.landed: list[int] = []  # the deferred graphs captured, in order
        self.profiling_extra = 0  # added to vLLM's CUDA-graph memory estimate: the deferred PIECEWISE graphs
        # What one more graph of a mode takes, measured by captures that allocate no pool base: of
        # deferred graphs (sampled before the engine is ready, then each one landed), and of ready
        # ones (the sampled pass's: vLLM's profiling captures on 0.29.0 on, else the ready capture;
        # vLLM's own FULL sample, its largest FULL graphs whether deferred or not, counts as ready)
        self.samples: dict[str, list[int]] = {}
        self.ready_readings: dict[str, list[int]] = {}
        self.firsts: dict[str, int] = {}  # each mode's first capture of the sampled pass (the pool's base)
        self.profiled = False  # vLLM's profiling pass ran here (0.29.0 on, unless the KV cache size is given)
        self.profiled_ids: list[int] = []  # deferred graphs captured in vLLM's profiling pass, as samples
        self.sampled_ids: list[int] = []  # deferred graphs captured at the start-up capture, as samples (now ready)
        self.sampled_bytes: list[int] = []  # their memory, in capture order
        self.free_ids: list[int] = []  # deferred graphs captured at start as they took no memory (now ready)
        self.free_bytes: list[int] = []  # their memory, in capture order (the last may be more than none)
        self.free_seconds = 0.0  # what capturing them took
        self.start_per_graph: dict[str, int] = {}  # the per-graph bound of each mode the start held
        self.start_readings: dict[str, list[int]] = {}  # the readings it rested on
        self.recent_seconds: dict[str, deque[float]] = {}  # the latest captures' seconds, per mode ("any": all)
        self.left_to_idle = 0  # step captures not taken: expected above STEP_PAUSE_BUDGET_S
        self.step_captures = True  # off with more than one TP or PP rank (set at the ready capture)
        self.one_rank = True  # the engine's only TP and PP rank (set at its first capture: `warm_attention`)
        # DP ranks that pad to one another: whole groups at DP-synced steps, dummy steps counted too
        self.synced = plan.spec.parallel.synced_size > 1
        self.group_of = {g: group for group in case_groups(plan.graphs, self.pending) for g in group}
        self.steps = 0
        self.fallback_steps = 0
        self.captures: list[dict[str, Any]] = []
        self.longest_step_pause = 0.0
        self.longest_idle_capture = 0.0
        self.last_gpu_wait = 0.0  # of the last capture's seconds, those spent waiting for the GPU's queued work
        self.attention_thresholds: list[int] | None = None  # the attention groups' seq_threshold_3D (read once)
        self.warmed: list[int] = []  # deferred graphs made ready for the attention kernels they compile

    # -- dispatch -------------------------------------------------------------------------
    def resolve(self, graph_id: int) -> int:
        """The graph a batch dispatched to `graph_id` replays now (-1: eager)."""
        if graph_id in self.captured:
            return graph_id
        self.fallback_steps += 1
        return replayed(self.tiers, graph_id, self.captured)

    # -- start-up -------------------------------------------------------------------------
    def warm_attention(self, call: Call) -> None:
        """As the first capture starts (vLLM's profiling pass, else the start-up capture; the
        capture hook calls it, later calls change nothing): read the
        attention groups' kernel switch (`planner.tiers.attention_warm`) from the builders the
        capture is given, and make ready the deferred graphs that would be the first to compile
        an attention kernel (with DP ranks that pad to one another, every LoRA case of their
        sizes, as the planner closes the ready set). A rank reads its own layers' builders (a
        pipeline stage may hold no attention layer), so the ranks join what they read (`joined`)
        and every rank makes the same graphs ready: their pending lists, which every later vote
        and capture walks, stay one list."""
        if self.attention_thresholds is not None:
            return
        self.one_rank = _one_rank(call["self"])
        builders = [b for groups in call["attn_groups"] for group in groups for b in group.metadata_builders]
        self.attention_thresholds = self.joined(
            {t for b in builders if type(t := getattr(b, "seq_threshold_3D", None)) is int}
        )
        graphs = self.engine.plan.graphs
        extra = attention_warm(
            graphs, set(self.ready_ids), self.engine.plan.spec.scheduler.max_num_seqs, self.attention_thresholds
        )
        if self.synced:
            extra = {g for gid in extra for g in self.group_of[gid]}
        extra &= set(self.pending)
        if not extra:
            return
        self.warmed = sorted(extra)
        self.pending = [g for g in self.pending if g not in extra]
        self.captured |= extra
        self.ready_ids = sorted(self.captured)
        print(
            f"capplan: {len(extra)} deferred graphs made ready, the first of their attention kernels "
            f"(seq_threshold_3D {self.attention_thresholds}): "
            + ", ".join(address(graphs[g].descriptor) for g in self.warmed),
            file=sys.stderr,
        )

    def ready_only(self, manager: Any) -> None:
        """Before the start-up capture: the manager's capture list becomes the ready graphs."""
        # More than one rank: every capture on the idle turns, which reach every rank at once.
        self.step_captures = self.one_rank
        manager._capture_descs = self._ready_descs()

    def _ready_descs(self) -> dict[Any, list[Any]]:
        """vLLM's descriptors of the ready graphs, by mode, in plan order (PIECEWISE then FULL,
        largest first)."""
        ready: dict[Any, list[Any]] = {}
        for gid in self.ready_ids:
            desc = self.engine.vllm_descs[gid]
            ready.setdefault(desc.cg_mode, []).append(desc)
        return ready

    def agreed(self, yes: bool) -> bool:
        """`yes` as the engine's ranks decide it: a single rank's own answer; with several TP or
        PP ranks, yes only where every one of them says yes (an all-reduce over the TP group's
        and the PP group's CPU side, which every rank reaches at the same point of the capture
        before the engine is ready). A capture runs the ranks' collectives, so what one rank
        reads of its memory must never make it capture apart from the others. Every rank votes
        over the same deferred graphs (the plan's, less those made ready for the attention
        kernels, which the ranks choose together: `joined`), as its idle captures already rely
        on. DP ranks that pad to one another decide nothing on readings (`sampled_enough`'s
        `fixed`, and no `_free_at_start`): answered as given."""
        if self.one_rank or self.synced:
            return yes
        import torch
        import torch.distributed as dist

        vote = torch.tensor([int(yes)], dtype=torch.int32)
        for group in self.rank_groups():
            dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=group)
        return bool(vote.item())

    def joined(self, values: set[int]) -> list[int]:
        """`values` joined with every TP and PP rank's, sorted (an all-gather over the groups'
        CPU side, which every rank reaches at its first capture); a single rank's own."""
        if self.one_rank:
            return sorted(values)
        import torch.distributed as dist

        for group in self.rank_groups():
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, sorted(values), group=group)
            values = {v for got in gathered for v in got}
        return sorted(values)

    def rank_groups(self) -> list[Any]:
        """The process groups (CPU side) of this engine's ranks: vLLM's TP and PP groups of
        more than one rank."""
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        groups = [get_tp_group(), get_pp_group()]  # RANKS_HOOKS' order
        for hook, group in zip(RANKS_HOOKS, groups):
            check_attributes(hook, group)
        return [group.cpu_group for group in groups if group.world_size > 1]

    def sample_deferred(self, mode: str, candidates: Sequence[int], capture: Any, most: int | None = None) -> list[int]:
        """Capture deferred graphs of `mode` from `candidates` (in plan order), each measured
        (`capture(gid)` gives its memory), in rounds of `SAMPLES_MIN` evenly spaced over those
        not sampled yet, until the mode's readings are enough (`sampled_enough`, as every rank
        decides it: `agreed`), or `most` are taken; the graphs captured. Each round is captured
        in plan order, largest first, as the deferred graphs land while serving: a graph
        captured after a larger one of its mode may reuse what the larger one's capture freed in
        the pool, one captured after a smaller one may need more."""
        limit = len(candidates) if most is None else most
        left, taken = list(candidates), list[int]()
        while left and len(taken) < limit and not self.agreed(sampled_enough(self.samples.get(mode, []), self.synced)):
            room = min(SAMPLES_MIN, limit - len(taken), SAMPLES_MAX - len(self.samples.get(mode, [])))
            for gid in spread_sample(left, room):
                self._sample(mode, capture(gid), deferred=True)
                taken.append(gid)
            sampled = set(taken)
            left = [g for g in left if g not in sampled]
        return taken

    def profile_ready(self, manager: Any, capture_fn: Any, call: Call) -> Any:
        """vLLM's memory-profiling capture (0.29.0 on, a throwaway manager and pool, before the
        KV cache is sized, in a process that has captured nothing yet): each graph in a call of
        its own, measured, in vLLM's order (PIECEWISE, then FULL): the ready PIECEWISE graphs,
        a sample of the deferred PIECEWISE ones (`sample_deferred`), vLLM's own sample of the
        plan's FULL graphs (its first `_max_full_descs_to_capture`), a sample of the other
        deferred FULL ones. These measurements, each mode's first left out (it allocates the
        pool's base), are what the deferred graphs are held at start (`hold_readings`: the
        deferred samples alone where a mode has `SAMPLES_MIN` of them). The manager's list is
        left as the PIECEWISE graphs captured and every FULL one, so vLLM's extrapolation of
        FULL memory counts the deferred FULL graphs (every FULL graph captured here adds its
        reading to vLLM's samples, which vLLM takes out of its measure again); what the
        deferred PIECEWISE graphs not captured here are held (`per_graph_bound`, times their
        count) is `profiling_extra`, which capplan adds to vLLM's estimate. The KV cache is
        then sized for the whole plan, with only the ready graphs captured."""
        graphs = self.engine.plan.graphs
        mode_of = {g: graphs[g].descriptor.cg_mode for g in range(len(graphs))}
        all_full = [g for g in range(len(graphs)) if mode_of[g] == "FULL"]
        vllm_sample = all_full[: getattr(manager, "_max_full_descs_to_capture", None) or len(all_full)]
        deferred_of = {m: [g for g in self.pending if mode_of[g] == m] for m in ("PIECEWISE", "FULL")}
        last: list[Any] = [None]

        def capture(gid: int) -> int:
            last[0], _, used = self._capture_one(gid, call.copy(), manager, capture_fn)
            return used

        for gid in [g for g in self.ready_ids if mode_of[g] == "PIECEWISE"]:
            self._sample("PIECEWISE", capture(gid), deferred=False)
        extra_pw = self.sample_deferred("PIECEWISE", deferred_of["PIECEWISE"], capture)
        for gid in vllm_sample:
            self._sample("FULL", capture(gid), deferred=False)
        full_candidates = [g for g in deferred_of["FULL"] if g not in vllm_sample]
        extra_full = self.sample_deferred("FULL", full_candidates, capture)
        self.profiled_ids = [*extra_pw, *extra_full]
        self.profiled = True
        captured_pw = sorted([g for g in self.ready_ids if mode_of[g] == "PIECEWISE"] + extra_pw)
        manager._capture_descs = {
            **({self.engine.vllm_descs[captured_pw[0]].cg_mode: [self.engine.vllm_descs[g] for g in captured_pw]}
               if captured_pw else {}),
            **({self.engine.vllm_descs[all_full[0]].cg_mode: [self.engine.vllm_descs[g] for g in all_full]}
               if all_full else {}),
        }  # fmt: skip
        self.profiling_extra = self.per_graph_bytes("PIECEWISE") * (len(deferred_of["PIECEWISE"]) - len(extra_pw))
        return last[0]

    def capture_ready(self, manager: Any, capture_fn: Any, call: Call) -> Any:
        """The start-up capture: each ready graph in a call of vLLM's capture of its own (plan
        order, vLLM's own LoRA hook and dummy adapters), so that each one's memory is measured;
        without a profiling pass before it, then a sample of the deferred graphs of each mode
        (`sample_deferred`), which stay captured: they are ready from here on. Then hold back
        what the deferred graphs still pending are estimated to need. With DP ranks that pad to
        one another no deferred graph is sampled here (the ready set is closed over each size's
        LoRA cases, and a sample would break that): the ready captures alone are the readings.
        vLLM's result: the calls' results merged where they are dicts (0.25-0.28 return
        attention states), else the last one."""
        self.manager, self.capture_fn, self.call = manager, capture_fn, call.copy()
        self.block_tables = call["block_tables"]
        check_attributes(DUMMY_TABLES_HOOK, self.block_tables)
        merged: dict[Any, Any] = {}
        last: list[Any] = [None]

        def capture(gid: int) -> int:
            result, seconds, used = self._capture_one(gid, call.copy())
            self._timed(gid, seconds)
            if isinstance(result, dict):
                merged.update(result)
            last[0] = result
            return used

        kept = manager._capture_descs
        try:
            for gid in self.ready_ids:
                used = capture(gid)
                self.ready_bytes.append(used)
                if not self.profiled:
                    # Without a profiling pass before them, the ready captures are readings; after
                    # one they read near nothing (on the H200, 0 MiB for 42 of the 43 after the first
                    # of a 0.9B model's ready graphs, whose deferred graphs took 1.7 MiB each), so
                    # they are not.
                    self._sample(self.engine.plan.graphs[gid].descriptor.cg_mode, used, deferred=False)
            if not self.profiled and not self.synced:
                self._sample_at_start(capture)
            if self.profiled:
                started = time.perf_counter()
                self._free_at_start(capture)
                self.free_seconds = time.perf_counter() - started
        finally:
            manager._capture_descs = kept
        if self.sampled_ids or self.free_ids:  # ready from here on: in the manager's list, which the report counts
            self.ready_ids = sorted(self.captured)
            manager._capture_descs = self._ready_descs()
        if self.pending:
            self._hold("start")
        self.active = True
        ready = len(self.ready_ids) - len(self.sampled_ids) - len(self.free_ids)
        sampled = f" and {len(self.sampled_ids)} deferred ones as samples" if self.sampled_ids else ""
        if self.free_ids:
            sampled += f" and {len(self.free_ids)} deferred ones that took {sum(self.free_bytes) / 2**20:.0f} MiB"
        print(
            f"capplan: {ready} ready graphs captured{sampled}; {len(self.pending)} deferred graphs will be captured "
            f"while serving (one every {self.tiers.every_steps} steps, and one after another while idle); "
            f"holding {self.held_bytes / 2**20:.1f} MiB for them",
            file=sys.stderr,
        )
        return merged if isinstance(result := last[0], dict) else result

    def _sample_at_start(self, capture: Any) -> None:
        """The start-up capture's sample of the deferred graphs, each mode's in turn; they become
        ready graphs. At most half of a mode's deferred graphs: the others are still captured
        while serving, and where a mode has few, what they take is small beside what a
        coarser bound holds back."""
        graphs = self.engine.plan.graphs

        def measured(gid: int) -> int:
            used: int = capture(gid)
            self.sampled_bytes.append(used)
            return used

        for mode in ("PIECEWISE", "FULL"):
            candidates = [g for g in self.pending if graphs[g].descriptor.cg_mode == mode]
            taken = self.sample_deferred(mode, candidates, measured, len(candidates) // 2)
            self.sampled_ids += taken  # in capture order, as sampled_bytes
            sampled = set(taken)
            self.pending = [g for g in self.pending if g not in sampled]
            self.captured |= sampled

    def _free_at_start(self, capture: Any) -> None:
        """After vLLM's profiling pass: the deferred graphs in the order they land while serving
        (plan order), up to and including the first that takes memory (on any rank: `agreed`),
        at most `SAMPLES_MAX` and half of them; they become ready graphs. The profiling pass
        leaves the process memory its discarded graphs held, which the next captures take
        before any more (on the H200, of a 0.9B model's 370 deferred graphs the first 24-26
        took none while serving after the profiling pass's one-graph captures, 1 without
        them); held at the profiling readings' bound, those graphs took the hold from 1.19x
        to 1.32x what the deferred graphs took (that run's readings replayed through this
        code). None of these readings joins the samples: what a graph takes from memory the
        process already holds says nothing of what the next one takes. None for DP
        ranks that pad to one another (their ready set stays closed over each size's LoRA
        cases)."""
        if self.synced:
            return
        most = min(SAMPLES_MAX, len(self.pending) // 2)
        while self.pending and len(self.free_ids) < most:
            gid = self.pending.pop(0)
            used: int = capture(gid)
            self.free_ids.append(gid)
            self.free_bytes.append(used)
            self.captured.add(gid)
            if not self.agreed(used <= 0):
                return

    # -- memory ---------------------------------------------------------------------------
    def _sample(self, mode: str, used: int, *, deferred: bool) -> None:
        """One capture's memory, in the sampled pass (profiling or start-up): each mode's first
        is the pool's base (and FULL's output buffer), not a graph's."""
        if mode not in self.firsts:
            self.firsts[mode] = used
        else:
            (self.samples if deferred else self.ready_readings).setdefault(mode, []).append(used)

    def hold_readings(self, mode: str) -> list[int]:
        """The readings `mode`'s deferred graphs are held by: its deferred graphs' own, once there
        are `SAMPLES_MIN` of them; before that, the ready graphs' too. A ready graph is no
        sample of the deferred ones (each is the largest of its kernel class: a 2-layer model's
        ready FULL graphs took 0.32 MiB each, its deferred ones 0.19 MiB on the H200)."""
        own = self.samples.get(mode, [])
        return own if len(own) >= SAMPLES_MIN else [*self.ready_readings.get(mode, []), *own]

    def per_graph_bytes(self, mode: str) -> int:
        """What one more graph of `mode` is held (`per_graph_bound` of its readings); of every
        mode's readings where it has none yet, of the first captures where no mode has any. Never
        less than what the start held per graph: the bound's added reading covers one run of
        captures (the sampled pass) falling a granule short of what it took, and the graphs
        landed since are another run, which could pull the mean below what the graphs take."""
        readings = self.hold_readings(mode) or [u for m in ("PIECEWISE", "FULL") for u in self.hold_readings(m)]
        return max(per_graph_bound(readings or list(self.firsts.values())), self.start_per_graph.get(mode, 0))

    def fix_start_bounds(self) -> None:
        """As the start-up capture ends: each mode's per-graph bound (and the readings it rests
        on), below which it is never held while serving."""
        self.start_per_graph = {m: self.per_graph_bytes(m) for m in ("PIECEWISE", "FULL")}
        self.start_readings = {m: list(r) for m in ("PIECEWISE", "FULL") if (r := self.hold_readings(m))}

    def pending_bound(self) -> int:
        """What the graphs still pending are held: each mode's per-graph bound, times its count."""
        modes = [self.engine.plan.graphs[g].descriptor.cg_mode for g in self.pending]
        return sum(self.per_graph_bytes(mode) * modes.count(mode) for mode in sorted(set(modes)))

    def _hold(self, when: str) -> None:
        """Hold one block for the graphs still pending (their estimate), or record that it could
        not be held. At start a shortfall on any rank refuses the start on every rank."""
        import torch

        if not torch.cuda.is_available():  # capplan's CPU checks of the hooks
            return
        if when == "start":
            self.fix_start_bounds()
        want = self.pending_bound()
        if when == "start":
            self.shared_gpu(self.memory.others() if self.memory is not None else None, want)
        self._take(want, torch.cuda.mem_get_info()[0], when)

    def _take(self, want: int, free: int, when: str) -> None:
        """Hold `want` bytes of the device's `free`. At start every rank votes on whether it
        holds its own (each reads its own memory), so that all refuse to start together: a rank
        refusing alone would leave the others waiting in their next collective. While serving, a
        block not held again is recorded (`reserve_shortfall`), not refused."""
        self._release()
        self.reserve = HeldBlock.take(want, free) if want > 0 else None
        held = want <= 0 or self.reserve is not None
        if when == "start" and not self.agreed(held):
            self._release()
            short = (
                f"not enough GPU memory left to hold back {want / 2**30:.2f} GiB for its {len(self.pending)} "
                "deferred graphs"
                if not held
                else "another rank of this engine has not enough GPU memory left to hold back for its deferred graphs"
            )
            raise EngineRefusal(
                f"capplan: {self.engine.plan_path}: {short}; refusing to start (lower "
                "--gpu-memory-utilization, or make more graphs ready in the spec's tiers)"
            ) from None
        if not held:
            self.reserve_shortfall = True
            return
        self.held_bytes = want if self.reserve is not None else 0
        self.held_peak_bytes = max(self.held_peak_bytes, self.held_bytes)

    def shared_gpu(self, others: int | None, want: int) -> None:
        """Record how many other processes share the GPU as the hold is first taken, and where a
        capture before it was read by the device's memory, say so unless NVML shows this process
        alone: that reading moves with what other processes allocate and free, so the hold is
        then an estimate, not a bound (vLLM's own memory profiling has the same limit). Read by
        this process's own memory, it is not. Captures read by the device later, while serving,
        are counted in the report (`memory_readings`), not said."""
        self.other_processes = others
        if others != 0 and want > 0 and self.readings["device"]:
            who = (
                f"{others} other process(es) hold memory on this GPU"
                if others
                else "NVML cannot say whether other processes hold memory on this GPU"
            )
            print(
                f"capplan: {who}, and {self.readings['device']} capture(s) could not be read by this process's own "
                f"memory: their readings include what other processes allocate and free meanwhile, so the "
                f"{want / 2**30:.2f} GiB held for the deferred graphs is an estimate, not a bound (run the "
                "engine alone on its GPU for one)",
                file=sys.stderr,
            )

    # -- capture --------------------------------------------------------------------------
    def before_step(self, runner: Any) -> None:
        """Called as a real model-runner step starts: capture one deferred graph before every
        every_steps-th step, between steps only."""
        if not self.pending or not self.active:
            return
        if self.synced:
            self._synced_step(runner)
            return
        if runner.execute_model_state is not None:
            return  # a step's sampling is still pending: not between steps
        self.steps += 1
        if self.step_captures and self.steps % self.tiers.every_steps == 0:
            expected = self.expected_seconds(self.pending[0])
            if expected is not None and expected > STEP_PAUSE_BUDGET_S:
                self.left_to_idle += 1  # this step does not wait: the graph lands on an idle turn
                return
            seconds = self.capture_next("step")
            self.longest_step_pause = max(self.longest_step_pause, seconds)

    def _synced_step(self, runner: Any) -> None:
        """A DP-synced step starts (a real batch or vLLM's dummy one, alike on every DP rank):
        before every every_steps-th, capture the next group, every LoRA case of one size."""
        if runner.execute_model_state is not None:
            raise RuntimeError(
                "capplan: a data-parallel step started while the last step's sampling was pending; deferred "
                "capture keeps DP ranks in lockstep only between steps, so the engine stops rather than let the "
                "ranks capture apart (remove tiers from the spec)"
            )
        self.steps += 1
        if self.steps % self.tiers.every_steps == 0:
            group = [g for g in self.group_of[self.pending[0]] if g in self.pending]
            seconds = sum(self.capture_next("dp_step", gid) for gid in group)
            self.longest_step_pause = max(self.longest_step_pause, seconds)

    def expected_seconds(self, gid: int) -> float | None:
        """How long capturing graph `gid` is expected to take: the slowest of the last `RECENT`
        captures of its mode, ready or deferred (captures of one model vary 3x without a
        pattern, so the last one alone foretells little); of any mode before its mode has
        one; None before any capture."""
        mode = self.engine.plan.graphs[gid].descriptor.cg_mode
        recent = self.recent_seconds.get(mode) or self.recent_seconds.get("any")
        return max(recent) if recent else None

    def capture_idle(self) -> int:
        """One deferred capture while the engine core is idle (no step in flight: its batch queue
        is empty); the graphs still pending, 0 when this process defers none."""
        if self.synced:
            return 0  # each DP rank's core idles on its own: captures only at DP-synced steps
        if self.pending and self.active:
            seconds = self.capture_next("idle")
            self.longest_idle_capture = max(self.longest_idle_capture, seconds)
        return len(self.pending) if self.active else 0

    def capture_next(self, trigger: str, gid: int | None = None) -> float:
        """Capture deferred graph `gid` (default: the next, in plan order); its seconds."""
        engine = self.engine
        gid = self.pending[0] if gid is None else gid
        assert self.call is not None
        with self.lock:
            # The warm-up pass really runs: its dummy block-table rows are the persistent ones,
            # which hold the last batch's blocks. Zeroed they point at the null block, as at
            # start-up, so no live request's blocks (or a hybrid model's state) are touched.
            for table in self.block_tables.input_block_tables:
                table.zero_()
            call = self.call.copy()
            if call["lora_capture_hook"] is not None:
                call["lora_capture_hook"] = self._lora_hook()
            self._release()
            kept = self.manager._capture_descs
            try:
                _, seconds, used = self._capture_one(gid, call)
                self._timed(gid, seconds)
            finally:
                self.manager._capture_descs = kept
            self.pending.remove(gid)
            self.captured.add(gid)
            self.landed.append(gid)
            self.deferred_bytes.append(used)
            self.samples.setdefault(engine.plan.graphs[gid].descriptor.cg_mode, []).append(used)
            if self.pending:
                self._hold("serving")  # the estimate, with this capture in it, for the graphs left
        self.captures.append(
            {
                "graph": address(engine.plan.graphs[gid].descriptor),
                "seconds": round(seconds, 4),
                "gpu_wait_seconds": round(self.last_gpu_wait, 4),  # of those, waiting for the GPU's queued work
                "trigger": trigger,
                "memory_mib": round(used / 2**20, 2),
            }
        )
        engine.report.deferred_captured(engine.vllm_descs[gid])
        if not self.pending:
            print(
                f"capplan: all {len(self.captures)} deferred graphs captured "
                f"({sum(c['seconds'] for c in self.captures):.2f} s in all, longest step pause "
                f"{self.longest_step_pause * 1000:.0f} ms; {sum(self.deferred_bytes) / 2**20:.1f} MiB, "
                f"{self.held_peak_bytes / 2**20:.1f} MiB held at most)",
                file=sys.stderr,
            )
        return seconds

    def _timed(self, gid: int, seconds: float) -> None:
        for key in (self.engine.plan.graphs[gid].descriptor.cg_mode, "any"):
            self.recent_seconds.setdefault(key, deque(maxlen=RECENT)).append(seconds)

    def _release(self) -> None:
        """Give the held block back to the driver, for the capture about to run."""
        if self.reserve is not None:
            self.reserve.give_back()
            self.reserve = None
            self.held_bytes = 0

    def _capture_one(self, gid: int, call: Call, manager: Any = None, capture_fn: Any = None) -> tuple[Any, float, int]:
        """Graph `gid` through vLLM's capture, the manager's list set to it alone: vLLM's
        result, the seconds it took and the device memory it took."""
        import torch
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed

        cuda = torch.cuda.is_available()  # False only in capplan's CPU checks of the hooks
        manager = self.manager if manager is None else manager
        capture_fn = self.capture_fn if capture_fn is None else capture_fn
        desc = self.engine.vllm_descs[gid]
        descs, what = {desc.cg_mode: [desc]}, f"graph {address(self.engine.plan.graphs[gid].descriptor)}"
        if cuda and not self.memory_opened:  # once, before the first capture is timed
            self.memory, self.memory_opened = open_for_current_device(), True
        with gpu_sync_allowed():
            started = time.perf_counter()
            if cuda:
                torch.cuda.synchronize()  # the last step's GPU work, which the capture waits for anyway
            self.last_gpu_wait = time.perf_counter() - started
            before = in_use(self.memory) if cuda else (None, 0)
            manager._capture_descs = descs
            try:
                result = call.run(capture_fn)
            except Exception as exc:
                raise RuntimeError(
                    f"capplan: capture of {what} failed "
                    f"({type(exc).__name__}: {exc}); the engine stops rather than serve from a graph pool in an "
                    "unknown state"
                ) from exc
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            used, own = growth(before, in_use(self.memory)) if cuda else (0, False)
            if cuda:
                self.readings["process" if own else "device"] += 1
        return result, seconds, used

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

    def _by_mode(self) -> dict[str, dict[str, float]]:
        """The deferred graphs' memory per mode: how many landed, their total and mean (MiB)."""
        out: dict[str, dict[str, float]] = {}
        for gid, used in zip(self.landed, self.deferred_bytes):
            row = out.setdefault(self.engine.plan.graphs[gid].descriptor.cg_mode, {"graphs": 0, "total_mib": 0.0})
            row["graphs"] += 1
            row["total_mib"] += used / 2**20
        for row in out.values():
            row["total_mib"] = round(row["total_mib"], 2)
            row["mean_mib"] = round(row["total_mib"] / row["graphs"], 3)
        return out

    def to_json(self) -> dict[str, Any]:
        basis = "ready captures and deferred samples" if self.sampled_ids else "ready captures"
        return {
            "ready": len(self.ready_ids),
            "deferred": len(self.tiers.deferred) - len(self.warmed) - len(self.sampled_ids) - len(self.free_ids),
            "attention_thresholds": self.attention_thresholds,
            "warmed_for_attention": [address(self.engine.plan.graphs[g].descriptor) for g in self.warmed],
            "captured": len(self.captures),
            "pending": [address(self.engine.plan.graphs[g].descriptor) for g in self.pending],
            "every_steps": self.tiers.every_steps,
            "steps_seen": self.steps,
            "fallback_steps": self.fallback_steps,
            "longest_step_pause_seconds": round(self.longest_step_pause, 4),
            "step_captures": self.step_captures,
            "dp_synced_captures": self.synced,
            "step_pause_budget_seconds": STEP_PAUSE_BUDGET_S,
            "step_captures_left_to_idle": self.left_to_idle,
            "longest_idle_capture_seconds": round(self.longest_idle_capture, 4),
            "capture_seconds": round(sum(c["seconds"] for c in self.captures), 3),
            "reserved_gib": round(self.held_peak_bytes / 2**30, 4),
            "reserve_shortfall": self.reserve_shortfall,
            "graph_memory_gib": round(sum(self.deferred_bytes) / 2**30, 4),
            "ready_graph_memory_gib": round(sum(self.ready_bytes) / 2**30, 4),
            "ready_graph_memory_mib": [round(b / 2**20, 2) for b in self.ready_bytes],
            "profiling_extra_gib": round(self.profiling_extra / 2**30, 4),
            "hold_basis": "vLLM's profiling pass" if self.profiled else basis,
            "other_gpu_processes_at_start": self.other_processes,
            "memory_readings": dict(self.readings),
            "held_per_graph_mib_at_start": {m: round(b / 2**20, 3) for m, b in self.start_per_graph.items()},
            "readings_mib_at_start": {m: [round(u / 2**20, 2) for u in us] for m, us in self.start_readings.items()},
            # the ready graphs' readings of the sampled pass (held by only until a mode has its own)
            "ready_readings_mib": {m: [round(u / 2**20, 2) for u in us] for m, us in self.ready_readings.items()},
            "deferred_graph_memory_mib_by_mode": self._by_mode(),
            "sampled_in_profiling": len(self.profiled_ids),
            "sampled_at_start": [address(self.engine.plan.graphs[g].descriptor) for g in self.sampled_ids],
            "sampled_at_start_mib": [round(b / 2**20, 2) for b in self.sampled_bytes],
            # after vLLM's profiling pass: deferred graphs captured at start, up to the first that took memory
            "free_at_start": [address(self.engine.plan.graphs[g].descriptor) for g in self.free_ids],
            "free_at_start_mib": [round(b / 2**20, 2) for b in self.free_bytes],
            "free_at_start_seconds": round(self.free_seconds, 3),
            "captures": self.captures,
        }
