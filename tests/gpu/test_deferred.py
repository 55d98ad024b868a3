"""Deferred capture under vLLM's OpenAI server with default multiprocessing
(tests/gpu/deferred_serve.py check): outputs while the deferred graphs are being captured
and once they landed differ from the reference engine's by no more than bf16 near-ties, in a
comparison that catches vLLM alone's no-LoRA-slot divergences; every deferred graph lands,
no capture while serving pauses a step more than 50 ms, and the memory held back for the
deferred graphs is at most 1.25 times what they took."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
OUT = Path(os.environ.get("CAPPLAN_GPU_OUT", "/tmp/capplan-gpu"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import vllm

    from capplan.releases import RELEASES

    if RELEASES.get(vllm.__version__.split("+")[0]) is None:
        pytest.skip(f"vLLM {vllm.__version__} is not a release capplan supports")
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / "gpu_deferred.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "deferred_serve.py"), str(tmp_path_factory.mktemp("deferred")), str(out), "check"],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_comparison_catches_vllm_alones_no_lora_slot_divergences(served):
    assert served["vanilla_vs_reference"]["differ_clearly"] > 0


def test_outputs_during_and_after_deferred_capture_differ_only_at_near_ties(served):
    for key in ("full_vs_reference", "tiers_during_capture_vs_reference", "tiers_after_landing_vs_reference"):
        assert served[key]["differ_clearly"] == 0, (key, served[key]["detail"])
    assert served["tiers"]["after_first_pass"]["fallback_steps"] > 0  # the window was exercised


def test_every_deferred_graph_landed_and_the_final_set_is_the_plan(served):
    report = served["tiers"]["report"]
    deferred = report["deferred"]
    assert deferred["pending"] == [] and deferred["captured"] == deferred["deferred"] > 0
    assert report["graphs_captured"] == report["graphs_planned"]
    assert len(deferred["captures"]) == deferred["deferred"]


def test_no_step_waits_more_than_50_ms_but_spaced_pauses_for_missed_graphs(served):
    """A step waits on a capture over 50 ms only for a graph the traffic missed (trigger "missed"),
    at most `pause_burst` of them plus one every `pause_spacing_steps` steps."""
    deferred = served["tiers"]["report"]["deferred"]
    steps = [c for c in deferred["captures"] if c["trigger"] == "step"]
    assert all(c["seconds"] <= 0.05 for c in steps), steps
    missed = [c for c in deferred["captures"] if c["trigger"] == "missed"]
    assert len(missed) <= deferred["pause_burst"] + deferred["steps_seen"] // deferred["pause_spacing_steps"]


def test_the_hold_is_a_bound_nothing_ran_short(served):
    assert not served["tiers"]["report"]["deferred"]["reserve_shortfall"]
    assert all(served[name]["out_of_memory"] == 0 for name in ("reference", "vanilla", "full", "tiers"))


def test_the_hold_is_at_most_1_25_times_what_the_deferred_graphs_took(served):
    # Fails on this model on every release so far (1.28x or 1.47x): its graphs take less than one
    # 2 MiB step each, and 19 ready readings per mode fix their size only to within one step
    # (tests/gpu/results/deferred/RELEASES.md). The 0.9B model of `starts` holds 1.208x.
    deferred = served["tiers"]["report"]["deferred"]
    assert deferred["reserved_gib"] <= 1.25 * deferred["graph_memory_gib"] + 2 / 1024  # one 2 MiB segment
