"""The example CI job's review step, run as the runner runs it (bash -eo pipefail) with this
checkout's capplan on PATH: it sorts the files as the pre-commit hook does and says what
each is (a vllm.yaml is another tool's file, not a stale plan; a plan is a plan)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
SPEC = "scheduler: {max_num_seqs: 16, max_num_batched_tokens: 64}\nlora: {enabled: true, max_loras: 4}\n"
VLLM_YAML = "model: meta-llama/Llama-3.1-8B-Instruct\nmax-num-seqs: 64\nmax-loras: 4\nport: 8000\n"
GIT = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, env={**os.environ, **GIT})


def _capplan(repo: Path, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "capplan", *args], cwd=repo, check=True, capture_output=True)


def _review(repo: Path, tmp: Path) -> tuple[int, str, str]:
    doc = yaml.safe_load((ROOT / "examples" / "ci" / "capture-plans.yml").read_text())
    [step] = [s for s in doc["jobs"]["plans"]["steps"] if s.get("name") == "review the capture plans"]
    script = re.sub(r"\$\{\{\s*github\.base_ref\s*\}\}", "main", step["run"])
    (tmp / "step.sh").write_text(script)
    summary = tmp / "summary.md"
    summary.write_text("")
    env = {
        **os.environ,
        **doc["env"],
        **{k: v.replace("${{ github.base_ref }}", "main") for k, v in step["env"].items()},
        "GITHUB_STEP_SUMMARY": str(summary),
        "RUNNER_TEMP": str(tmp),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    done = subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(tmp / "step.sh")],
        cwd=repo,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    return done.returncode, summary.read_text(), done.stderr


@pytest.fixture
def repo(tmp_path) -> Path:
    if shutil.which("capplan", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("capplan is not installed beside this Python")
    repo = tmp_path / "deployments"
    (repo / "configs").mkdir(parents=True)
    (repo / "examples").mkdir()
    (repo / "configs" / "deploy.yaml").write_text(SPEC)
    (repo / "configs" / "vllm.yaml").write_text(VLLM_YAML)  # the deployment's own vLLM config, beside the spec
    _git(repo, "init", "-q", "-b", "main")
    _capplan(repo, "compile", "configs/deploy.yaml", "--plan-dir", "examples")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "deploy")
    _git(repo, "update-ref", "refs/remotes/origin/main", "main")
    _git(repo, "checkout", "-qb", "feature")
    return repo


def test_a_vllm_config_beside_the_specs_is_said_to_be_another_tools_file(repo, tmp_path):
    code, summary, stderr = _review(repo, tmp_path)
    assert code == 0, stderr
    assert "All 1 plan(s) are what their specs compile to." in summary
    assert "Skipped (not specs):" in summary and "`configs/vllm.yaml: skipped, not a capplan spec or plan" in summary
    assert "Stale" not in summary and "unknown key" not in summary


def test_stale_plans_and_broken_specs_are_told_apart(repo, tmp_path):
    (repo / "configs" / "deploy.yaml").write_text(SPEC.replace("max_num_seqs: 16", "max_num_seqs: 8"))
    (repo / "configs" / "copy.plan.yaml").write_text((repo / "examples" / "deploy.plan.yaml").read_text())
    code, summary, _ = _review(repo, tmp_path)
    assert code == 1
    stale = summary.split("**Stale plans** (the spec changed, the plan did not):", 1)[1].split("\n\n", 2)[1]
    assert "examples/deploy.plan.yaml" in stale and "vllm.yaml" not in stale
    assert "`configs/copy.plan.yaml: skipped, a capplan plan" in summary  # not "not a capplan spec"
    (repo / "configs" / "broken.yaml").write_text("scheduler: {max_num_seqs: 0}\n")
    code, summary, _ = _review(repo, tmp_path)
    assert code == 1 and "**Specs capplan cannot compile**" in summary
    assert "configs/broken.yaml: scheduler.max_num_seqs: must be >= 1 (got 0)" in summary
    assert "**Stale plans**" not in summary  # nothing was compared: it says so, not "stale"


def test_every_checked_in_plan_spec_and_vllm_config_is_sorted_as_what_it_is(tmp_path):
    from capplan.commands.compile import yaml_kind

    for plan in (ROOT / "examples").glob("*.plan.yaml"):
        assert yaml_kind(plan) == "plan", plan
    for spec in (ROOT / "configs").glob("*.yaml"):
        assert yaml_kind(spec) == "spec", spec
    vllm = tmp_path / "vllm.yaml"
    vllm.write_text(VLLM_YAML)
    assert yaml_kind(vllm) == "other"


VALUES = st.one_of(st.none(), st.integers(), st.text(max_size=10), st.dictionaries(st.text(max_size=5), st.integers()))
KEYS = st.one_of(
    st.sampled_from(["target", "scheduler", "lora", "model", "fixes", "max-num-seqs", "port", "enable-lora", "graphs"]),
    st.text(min_size=1, max_size=12),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.dictionaries(KEYS, VALUES, max_size=6))
def test_skip_non_specs_never_breaks_on_any_yaml_mapping(tmp_path, data):
    """Any YAML mapping: skipped with a one-line note saying what it is, or read as a spec (one
    line when it is a bad one); never a traceback, never a plan called a spec or the reverse."""
    from typer.testing import CliRunner

    from capplan.cli import app

    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["compile", "--check", "--skip-non-specs", str(path)])
    assert "Traceback" not in result.output
    assert result.exit_code in (0, 1, 2), result.output
    if "skipped" in result.stderr:
        assert len(result.stderr.strip().splitlines()) == 1
        assert "a capplan plan" not in result.stderr  # these mappings are no plan files
    elif result.exit_code:
        assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1


def test_the_review_policy_leads_each_diff_and_a_denied_plan_fails_the_job(repo, tmp_path):
    (repo / ".capplan").mkdir()
    (repo / ".capplan" / "review.yaml").write_text("thresholds:\n  graphs: {deny: 5}\n  lora_case_moves: {warn: 0}\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "policy")
    (repo / "configs" / "deploy.yaml").write_text(SPEC.replace("max_loras: 4", "max_loras: 5"))
    _capplan(repo, "compile", "configs/deploy.yaml", "--plan-dir", "examples")
    _git(repo, "commit", "-qam", "max_loras 5")
    code, summary, stderr = _review(repo, tmp_path)
    assert code == 0, stderr  # a warning is shown, not a failure
    assert "⚠️ **Verdict: WARN: +" in summary
    (repo / "configs" / "deploy.yaml").write_text(SPEC.replace("max_num_seqs: 16", "max_num_seqs: 64"))
    _capplan(repo, "compile", "configs/deploy.yaml", "--plan-dir", "examples")
    _git(repo, "commit", "-qam", "max_num_seqs 64")
    code, summary, stderr = _review(repo, tmp_path)
    assert code == 4, stderr
    assert "⛔ **Verdict: DENY: +" in summary and "(over deny 5)" in summary
    assert "to accept this plan, add under overrides: in `.capplan/review.yaml`" in summary


def test_a_vllm_yaml_edit_fails_the_job_through_the_spec_that_reads_it(repo, tmp_path):
    (repo / "configs" / "deploy.yaml").write_text(
        "deployment: {config: vllm.yaml}\nscheduler: {max_num_batched_tokens: 2048, max_model_len: 4096}\n"
    )
    _capplan(repo, "compile", "configs/deploy.yaml", "--plan-dir", "examples")
    _git(repo, "commit", "-qam", "read the vLLM config")
    assert _review(repo, tmp_path)[0] == 0
    (repo / "configs" / "vllm.yaml").write_text(VLLM_YAML.replace("max-loras: 4", "max-loras: 10"))
    code, summary, _ = _review(repo, tmp_path)
    assert code == 1
    assert "configs/vllm.yaml now sets lora.max_loras 10 (--max-loras 10), the plan has 4" in summary
