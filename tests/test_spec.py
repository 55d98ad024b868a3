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
            "lora.max_lora: unknown key; known keys: enabled, max_lora_rank, max_loras, specialize, specialize_active",
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
        ({"cudagraph": {"capture_sizes": [9000, 9001]}}, "every size exceeds scheduler.max_num_batched_tokens (8192)"),
        (
            {"cudagraph": {"capture_sizes": [1, 8], "max_capture_size": 16}},
            "max_capture_size (16) must equal the largest capture size (8)",
        ),
        ({"target": {"vllm": "0.27"}}, 'target.vllm: name the release: "0.27.0" or "0.27.1"'),
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


def test_a_minor_version_names_its_one_supported_release():
    """`target.vllm: "0.32"` is 0.32.0, the one 0.32 release capplan supports (as the default
    "0.33" is an alias); a minor version with several supported releases is refused, naming them."""
    from capplan.releases import ALIASES, RELEASES
    from tests.conftest import make_spec

    for release in RELEASES:
        minor = release.rsplit(".", 1)[0]
        same = [r for r in RELEASES if r.rsplit(".", 1)[0] == minor]
        if minor in ALIASES:
            assert make_spec(target={"vllm": minor}).target.vllm == minor
        elif len(same) == 1:
            assert make_spec(target={"vllm": minor}).target.vllm == release
    assert make_spec(target={"vllm": "0.32"}).target.vllm == "0.32.0"


def test_schema_defaults_is_a_spec_of_every_default_with_each_field_described():
    import yaml
    from typer.testing import CliRunner

    from capplan.cli import app

    out = CliRunner().invoke(app, ["schema", "--defaults"])
    assert out.exit_code == 0, out.output
    data = yaml.safe_load(out.stdout)
    assert spec_from_data(data, "defaults") == Spec()
    for name, field in Spec.model_fields.items():
        assert name in data
        sub = getattr(field.annotation, "model_fields", {})
        assert set(sub) <= set(data[name] or {})
    assert out.stdout.count("\n# ") + out.stdout.count("\n  # ") >= len(Spec.model_fields)


def test_any_target_vllm_is_a_release_or_one_line():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from capplan.releases import RELEASES, TARGETS

    @settings(max_examples=200, deadline=None)
    @given(st.one_of(st.sampled_from([*TARGETS, "0.27", "0.32", "0.30", "0.34", "1", "0.3"]), st.text(max_size=8)))
    def check(value):
        try:
            spec = spec_from_data({"target": {"vllm": value}}, "s.yaml")
        except SpecError as exc:
            assert "\n" not in exc.one_line() and exc.one_line().startswith("s.yaml: target.vllm: ")
            return
        assert spec.target.vllm in TARGETS
        assert spec.target.vllm == value or spec.target.vllm in RELEASES and spec.target.vllm.startswith(value + ".")

    check()
