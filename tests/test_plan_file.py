from pathlib import Path

import pytest

from capplan.errors import PlanError
from capplan.loading import load_plan
from capplan.planner import compile_plan
from capplan.planner.render import render_plan
from tests.conftest import make_spec

SPEC = make_spec(lora={"enabled": True, "max_loras": 2, "specialize_active": True}, scheduler={"max_num_seqs": 16})


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.plan.yaml"
    path.write_text(text)
    return path


def test_compile_is_byte_deterministic():
    assert render_plan(compile_plan(SPEC), "c") == render_plan(compile_plan(SPEC.model_copy()), "c")


def test_round_trip(tmp_path):
    text = render_plan(compile_plan(SPEC), "capplan compile x.yaml")
    loaded = load_plan(write(tmp_path, text))
    assert loaded == compile_plan(SPEC)
    assert render_plan(loaded, "capplan compile x.yaml") == text


def test_no_absolute_paths_or_timestamps():
    text = render_plan(compile_plan(SPEC), "capplan compile x.yaml")
    assert "/tmp" not in text and "/work" not in text and "2026" not in text


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("num_active_loras: 3}", "num_active_loras: 2}", "graphs does not match"),
        ("max_loras: 2,", "max_loras: 3,", "spec_hash does not match"),
        ("lora_dispatch_map: {1: 1, 2: 2, 3: 3}", "lora_dispatch_map: {1: 1, 2: 3, 3: 3}", "lora_dispatch_map does not match"),
        ("format_version: 1", "format_version: 2", "format_version: 2 is newer"),
        ("format_version: 1", "format_version: 0", "format_version: must be 1"),
        ("lora_dispatch_key: kernel_slots", "lora_dispatch_key: slots", "lora_dispatch_key"),
    ],
)
def test_hand_edits_are_caught(tmp_path, old, new, message):
    text = render_plan(compile_plan(SPEC), "capplan compile x.yaml")
    assert old in text
    with pytest.raises(PlanError) as info:
        load_plan(write(tmp_path, text.replace(old, new, 1)))
    assert message in info.value.one_line()


def test_unsafe_yaml_is_refused(tmp_path):
    with pytest.raises(PlanError, match="could not determine a constructor"):
        load_plan(write(tmp_path, "format_version: !!python/object/apply:os.system ['true']\n"))


def test_duplicate_keys_are_refused(tmp_path):
    with pytest.raises(PlanError, match="duplicate key 'format_version'"):
        load_plan(write(tmp_path, "format_version: 1\nformat_version: 1\n"))


@pytest.mark.parametrize(
    "line",
    [
        "  - {id: 0, descriptor: {cg_mode: on}}",
        "  - {id: 007, x: 1}",
        "  - {id: 0x1F}",
        "  - {id: 1_000}",
        "  - {a: yes, b: [1, 2]}",
        "  - {a: 1, a: 2}",
        "  - {a: [1, {b: null}], c: -3}",
    ],
)
def test_fast_flow_parser_matches_yaml_or_falls_back(tmp_path, line):
    import yaml

    from capplan.errors import PlanError as Err
    from capplan.yaml_io import read_yaml

    path = tmp_path / "x.plan.yaml"
    path.write_text(f"format_version: 1\ngraphs:\n{line}\ndispatch: []\n")
    try:
        expected = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        expected = None
    if expected is None or "a: 1, a: 2" in line:
        with pytest.raises(Err):
            read_yaml(path, "plan", Err)
    else:
        assert read_yaml(path, "plan", Err) == expected


def test_fast_parser_equals_yaml_on_examples():
    import yaml

    from capplan.errors import PlanError as Err
    from capplan.yaml_io import read_yaml

    for path in sorted(Path(__file__).resolve().parents[1].glob("examples/*.plan.yaml")):
        assert read_yaml(path, "plan", Err) == yaml.safe_load(path.read_text())


def test_fast_graph_lines_equal_generic_flow_rendering():
    from capplan.planner.render import flow

    plan = compile_plan(make_spec(lora={"enabled": True, "max_loras": 4, "specialize_active": True},
                                  target={"vllm": "0.25"}, fixes=[]))
    text = render_plan(plan, "c").splitlines()
    start = text.index("graphs:") + 1
    for graph, line in zip(plan.graphs, text[start:start + len(plan.graphs)], strict=True):
        assert line == "  - " + flow(graph.model_dump(mode="json"))
    start = text.index("dispatch:") + 1
    for row, line in zip(plan.dispatch, text[start:], strict=True):
        assert line == "  - " + flow(row.model_dump(mode="json"))


# --- the canonical fast path of load_plan -------------------------------------


def _full_load(path: Path, monkeypatch) -> object:
    import capplan.loading as loading

    with monkeypatch.context() as m:
        m.setattr(loading, "_canonical_plan", lambda _path: (None, None))
        return loading.load_plan(path)


def test_canonical_files_take_the_fast_path_and_equal_the_full_load(tmp_path, monkeypatch):
    from capplan.loading import _canonical_plan

    root = Path(__file__).resolve().parents[1]
    paths = sorted(root.glob("examples/*.plan.yaml"))
    assert len(paths) >= 5
    for path in paths:
        fast, compiled = _canonical_plan(path)
        assert fast is not None and compiled is None, path
        assert fast == _full_load(path, monkeypatch) == load_plan(path)


def test_comment_header_is_not_compared(tmp_path):
    from capplan.loading import _canonical_plan

    text = render_plan(compile_plan(SPEC), "capplan compile x.yaml")
    other = "# written by hand-rolled tooling\n#\n" + text.split("\n", 3)[3]
    assert _canonical_plan(write(tmp_path, other)) == (compile_plan(SPEC), None)


@pytest.mark.parametrize(
    "old, new",
    [
        ("graphs:\n", "graphs:\n\n"),  # a blank line: valid YAML, same data
        ("decode_query_len: 1\n", "decode_query_len:   1\n"),
        ("dispatch:\n", "# a comment\ndispatch:\n"),
        ("spec:\n  target: {runner: mrv2,", "spec:\n  target: {runner: \"mrv2\","),
        ("lora: {enabled: true,", "lora: {enabled: yes,"),
    ],
)
def test_equivalent_but_reformatted_files_load_through_yaml(tmp_path, monkeypatch, old, new):
    from capplan.loading import _canonical_plan

    text = render_plan(compile_plan(SPEC), "capplan compile x.yaml")
    assert old in text
    path = write(tmp_path, text.replace(old, new, 1))
    assert _canonical_plan(path)[0] is None
    assert load_plan(path) == compile_plan(SPEC)


def test_a_reformatted_file_is_compiled_once(tmp_path, monkeypatch):
    import capplan.planner.compiler as compiler

    text = render_plan(compile_plan(SPEC), "capplan compile x.yaml").replace("graphs:\n", "graphs:\n\n", 1)
    calls = []
    real = compiler.compile_plan
    monkeypatch.setattr(compiler, "compile_plan", lambda spec, **kw: calls.append(spec) or real(spec, **kw))
    assert load_plan(write(tmp_path, text)) == compile_plan(SPEC)
    assert len(calls) == 1  # the fast path's compile is reused by the full load's consistency check
    # A file whose spec lines the fast path could not read is still compiled (once) by the full load.
    calls.clear()
    assert load_plan(write(tmp_path, text.replace("spec:\n", "spec:\n\n", 1))) == compile_plan(SPEC)
    assert len(calls) == 1


@pytest.mark.parametrize(
    "old, new",
    [
        ("num_active_loras: 3}", "num_active_loras: 2}"),
        ("candidates: [", "candidates: [0, "),
        ("max_loras: 2,", "max_loras: 3,"),
        ("max_num_seqs: 16,", "max_num_seqs: -16,"),
        ("max_num_seqs: 16,", "max_num_seqs: \"16\\u0000\","),
        ("spec:\n  target:", "spec:\n  target: {}\n  target:"),
        ("spec:\n", "spec: {}\n"),
    ],
)
def test_edited_files_fall_back_to_the_full_load(tmp_path, old, new):
    from capplan.loading import _canonical_plan

    text = render_plan(compile_plan(SPEC), "capplan compile x.yaml")
    assert old in text
    path = write(tmp_path, text.replace(old, new, 1))
    assert _canonical_plan(path)[0] is None
    with pytest.raises(PlanError):
        load_plan(path)


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{runner: mrv2, vllm: "0.33", blackwell: false}', {"runner": "mrv2", "vllm": "0.33", "blackwell": False}),
        ("{capture_sizes: [1, 2, 4], max_capture_size: null}", {"capture_sizes": [1, 2, 4], "max_capture_size": None}),
        ('{a: "x\\"y", b: [c_d, e-f], n: -3}', {"a": 'x"y', "b": ["c_d", "e-f"], "n": -3}),
        ("[]", []),
    ],
)
def test_flow_reader_reads_what_render_writes(text, expected):
    import yaml

    from capplan.loading import _flow_as_json

    assert _flow_as_json(text) == expected == yaml.safe_load(text)


@pytest.mark.parametrize("text", ["{a: 'single'}", "{a: 1.5}", "{a: !!str 1}", "{a: &x 1}", "{a: 1", "{a: b c}"])
def test_flow_reader_refuses_anything_else(text):
    from capplan.loading import _flow_as_json

    with pytest.raises(ValueError):
        _flow_as_json(text)


@pytest.mark.parametrize("comment", ["# hi\u2028format_version: 2\n", "# hi\x85notes: 1\n", "# hi\x01\n",
                                     "# \ufffe\n", "# tab\there\n"])
def test_comments_yaml_reads_differently_go_to_the_full_load(tmp_path, monkeypatch, comment):
    from capplan.loading import _canonical_plan

    path = write(tmp_path, comment + render_plan(compile_plan(SPEC), "capplan compile x.yaml"))
    assert _canonical_plan(path) == (None, None)
    try:
        expected = _full_load(path, monkeypatch)
    except PlanError as exc:
        with pytest.raises(PlanError) as info:
            load_plan(path)
        assert info.value.one_line() == exc.one_line()
    else:
        assert load_plan(path) == expected == compile_plan(SPEC)  # the tab: a plain comment to YAML too


def test_a_small_file_naming_a_huge_spec_is_not_compiled(tmp_path, monkeypatch):
    import capplan.loading as loading

    huge = ("format_version: 1\nspec:\n  scheduler: {max_num_seqs: 1024, max_num_batched_tokens: 1048576}\n"
            "  cudagraph: {max_capture_size: 1048576}\n"
            "  lora: {enabled: true, max_loras: 512, specialize: true, specialize_active: true}\n"
            "graphs: []\n")
    monkeypatch.setattr("capplan.planner.compiler.compile_plan", lambda *_a, **_k: pytest.fail("compiled"))
    with pytest.raises(PlanError, match="is required"):
        loading.load_plan(write(tmp_path, huge))


def test_bodies_over_the_entry_limit_go_to_the_full_load(tmp_path, monkeypatch):
    import capplan.loading as loading

    text = render_plan(compile_plan(SPEC), "capplan compile x.yaml")
    path = write(tmp_path, text)
    assert loading._canonical_plan(path)[0] is not None
    monkeypatch.setattr(loading, "_CANONICAL_MAX_CHARS", len(text) // 2)
    assert loading._canonical_plan(path) == (None, None)
    assert load_plan(path) == compile_plan(SPEC)


def test_canonical_text_takes_at_least_two_characters_per_entry():
    """The bound behind _CANONICAL_MAX_CHARS, on the densest plans we make."""
    import yaml

    from capplan.loading import _past_comments
    from capplan.yaml_io import check_shape

    for spec in (SPEC, make_spec(lora={"enabled": True, "max_loras": 16, "specialize_active": True}),
                 make_spec(speculative={"num_speculative_tokens": 3}, parallel={"data_parallel_size": 4})):
        body = _past_comments(render_plan(compile_plan(spec), "c"))
        assert len(body) >= 2 * check_shape(yaml.safe_load(body), "x")


def test_the_fast_section_parser_reads_canonical_plans(monkeypatch):
    from capplan.yaml_io import _fast_plan_sections

    for path in sorted(Path(__file__).resolve().parents[1].glob("examples/*.plan.yaml")):
        assert _fast_plan_sections(path.read_text()) is not None, path


@pytest.mark.parametrize("tail", ["graphs:\ndispatch: []\n", "graphs: []\ndispatch:\n", "graphs: []\ndispatch:"])
def test_an_empty_block_section_is_null_as_yaml_reads_it(tmp_path, tail):
    from capplan.yaml_io import read_yaml

    path = write(tmp_path, "format_version: 1\n" + tail)
    assert read_yaml(path, "plan", PlanError) == {"format_version": 1, **__import__("yaml").safe_load(tail)}
