"""`capplan apply` refuses every setup where the plan would be silently ignored, then runs the command."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "examples" / "h200-tiny-llama-025.plan.yaml"


def apply(*command, env=None, report=None, cwd=None):
    args = [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(PLAN)]
    if report is not None:
        args += ["--report", str(report)]
    return subprocess.run(
        [*args, "--", *command], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}, cwd=cwd
    )


@pytest.fixture
def fake_vllm(tmp_path):
    """A `vllm` package the target Python can import (capplan's plugin is installed in this venv)."""
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("")
    return {"PYTHONPATH": str(tmp_path / "site")}


def last_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert lines and "Traceback" not in proc.stderr, proc.stderr
    return lines[-1]


def test_an_explicit_v1_runner_is_refused_not_overridden(fake_vllm):
    proc = apply(sys.executable, "-c", "print('ran')", env={**fake_vllm, "VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert proc.returncode == 1 and "ran" not in proc.stdout
    assert last_line(proc) == (
        "error: VLLM_USE_V2_MODEL_RUNNER=0 puts the engine on vLLM's V1 model runner, where "
        "the plan cannot be in force (unset it: capplan apply runs Model Runner V2)"
    )


def test_a_plugin_filter_without_capplan_is_refused(fake_vllm):
    proc = apply(sys.executable, "-c", "print('ran')", env={**fake_vllm, "VLLM_PLUGINS": "lora_filesystem_resolver"})
    assert proc.returncode == 1 and "leaves out capplan's plugin" in last_line(proc)


def test_a_python_without_vllm_is_refused_naming_it():
    env = {"PYTHONPATH": ""}
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, env={**os.environ, **env})
    if probe.returncode == 0:
        pytest.skip("vLLM is installed here")
    proc = apply(sys.executable, "-c", "print('ran')", env=env)
    assert proc.returncode == 1 and "ran" not in proc.stdout
    assert last_line(proc).startswith(f"error: vLLM is not installed for {sys.executable}, which runs the command")


def test_the_command_runs_with_the_plan_and_its_exit_code_and_quoting_are_kept(fake_vllm, tmp_path):
    code = "import os, sys; print(os.environ['CAPPLAN_PLAN'], os.environ['VLLM_USE_V2_MODEL_RUNNER']); sys.exit(3)"
    proc = apply(sys.executable, "-c", code, env=fake_vllm)
    assert proc.returncode == 3
    assert proc.stdout.split() == [str(PLAN), "1"]
    import shlex

    echoed = proc.stderr.splitlines()[0].split("graphs): ", 1)[1]
    assert shlex.split(echoed) == [sys.executable, "-c", code]  # quoting kept: pastes back into a shell


def test_a_promised_report_that_never_appears_fails_the_run(fake_vllm, tmp_path):
    report = tmp_path / "report.json"
    proc = apply(sys.executable, "-c", "print('no engine here')", env=fake_vllm, report=report)
    assert proc.returncode == 1
    assert last_line(proc).startswith(f"error: {report} was never written: the plan was not put in force")
    written = apply(sys.executable, "-c", f"open({str(report)!r}, 'w').write('{{}}')", env=fake_vllm, report=report)
    assert written.returncode == 0, written.stderr


def test_python_m_capplan_is_the_cli():
    proc = subprocess.run([sys.executable, "-m", "capplan", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "compile" in proc.stdout
