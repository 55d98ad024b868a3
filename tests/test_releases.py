"""The supported vLLM releases are one table: the runtime, the plans and the install extra agree."""

import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from capplan.releases import SUPPORTED_RELEASES
from capplan.runtime.versions import detect_semantics

ROOT = Path(__file__).resolve().parents[1]
ON_PYPI = ["0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"]


@pytest.mark.parametrize("release", ON_PYPI)
def test_runtime_accepts_exactly_the_supported_releases(release):
    if release in SUPPORTED_RELEASES:
        assert detect_semantics(release) == SUPPORTED_RELEASES[release]
        assert detect_semantics(release + "+cu130") == SUPPORTED_RELEASES[release]
    else:
        with pytest.raises(RuntimeError, match=f"vLLM {release} is not supported; supported: vLLM 0.25.0, 0.25.1"):
            detect_semantics(release)


def test_the_vllm_extra_installs_no_release_the_runtime_refuses():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (requirement,) = extras["vllm"]
    allowed = SpecifierSet(requirement.removeprefix("vllm"))
    assert [r for r in ON_PYPI if r in allowed] == list(SUPPORTED_RELEASES)


def test_plans_name_the_releases_of_their_semantics():
    from capplan.planner import compile_plan
    from tests.conformance.specs import BASE_SPECS  # noqa: F401  (importable without the oracle)
    from tests.conftest import make_spec

    assert compile_plan(make_spec(target={"vllm": "0.25"})).target["vllm"] == "0.25.0, 0.25.1, 0.26.0"
    assert compile_plan(make_spec(target={"vllm": "0.33"})).target["vllm"] == "0.31.0, 0.32.0, 0.33.0"


def test_a_plan_written_before_a_release_was_added_still_loads(tmp_path):
    """The releases a plan's target line lists grow as capplan proves more; the plan means
    the same, so it loads and --check passes. Everything else in the file is still compared."""
    from typer.testing import CliRunner

    from capplan.cli import app
    from capplan.planfile import load_plan

    text = (ROOT / "examples" / "h200-tiny-llama-025.plan.yaml").read_text()
    current = 'target: {runner: mrv2, vllm: "0.25.0, 0.25.1, 0.26.0"}'
    assert current in text
    old = tmp_path / "h200-tiny-llama-025.plan.yaml"
    old.write_text(text.replace(current, 'target: {runner: mrv2, vllm: "0.25.0, 0.25.1"}'))
    assert load_plan(old).target["vllm"] == "0.25.0, 0.25.1, 0.26.0"
    spec = str(ROOT / "configs" / "h200-tiny-llama-025.yaml")
    assert CliRunner().invoke(app, ["compile", spec, "--check", "-o", str(old)]).exit_code == 0
    old.write_text(text.replace(current, 'target: {runner: v1, vllm: "0.25.0, 0.25.1"}'))
    assert CliRunner().invoke(app, ["compile", spec, "--check", "-o", str(old)]).exit_code == 1


@pytest.mark.parametrize(
    ("release", "mode", "breakable", "refused"),
    [
        ("0.26.0", "FULL_AND_PIECEWISE", True, True),
        ("0.26.0", "PIECEWISE", True, True),
        ("0.26.0", "FULL_AND_PIECEWISE", False, False),
        ("0.26.0", "FULL", True, False),  # no PIECEWISE graph: nothing breakable changes
        ("0.25.1", "FULL_AND_PIECEWISE", True, False),  # 0.25's breakable graphs plan alike
        ("0.33.0", "FULL_AND_PIECEWISE", True, False),
    ],
)
def test_breakable_graphs_are_refused_where_they_change_the_graphs(monkeypatch, release, mode, breakable, refused):
    """The runtime's check, on a stand-in vllm module (the conformance tier runs it against
    each release's real vllm.envs)."""
    import sys
    import types

    from capplan.planner import compile_plan
    from capplan.runtime.mrv2 import breakable_problem
    from tests.conftest import make_spec

    fake = types.ModuleType("vllm")
    fake.__version__ = release + "+cu130"
    fake.envs = types.SimpleNamespace(VLLM_USE_BREAKABLE_CUDAGRAPH=breakable)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.envs", fake.envs)
    plan = compile_plan(make_spec(target={"vllm": SUPPORTED_RELEASES[release]}, cudagraph={"mode": mode}))
    problem = breakable_problem(plan, "p.plan.yaml")
    assert (problem is not None) == refused
    if refused:
        assert problem.startswith("capplan: VLLM_USE_BREAKABLE_CUDAGRAPH is on") and "p.plan.yaml" in problem
