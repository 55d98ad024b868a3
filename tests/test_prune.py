"""prune_unreachable: (graph, LoRA case) pairs no reachable batch can dispatch to are not captured,
and no reachable batch dispatches differently."""

import pytest

from capplan.analysis.verify import verify_plan
from capplan.planner import Batch, Dispatcher, compile_plan
from capplan.schemas.spec import ALL_FIXES
from tests.conftest import make_spec

UNPRUNED = [f.value for f in ALL_FIXES if f.value != "prune_unreachable"]
SPECS = {
    "0.33 active": dict(
        scheduler={"max_num_seqs": 16, "max_num_batched_tokens": 96},
        cudagraph={"capture_sizes": [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]},
        lora={"enabled": True, "max_loras": 4, "specialize_active": True},
    ),
    "0.25 spec decode": dict(
        target={"vllm": "0.25"},
        scheduler={"max_num_seqs": 12, "max_num_batched_tokens": 80},
        speculative={"num_speculative_tokens": 2},
        lora={"enabled": True, "max_loras": 8, "specialize_active": True},
    ),
    "DP 2": dict(
        scheduler={"max_num_seqs": 16, "max_num_batched_tokens": 64},
        parallel={"data_parallel_size": 2, "moe": True},
        lora={"enabled": True, "max_loras": 4, "specialize_active": True},
    ),
    "no slot fix": dict(
        scheduler={"max_num_seqs": 16, "max_num_batched_tokens": 64},
        lora={"enabled": True, "max_loras": 4, "specialize_active": True},
    ),
}


def _pair(name):
    kwargs = SPECS[name]
    others = UNPRUNED if name != "no slot fix" else []
    pruned = compile_plan(make_spec(**kwargs, fixes=[*others, "prune_unreachable"]))
    full = compile_plan(make_spec(**kwargs, fixes=others))
    return pruned, full


@pytest.mark.parametrize("name", list(SPECS))
def test_pruning_drops_graphs_and_still_verifies(name):
    pruned, full = _pair(name)
    assert len(pruned.graphs) < len(full.graphs)
    before = {v.kind for v in verify_plan(full).violations}  # without lora_slot: vLLM's own class 6
    after = verify_plan(pruned)
    assert {v.kind for v in after.violations} == before, after.violations[:3]
    assert after.ok == (name != "no slot fix")
    (dev,) = [d for d in pruned.deviations if d.fix == "prune_unreachable"]
    assert dev.changes[0].startswith(f"capture: {len(full.graphs) - len(pruned.graphs)} of {len(full.graphs)}")


@pytest.mark.parametrize("name", list(SPECS))
def test_no_reachable_batch_dispatches_differently(name):
    pruned, full = _pair(name)
    a, b = Dispatcher(pruned), Dispatcher(full)
    spec = pruned.spec
    checked = 0
    for reqs in range(1, spec.scheduler.max_num_seqs + 1):
        for tokens in range(reqs, spec.scheduler.max_num_batched_tokens + 1):
            for q in {-(-tokens // reqs), tokens - reqs + 1}:
                for adapters in range(0, min(reqs, spec.lora.max_loras) + 1):
                    for base in (False, True):
                        if base and adapters == reqs:
                            continue  # every request has an adapter: no base request possible
                        batch = Batch(reqs, tokens, q, adapters, base)
                        assert a.dispatch(batch)[:6] == b.dispatch(batch)[:6], batch
                        checked += 1
    assert checked > 15000


def test_three_slots_keep_case_four_on_a_three_token_graph():
    pruned, _ = _pair("0.33 active")
    cases_at = {}
    for g in pruned.graphs:
        if g.descriptor.cg_mode == "PIECEWISE":
            cases_at.setdefault(g.descriptor.num_tokens, set()).add(g.descriptor.num_active_loras)
    assert cases_at[1] == {0, 1}
    assert cases_at[2] == {0, 1, 2}
    assert cases_at[3] == {0, 1, 2, 4}  # 2 adapters + base = 3 slots -> case 4
    assert cases_at[4] == {0, 1, 2, 4} and cases_at[6] == {0, 1, 2, 4, 5}


def test_dp_keeps_the_idle_rank_dummy_case_everywhere():
    pruned, _ = _pair("DP 2")
    at_one = {g.descriptor.num_active_loras for g in pruned.graphs if g.descriptor.num_tokens == 1}
    assert at_one == {0, 1, 5}  # 5: vLLM's dummy batch counts max_loras + 1
    assert pruned.dp.padded_tokens_lora_invariant is True
