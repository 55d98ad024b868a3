"""The supported vLLM releases are one table of rules: the runtime, the plans, the planner's
rules and the install extra all read it, and no code compares release strings."""

import re
import subprocess
import tomllib
from dataclasses import fields, replace
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from capplan.releases import ALIASES, GROUPS, RELEASES, TARGETS, Rules, release_of, release_problem, rules_of, runs_on
from capplan.runtime.versions import detect_release

ROOT = Path(__file__).resolve().parents[1]
ON_PYPI = ["0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"]


def test_every_release_on_pypi_with_lora_cuda_graphs_on_mrv2_is_supported():
    assert list(RELEASES) == ON_PYPI
    assert {r.rules for r in RELEASES.values()} == set(GROUPS)


@pytest.mark.parametrize("release", ON_PYPI)
def test_runtime_knows_each_release_and_ignores_a_local_build_suffix(release):
    assert detect_release(release) is RELEASES[release]
    assert detect_release(release + "+cu130") is RELEASES[release]


@pytest.mark.parametrize("version", ["0.24.0", "0.34.0", "0.33", "0.33.0rc1", "garbage"])
def test_runtime_refuses_an_unknown_release_naming_the_supported_ones(version):
    with pytest.raises(RuntimeError, match=f"vLLM {re.escape(version)} is not supported; supported: vLLM 0.25.0"):
        detect_release(version)


def test_the_vllm_extra_installs_exactly_the_supported_releases():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (requirement,) = extras["vllm"]
    allowed = SpecifierSet(requirement.removeprefix("vllm"))
    assert [r for r in ON_PYPI + ["0.24.0", "0.33.1", "0.34.0"] if r in allowed] == list(RELEASES)


def test_each_group_adds_rules_and_never_takes_one_back():
    """The groups are ordered by release and each rule, once on, stays on: a change of MRV2's
    planning that a later release reverts would need a rule of its own."""
    flags = [f.name for f in fields(Rules) if f.name != "group"]
    for before, after in zip(GROUPS, GROUPS[1:]):
        assert any(getattr(after, f) and not getattr(before, f) for f in flags), (before.group, after.group)
        assert all(getattr(after, f) for f in flags if getattr(before, f)), (before.group, after.group)
    groups_in_release_order = [r.rules.group for r in RELEASES.values()]
    assert groups_in_release_order == sorted(groups_in_release_order)


def test_aliases_plan_with_their_newest_release_and_run_on_every_release_they_cover():
    assert release_of("0.25").version == "0.26.0" and release_of("0.33").version == "0.33.0"
    assert runs_on("0.25") == ("0.25.0", "0.25.1", "0.26.0")
    assert runs_on("0.33") == ("0.31.0", "0.32.0", "0.33.0")
    for alias, covered in ALIASES.items():
        # Every release an alias covers plans the same graphs, ranges, dispatch and dummies;
        # only the encoder packing prediction may differ (vLLM 0.31.0 does not defer).
        rules = {replace(RELEASES[r].rules, group="", encoder_packing_defers=False) for r in covered}
        assert len(rules) == 1, alias
    assert set(TARGETS) == set(RELEASES) | set(ALIASES)


@pytest.mark.parametrize("release", ON_PYPI)
def test_an_exact_release_runs_on_its_group(release):
    group = RELEASES[release].rules
    assert runs_on(release) == tuple(v for v, r in RELEASES.items() if r.rules == group)
    assert rules_of(release) is group
    for other in ON_PYPI:
        problem = release_problem(release, other)
        assert (problem is None) == (RELEASES[other].rules == group)
        if problem:
            assert f'target.vllm: "{other}"' in problem[1]


def test_plans_name_the_releases_they_run_on():
    from capplan.planner import compile_plan
    from tests.conftest import make_spec

    assert compile_plan(make_spec(target={"vllm": "0.25"})).target["vllm"] == "0.25.0, 0.25.1, 0.26.0"
    assert compile_plan(make_spec(target={"vllm": "0.33"})).target["vllm"] == "0.31.0, 0.32.0, 0.33.0"
    assert compile_plan(make_spec(target={"vllm": "0.29.0"})).target["vllm"] == "0.29.0, 0.30.0"
    assert compile_plan(make_spec(target={"vllm": "0.28.0"})).target["vllm"] == "0.28.0"


def test_no_code_compares_a_release_string_outside_the_table():
    """The rules live in capplan/releases.py; elsewhere a release appears in prose only."""
    found = subprocess.run(
        ["grep", "-rnE", r"""(==|!=|\bin\b|startswith\()\s*\(?["']0\.[0-9]{2}""", str(ROOT / "src" / "capplan")],
        capture_output=True,
        text=True,
    ).stdout
    assert found == "", found


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
    for listed in ("0.25.0, 0.27.0", "0.25.1, 0.25.0", "0.25.0, 0.25.0", "1.25.0"):  # not releases it runs on
        old.write_text(text.replace(current, f'target: {{runner: mrv2, vllm: "{listed}"}}'))
        assert CliRunner().invoke(app, ["compile", spec, "--check", "-o", str(old)]).exit_code == 1, listed


@pytest.mark.parametrize(
    ("release", "mode", "breakable", "refused"),
    [
        ("0.26.0", "FULL_AND_PIECEWISE", True, True),
        ("0.26.0", "PIECEWISE", True, True),
        ("0.26.0", "FULL_AND_PIECEWISE", False, False),
        ("0.26.0", "FULL", True, False),  # no PIECEWISE graph: nothing breakable changes
        ("0.25.1", "FULL_AND_PIECEWISE", True, False),  # 0.25's breakable graphs plan alike
        ("0.27.0", "FULL_AND_PIECEWISE", True, False),  # from 0.27 they plan alike again
        ("0.33.0", "FULL_AND_PIECEWISE", True, False),
    ],
)
def test_breakable_graphs_are_refused_where_they_change_the_graphs(monkeypatch, release, mode, breakable, refused):
    """The runtime's check, on a stand-in vllm.envs (the conformance tier runs it against
    each release's real vllm.envs)."""
    import sys
    import types

    from capplan.planner import compile_plan
    from capplan.runtime.engine_check import breakable_problem
    from tests.conftest import make_spec

    fake = types.ModuleType("vllm")
    fake.envs = types.SimpleNamespace(VLLM_USE_BREAKABLE_CUDAGRAPH=breakable)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.envs", fake.envs)
    plan = compile_plan(make_spec(target={"vllm": release}, cudagraph={"mode": mode}))
    problem = breakable_problem(plan, "p.plan.yaml", RELEASES[release])
    assert (problem is not None) == refused
    if refused:
        assert problem.startswith("capplan: VLLM_USE_BREAKABLE_CUDAGRAPH is on") and "p.plan.yaml" in problem


def test_speculative_decoding_on_029_compiles_to_its_own_sizes_and_ranges():
    """The rules that changed in 0.29 against those before and after, on one spec (the
    conformance tier compares each with the release's own code)."""
    from capplan.planner import compile_plan
    from tests.conftest import make_spec

    def plan(vllm):
        return compile_plan(
            make_spec(target={"vllm": vllm}, scheduler={"max_num_seqs": 100}, speculative={"num_speculative_tokens": 2})
        )

    p28, p29, p31 = plan("0.28.0"), plan("0.29.0"), plan("0.31.0")
    assert 3 not in p28.capture_sizes and {3, 6, 12, 300} <= set(p29.capture_sizes)  # n * (1 + 2)
    assert p29.capture_sizes == p31.capture_sizes  # max_num_seqs joins only without speculation
    one = make_spec(target={"vllm": "0.29.0"}, scheduler={"max_num_seqs": 100})
    assert 100 not in compile_plan(one).capture_sizes
    assert (
        100
        in compile_plan(
            one.model_copy(update={"target": one.target.model_copy(update={"vllm": "0.31.0"})})
        ).capture_sizes
    )
