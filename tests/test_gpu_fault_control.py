"""The GPU runs' positive control for deferred capture (tests/gpu/faults/): on the plan the
production-size run serves, the fault swaps fallbacks for graphs of one adapter slot too few,
and every swap is a graph vLLM can replay for that batch (captured, same mode, enough tokens and
requests). A control that never bites, or that crashes the engine, proves nothing."""

import importlib.util
from pathlib import Path

import yaml

from capplan.loading import spec_from_data
from capplan.planner.compiler import compile_plan
from capplan.planner.tiers import replayed

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "tests" / "gpu" / "results" / "production" / "0.33.0-h100"


def _fault():
    spec = importlib.util.spec_from_file_location("one_slot_short", ROOT / "tests/gpu/faults/one_slot_short.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.one_slot_short


def test_the_fault_swaps_fallbacks_for_a_replayable_graph_one_slot_short():
    one_slot_short = _fault()
    plan = compile_plan(spec_from_data(yaml.safe_load((RUN / "tiers.yaml").read_text()), "tiers.yaml"))
    assert plan.tiers is not None
    captured = set(range(len(plan.graphs))) - set(plan.tiers.deferred)
    swaps = 0
    for gid in plan.tiers.deferred:
        got = replayed(plan.tiers, gid, captured)
        new = one_slot_short(plan.graphs, captured, gid, got)
        if new == got:
            continue
        swaps += 1
        want, fell, g = (plan.graphs[i].descriptor for i in (gid, got, new))
        assert new in captured
        assert g.cg_mode == fell.cg_mode and g.uniform_token_count == fell.uniform_token_count
        assert g.num_active_loras < fell.num_active_loras
        assert g.num_tokens >= want.num_tokens
        assert g.num_reqs is None or g.num_reqs >= (want.num_reqs or 0)
    # the fault bites on most of the deferred graphs with a LoRA case above 0
    with_lora = [g for g in plan.tiers.deferred if plan.graphs[g].descriptor.num_active_loras > 0]
    assert swaps >= len(with_lora) // 2, (swaps, len(with_lora))


def test_the_fault_leaves_captured_graphs_and_eager_alone():
    one_slot_short = _fault()
    plan = compile_plan(spec_from_data(yaml.safe_load((RUN / "tiers.yaml").read_text()), "tiers.yaml"))
    assert one_slot_short(plan.graphs, {0}, 0, 0) == 0
    assert one_slot_short(plan.graphs, {0}, 5, -1) == -1


def test_the_installed_fault_takes_the_runtimes_resolve_call_as_the_dispatch_hook_makes_it(monkeypatch, capsys):
    """sitecustomize.py wraps GraphSets.resolve: called as the runtime calls it (with the
    `traffic` flag), it swaps a fallback and still counts the miss; a wrapper whose signature
    fell behind the runtime's would crash the engine at the first fallback instead of biting."""
    import sys

    from capplan.runtime.deferred import graphs as graphs_module

    monkeypatch.setenv("CAPPLAN_FAULT", "fallback-one-slot-short")
    monkeypatch.setattr(graphs_module.GraphSets, "resolve", graphs_module.GraphSets.resolve)  # restored after
    spec = importlib.util.spec_from_file_location("capplan_fault_site", ROOT / "tests/gpu/faults/sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delitem(sys.modules, "one_slot_short", raising=False)
    plan = compile_plan(spec_from_data(yaml.safe_load((RUN / "tiers.yaml").read_text()), "tiers.yaml"))
    sets = graphs_module.GraphSets(plan)
    swapped = 0
    for gid in plan.tiers.deferred:
        plain = replayed(plan.tiers, gid, sets.captured)
        got = sets.resolve(gid, True)
        assert got in sets.captured or got == -1
        swapped += got != plain
    assert swapped > 0 and sets.fault_swaps == swapped
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("capplan-fault: swap ")]
    assert len(said) == sum(1 for n in range(1, swapped + 1) if n <= 20 or n % 100 == 0)
    assert said[0].startswith("capplan-fault: swap 1: graph ")
    assert sum(sets.misses.values()) == len(plan.tiers.deferred)  # every call counted as the runtime's
