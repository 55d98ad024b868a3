"""Graph counts against what vLLM 0.25.0 MRV2 logged on the H200 (VLLM_NOTES.md)."""

import pytest

from capplan.planner import compile_plan
from tests.conftest import make_spec

CALIBRATION = [
    # (lora section, PIECEWISE, FULL) for max_num_seqs 256, FULL_AND_PIECEWISE, vLLM 0.25
    ({"enabled": False}, 51, 35),
    ({"enabled": True, "max_loras": 4}, 102, 70),
    ({"enabled": True, "max_loras": 4, "specialize_active": True}, 255, 175),
]


@pytest.mark.parametrize("lora, piecewise, full", CALIBRATION)
def test_graph_counts_match_vllm_logs(lora, piecewise, full):
    plan = compile_plan(make_spec(target={"vllm": "0.25"}, lora=lora, fixes=[]))
    assert plan.stats["total"]["PIECEWISE"] == piecewise
    assert plan.stats["total"]["FULL"] == full


@pytest.mark.parametrize("specialize_active, piecewise, full", [(False, 22, 14), (True, 55, 35)])
def test_tiny_llama_counts_match_h200_run(specialize_active, piecewise, full):
    plan = compile_plan(
        make_spec(
            target={"vllm": "0.25"},
            scheduler={"max_num_seqs": 32, "max_num_batched_tokens": 2048, "max_model_len": 512},
            lora={"enabled": True, "max_loras": 4, "specialize_active": specialize_active},
            fixes=[],
        )
    )
    assert (plan.stats["total"]["PIECEWISE"], plan.stats["total"]["FULL"]) == (piecewise, full)


def test_capture_order_piecewise_first_largest_first():
    plan = compile_plan(make_spec(lora={"enabled": True, "max_loras": 2}))
    modes = [d.cg_mode for d in plan.descriptors]
    assert modes == sorted(modes, key=lambda m: m != "PIECEWISE")
    for mode in ("PIECEWISE", "FULL"):
        tokens = [d.num_tokens for d in plan.descriptors if d.cg_mode == mode]
        assert tokens == sorted(tokens, reverse=True)
    # Equal token counts keep LoRA-case order.
    first = [d.num_active_loras for d in plan.descriptors if d.num_tokens == 512]
    assert first == [0, 3]


def test_uniform_decode_descriptors_round_to_decode_query_len():
    plan = compile_plan(
        make_spec(scheduler={"max_num_seqs": 8}, speculative={"num_speculative_tokens": 2}, target={"vllm": "0.25"})
    )
    full = [(d.num_tokens, d.num_reqs, d.uniform_token_count) for d in plan.descriptors if d.cg_mode == "FULL"]
    assert full == [(24, 8, 3), (18, 6, 3), (9, 3, 3), (6, 2, 3), (3, 1, 3)]


def test_modes():
    def modes(mode):
        plan = compile_plan(make_spec(cudagraph={"mode": mode}, scheduler={"max_num_seqs": 4}))
        return {(d.cg_mode, d.num_reqs is None, d.uniform_token_count) for d in plan.descriptors}

    assert modes("PIECEWISE") == {("PIECEWISE", True, None)}
    assert modes("FULL") == {("FULL", False, None)}
    assert modes("FULL_DECODE_ONLY") == {("FULL", False, 1)}
    assert modes("FULL_AND_PIECEWISE") == {("FULL", False, 1), ("PIECEWISE", True, None)}
    assert modes("NONE") == set()
