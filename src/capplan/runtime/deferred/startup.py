"""The captures before the engine is ready: the ready graphs, each measured, samples of the
deferred ones, and the hold for the graphs left pending.

Order of a start (one worker process):

1. The first capture (vLLM's profiling pass from 0.29.0, else the start-up capture) reads the
   attention groups' kernel switch and makes ready the deferred graphs that would be the first
   to compile an attention kernel (`warm_attention`).
2. From 0.29.0, unless the KV cache's size is given, vLLM's memory-profiling capture: the
   ready graphs and a spread sample of the deferred ones, each measured (`profile_ready`);
   what the deferred PIECEWISE graphs it left out are held is added to vLLM's estimate.
3. The start-up capture: the ready graphs, each in a call of its own (`capture_ready`); without
   a profiling pass, then a sample of the deferred graphs, which stay captured; after one, the
   deferred graphs in plan order up to the first that takes memory (the profiling pass leaves
   the process memory its discarded graphs held, which the next captures take first).
4. The per-graph bounds are fixed and the block for the graphs still pending is held; a start
   that cannot hold it refuses, on every rank at once.

With several TP or PP ranks every decision a reading feeds is every rank's (`DeferredState.agreed`),
so the ranks capture the same graphs. DP ranks that pad to one another take no sample at the
start-up capture and no graph as it takes no memory: their ready set stays closed over each
size's LoRA cases.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from capplan.planner.tiers import attention_warm
from capplan.runtime.deferred.estimate import MODES, SAMPLES_MAX, SAMPLES_MIN, spread_sample
from capplan.runtime.deferred.ranks import ranks_of
from capplan.runtime.deferred.state import DeferredState
from capplan.runtime.deferred.vllm_capture import set_capture_list
from capplan.runtime.hooking import Call, Hook, check_attributes
from capplan.runtime.log import log

DUMMY_TABLES_HOOK = Hook(
    "deferred.dummy_tables",
    "vllm.v1.worker.gpu.block_table:BlockTables.get_dummy_block_tables",
    "the dummy rows are zeroed first (the null block, as at start-up), so a warm-up never reads or updates "
    "a live request's blocks or state",
    attributes=("input_block_tables",),
)

Measure = Callable[[int], int]
"""Capture graph `gid`: the device memory it took."""


class StartUp:
    """The start-up captures of one worker process."""

    def __init__(self, state: DeferredState) -> None:
        self.state = state

    def warm_attention(self, call: Call) -> None:
        """As the first capture starts (the capture hook calls it; later calls change nothing):
        read the attention groups' kernel switch (`planner.tiers.attention_warm`) from the
        builders the capture is given, and make ready the deferred graphs that would be the first
        to compile an attention kernel (with DP ranks that pad to one another, every LoRA case of
        their sizes, as the planner closes the ready set). A rank reads its own layers' builders
        (a pipeline stage may hold no attention layer), so the ranks join what they read and
        every rank makes the same graphs ready: their pending lists, which every later vote and
        capture walks, stay one list."""
        state, graphs, start = self.state, self.state.graphs, self.state.start
        if start.attention_thresholds is not None:
            return
        if state.ranks is None:
            state.ranks = ranks_of(call["self"])
        builders = [b for groups in call["attn_groups"] for group in groups for b in group.metadata_builders]
        start.attention_thresholds = state.ranks.joined(
            {t for b in builders if type(t := getattr(b, "seq_threshold_3D", None)) is int}
        )
        max_num_seqs = state.ctx.plan.spec.scheduler.max_num_seqs
        extra = attention_warm(graphs.graphs, set(graphs.ready_ids), max_num_seqs, start.attention_thresholds)
        if state.synced:
            extra = {g for gid in extra for g in graphs.group_of[gid]}
        extra &= set(graphs.pending)
        if not extra:
            return
        start.warmed = sorted(extra)
        graphs.take(extra)
        graphs.ready_now()
        log.info(
            "%d deferred graphs made ready, the first of their attention kernels (seq_threshold_3D %s): %s",
            len(extra),
            start.attention_thresholds,
            ", ".join(graphs.name(g) for g in start.warmed),
        )

    def ready_only(self, manager: Any) -> None:
        """Before the start-up capture: the manager's capture list becomes the ready graphs."""
        # More than one rank: every capture on the idle turns, which reach every rank at once.
        self.state.serving.step_captures = self.state.ranks is None or self.state.ranks.single
        set_capture_list(manager, self.state.ready_descs())

    def sample_deferred(
        self, mode: str, candidates: Sequence[int], capture: Measure, most: int | None = None
    ) -> list[int]:
        """Capture deferred graphs of `mode` from `candidates` (in plan order), each measured, in
        rounds of `SAMPLES_MIN` evenly spaced over those not sampled yet, until the mode's
        readings are enough (`sampled_enough`, as every rank decides it), or `most` are taken;
        the graphs captured. Each round is captured in plan order, largest first, as the
        deferred graphs land while serving: a graph captured after a larger one of its mode may
        reuse what the larger one's capture freed in the pool, one captured after a smaller one
        may need more."""
        state, estimate = self.state, self.state.estimate
        limit = len(candidates) if most is None else most
        left, taken = list(candidates), list[int]()
        while left and len(taken) < limit and not state.agreed(estimate.enough(mode, state.synced)):
            room = min(SAMPLES_MIN, limit - len(taken), estimate.room(mode))
            for gid in spread_sample(left, room):
                estimate.reading(mode, capture(gid), deferred=True)
                taken.append(gid)
            sampled = set(taken)
            left = [g for g in left if g not in sampled]
        return taken

    def profile_ready(self, manager: Any, capture_fn: Any, call: Call) -> Any:
        """vLLM's memory-profiling capture (0.29.0 on, a throwaway manager and pool, before the
        KV cache is sized, in a process that has captured nothing yet): each graph in a call of
        its own, measured, in vLLM's order (PIECEWISE, then FULL): the ready PIECEWISE graphs,
        a sample of the deferred PIECEWISE ones, vLLM's own sample of the plan's FULL graphs (its
        first `_max_full_descs_to_capture`), a sample of the other deferred FULL ones. The
        manager's list is left as the PIECEWISE graphs captured and every FULL one, so vLLM's
        extrapolation of FULL memory counts the deferred FULL graphs; what the deferred
        PIECEWISE graphs not captured here are held is `profiling_extra`, which capplan adds to
        vLLM's estimate. The KV cache is then sized for the whole plan, with only the ready
        graphs captured."""
        state, graphs, estimate, start = self.state, self.state.graphs, self.state.estimate, self.state.start
        descs = state.ctx.vllm_descs
        all_full = [g for g in range(len(graphs.graphs)) if graphs.mode(g) == "FULL"]
        vllm_sample = all_full[: getattr(manager, "_max_full_descs_to_capture", None) or len(all_full)]
        deferred_of = {m: graphs.pending_of(m) for m in MODES}
        ready_pw = [g for g in graphs.ready_ids if graphs.mode(g) == "PIECEWISE"]
        last: list[Any] = [None]

        def capture(gid: int) -> int:
            got = state.capture_one(gid, call.copy(), manager, capture_fn)
            last[0] = got.result
            return got.used

        for gid in ready_pw:
            estimate.reading("PIECEWISE", capture(gid), deferred=False)
        extra_pw = self.sample_deferred("PIECEWISE", deferred_of["PIECEWISE"], capture)
        for gid in vllm_sample:
            estimate.reading("FULL", capture(gid), deferred=False)
        full_candidates = [g for g in deferred_of["FULL"] if g not in vllm_sample]
        extra_full = self.sample_deferred("FULL", full_candidates, capture)
        start.profiled_ids = [*extra_pw, *extra_full]
        start.profiled = True
        captured_pw = sorted(ready_pw + extra_pw)
        set_capture_list(
            manager,
            {
                **({descs[captured_pw[0]].cg_mode: [descs[g] for g in captured_pw]} if captured_pw else {}),
                **({descs[all_full[0]].cg_mode: [descs[g] for g in all_full]} if all_full else {}),
            },
        )
        left_out = len(deferred_of["PIECEWISE"]) - len(extra_pw)
        start.profiling_extra = estimate.per_graph_bytes("PIECEWISE") * left_out
        return last[0]

    def capture_ready(self, manager: Any, capture_fn: Any, call: Call) -> Any:
        """The start-up capture: each ready graph in a call of vLLM's capture of its own (plan
        order, vLLM's own LoRA hook and dummy adapters), so that each one's memory is measured;
        without a profiling pass before it, then a sample of the deferred graphs of each mode,
        which stay captured; after one, the deferred graphs that take no memory. Then hold back
        what the deferred graphs still pending are estimated to need. vLLM's result: the calls'
        results merged where they are dicts (0.25-0.28 return attention states), else the last
        one."""
        state, graphs, start = self.state, self.state.graphs, self.state.start
        state.manager, state.capture_fn, state.call = manager, capture_fn, call.copy()
        state.block_tables = call["block_tables"]
        check_attributes(DUMMY_TABLES_HOOK, state.block_tables)
        merged: dict[Any, Any] = {}
        last: list[Any] = [None]

        def capture(gid: int) -> int:
            got = state.capture_one(gid, call.copy(), manager, capture_fn)
            state.timed(gid, got.seconds)
            if isinstance(got.result, dict):
                merged.update(got.result)
            last[0] = got.result
            return got.used

        for gid in list(graphs.ready_ids):
            used = capture(gid)
            start.ready_bytes.append(used)
            if not start.profiled:
                # After a profiling pass the ready captures read near nothing: no readings.
                state.estimate.reading(graphs.mode(gid), used, deferred=False)
        if not start.profiled and not state.synced:
            self.sample_at_start(capture)
        if start.profiled:
            started = time.perf_counter()
            self.free_at_start(capture)
            start.free_seconds = time.perf_counter() - started
        if start.sampled_ids or start.free_ids:  # ready from here on: in the manager's list, which the report counts
            graphs.ready_now()
            set_capture_list(manager, state.ready_descs())
        if graphs.pending:
            state.hold_pending("start")
        state.active = True
        ready = len(graphs.ready_ids) - len(start.sampled_ids) - len(start.free_ids)
        sampled = f" and {len(start.sampled_ids)} deferred ones as samples" if start.sampled_ids else ""
        if start.free_ids:
            sampled += f" and {len(start.free_ids)} deferred ones that took {sum(start.free_bytes) / 2**20:.0f} MiB"
        log.info(
            "%d ready graphs captured%s; %d deferred graphs will be captured while serving (one every %d steps, "
            "and one after another while idle); holding %.1f MiB for them",
            ready,
            sampled,
            len(graphs.pending),
            state.tiers.every_steps,
            state.hold.held_bytes / 2**20,
        )
        return merged if isinstance(result := last[0], dict) else result

    def sample_at_start(self, capture: Measure) -> None:
        """The start-up capture's sample of the deferred graphs, each mode's in turn; they become
        ready graphs. At most half of a mode's deferred graphs: the others are still captured
        while serving, and where a mode has few, what they take is small beside what a coarser
        bound holds back."""
        graphs, start = self.state.graphs, self.state.start

        def measured(gid: int) -> int:
            used = capture(gid)
            start.sampled_bytes.append(used)
            return used

        for mode in MODES:
            candidates = graphs.pending_of(mode)
            taken = self.sample_deferred(mode, candidates, measured, len(candidates) // 2)
            start.sampled_ids += taken  # in capture order, as sampled_bytes
            graphs.take(taken)

    def free_at_start(self, capture: Measure) -> None:
        """After vLLM's profiling pass: the deferred graphs in the order they land while serving
        (plan order), up to and including the first that takes memory (on any rank), at most
        `SAMPLES_MAX` and half of them; they become ready graphs. The profiling pass leaves the
        process memory its discarded graphs held, which the next captures take before any more;
        held at the profiling readings' bound, those graphs would hold memory for nothing. None
        of these readings joins the samples: what a graph takes from memory the process already
        holds says nothing of what the next one takes. None for DP ranks that pad to one another
        (their ready set stays closed over each size's LoRA cases)."""
        state, graphs, start = self.state, self.state.graphs, self.state.start
        if state.synced:
            return
        most = min(SAMPLES_MAX, len(graphs.pending) // 2)
        while graphs.pending and len(start.free_ids) < most:
            gid = graphs.pending[0]
            used = capture(gid)
            graphs.take([gid])
            start.free_ids.append(gid)
            start.free_bytes.append(used)
            if not state.agreed(used <= 0):
                return
