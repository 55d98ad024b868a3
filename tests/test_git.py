"""Plans in git: `capplan git-setup` makes `git diff` semantic. Real git, temporary
repositories. (The pull-request workflow in examples/ci/: tests/test_install_from_git.py.)"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or shutil.which("capplan", path=str(BIN)) is None,
    reason="needs git and the capplan command next to this Python",
)
SPEC = """\
target: {runner: mrv2, vllm: "0.33"}
scheduler: {max_num_seqs: 16, max_num_batched_tokens: 256}
lora: {enabled: true, max_loras: 4, specialize: true, specialize_active: true}
"""


@pytest.fixture
def repo(tmp_path):
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GITHUB_STEP_SUMMARY": "",
    }

    def run(*args, check=True):
        proc = subprocess.run(list(args), cwd=tmp_path, env=env, capture_output=True, text=True)
        assert not check or proc.returncode == 0, (args, proc.stdout, proc.stderr)
        return proc

    run("git", "init", "-q", "-b", "main")
    run("git", "config", "user.email", "ci@example.com")
    run("git", "config", "user.name", "ci")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "deploy.yaml").write_text(SPEC)
    run("capplan", "compile", "configs/deploy.yaml")
    run("git", "add", "-A")
    run("git", "commit", "-qm", "plan")
    run.path = tmp_path
    return run


def test_git_diff_shows_graphs_added_and_removed_per_mode_and_case(repo):
    setup = repo("capplan", "git-setup")
    assert "diff.capplan.command" in setup.stderr
    assert (repo.path / ".gitattributes").read_text() == "*.plan.yaml diff=capplan\n"
    # this capplan by its Python's absolute path (outside the repository): git finds it whatever
    # PATH it runs with, and falls back to a capplan on PATH once that Python is gone
    value = repo("git", "config", "diff.capplan.command").stdout.strip()
    assert value.startswith("sh -c ") and " capplan " in value
    # the Python that runs the capplan command (a venv's python and python3 are one interpreter)
    assert Path(value.rsplit(" capplan ", 1)[1]).resolve() == Path(sys.executable).resolve()
    repo("capplan", "git-setup")  # idempotent: the attribute line is not added twice
    assert (repo.path / ".gitattributes").read_text() == "*.plan.yaml diff=capplan\n"
    spec = repo.path / "configs" / "deploy.yaml"
    spec.write_text(SPEC.replace("max_loras: 4", "max_loras: 2"))
    repo("capplan", "compile", "configs/deploy.yaml")
    out = repo("git", "diff", "--", "configs/deploy.plan.yaml").stdout
    assert "capplan diff a/configs/deploy.plan.yaml -> b/configs/deploy.plan.yaml: lora.max_loras: 4 -> 2" in out
    assert "  * PIECEWISE case 3: +" in out and "  * PIECEWISE case 5: +0 -" in out
    assert "  * FULL case 4: +0 -" in out
    raw = repo("git", "diff", "--no-ext-diff", "--", "configs/deploy.plan.yaml").stdout
    assert "-  - {graph: PIECEWISE:" in raw  # the raw line diff is still there when asked for
    repo("git", "commit", "-qam", "fewer adapters")
    history = repo("git", "log", "-p", "--ext-diff", "-1", "--", "configs/deploy.plan.yaml").stdout
    assert "lora.max_loras: 4 -> 2" in history


def test_git_diff_of_an_unloadable_side_falls_back_to_the_raw_diff(repo):
    repo("capplan", "git-setup")
    plan = repo.path / "configs" / "deploy.plan.yaml"
    plan.write_text(plan.read_text().replace("format_version: 2", "format_version: 1"))
    out = repo("git", "diff", "--", "configs/deploy.plan.yaml")
    assert out.returncode == 0
    assert "not compared semantically" in out.stdout and "a format 1 plan" in out.stdout
    assert "-format_version: 2\n+format_version: 1" in out.stdout


def test_git_diff_works_where_capplan_is_not_on_path(repo):
    repo("capplan", "git-setup")
    spec = repo.path / "configs" / "deploy.yaml"
    spec.write_text(SPEC.replace("max_loras: 4", "max_loras: 2"))
    repo("capplan", "compile", "configs/deploy.yaml")
    env = {**os.environ, "PATH": "/usr/bin:/bin", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    out = subprocess.run(["git", "diff"], cwd=repo.path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "lora.max_loras: 4 -> 2" in out.stdout


def test_plans_named_like_options_and_with_odd_names_are_diffed(repo):
    repo("capplan", "git-setup")
    for name in ("-h.plan.yaml", "--x.plan.yaml", "a\x1b[31mred.plan.yaml"):
        shutil.copy(repo.path / "configs" / "deploy.plan.yaml", repo.path / "configs" / name)
    repo("git", "add", "-A")
    repo("git", "commit", "-qm", "odd names")
    spec = repo.path / "configs" / "deploy.yaml"
    spec.write_text(SPEC.replace("max_loras: 4", "max_loras: 2"))
    repo("capplan", "compile", "configs/deploy.yaml")
    for name in ("-h.plan.yaml", "--x.plan.yaml", "a\x1b[31mred.plan.yaml"):
        shutil.copy(repo.path / "configs" / "deploy.plan.yaml", repo.path / "configs" / name)
    out = repo("git", "diff")
    heads = [line for line in out.stdout.splitlines() if line.startswith("capplan diff a/")]
    assert len(heads) == 4 and all("lora.max_loras: 4 -> 2" in line for line in heads)
    assert "\x1b" not in out.stdout  # the escape sequence is printed escaped, not sent to the terminal


def test_diff_driver_with_a_missing_directory_or_fifo_side_says_so(tmp_path):
    from typer.testing import CliRunner

    from capplan.cli import app

    plan = tmp_path / "p.plan.yaml"
    plan.write_text("format_version: 1\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for other in (tmp_path / "missing", tmp_path, fifo):
        result = CliRunner().invoke(
            app, ["git-diff", "--", "p.plan.yaml", str(plan), "0", "100644", str(other), "0", "100644"]
        )
        assert result.exit_code == 0, result.output
        assert "not compared (" in result.stdout and result.exception is None


def _setup_env(tmp_path):
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
    }


@pytest.mark.parametrize("kind", ["not-utf8", "fifo", "symlink"])
def test_git_setup_refuses_an_odd_gitattributes_in_one_line_and_changes_nothing(tmp_path, kind):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    attributes = tmp_path / ".gitattributes"
    if kind == "not-utf8":
        attributes.write_bytes(b"*.bin binary \xff\xfe\n")
    elif kind == "fifo":
        os.mkfifo(attributes)
    else:
        (tmp_path / "elsewhere").write_text("")
        attributes.symlink_to(tmp_path / "elsewhere")
    proc = subprocess.run(
        ["capplan", "git-setup"], cwd=tmp_path, env=_setup_env(tmp_path), capture_output=True, text=True, timeout=20
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and ".gitattributes" in proc.stderr
    config = subprocess.run(
        ["git", "config", "--local", "--get", "diff.capplan.command"], cwd=tmp_path, capture_output=True, text=True
    )
    assert config.returncode == 1  # not set: all or nothing


def test_git_setup_with_a_held_config_lock_changes_nothing_and_names_the_lock(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".git" / "config.lock").write_text("")
    proc = subprocess.run(
        ["capplan", "git-setup"], cwd=tmp_path, env=_setup_env(tmp_path), capture_output=True, text=True, timeout=20
    )
    assert proc.returncode == 1 and "config lock" in proc.stderr
    assert not (tmp_path / ".gitattributes").exists()


def test_git_setup_in_a_repository_whose_path_ends_in_a_space(tmp_path):
    root = tmp_path / "repo "
    root.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    proc = subprocess.run(["capplan", "git-setup"], cwd=root, env=_setup_env(tmp_path), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (root / ".gitattributes").exists()
    assert not (tmp_path / "repo" / ".gitattributes").exists() and not (tmp_path / "repo").exists()


def test_git_setup_refuses_when_a_later_attributes_line_overrides_it(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    content = "*.plan.yaml diff=capplan\n*.plan.yaml binary\n"
    (tmp_path / ".gitattributes").write_text(content)
    proc = subprocess.run(["capplan", "git-setup"], cwd=tmp_path, env=_setup_env(tmp_path), capture_output=True,
                          text=True, timeout=20)  # fmt: skip
    assert proc.returncode == 1 and "overrides" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert (tmp_path / ".gitattributes").read_text() == content
    config = subprocess.run(["git", "config", "--local", "--get", "diff.capplan.command"], cwd=tmp_path,
                            capture_output=True, text=True)  # fmt: skip
    assert config.returncode == 1


def test_git_setup_refuses_when_a_folder_s_attributes_override_it_for_a_tracked_plan(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / ".gitattributes").write_text("*.plan.yaml -diff\n")
    shutil.copy(ROOT / "examples" / "qwen3-8b-multilora.plan.yaml", tmp_path / "sub" / "a.plan.yaml")
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    proc = subprocess.run(["capplan", "git-setup"], cwd=tmp_path, env=_setup_env(tmp_path), capture_output=True,
                          text=True, timeout=20)  # fmt: skip
    assert proc.returncode == 1 and "overrides" in proc.stderr
    assert not (tmp_path / ".gitattributes").exists()


def _venv_python(folder: Path) -> Path:
    """A stand-in for a venv's python inside the repository (a link to this one, which keeps
    its own name as sys.executable; VENV_ENV puts this capplan and its dependencies on its path)."""
    folder.mkdir(parents=True)
    python = folder / "python"
    python.symlink_to(sys.executable)
    return python


def _venv_env() -> dict[str, str]:
    import sysconfig

    return {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), sysconfig.get_paths()["purelib"]])}


def test_git_diff_survives_a_rebuilt_venv_and_says_how_to_repair_a_missing_one(repo):
    """The driver names a venv inside the repository by a relative path: a venv removed and
    built again in place needs no new git-setup; with none (and no capplan on PATH) git
    prints one line saying what to run."""
    python = _venv_python(repo.path / ".venv" / "bin")
    subprocess.run([str(python), "-m", "capplan", "git-setup"], cwd=repo.path, env={**os.environ, **_venv_env(),
                   "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}, check=True, capture_output=True)  # fmt: skip
    value = repo("git", "config", "diff.capplan.command").stdout.strip()
    assert value.endswith(" capplan ./.venv/bin/python"), value
    spec = repo.path / "configs" / "deploy.yaml"
    spec.write_text(SPEC.replace("max_loras: 4", "max_loras: 2"))
    repo("capplan", "compile", "configs/deploy.yaml")
    bare = {"PATH": "/usr/bin:/bin", **_venv_env()}  # no capplan on PATH

    def git_diff(check=True):
        env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1", **bare}
        return subprocess.run(
            ["git", "diff", "--", "configs/deploy.plan.yaml"], cwd=repo.path, env=env, capture_output=True, text=True
        )

    assert "lora.max_loras: 4 -> 2" in git_diff().stdout
    shutil.rmtree(repo.path / ".venv")
    _venv_python(repo.path / ".venv" / "bin")  # rm -rf .venv && python3 -m venv .venv && pip install ...
    assert "lora.max_loras: 4 -> 2" in git_diff().stdout
    shutil.rmtree(repo.path / ".venv")
    gone = git_diff()
    assert gone.returncode != 0
    said = [line for line in gone.stderr.splitlines() if line.startswith("capplan:")]
    assert said == [
        "capplan: the git diff driver's python ./.venv/bin/python is gone and no capplan is on PATH; run "
        "capplan git-setup again from the environment that has capplan"
    ], gone.stderr
