"""The example CI workflow and the pre-commit config, copied into another repository
exactly as their comments say, install capplan from its git repository at the
release commit and do their job; the install hints of such an installation work.

The repository URL (a placeholder in the examples) is replaced by a `file://`
URL of a temporary copy of this checkout, tagged as a release is
(docs/releasing.md). Needs git and the package index (capplan's dependencies
and its build backend are installed into fresh environments, as on a CI runner).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import yaml

from capplan import __version__

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER = "https://git.example.invalid/capplan.git"
TAG = f"v{__version__}"
SPEC = "scheduler: {max_num_seqs: 16, max_num_batched_tokens: 64}\nlora: {enabled: true, max_loras: 4}\n"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}

pytestmark = [
    pytest.mark.install,
    pytest.mark.skipif(shutil.which("git") is None, reason="needs git"),
    pytest.mark.skipif(
        os.environ.get("CAPPLAN_INSTALL_TESTS") != "1",
        reason="installs capplan from git into fresh environments (about a minute): set CAPPLAN_INSTALL_TESTS=1 "
        "(.ci/run does)",
    ),
]


def run(args, cwd, env=None, check=True):
    proc = subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=300, env={**os.environ, **GIT_ENV, **(env or {})}
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def capplan_repo(tmp_path_factory) -> tuple[str, str]:
    """A copy of this checkout (its tracked and unignored files) as a git repository with the
    release tag; its file:// URL and the tagged commit."""
    repo = tmp_path_factory.mktemp("capplan-src")
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], ROOT).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, repo / name)
    run(["git", "init", "-q", "-b", "main"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "release"], repo)
    run(["git", "tag", "-a", TAG, "-m", f"capplan {__version__}"], repo)
    return repo.as_uri(), run(["git", "rev-parse", "HEAD"], repo).stdout.strip()


def consumer_repo(path: Path, plan_dir: str | None) -> Path:
    """Someone else's repository: one spec and its plan on main, `origin/main` as a checkout with
    fetch-depth 0 has it, and a branch `feature` for the pull request."""
    path.mkdir()
    run(["git", "init", "-q", "-b", "main"], path)
    (path / "configs").mkdir()
    (path / "configs" / "deploy.yaml").write_text(SPEC)
    if plan_dir:
        (path / plan_dir).mkdir()
    capplan("compile", "configs/deploy.yaml", *(["--plan-dir", plan_dir] if plan_dir else []), cwd=path)
    run(["git", "add", "-A"], path)
    run(["git", "commit", "-qm", "deploy"], path)
    run(["git", "update-ref", "refs/remotes/origin/main", "main"], path)
    run(["git", "checkout", "-qb", "feature"], path)
    return path


def capplan(*args, cwd):
    return run([sys.executable, "-m", "capplan", *args], cwd)


def pinned(text: str, url: str, commit: str) -> str:
    """The example with the placeholder URL replaced and the release commit pinned, as its
    comment says (docs/releasing.md): the URL once, pinned to COMMIT."""
    assert text.count(PLACEHOLDER) == 1, "the examples name the repository once"
    assert f"{PLACEHOLDER}@COMMIT" in text or "rev: COMMIT" in text
    return text.replace(PLACEHOLDER, url).replace("@COMMIT", f"@{commit}").replace("rev: COMMIT", f"rev: {commit}")


class Workflow:
    """Runs a GitHub Actions job of `run:` steps the way the runner does (bash -eo pipefail,
    GITHUB_STEP_SUMMARY, RUNNER_TEMP, workflow and step env, `${{ github.base_ref }}`); the
    two `uses:` steps the example has are done here: the checkout is the repository itself,
    setup-python a fresh venv first on PATH. Anything else in a step is refused."""

    def __init__(self, path: Path, runner: Path):
        self.doc = yaml.safe_load(path.read_text())
        self.runner = runner
        self.venv = runner / "python"

    def run(self, repo: Path, base_ref: str) -> tuple[int, str, str]:
        (job,) = self.doc["jobs"].values()
        temp = self.runner / "temp"
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
        summary = temp / "summary.md"
        summary.write_text("")
        env = {
            **self.doc.get("env", {}),
            "GITHUB_STEP_SUMMARY": str(summary),
            "RUNNER_TEMP": str(temp),
            "PATH": f"{self.venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
            "VIRTUAL_ENV": str(self.venv),
        }
        errors = []
        for step in job["steps"]:
            uses = step.get("uses", "")
            if uses.startswith("actions/checkout@"):
                assert step["with"]["fetch-depth"] == 0
                continue
            if uses.startswith("actions/setup-python@"):
                assert step["with"]["python-version"] == f"{sys.version_info.major}.{sys.version_info.minor}"
                if not self.venv.exists():  # setup-python's Python comes with a current pip
                    venv.create(self.venv, with_pip=True)
                    run([str(self.venv / "bin" / "python"), "-m", "pip", "install", "-q", "-U", "pip"], self.runner)
                continue
            assert set(step) <= {"name", "run", "env"}, f"step not emulated: {step}"
            script = re.sub(r"\$\{\{\s*github\.base_ref\s*\}\}", base_ref, step["run"])
            assert "${{" not in script and "${{" not in json.dumps(step.get("env", {})).replace(
                "${{ github.base_ref }}", ""
            )
            step_env = {k: v.replace("${{ github.base_ref }}", base_ref) for k, v in step.get("env", {}).items()}
            (temp / "step.sh").write_text(script)
            proc = subprocess.run(
                ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(temp / "step.sh")],
                cwd=repo,
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, **GIT_ENV, **env, **step_env},
            )
            errors.append(proc.stderr)
            if proc.returncode != 0:
                return proc.returncode, summary.read_text(), "".join(errors)
        return 0, summary.read_text(), "".join(errors)


def test_the_example_workflow_copied_into_another_repository(capplan_repo, tmp_path):
    url, commit = capplan_repo
    repo = consumer_repo(tmp_path / "deployments", plan_dir="examples")
    # "copy this one file to .github/workflows/capture-plans.yml"; then set the capplan URL.
    workflow = repo / ".github" / "workflows" / "capture-plans.yml"
    workflow.parent.mkdir(parents=True)
    workflow.write_text(pinned((ROOT / "examples" / "ci" / "capture-plans.yml").read_text(), url, commit))
    job = Workflow(workflow, tmp_path / "runner")

    # A pull request that changes the spec and its plan, and adds a second spec.
    spec = repo / "configs" / "deploy.yaml"
    spec.write_text(SPEC.replace("max_num_seqs: 16", "max_num_seqs: 8"))
    (repo / "configs" / "small.yaml").write_text(SPEC.replace("max_loras: 4", "max_loras: 2"))
    capplan("compile", "configs/deploy.yaml", "configs/small.yaml", "--plan-dir", "examples", cwd=repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "smaller batches"], repo)
    code, summary, stderr = job.run(repo, base_ref="main")
    assert code == 0, stderr
    assert "All 2 plan(s) are what their specs compile to." in summary
    assert "### capplan plan diff: `origin/main:examples/deploy.plan.yaml` → `examples/deploy.plan.yaml`" in summary
    assert "scheduler.max_num_seqs: 16 -> 8" in summary and "| graphs |" in summary
    assert "### New plan `examples/small.plan.yaml`" in summary

    # capplan came from the repository at the tag, and its install hints name that commit.
    python = job.venv / "bin" / "python"
    record = json.loads(run([str(python), "-c", DIRECT_URL], repo).stdout)
    assert record["url"] == url and record["vcs_info"]["commit_id"] == commit
    assert record["vcs_info"]["requested_revision"] == commit
    hint = run([str(python), "-c", "from capplan.install_hints import pip_install; print(pip_install('plot'))"], repo)
    local = url.replace("file:///", "file://localhost/")  # a host, for the pip Python 3.11 ships
    assert hint.stdout.strip() == f"pip install 'capplan[plot] @ git+{local}@{commit}'"

    # The spec changes again and the plan is not recompiled: the job fails and says what to run.
    spec.write_text(SPEC.replace("max_num_seqs: 16", "max_num_seqs: 4"))
    run(["git", "commit", "-qam", "even smaller"], repo)
    code, summary, stderr = job.run(repo, base_ref="main")
    assert code == 1
    assert "run capplan compile configs/deploy.yaml -o examples/deploy.plan.yaml" in stderr
    assert "**Stale plans**" in summary
    assert "spec.scheduler.max_num_seqs: the file says 8, its spec compiles to 4" in summary
    assert "scheduler.max_num_seqs: 16 -> 8" in summary  # the diff is still there for the reviewer


DIRECT_URL = "import importlib.metadata as m; print(m.distribution('capplan').read_text('direct_url.json'))"


def test_the_apply_hint_installs_the_plugin_where_vllm_runs(capplan_repo, tmp_path):
    """`apply` against a Python without capplan's plugin prints a command; run as printed, it
    installs the plugin there from the same source, and the same check then passes it."""
    url, commit = capplan_repo
    here = tmp_path / "capplan-env"
    venv.create(here, with_pip=True)
    local = url.replace("file:///", "file://localhost/")  # the pip of a fresh venv needs a host
    run([str(here / "bin" / "python"), "-m", "pip", "install", "-q", f"capplan @ git+{local}@{TAG}"], tmp_path)
    engine = tmp_path / "engine-env"  # vLLM's environment: a stand-in vllm package, no capplan
    venv.create(engine, with_pip=True)
    (site,) = (engine / "lib").glob("python*/site-packages")
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text("")
    plan = ROOT / "examples" / "h200-tiny-llama-025.plan.yaml"
    apply = [str(here / "bin" / "capplan"), "apply", "--runner", "mrv2", str(plan), "--"]
    refused = run([*apply, str(engine / "bin" / "python"), "-c", "print('served')"], tmp_path, check=False)
    assert refused.returncode == 1
    line = refused.stderr.strip().splitlines()[-1]
    prefix = f"error: capplan's vLLM plugin is not installed for {engine / 'bin' / 'python'}"
    assert line.startswith(prefix), line
    hint = re.fullmatch(r".*, so vLLM would run without the plan \((.*)\)", line).group(1)
    local = url.replace("file:///", "file://localhost/")
    assert hint == f"{engine / 'bin' / 'python'} -m pip install 'capplan @ git+{local}@{commit}'"
    run(["bash", "-c", hint], tmp_path)
    served = run([*apply, str(engine / "bin" / "python"), "-c", "print('served')"], tmp_path, check=False)
    assert "plugin is not installed" not in served.stderr and "served" in served.stdout, served.stderr


def test_the_precommit_config_copied_into_another_repository(capplan_repo, tmp_path):
    pytest.importorskip("pre_commit")
    url, commit = capplan_repo
    repo = consumer_repo(tmp_path / "deployments", plan_dir=None)
    # The snippet in .pre-commit-hooks.yaml's comment, as a user pastes it.
    comment = (ROOT / ".pre-commit-hooks.yaml").read_text().split("\n- id:", 1)[0]
    snippet = comment.split("#   repos:\n", 1)[1]
    config = "repos:\n" + "\n".join(line.removeprefix("#   ") for line in snippet.splitlines()) + "\n"
    (repo / ".pre-commit-config.yaml").write_text(pinned(config, url, commit))
    run(["git", "add", "-A"], repo)
    env = {"PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home")}
    hook = [sys.executable, "-m", "pre_commit", "run", "--all-files"]
    ok = run(hook, repo, env=env, check=False)
    assert ok.returncode == 0 and "capplan plans are up to date" in ok.stdout and "Passed" in ok.stdout, ok.stdout
    (repo / "configs" / "deploy.yaml").write_text(SPEC.replace("max_loras: 4", "max_loras: 2"))
    stale = run(hook, repo, env=env, check=False)
    assert stale.returncode == 1 and "Failed" in stale.stdout
    assert "plan is stale" in stale.stdout and "run capplan compile configs/deploy.yaml" in stale.stdout
