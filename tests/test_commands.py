"""The commands layer called as a library: typed arguments in, result objects out,
nothing printed, and the decisions the command line used to hold testable alone."""

from pathlib import Path

import pytest

from capplan.commands.compile import (
    CompileOptions,
    compile_specs,
    looks_like_spec,
    plan_targets,
    refuse_stale,
    settle,
)
from capplan.errors import CapplanError, StalePlansError, UsageError
from capplan.planfile import default_plan_path, regenerate_command, stale_reason

SPEC = """\
target: {runner: mrv2, vllm: "0.33"}
scheduler: {max_num_seqs: 8, max_num_batched_tokens: 512, max_model_len: 1024}
cudagraph: {mode: FULL_AND_PIECEWISE, capture_sizes: [1, 2, 4, 8]}
"""


@pytest.fixture
def spec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "deploy.yaml"
    path.write_text(SPEC)
    return path


def test_compile_writes_then_finds_the_plan_unchanged_then_up_to_date(spec, capsys):
    options = CompileOptions()
    [job] = compile_specs([spec], options)
    assert job.plan_path == spec.with_name("deploy.plan.yaml") and not job.plan_path.exists()
    assert settle(job, options, [spec]).action == "wrote"
    assert job.plan_path.read_text() == job.text
    assert settle(job, options, [spec]).action == "unchanged"
    checked = settle(job, CompileOptions(check=True))
    assert (checked.action, checked.stale) == ("up to date", None)
    assert capsys.readouterr() == ("", "")  # the library prints nothing


def test_check_names_the_command_that_regenerates_a_stale_plan(spec):
    options = CompileOptions(check=True)
    [job] = compile_specs([spec], options)
    job.plan_path.write_text(job.text.replace("max_capture_size: 8", "max_capture_size: 9"))
    outcome = settle(job, options)
    assert outcome.action == "stale"
    assert outcome.stale == (
        f"plan is stale ({job.plan_path}: max_capture_size: the file says 9, its spec compiles to 8): "
        "run capplan compile deploy.yaml"
    )
    with pytest.raises(StalePlansError) as raised:
        refuse_stale([outcome, outcome])
    assert raised.value.message == outcome.stale and raised.value.earlier == [outcome.stale]
    refuse_stale([settle(job, CompileOptions(dry_run=True))])  # nothing stale: no error


def test_stale_reason_says_what_is_wrong_with_the_file(spec, tmp_path):
    [job] = compile_specs([spec], CompileOptions(dry_run=True))
    missing = tmp_path / "none.plan.yaml"
    assert stale_reason(missing, job.data) == f"{missing} does not exist"
    old = tmp_path / "old.plan.yaml"
    old.write_text("format_version: 1\n")
    assert stale_reason(old, job.data) == f"{old} is format 1, this capplan writes format 2"
    listed = tmp_path / "list.plan.yaml"
    listed.write_text("- 1\n")
    assert stale_reason(listed, job.data) == f"{listed} is format None, this capplan writes format 2"
    job.plan_path.write_text(job.text)
    assert stale_reason(job.plan_path, job.data) is None


def test_two_specs_that_would_write_one_plan_are_refused_before_anything(spec, tmp_path):
    other = tmp_path / "sub" / "deploy.yaml"
    other.parent.mkdir()
    other.write_text(SPEC)
    with pytest.raises(UsageError, match="would both be written to"):
        plan_targets([spec, other], CompileOptions(plan_dir=tmp_path))
    with pytest.raises(UsageError, match="-o names one plan"):
        plan_targets([spec, other], CompileOptions(output=tmp_path / "x.plan.yaml"))
    assert plan_targets([spec, other], CompileOptions()) == [
        (spec, spec.with_name("deploy.plan.yaml")),
        (other, other.with_name("deploy.plan.yaml")),
    ]


def test_non_specs_are_skipped_with_a_note(spec, tmp_path):
    ci = tmp_path / "ci.yaml"
    ci.write_text("jobs: {build: {runs-on: ubuntu}}\n")
    notes: list[str] = []
    targets = plan_targets([ci, spec], CompileOptions(skip_non_specs=True), notes.append)
    assert targets == [(spec, spec.with_name("deploy.plan.yaml"))]
    assert notes == [f"{ci}: skipped, not a capplan spec or plan (no spec section: another tool's YAML)"]


@pytest.mark.parametrize(
    "text, is_spec",
    [
        (SPEC, True),
        ("scheduler: {max_num_seqs: 0}\n", True),  # an invalid spec is still a spec: its load says why
        ('{"lora": {"enabled": true}}', True),
        ("apiVersion: v1\nkind: Pod\n", False),
        ("--- \na: 1\n--- \nb: 2\n", False),  # several documents, no spec section
        ("--- \nlora: {}\n--- \nb: 2\n", True),  # several documents, a line starts a spec section
        ("format_version: 2\ngraphs: []\nlora: {}\n", False),  # a plan
        ("", False),
    ],
)
def test_looks_like_spec(tmp_path, text, is_spec):
    path = tmp_path / "some.yaml"
    path.write_text(text)
    assert looks_like_spec(path) is is_spec


def test_plan_paths_and_the_regenerate_command(tmp_path):
    spec = tmp_path / "configs" / "deploy.yml"
    assert default_plan_path(spec) == tmp_path / "configs" / "deploy.plan.yaml"
    assert regenerate_command(spec, default_plan_path(spec), tmp_path) == "capplan compile configs/deploy.yml"
    elsewhere = tmp_path / "examples" / "d.plan.yaml"
    assert regenerate_command(spec, elsewhere, tmp_path / "examples") == (
        "capplan compile ../configs/deploy.yml -o d.plan.yaml"
    )


def test_a_plan_no_command_could_load_is_refused_before_writing(tmp_path, monkeypatch):
    from capplan.commands import compile as compile_command

    spec = tmp_path / "deploy.yaml"
    spec.write_text(SPEC)
    monkeypatch.setattr("capplan.planfile.compare.MAX_FILE_BYTES", 100)
    with pytest.raises(CapplanError, match="so no command could load it"):
        compile_command.compile_specs([spec], CompileOptions())
    assert not default_plan_path(spec).exists()


def test_dispatch_answers_with_data(tmp_path):
    from capplan.commands.inspect import DispatchQuestion, Explained, dispatch

    root = Path(__file__).resolve().parents[1]
    plan = root / "examples" / "qwen3-8b-multilora.plan.yaml"
    result = dispatch(DispatchQuestion(plan, reqs=3, tokens=17, loras=2, base=True))
    assert isinstance(result, Explained)
    assert result.dispatch.num_tokens >= 17 and result.trace
    with pytest.raises(UsageError, match="give --reqs and --tokens"):
        dispatch(DispatchQuestion(plan, reqs=3))
