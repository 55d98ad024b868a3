"""The deferred graphs captured while the engine serves, one at a time, between steps.

When a capture runs:

- Single-rank engine: before every `every_steps`-th model-runner step (as it starts, before its
  inputs are prepared), unless one of the last `RECENT` captures of its mode took longer than
  the step pause bound: then only a graph the traffic has missed, and within a token bucket
  (`pauses`: at most the burst plus one per slow-capture spacing's steps in any run of steps),
  else it waits for an idle turn (the operator's two settings,
  `pauses.Pauses`); and one per idle turn of the
  engine core. The next graph is the pending one the traffic missed most (`GraphSets.next`);
  ranks that capture together keep plan order.
- Several TP or PP ranks: only on the engine core's idle turns, where one `collective_rpc`
  reaches every worker at the same point of the step sequence (a step capture decided on a
  rank-local time could differ between ranks).
- DP ranks that pad to one another: at DP-synced steps only (every model-runner step, vLLM's
  dummy batch included, counts on every rank alike), a whole group at once: every LoRA case of
  one size and shape. No idle captures: each DP rank's engine core idles on its own.

Each capture gives the held block back, joins its mode's readings, and the bound is held again
for the graphs still pending. A capture and the async output thread exclude each other through
the state's lock (CUDA's global capture mode fails another thread's event waits).
"""

from __future__ import annotations

import time
from typing import Any

from capplan.runtime.deferred.state import DeferredState
from capplan.runtime.log import log
from capplan.runtime.lora_warm import dummy_mapping, layout_for


class Serving:
    """The serving-time captures of one worker process."""

    def __init__(self, state: DeferredState) -> None:
        self.state = state

    def before_step(self, runner: Any) -> None:
        """Called as a real model-runner step starts: capture one deferred graph before every
        every_steps-th step, between steps only."""
        state, record = self.state, self.state.serving
        if not state.graphs.pending or not state.active:
            return
        if state.synced:
            self.synced_step(runner)
            return
        if runner.execute_model_state is not None:
            return  # a step's sampling is still pending: not between steps
        record.steps += 1
        every = state.pauses.slow_every_steps
        record.slow_debt_steps = max(0, record.slow_debt_steps - 1)  # each spacing's steps earn one capture back
        if record.step_captures and record.steps % state.tiers.every_steps == 0:
            gid = self.next_graph()
            trigger = "step"
            if self.slow(gid):
                burst = state.pauses.slow_burst
                if every and state.graphs.misses[gid] > 0 and record.slow_debt_steps + every <= burst * every:
                    record.slow_debt_steps += every
                    trigger = "missed"
                else:  # the most missed graph of a mode whose captures are fast, if any, lands instead
                    fast = next((g for g in state.graphs.ranked() if not self.slow(g)), None)
                    if fast is None:
                        record.left_to_idle += 1  # this step does not wait: the graph lands on an idle turn
                        return
                    gid = fast
            seconds = self.capture_next(trigger, gid)
            record.longest_step_pause = max(record.longest_step_pause, seconds)

    def synced_step(self, runner: Any) -> None:
        """A DP-synced step starts (a real batch or vLLM's dummy one, alike on every DP rank):
        before every every_steps-th, capture the next group, every LoRA case of one size."""
        state, record = self.state, self.state.serving
        if runner.execute_model_state is not None:
            raise RuntimeError(
                "capplan: a data-parallel step started while the last step's sampling was pending; deferred "
                "capture keeps DP ranks in lockstep only between steps, so the engine stops rather than let the "
                "ranks capture apart (remove tiers from the spec)"
            )
        record.steps += 1
        if record.steps % state.tiers.every_steps == 0:
            pending = state.graphs.pending
            group = [g for g in state.graphs.group_of[self.next_graph()] if g in pending]
            seconds = sum(self.capture_next("dp_step", gid) for gid in group)
            record.longest_step_pause = max(record.longest_step_pause, seconds)

    def next_graph(self) -> int:
        """The next deferred graph: the most missed in a single-rank engine, else in plan order
        (ranks that capture together must pick alike; misses are each rank's own)."""
        state = self.state
        return state.graphs.next(by_misses=state.serving.step_captures and not state.synced)

    def slow(self, gid: int) -> bool:
        """Whether capturing `gid` is expected to pause a step longer than the operator's bound."""
        expected = self.expected_seconds(gid)
        return expected is not None and expected > self.state.pauses.step_pause_s

    def expected_seconds(self, gid: int) -> float | None:
        """How long capturing graph `gid` is expected to take: the slowest of the last `RECENT`
        captures of its mode, ready or deferred (captures of one model vary 3x without a
        pattern, so the last one alone foretells little); of any mode before its mode has
        one; None before any capture."""
        recent_seconds = self.state.serving.recent_seconds
        recent = recent_seconds.get(self.state.graphs.mode(gid)) or recent_seconds.get("any")
        return max(recent) if recent else None

    def capture_idle(self) -> int:
        """One deferred capture while the engine core is idle (no step in flight: its batch queue
        is empty); the graphs still pending, 0 when this process defers none."""
        state = self.state
        if state.synced:
            return 0  # each DP rank's core idles on its own: captures only at DP-synced steps
        if state.graphs.pending and state.active:
            seconds = self.capture_next("idle")
            state.serving.longest_idle_capture = max(state.serving.longest_idle_capture, seconds)
        return len(state.graphs.pending) if state.active else 0

    def capture_next(self, trigger: str, gid: int | None = None) -> float:
        """Capture deferred graph `gid` (default: the next, `GraphSets.next`); its seconds."""
        state, graphs, record = self.state, self.state.graphs, self.state.serving
        gid = self.next_graph() if gid is None else gid
        assert state.call is not None
        with state.lock:
            # The warm-up pass really runs: its dummy block-table rows are the persistent ones,
            # which hold the last batch's blocks. Zeroed they point at the null block, as at
            # start-up, so no live request's blocks (or a hybrid model's state) are touched.
            for table in state.block_tables.input_block_tables:
                table.zero_()
            call = state.call.copy()
            if call["lora_capture_hook"] is not None:
                call["lora_capture_hook"] = self.lora_hook()
            state.hold.release()
            got = state.capture_one(gid, call, state.manager, state.capture_fn)
            state.timed(gid, got.seconds)
            graphs.take([gid])
            record.landed.append(gid)
            record.deferred_bytes.append(got.used)
            state.estimate.landed(graphs.mode(gid), got.used)
            if graphs.pending:
                state.hold_pending("serving")  # the estimate, with this capture in it, for the graphs left
        record.captures.append(
            {
                "graph": graphs.name(gid),
                "seconds": round(got.seconds, 4),
                "gpu_wait_seconds": round(got.gpu_wait, 4),  # of those, waiting for the GPU's queued work
                "trigger": trigger,
                "memory_mib": round(got.used / 2**20, 2),
                "landed_unix": round(time.time(), 3),  # wall clock, to place the landing against traffic
            }
        )
        state.ctx.report.deferred_captured(state.ctx.vllm_descs[gid])
        if not graphs.pending:
            log.info(
                "all %d deferred graphs captured (%.2f s in all, longest step pause %.0f ms; %.1f MiB, "
                "%.1f MiB held at most)",
                len(record.captures),
                sum(c["seconds"] for c in record.captures),
                record.longest_step_pause * 1000,
                sum(record.deferred_bytes) / 2**20,
                state.hold.peak_bytes / 2**20,
            )
        return got.seconds

    def lora_hook(self) -> Any:
        """Warm a LoRA graph with the plan's dummy mapping set on the punica wrapper only:
        no adapter is loaded, activated or evicted. The wrapper maps adapter ids to slots
        through lora_index_to_id; for the capture it reads slot i as adapter i + 1 (the
        plan's dummy ids are 1..max_loras), and the next step maps its own batch again."""
        from vllm.lora.layers import LoRAMapping

        ctx = self.state.ctx
        manager = self.state.runner.lora_manager._adapter_manager

        def hook(num_active_loras: int, num_reqs: int, num_tokens: int) -> None:
            prompt, token = dummy_mapping(layout_for(ctx, num_active_loras, num_reqs, num_tokens), num_reqs)
            live = manager.lora_index_to_id
            manager.lora_index_to_id = list(range(1, len(live) + 1))
            try:
                manager._set_adapter_mapping(LoRAMapping(tuple(token), tuple(prompt), is_prefill=True))
            finally:
                manager.lora_index_to_id = live
                manager._last_mapping = None  # the next step sets its batch's mapping again

        return hook
