"""`capplan git-setup` ends with the setting as a shell command: pasted into a shell in
another clone, it sets exactly what git-setup set."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
ENV = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def _repo(path: Path) -> Path:
    path.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=path, check=True, env=ENV)
    return path


def test_the_echoed_command_pastes_into_a_shell(tmp_path):
    first = _repo(tmp_path / "a")
    done = subprocess.run(
        [sys.executable, "-m", "capplan", "git-setup"], cwd=first, capture_output=True, text=True, env=ENV
    )
    assert done.returncode == 0, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    command = line.split("the setting, as a command: ", 1)[1]
    assert command.startswith("git config diff.capplan.command ")
    second = _repo(tmp_path / "b")
    pasted = subprocess.run(["bash", "-c", command], cwd=second, capture_output=True, text=True, env=ENV)
    assert pasted.returncode == 0, pasted.stderr

    def setting(repo: Path) -> str:
        got = subprocess.run(["git", "config", "--local", "--get", "diff.capplan.command"], cwd=repo, env=ENV,
                             capture_output=True, text=True)  # fmt: skip
        return got.stdout

    assert setting(second) == setting(first) != ""
