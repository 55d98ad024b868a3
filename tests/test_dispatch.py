import pytest

from capplan.planner import Batch, Dispatcher, compile_plan
from capplan.planner.dispatch import derive_uniform
from capplan.planner.lora_cases import kernel_slots
from capplan.releases import rules_of
from tests.conftest import make_spec

SMALL = dict(
    scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 512},
    cudagraph={"capture_sizes": [1, 2, 4, 8]},
    speculative={"num_speculative_tokens": 2},
)


def dispatch(spec, **batch):
    return Dispatcher(compile_plan(spec)).dispatch(Batch(**batch))


def test_025_union_ranges_send_mixed_5_token_batch_eager():
    batch = dict(num_reqs=2, num_tokens=5, max_query_len=3)
    assert dispatch(make_spec(**SMALL, target={"vllm": "0.25"}, fixes=[]), **batch).cg_mode == "NONE"
    on_033 = dispatch(make_spec(**SMALL, fixes=[]), **batch)
    assert (on_033.cg_mode, on_033.num_tokens) == ("PIECEWISE", 8)
    fixed = dispatch(make_spec(**SMALL, target={"vllm": "0.25"}, fixes=["mixed_ranges"]), **batch)
    assert fixed == on_033


def test_uniform_decode_batch_replays_full_graph():
    desc = dispatch(make_spec(**SMALL), num_reqs=2, num_tokens=6, max_query_len=3)
    assert (desc.cg_mode, desc.num_tokens, desc.num_reqs, desc.uniform_token_count) == ("FULL", 6, 2, 3)


def test_033_keeps_prefill_out_of_decode_graphs():
    batch = dict(num_reqs=2, num_tokens=6, max_query_len=3, has_prefill=True)
    assert dispatch(make_spec(**SMALL), **batch).cg_mode == "PIECEWISE"
    assert dispatch(make_spec(**SMALL, target={"vllm": "0.25"}), **batch).cg_mode == "FULL"


def test_uniform_derivation_rules():
    old, new = rules_of("0.27.1"), rules_of("0.28.0")  # from 0.28 a prefill breaks uniformity
    assert derive_uniform(Batch(4, 8, 2), old) == 2
    assert derive_uniform(Batch(4, 8, 3), old) is None
    assert derive_uniform(Batch(4, 8, 2, has_prefill=True), old) == 2
    assert derive_uniform(Batch(4, 8, 2, has_prefill=True), new) is None
    assert derive_uniform(Batch(4, 8, 2), new) == 2
    assert derive_uniform(Batch(4, 8, 3, uniform_token_count=7), new) == 7


def test_above_largest_graph_is_eager():
    desc = dispatch(make_spec(**SMALL), num_reqs=3, num_tokens=9 * 100, max_query_len=300)
    assert desc.cg_mode == "NONE" and desc.num_tokens == 900


ACTIVE = dict(lora={"enabled": True, "max_loras": 4, "specialize_active": True})


@pytest.mark.parametrize("adapters, exact_case, fixed_case", [(1, 1, 2), (2, 2, 4), (3, 4, 4), (4, 4, 5)])
def test_lora_slot_counts_the_base_slot(adapters, exact_case, fixed_case):
    batch = dict(num_reqs=8, num_tokens=8, max_query_len=1, num_active_loras=adapters, base=True)
    assert dispatch(make_spec(**ACTIVE, fixes=[]), **batch).num_active_loras == exact_case
    assert dispatch(make_spec(**ACTIVE), **batch).num_active_loras == fixed_case
    # Without base requests the fix changes nothing.
    no_base = dict(batch, base=False)
    # (graph ids differ: the fixed plan prunes graphs no batch can reach)
    assert dispatch(make_spec(**ACTIVE), **no_base)[:6] == dispatch(make_spec(**ACTIVE, fixes=[]), **no_base)[:6]


def _grid_covers_slots(spec) -> list[tuple[int, bool, int]]:
    """(adapters, base, num_reqs) batches whose replayed graph's kernel grid is short."""
    plan = compile_plan(spec)
    dispatcher = Dispatcher(plan)
    short = []
    for reqs in range(1, 9):
        for adapters in range(0, min(reqs, 4) + 1):
            for base in (False, True):
                if base and adapters == reqs:
                    continue
                desc = dispatcher.dispatch(Batch(reqs, reqs, 1, adapters, base))
                grid = plan.graphs[desc.graph_id].dummy.kernel_grid
                if desc.cg_mode != "NONE" and grid < kernel_slots(adapters, base):
                    short.append((adapters, base, reqs))
    return short


def test_vllm_plan_drops_an_adapter_and_the_fixed_plan_does_not():
    # Failure class 6: reproduce the bug seen on the H200, then show it gone.
    short = _grid_covers_slots(make_spec(**ACTIVE, fixes=[]))
    assert {(a, b) for a, b, _ in short} == {(1, True), (2, True), (4, True)}
    assert _grid_covers_slots(make_spec(**ACTIVE)) == []


def test_explain_says_why():
    plan = compile_plan(make_spec(**SMALL, **ACTIVE))
    trace: list[str] = []
    Dispatcher(plan).explain(Batch(2, 5, 3, 1, True), trace)
    assert trace[1] == "LoRA: 1 adapter(s) + base requests -> 2 kernel slots -> case 2"
    assert trace[2].startswith("skips FULL:6 tokens") and "not uniform" in trace[2]
    assert trace[3] == "replays PIECEWISE:8 tokens, LoRA case 2"


def test_smoke_batches_hold_exactly_k_adapters_plus_base():
    from capplan.offline.smoke import assign_adapters

    for k in range(0, 5):
        for base in (False, True):
            loras = assign_adapters(["a", "b", "c", "d"], k, base, 8)
            assert len({x for x in loras if x is not None}) == k
            assert (None in loras) == (base or k == 0)
