"""The GPU suite's documented recipe (tests/gpu/README.md): capplan installed with
--no-deps into an environment that has pytest, nothing else. On a machine without a
GPU and vLLM, `pytest tests/gpu` collects every test and skips it."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pip(venv: Path, *args: str) -> None:
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
        check=True,
        cwd=ROOT,
        timeout=600,
    )


def test_gpu_suite_collects_and_skips_with_the_documented_recipe(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # What the README installs: capplan without dependencies and without build isolation
    # (the GPU machine is offline), and pytest; vLLM's environment has the build tools.
    readme = (ROOT / "tests" / "gpu" / "README.md").read_text()
    assert "pip install -q --no-deps --no-build-isolation -e ." in readme
    _pip(venv, "pytest", "setuptools>=61", "wheel")
    _pip(venv, "--no-deps", "--no-build-isolation", "-e", ".")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "CAPPLAN_"))}
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    summary = out.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ skipped in [\d.]+s", summary), summary
    # No module of the suite is left out: the venv has neither pydantic nor hypothesis.
    missing = subprocess.run([str(venv / "bin" / "python"), "-c", "import pydantic"], capture_output=True)
    assert missing.returncode != 0
