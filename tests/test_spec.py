import pytest
from pydantic import ValidationError

from capplan.errors import SpecError
from capplan.loading import spec_from_data
from capplan.schemas.spec import ALL_FIXES, CudagraphMode, Spec


def test_defaults_are_vllm_defaults():
    spec = Spec()
    assert spec.target.vllm == "0.33"
    assert spec.scheduler.max_num_seqs == 256
    assert spec.cudagraph.mode is CudagraphMode.FULL_AND_PIECEWISE
    assert spec.lora.specialize is True and spec.lora.specialize_active is False
    assert spec.fixes == list(ALL_FIXES)
    assert spec.decode_query_len == 1


def test_unquoted_version_is_accepted():
    assert Spec.model_validate({"target": {"vllm": 0.25}}).target.vllm == "0.25"


def test_fixes_are_canonicalised():
    spec = Spec.model_validate({"fixes": ["mixed_ranges", "lora_slot"]})
    assert [f.value for f in spec.fixes] == ["lora_slot", "mixed_ranges"]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"lora": {"max_loras": 0}}, "lora.max_loras: must be >= 1 (got 0)"),
        (
            {"lora": {"max_lora": 2}},
            "lora.max_lora: unknown key; known keys: enabled, max_loras, specialize, specialize_active",
        ),
        ({"speculative": {"num_speculative_tokens": 17}}, "speculative.num_speculative_tokens: must be <= 16 (got 17)"),
        (
            {"cudagraph": {"mode": "FULLY"}},
            "cudagraph.mode: must be one of NONE | PIECEWISE | FULL | FULL_DECODE_ONLY | FULL_AND_PIECEWISE (got 'FULLY')",
        ),
        (
            {"cudagraph": {"capture_sizes": [1, 4, 2]}},
            "cudagraph.capture_sizes: unsorted size 2 after 4; list sizes strictly increasing",
        ),
        ({"cudagraph": {"capture_sizes": [1, 2, 2]}}, "cudagraph.capture_sizes: duplicate size 2 after 2"),
        ({"cudagraph": {"capture_sizes": [1, 9000]}}, "size 9000 exceeds scheduler.max_num_batched_tokens (8192)"),
        (
            {"cudagraph": {"capture_sizes": [1, 8], "max_capture_size": 16}},
            "max_capture_size (16) must equal the largest capture size (8)",
        ),
        ({"target": {"vllm": "0.30"}}, 'target.vllm: name the release: "0.30.0"'),
        (
            {"scheduler": {"max_num_seqs": 512, "max_num_batched_tokens": 256}},
            "max_num_batched_tokens (256) must be >= max_num_seqs (512)",
        ),
        ({"lora": {"enabled": "yes"}}, "lora.enabled: must be true or false (got 'yes')"),
        ({"fixes": ["lora_slot", "lora_slot"]}, "fixes: lists a fix twice"),
        ({"fixes": ["faster"]}, "fixes: unknown fix 'faster'"),
    ],
)
def test_bad_spec_gives_one_line_with_field_path(data, message):
    with pytest.raises(SpecError) as info:
        spec_from_data(data, "deploy.yaml")
    line = info.value.one_line()
    assert "\n" not in line
    assert line.startswith("deploy.yaml: ")
    assert message in line


def test_spec_is_frozen():
    with pytest.raises(ValidationError):
        Spec().scheduler.max_num_seqs = 3
