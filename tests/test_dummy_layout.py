from capplan.planner import compile_plan
from capplan.planner.dummy_layout import dummy_lora_ids, token_runs
from tests.conftest import make_spec


def test_seed_004_remainder():
    # 496 tokens over 256 dummy requests: vLLM 0.25 piles 240 extra tokens on one.
    assert token_runs(496, 256, spread=False) == [(255, 1), (1, 241)]
    assert token_runs(496, 256, spread=True) == [(16, 1), (240, 2)]
    assert token_runs(512, 128, spread=False) == [(128, 4)]
    assert token_runs(7, 1, spread=True) == [(1, 7)]


def test_remainder_fix_only_matters_on_025():
    for version, fixes, longest in (("0.25", [], 241), ("0.25", ["dummy_remainder"], 2), ("0.33", [], 2)):
        plan = compile_plan(make_spec(target={"vllm": version}, fixes=fixes))
        assert max(g.dummy.max_query_len for g in plan.graphs) == longest


def test_piled_dummy_over_max_model_len_is_reported():
    spec = dict(
        target={"vllm": "0.25"},
        scheduler={"max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_model_len": 256},
        cudagraph={"mode": "PIECEWISE", "capture_sizes": [767]},
    )
    exact = compile_plan(make_spec(**spec, fixes=[]))
    assert exact.graphs[0].dummy.max_query_len == 257  # 2 each, 255 piled on the last
    fixed = compile_plan(make_spec(**spec, fixes=["dummy_remainder"]))
    assert fixed.graphs[0].dummy.max_query_len == 3
    (dev,) = fixed.deviations
    assert "257 -> 3 tokens (max_model_len 256: 1 -> 0 over)" in dev.changes[0]


def test_lora_ids_and_no_adapter_slot():
    spec = make_spec(lora={"enabled": True, "max_loras": 4, "specialize_active": True}, fixes=[])
    assert dummy_lora_ids(0, spec) == [-1]
    assert dummy_lora_ids(2, spec) == [1, 2]
    assert dummy_lora_ids(5, spec) == [1, 2, 3, 4]  # vLLM: no -1 row despite its comment
    fixed = make_spec(lora={"enabled": True, "max_loras": 4, "specialize_active": True})
    assert dummy_lora_ids(5, fixed) == [1, 2, 3, 4, -1]
    assert dummy_lora_ids(3, make_spec()) is None


def test_every_lora_graph_records_lora_kernels():
    # Failure class 1: a case > 0 graph must never be captured with all -1 ids.
    plan = compile_plan(make_spec(lora={"enabled": True, "max_loras": 8, "specialize_active": True}))
    for g in plan.graphs:
        assert (g.dummy.kernel_grid > 0) == (g.descriptor.num_active_loras > 0)
