"""Deferred capture with DP ranks that pad to one another (an MoE model's), inside vLLM's real
DP sync: two processes, gloo, CPU (dp_deferred_worker.py). Captures are collectives across the
DP ranks, taken in lockstep at DP-synced steps (dummy steps counted), a group at a time; at
every step both ranks replay a captured graph of one size and mode. A control run capturing
one graph at a time shows the check sees ranks disagree."""

from pathlib import Path

import pytest

from capplan.releases import RELEASES
from tests.conformance.releases import ends
from tests.conformance.test_dp_sync_cpu import _pair

WORKER = Path(__file__).parent / "dp_deferred_worker.py"


@pytest.mark.conformance
@pytest.mark.parametrize("version", ends())
def test_dp_ranks_capture_in_lockstep_and_replay_one_size_in_every_state(version, tmp_path):
    r0, r1 = _pair(version, "lockstep", tmp_path, WORKER)
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    for r in (r0, r1):
        assert r["mismatch_count"] == 0, r["mismatches"]
        assert r["uncaptured"] == []
        assert r["pending_after"] == 0 and r["deferred_in_plan_groups"]
        assert r["fallback_steps"] > 20  # the intermediate states were exercised (30 per rank on 0.25.0)
        assert r["idle_capture_returns"] == 0  # no idle captures under DP sync
        assert r["report"]["dp_synced_captures"] is True
    assert r0["captured_order"] == r1["captured_order"]
    # vLLM's profiling pass (0.29.0 on), the ranks reading memory differently: the same captures on
    # both, and no deferred graph taken at start (none sampled there, none for reading no memory)
    assert r0["profiling_captured"] == r1["profiling_captured"] and r0["profiled_samples"] == r1["profiled_samples"]
    assert bool(r0["profiling_captured"]) is RELEASES[version].profiling_capture
    assert r0["taken_at_start"] == r1["taken_at_start"] == []
    graph_steps = [(a, b) for a, b in zip(r0["steps"], r1["steps"]) if a[0] != "NONE"]
    assert len(graph_steps) > 1000
    assert sum(a[2] != b[2] for a, b in graph_steps) > 300  # the ranks' LoRA counts differ
    # the states moved: pending counts fell through many values while both ranks stepped
    assert len({a[3] for a, _ in graph_steps}) >= 6  # 28 deferred graphs in 6 groups on 0.25.0: every state


@pytest.mark.conformance
@pytest.mark.parametrize("version", ends()[:1])
def test_the_dp_check_sees_one_graph_at_a_time_diverge(version, tmp_path):
    r0, r1 = _pair(version, "single", tmp_path, WORKER)
    assert r0["mismatch_count"] or r1["mismatch_count"], (r0["error"], r1["error"])
