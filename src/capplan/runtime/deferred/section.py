"""Deferred capture's section of the runtime's report (`Report.deferred`): what the start and
the serving-time captures did, as JSON. Its shape is read by the GPU harnesses: kept."""

from __future__ import annotations

from typing import Any

from capplan.runtime.deferred.state import DeferredState


def by_mode(state: DeferredState) -> dict[str, dict[str, float]]:
    """The deferred graphs' memory per mode: how many landed, their total and mean (MiB)."""
    out: dict[str, dict[str, float]] = {}
    for gid, used in zip(state.serving.landed, state.serving.deferred_bytes):
        row = out.setdefault(state.graphs.mode(gid), {"graphs": 0, "total_mib": 0.0})
        row["graphs"] += 1
        row["total_mib"] += used / 2**20
    for row in out.values():
        row["total_mib"] = round(row["total_mib"], 2)
        row["mean_mib"] = round(row["total_mib"] / row["graphs"], 3)
    return out


def all_bytes(state: DeferredState) -> int:
    """What every capture of the plan's graphs in this process took: the ready graphs, the deferred
    ones sampled or taken at start, those landed while serving (vLLM's profiling pass, discarded,
    is not among them)."""
    start = state.start
    return sum(start.ready_bytes) + sum(start.sampled_bytes) + sum(start.free_bytes) + sum(state.serving.deferred_bytes)


def section(state: DeferredState) -> dict[str, Any]:
    graphs, start, serving, hold, estimate = state.graphs, state.start, state.serving, state.hold, state.estimate
    names = graphs.name
    basis = "ready captures and deferred samples" if start.sampled_ids else "ready captures"

    def mib(readings: dict[str, list[int]]) -> dict[str, list[float]]:
        return {m: [round(u / 2**20, 2) for u in us] for m, us in readings.items()}

    return {
        "ready": len(graphs.ready_ids),
        "deferred": len(state.tiers.deferred) - len(start.warmed) - len(start.sampled_ids) - len(start.free_ids),
        "attention_thresholds": start.attention_thresholds,
        "warmed_for_attention": [names(g) for g in start.warmed],
        "captured": len(serving.captures),
        "pending": [names(g) for g in graphs.pending],
        "every_steps": state.tiers.every_steps,
        "steps_seen": serving.steps,
        "fallback_steps": graphs.fallback_steps,
        "misses_by_graph": {names(g): n for g, n in sorted(graphs.misses.items())},  # fallbacks replayed for it
        "pause_spacing_steps": state.pauses.slow_every_steps,
        "pause_burst": state.pauses.slow_burst,
        "longest_step_pause_seconds": round(serving.longest_step_pause, 4),
        "step_captures": serving.step_captures,
        "dp_synced_captures": state.synced,
        "step_pause_budget_seconds": state.pauses.step_pause_s,
        "step_captures_left_to_idle": serving.left_to_idle,
        "longest_idle_capture_seconds": round(serving.longest_idle_capture, 4),
        "capture_seconds": round(sum(c["seconds"] for c in serving.captures), 3),
        "reserved_gib": round(hold.peak_bytes / 2**30, 4),
        "reserve_shortfall": hold.shortfall,
        "graph_memory_gib": round(sum(serving.deferred_bytes) / 2**30, 4),
        "ready_graph_memory_gib": round(sum(start.ready_bytes) / 2**30, 4),
        # every graph this process captured for the plan (ready, sampled and taken at start, landed):
        # comparable with a full plan's graph memory where no profiling pass ran before (`all_first_capture`)
        "all_graph_memory_gib": round(all_bytes(state) / 2**30, 4),
        "all_first_capture": not start.profiled,
        "ready_graph_memory_mib": [round(b / 2**20, 2) for b in start.ready_bytes],
        "profiling_extra_gib": round(start.profiling_extra / 2**30, 4),
        "hold_basis": "vLLM's profiling pass" if start.profiled else basis,
        "other_gpu_processes_at_start": state.other_processes,
        "memory_readings": dict(state.vllm.readings),
        "held_per_graph_mib_at_start": {m: round(b / 2**20, 3) for m, b in estimate.start_per_graph.items()},
        "readings_mib_at_start": mib(estimate.start_readings),
        # the ready graphs' readings of the sampled pass (held by only until a mode has its own)
        "ready_readings_mib": mib(estimate.ready_readings),
        "deferred_graph_memory_mib_by_mode": by_mode(state),
        "sampled_in_profiling": len(start.profiled_ids),
        "sampled_at_start": [names(g) for g in start.sampled_ids],
        "sampled_at_start_mib": [round(b / 2**20, 2) for b in start.sampled_bytes],
        # after vLLM's profiling pass: deferred graphs captured at start, up to the first that took memory
        "free_at_start": [names(g) for g in start.free_ids],
        "free_at_start_mib": [round(b / 2**20, 2) for b in start.free_bytes],
        "free_at_start_seconds": round(start.free_seconds, 3),
        "captures": serving.captures,
    }
