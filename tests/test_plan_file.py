"""The plan file (format 2): deterministic, diff-stable text, and a loader that
accepts exactly what the embedded spec compiles to."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from capplan.errors import PlanError
from capplan.planfile import MAX_LINE, first_difference, int_runs, load_plan, plan_file_data, render_plan
from capplan.planner import compile_plan
from capplan.schemas.plan import address
from tests.conftest import make_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = make_spec(lora={"enabled": True, "max_loras": 2, "specialize_active": True}, scheduler={"max_num_seqs": 16})


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.plan.yaml"
    path.write_text(text)
    return path


def test_compile_is_byte_deterministic():
    assert render_plan(compile_plan(SPEC), "c") == render_plan(compile_plan(SPEC.model_copy()), "c")


def test_compile_is_byte_deterministic_across_processes_and_hash_seeds(tmp_path):
    """Set and dict iteration order must never reach the file: compile in two
    interpreters with different PYTHONHASHSEED and compare the bytes."""
    spec = ROOT / "configs" / "qwen3-8b-multilora.yaml"
    outputs = []
    for seed in ("1", "2"):
        (tmp_path / seed).mkdir()
        out = tmp_path / seed / "q.plan.yaml"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        code = "from capplan.cli import main; main()"
        proc = subprocess.run(
            [sys.executable, "-c", code, "compile", str(spec), "-o", str(out)],
            env=env,
            capture_output=True,
            text=True,
            cwd=tmp_path / seed,
        )
        assert proc.returncode == 0, proc.stderr
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]


def test_round_trip(tmp_path):
    text = render_plan(compile_plan(SPEC), "x.yaml")
    loaded = load_plan(write(tmp_path, text))
    assert loaded == compile_plan(SPEC)
    assert render_plan(loaded, "x.yaml") == text


def test_no_absolute_paths_timestamps_nulls_or_long_lines():
    text = render_plan(compile_plan(SPEC), "x.yaml")
    assert "/tmp" not in text and "/work" not in text and "2026" not in text
    assert "null" not in text
    assert max(len(line) for line in text.splitlines()) <= MAX_LINE


@pytest.mark.parametrize("path", sorted(ROOT.glob("examples/*.plan.yaml")), ids=lambda p: p.name)
def test_examples_read_back_as_the_format_data_with_short_lines(path):
    text = path.read_text()
    plan = load_plan(path)
    assert first_difference(yaml.safe_load(text), plan_file_data(plan)) is None
    assert max(len(line) for line in text.splitlines() if not line.startswith("#")) <= MAX_LINE
    body = text.split("\ngraphs:\n")[1].split("\ndispatch:")[0]
    assert "{id:" not in body and "null" not in text


def test_every_graph_reference_is_an_address():
    plan = compile_plan(SPEC)
    data = plan_file_data(plan)
    names = [g["graph"] for g in data["graphs"]]
    assert names == [address(g.descriptor) for g in plan.graphs] and len(set(names)) == len(names)
    assert {n for row in data["dispatch"] for n in row["graphs"]} <= set(names)


@pytest.mark.parametrize(
    "values, runs",
    [
        ([1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)], [1, 2, 4, "8..256/8", "272..512/16"]),
        ([1, 2, 3, 4, -1], ["1..4", -1]),
        ([-1], [-1]),
        ([1, 2], [1, 2]),
        ([5, 3, 1], [5, 3, 1]),
        ([], []),
    ],
)
def test_int_runs(values, runs):
    assert int_runs(values) == runs


def test_adding_a_graph_changes_only_its_lines():
    """Adding one capture size adds that size's graph lines and the dispatch rows
    around it; every other graph line stays byte-identical."""
    sizes = [1, 2, 4, 8, 16, 24, 32]
    old = render_plan(
        compile_plan(make_spec(cudagraph={"capture_sizes": sizes}, lora={"enabled": True, "max_loras": 2})), "x.yaml"
    )
    new = render_plan(
        compile_plan(
            make_spec(cudagraph={"capture_sizes": sorted([*sizes, 12])}, lora={"enabled": True, "max_loras": 2})
        ),
        "x.yaml",
    )

    def graphs(text):
        return set(text.split("\ngraphs:\n")[1].split("\n# per LoRA case")[0].splitlines())

    removed, added = graphs(old) - graphs(new), graphs(new) - graphs(old)
    assert not removed
    assert added and all(":12" in line for line in added)


@pytest.mark.parametrize(
    "old, new, message",
    [
        (
            "{graph: PIECEWISE:32@3, dummy: [[16, 2]], grid: 3}",
            "{graph: PIECEWISE:32@3, dummy: [[16, 2]], grid: 2}",
            "graphs[3] (PIECEWISE:32@3).grid: the file says 2, its spec compiles to 3",
        ),
        ("max_loras: 2,", "max_loras: 3,", "fingerprint: differs"),
        (
            "{case: 3, serves: [3], dummy_ids: [1, 2, -1]}",
            "{case: 3, serves: [3], dummy_ids: [1, 2]}",
            "lora_cases[3].dummy_ids: the file lists 2, its spec compiles to 3",
        ),
        ("format_version: 2", "format_version: 3", "format_version: 3 is newer"),
        ("format_version: 2", "format_version: 1", "a format 1 plan; this capplan reads format 2"),
        ("format_version: 2", 'format_version: "2"', "format_version: must be the integer 2"),
        ("lora_dispatch_key: kernel_slots", "lora_dispatch_key: slots", "lora_dispatch_key"),
        ("graphs: [FULL:1x1@0, PIECEWISE:1@0]", "graphs: [PIECEWISE:1@0, FULL:1x1@0]", "dispatch[0].graphs[0]"),
    ],
)
def test_hand_edits_are_caught(tmp_path, old, new, message):
    text = render_plan(compile_plan(SPEC), "x.yaml")
    assert old in text
    with pytest.raises(PlanError) as info:
        load_plan(write(tmp_path, text.replace(old, new, 1)))
    assert message in info.value.one_line()


@pytest.mark.parametrize(
    "old, new",
    [
        ("# Generated by capplan", "# Somebody renamed the spec; generated by capplan"),
        ("spec:\n  target: {runner: mrv2,", 'spec:\n  target: {runner: "mrv2",'),
        (
            "graphs:\n  - {graph: PIECEWISE:32@0, dummy: [[16, 2]], grid: 0}",
            "graphs:\n  - graph: PIECEWISE:32@0\n    grid: 0\n    dummy:\n      - [16, 2]",
        ),
        ("dp: {padded_tokens_lora_invariant: true}", "dp:\n  padded_tokens_lora_invariant: true"),
    ],
)
def test_same_content_in_another_layout_loads(tmp_path, old, new):
    """The loader compares content, not bytes: comments and YAML layout do not matter."""
    text = render_plan(compile_plan(SPEC), "x.yaml")
    assert old in text
    assert load_plan(write(tmp_path, text.replace(old, new, 1))) == compile_plan(SPEC)


def test_unsafe_yaml_is_refused(tmp_path):
    with pytest.raises(PlanError, match="could not determine a constructor"):
        load_plan(write(tmp_path, "format_version: !!python/object/apply:os.system ['true']\n"))


def test_duplicate_keys_are_refused(tmp_path):
    with pytest.raises(PlanError, match="duplicate key 'format_version'"):
        load_plan(write(tmp_path, "format_version: 2\nformat_version: 2\n"))


def test_a_small_file_naming_a_huge_spec_is_refused_before_compiling(tmp_path, monkeypatch):
    import capplan.planner.compiler as compiler

    sizes = ", ".join(map(str, range(1, 2049)))
    text = render_plan(compile_plan(SPEC), "x.yaml").replace("max_loras: 2,", "max_loras: 512,", 1)
    text = text.replace("mode: FULL_AND_PIECEWISE,", f"mode: FULL_AND_PIECEWISE, capture_sizes: [{sizes}],", 1)
    monkeypatch.setattr(compiler, "compile_plan", lambda *a, **k: pytest.fail("compiled a spec the file cannot hold"))
    with pytest.raises(PlanError, match="spec: the plan would have up to 49152 graphs, more than a plan file can hold"):
        load_plan(write(tmp_path, text))


def test_a_plan_of_no_graphs_loads(tmp_path):
    """FULL_DECODE_ONLY with one sequence and no capture size that one request fills: vLLM
    captures nothing, and the plan file of no graphs loads (the size guard against a short file
    that would buy a long compile leaves small specs alone)."""
    from capplan.loading import spec_from_data
    from capplan.planfile.read import load_plan
    from capplan.planfile.write import render_plan
    from capplan.planner import compile_plan

    spec = spec_from_data(
        {
            "target": {"vllm": "0.25"},
            "scheduler": {"max_num_seqs": 1},
            "cudagraph": {"mode": "FULL_DECODE_ONLY", "capture_sizes": [2, 4, 8, 12]},
            "lora": {"enabled": True, "max_loras": 8},
        },
        "x",
    )
    plan = compile_plan(spec)
    assert plan.graphs == []
    path = tmp_path / "x.plan.yaml"
    path.write_text(render_plan(plan, "x.yaml"))
    assert load_plan(path).graphs == []


# -- the loader's difference is a record: where the file differs, what it has, what it should --------


def test_first_difference_is_a_record_with_the_same_line():
    from capplan.planfile.compare import LoadDifference

    data = plan_file_data(compile_plan(SPEC))
    edited = yaml.safe_load(yaml.safe_dump(data))
    edited["graphs"][3]["grid"] = 2
    found = first_difference(edited, data)
    assert found == LoadDifference("graphs[3] (PIECEWISE:32@3).grid", "value", 3, 2)
    assert found.text() == str(found) == "graphs[3] (PIECEWISE:32@3).grid: the file says 2, its spec compiles to 3"
    edited["graphs"][3]["grid"] = True  # types count: true is not 1
    assert first_difference(edited, data) == LoadDifference("graphs[3] (PIECEWISE:32@3).grid", "value", 3, True)
    del edited["graphs"][3]["grid"]
    assert first_difference(edited, data) == LoadDifference("graphs[3] (PIECEWISE:32@3).grid", "missing", 3)
    assert first_difference(edited, data).text() == "graphs[3] (PIECEWISE:32@3).grid: is missing"
    swapped = yaml.safe_load(yaml.safe_dump(data))
    swapped["graphs"][0], swapped["graphs"][1] = swapped["graphs"][1], swapped["graphs"][0]
    moved = first_difference(swapped, data)
    assert moved is not None and (moved.path, moved.kind) == ("graphs[0]", "graph")
    assert (moved.actual, moved.expected) == (data["graphs"][1]["graph"], data["graphs"][0]["graph"])
    assert first_difference({**data, "notes": 1}, data) == LoadDifference("notes", "unknown_key", actual=1)
    assert first_difference([], data) == LoadDifference("the file", "type", "mapping", [])
    short = {**data, "graphs": data["graphs"][:-1]}
    assert first_difference(short, data) == LoadDifference(
        "graphs", "length", len(data["graphs"]), len(short["graphs"])
    )
    assert first_difference(short, data).text() == (
        f"graphs: the file lists {len(short['graphs'])}, its spec compiles to {len(data['graphs'])}"
    )


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "tests" / "data" / "bad").glob("plan-*.plan.yaml")))
def test_a_bad_plan_is_refused_with_the_line_of_its_difference(name):
    """The loader's refusal is the record's own line, whatever the file."""
    from capplan.errors import CapplanError
    from capplan.files import read_yaml
    from capplan.planfile import plan_from_data

    path = ROOT / "tests" / "data" / "bad" / name
    try:
        plan, found = plan_from_data(read_yaml(path, "plan", PlanError), str(path))
    except CapplanError:
        return  # refused before any comparison (YAML, format, spec)
    assert found is not None
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert info.value.message == f"{path}: {found.text()} (edited by hand, or written by another capplan version)"


def test_spec_or_plan_is_decided_in_one_place(tmp_path):
    """document_kind decides; the loaders raise typed errors saying what the file is, and diff
    names the mix-up from them."""
    from typer.testing import CliRunner

    from capplan.cli import app
    from capplan.errors import SpecError
    from capplan.loading import (
        PlanGivenForSpec,
        SpecGivenForPlan,
        document_kind,
        load_spec,
        wrong_document,
    )

    data = plan_file_data(compile_plan(SPEC))
    assert document_kind(data) == "plan"
    assert document_kind({"lora": {"enabled": True}}) == document_kind({"scheduler": {}}) == "spec"
    assert document_kind({"format_version": 2}) is None and document_kind([]) is None and document_kind({}) is None
    spec_file, plan_file = tmp_path / "s.yaml", tmp_path / "s.plan.yaml"
    spec_file.write_text("lora: {enabled: true}\n")
    plan_file.write_text(render_plan(compile_plan(SPEC), "x.yaml"))
    with pytest.raises(SpecGivenForPlan) as as_plan:
        load_plan(spec_file)
    assert isinstance(as_plan.value, PlanError) and wrong_document(as_plan.value) == "spec"
    assert "not a capplan plan (no format_version) but a spec" in as_plan.value.message
    with pytest.raises(PlanGivenForSpec) as as_spec:
        load_spec(plan_file)
    assert isinstance(as_spec.value, SpecError) and wrong_document(as_spec.value) == "plan"
    assert as_spec.value.message.endswith("this is a capture plan, not a spec")
    other = tmp_path / "other.yaml"
    other.write_text("graphs: 1\n")
    with pytest.raises(PlanError) as neither:
        load_plan(other)
    assert wrong_document(neither.value) is None
    runner = CliRunner()
    both = runner.invoke(app, ["diff", str(spec_file), str(spec_file)])
    assert both.exit_code == 1 and f"{spec_file} is a spec, not a plan" in both.stderr
    plans = runner.invoke(app, ["diff", "--spec", str(plan_file), str(plan_file)])
    assert plans.exit_code == 1 and f"{plan_file} is a plan, not a spec" in plans.stderr
    mixed = runner.invoke(app, ["diff", str(spec_file), str(plan_file)])
    assert mixed.exit_code == 1 and f"{spec_file} is a spec and {plan_file} a plan" in mixed.stderr
