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
