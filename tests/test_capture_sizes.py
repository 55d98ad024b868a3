from capplan.planner.capture_sizes import resolve_capture_sizes
from tests.conftest import make_spec

STRIDE_512 = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]


def test_025_default_for_256_seqs():
    sizes, top = resolve_capture_sizes(make_spec(target={"vllm": "0.25"}))
    assert sizes == STRIDE_512 and top == 512 and len(sizes) == 51


def test_default_ceiling_follows_max_num_seqs_and_spec_tokens():
    spec = make_spec(target={"vllm": "0.25"}, scheduler={"max_num_seqs": 8}, speculative={"num_speculative_tokens": 2})
    assert resolve_capture_sizes(spec) == ([1, 2, 4, 8, 16, 24, 32, 40, 48], 48)


def test_033_adds_uniform_decode_sizes():
    # decode_query_len 3: request counts 1, 2, 4, 8, ... times 3 are appended.
    spec = make_spec(scheduler={"max_num_seqs": 8}, speculative={"num_speculative_tokens": 2})
    sizes, top = resolve_capture_sizes(spec)
    assert {3, 6, 12, 24} <= set(sizes) and top == 48
    assert sizes == sorted(set(sizes))


def test_033_adds_off_stride_max_num_seqs():
    sizes, _ = resolve_capture_sizes(make_spec(scheduler={"max_num_seqs": 100}))
    assert 100 in sizes
    sizes, _ = resolve_capture_sizes(make_spec(target={"vllm": "0.25"}, scheduler={"max_num_seqs": 100}))
    assert 100 not in sizes


def test_033_blackwell_ceiling():
    sizes, top = resolve_capture_sizes(
        make_spec(scheduler={"max_num_seqs": 1024, "max_num_batched_tokens": 16384}, target={"blackwell": True})
    )
    assert top == 1024
    _, top_025 = resolve_capture_sizes(
        make_spec(
            scheduler={"max_num_seqs": 1024, "max_num_batched_tokens": 16384},
            target={"vllm": "0.25", "blackwell": True},
        )
    )
    assert top_025 == 512


def test_budget_below_ceiling_is_captured():
    sizes, top = resolve_capture_sizes(make_spec(scheduler={"max_num_seqs": 256, "max_num_batched_tokens": 300}))
    assert top == 300 and 300 in sizes and max(sizes) == 300


def test_interactivity_captures_every_size_to_32():
    sizes, _ = resolve_capture_sizes(make_spec(cudagraph={"performance_mode": "interactivity"}))
    assert sizes[:32] == list(range(1, 33))


def test_explicit_sizes_and_truncated_max():
    spec = make_spec(cudagraph={"capture_sizes": [3, 5, 17]})
    assert resolve_capture_sizes(spec) == ([3, 5, 17], 17)
    # An off-grid max is truncated to the largest grid size, as vLLM does.
    sizes, top = resolve_capture_sizes(make_spec(cudagraph={"max_capture_size": 300}))
    assert top == 288 and sizes[-1] == 288


def test_mode_none_captures_nothing():
    assert resolve_capture_sizes(make_spec(cudagraph={"mode": "NONE"})) == ([], 0)


def test_a_given_size_above_the_token_budget_is_dropped_as_vllm_drops_it():
    """vLLM's _set_cudagraph_sizes keeps the given sizes at most max_num_batched_tokens."""
    spec = make_spec(
        scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 256, "max_model_len": 4096},
        cudagraph={"capture_sizes": [1, 2, 4, 8, 16, 512]},
    )
    assert resolve_capture_sizes(spec) == ([1, 2, 4, 8, 16], 16)
