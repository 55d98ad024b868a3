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
