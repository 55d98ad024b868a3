"""The checked-in example plans are exactly what their configs compile to, and
`compile --check` says so wherever it is run from and however the plan is named."""

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from capplan.analysis.verify import verify_plan
from capplan.cli import app
from capplan.planfile import load_plan

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
runner = CliRunner()


def test_there_are_realistic_configs():
    assert len(CONFIGS) >= 4


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_example_plan_is_byte_for_byte_what_compile_writes(config, monkeypatch):
    monkeypatch.chdir(ROOT)
    plan_path = ROOT / "examples" / f"{config.stem}.plan.yaml"
    result = runner.invoke(app, ["compile", f"configs/{config.name}", "--plan-dir", "examples", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert plan_path.read_text() == result.stdout, (
        f"stale: run capplan compile configs/{config.name} --plan-dir examples"
    )
    assert f"#   capplan compile ../configs/{config.name} -o {plan_path.name}\n" in result.stdout
    assert verify_plan(load_plan(plan_path)).ok


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
@pytest.mark.parametrize(
    "cwd, args",
    [
        (".", ["configs/{spec}", "--plan-dir", "examples"]),
        (".", ["configs/{spec}", "-o", "examples/{plan}"]),
        (".", ["./configs/../configs/{spec}", "-o", "examples/./{plan}"]),
        ("configs", ["{spec}", "--plan-dir", "../examples"]),
        ("configs", ["{spec}", "-o", "../examples/{plan}"]),
        ("examples", ["../configs/{spec}", "-o", "{plan}"]),
    ],
)
def test_check_passes_from_anywhere(config, cwd, args, monkeypatch):
    monkeypatch.chdir(ROOT / cwd)
    names = {"spec": config.name, "plan": f"{config.stem}.plan.yaml"}
    result = runner.invoke(app, ["compile", *[a.format(**names) for a in args], "--check"])
    assert result.exit_code == 0, result.output
    assert "up to date" in result.stderr


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_check_after_renaming_the_spec_and_after_an_edit(config, tmp_path, monkeypatch):
    shutil.copy(config, tmp_path / "renamed-spec.yaml")
    plan = tmp_path / "elsewhere" / "some.plan.yaml"
    plan.parent.mkdir()
    shutil.copy(ROOT / "examples" / f"{config.stem}.plan.yaml", plan)
    monkeypatch.chdir(tmp_path)
    same = runner.invoke(app, ["compile", "renamed-spec.yaml", "-o", "elsewhere/some.plan.yaml", "--check"])
    assert same.exit_code == 0, same.output
    spec = (tmp_path / "renamed-spec.yaml").read_text()
    edited = spec.replace("max_model_len: ", "max_model_len: 1", 1)
    assert edited != spec
    (tmp_path / "renamed-spec.yaml").write_text(edited)
    stale = runner.invoke(app, ["compile", "renamed-spec.yaml", "-o", "elsewhere/some.plan.yaml", "--check"])
    assert stale.exit_code == 1
    line = stale.stderr.strip()
    assert line.startswith("error: plan is stale (elsewhere/some.plan.yaml: spec.scheduler.max_model_len: the file")
    assert line.endswith(": run capplan compile renamed-spec.yaml -o elsewhere/some.plan.yaml")
    # The suggested command works from here, and then the check passes.
    assert runner.invoke(app, ["compile", "renamed-spec.yaml", "-o", "elsewhere/some.plan.yaml"]).exit_code == 0
    assert (
        runner.invoke(app, ["compile", "renamed-spec.yaml", "-o", "elsewhere/some.plan.yaml", "--check"]).exit_code == 0
    )
