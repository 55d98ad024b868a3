"""The checked-in example plans are exactly what their configs compile to."""

from pathlib import Path

import pytest

from capplan.cli import regenerate_command
from capplan.loading import load_plan, load_spec
from capplan.planner import compile_plan
from capplan.planner.render import render_plan
from capplan.planner.verify import verify_plan

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_there_are_realistic_configs():
    assert len(CONFIGS) >= 4


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_example_plan_is_up_to_date(config, monkeypatch):
    monkeypatch.chdir(ROOT)
    plan_path = Path("examples") / f"{config.stem}.plan.yaml"
    spec_path = Path("configs") / config.name
    command = regenerate_command(spec_path, plan_path, Path("examples"))
    assert command == f"capplan compile configs/{config.name} --plan-dir examples"
    expected = render_plan(compile_plan(load_spec(spec_path)), command)
    assert plan_path.read_text() == expected, f"stale: run {command}"
    assert verify_plan(load_plan(plan_path)).ok
