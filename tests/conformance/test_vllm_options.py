"""vLLM's option tables (capplan/data/vllm_options/RELEASE.json), which capplan's own launch
reader reads instead of hand-kept lists, are each release's parser: built again from every release
this run's oracle carries (CAPPLAN_ORACLE_RELEASES) and compared whole."""

from __future__ import annotations

import pytest

from capplan.launcher.vllm_options import dump, table
from tests.conformance.releases import releases
from tests.conformance.test_init_roundtrip import PYTHON, _env, _oracle

pytestmark = [pytest.mark.conformance, pytest.mark.usefixtures("vllm_parser_in_fork_server")]


@pytest.mark.parametrize("release", releases())  # CI: one of each group of rules; the matrix, every release
def test_the_checked_in_option_table_is_the_releases_own_parser(release):
    _oracle(release)
    got = dump(str(PYTHON), _env(release))
    assert got["release"] == release
    theirs = {option: tuple(v) for option, v in got["options"].items()}
    ours = table(release)
    assert ours is not None, f"no table checked in for {release}: python -m capplan.launcher.vllm_options"
    assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))[:20]
    assert {o: v for o, v in ours.items() if theirs[o] != v} == {}
