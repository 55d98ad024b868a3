"""The GPU token comparison's positive control (`tests/gpu/faults/sitecustomize.py`), on CPU:
with CAPPLAN_FAULT=fallback-one-slot-short it patches deferred capture's dispatch resolution so
that a batch whose graph is pending replays a captured graph of the next smaller LoRA case (one
adapter slot too few), and only then; a control that never swaps would vouch for nothing."""

from __future__ import annotations

import importlib
import runpy
from pathlib import Path

import pytest

from capplan.loading import spec_from_data
from capplan.planner import compile_plan

FAULT = Path(__file__).parent / "gpu" / "faults" / "sitecustomize.py"
SPEC = {
    "target": {"vllm": "0.33.0"},
    "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 256, "max_model_len": 512},
    "cudagraph": {"mode": "FULL_AND_PIECEWISE"},
    "lora": {"enabled": True, "max_loras": 4, "specialize_active": True},
    "tiers": {"ready": "full_decode", "every_steps": 1},
}


@pytest.fixture
def fault(monkeypatch, capsys):
    """The control installed as the GPU run installs it; deferred capture's resolution restored after."""
    # The module as it is imported now (another test may have imported the runtime afresh).
    graphs = importlib.import_module("capplan.runtime.deferred.graphs")
    monkeypatch.setenv("CAPPLAN_FAULT", "fallback-one-slot-short")
    monkeypatch.setattr(graphs.GraphSets, "resolve", graphs.GraphSets.resolve)
    runpy.run_path(str(FAULT))
    return graphs.GraphSets, capsys.readouterr().err


def test_the_fault_replays_a_graph_one_adapter_slot_short_for_a_pending_graph(fault):
    GraphSets, said = fault
    assert "capplan-fault: installed" in said
    plan = compile_plan(spec_from_data(SPEC, "fault"))
    sets = GraphSets(plan)
    desc = [g.descriptor for g in plan.graphs]
    swapped = 0
    for gid in plan.tiers.deferred:
        got = sets.resolve(gid)
        assert got in sets.captured or got == -1
        if got >= 0 and desc[got].num_active_loras < desc[gid].num_active_loras:
            swapped += 1
            assert desc[got].cg_mode == desc[gid].cg_mode and desc[got].num_tokens >= desc[gid].num_tokens
    assert swapped > 0 and sets.fault_swaps == swapped
    ready = next(iter(sets.captured))
    assert sets.resolve(ready) == ready  # a captured graph replays itself
