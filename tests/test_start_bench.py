"""The start-up benchmark's own logic on CPU (`tests/gpu/start_bench.py`): the order of its
starts, and its summary read again from a kept run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parent / "gpu"
sys.path.insert(0, str(GPU))
start_bench = pytest.importorskip("start_bench")
PAIRS = GPU / "results" / "startup" / "0.33.0-h100" / "pairs"


def test_the_order_warms_each_arm_first_then_interleaves_and_puts_one_tiers_start_early():
    order = start_bench.order(2, 1, 2)
    assert order[:3] == ["vllm", "apply", "tiers"]
    assert order[3:7] == ["vllm", "apply", "apply", "vllm"]  # interleaved pairs
    assert order[7:10] == ["startup", "startup", "apply"]  # the recording boot, then a pair
    assert order[10:] == ["tiers"]
    assert start_bench.order(1, 0) == ["vllm", "apply", "vllm", "apply"]


def test_the_kept_runs_summary_is_reproduced_from_its_records(tmp_path):
    done = [start_bench.with_log_phases(PAIRS, json.loads(line)) for line in (PAIRS / "starts.jsonl").open()]
    start_bench.summarize(tmp_path / "summary.json", done)
    got = json.loads((tmp_path / "summary.json").read_text())
    kept = json.loads((PAIRS / "summary.json").read_text())
    assert got["healthy_ratio_apply_over_vllm"] == kept["healthy_ratio_apply_over_vllm"]
    assert got["arms"]["apply"]["kv_cache_tokens"] == kept["arms"]["apply"]["kv_cache_tokens"]
    assert got["tiers"] is None  # that run had no tiers start
    assert json.loads((tmp_path / "run.json").read_text())["starts"][0]["files"] == ["start0-vllm.log.gz"]


def test_tiers_memory_is_read_against_the_full_plans_first_capture_of_the_same_run():
    deferred = {"all_graph_memory_gib": 1.25, "all_first_capture": True, "reserved_gib": 1.0,
                "ready_graph_memory_gib": 0.05, "sampled_at_start_mib": [102.4], "pending": []}  # fmt: skip
    done = [
        {"arm": "apply", "index": 1, "report": {"graph_memory_gib": 1.2}},
        {"arm": "tiers", "index": 2, "report": {"deferred": deferred}, "landing": {"all_landed": True}},
        {"arm": "apply", "index": 3, "report": {"graph_memory_gib": 1.2}},
    ]
    got = start_bench.tiers_memory(done)
    assert got["full_plan_graph_memory_gib"] == 1.2 and len(got["starts"]) == 1
    one = got["starts"][0]
    assert one["over_full_plan"] == round(1.25 / 1.2, 4)
    assert one["set_aside_at_start_gib"] == 1.15 and one["set_aside_at_start_over_full_plan"] == round(1.15 / 1.2, 4)
    assert start_bench.tiers_memory(done[:1]) is None
