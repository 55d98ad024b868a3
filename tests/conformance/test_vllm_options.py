"""vLLM's option tables (capplan/data/vllm_options/RELEASE.json), which capplan's own launch
reader reads instead of hand-kept lists, are each release's parser: built again from every release
this run's oracle carries (CAPPLAN_ORACLE_RELEASES) and compared whole."""

from __future__ import annotations

import pytest

from capplan.launcher.vllm_options import compilation_keys, dump, table
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
    assert compilation_keys(release) == frozenset(got["compilation_keys"])


def test_a_line_vllm_reads_but_not_without_its_config_file_keeps_the_batch_read(tmp_path):
    """The resolver parses a line again without its --config file to tell the file's values from
    the line's; where that second parse refuses (here the file's switch takes `8` from the line),
    vLLM's reading stands, and the other lines of the batch are still read by vLLM, not left to
    capplan's own reader."""
    from capplan.launcher.cmdline import read_resolved, read_with_vllm
    from capplan.launcher.vllm_cli import resolution_of

    _oracle("0.33.0")
    (tmp_path / "f.yaml").write_text("max-num-seqs: true\n")  # the loader gives `--max-num-seqs` alone
    odd = ["vllm", "serve", "M", "--config", str(tmp_path / "f.yaml"), "8"]  # vLLM reads max_num_seqs 8
    plain = ["vllm", "serve", "M", "--max-num-seqs", "32"]
    results = read_with_vllm(str(PYTHON), [odd, plain], _env("0.33.0"))
    assert results is not None and len(results) == 2
    assert read_resolved(odd, resolution_of(results[0])).values["scheduler.max_num_seqs"] == 8
    assert read_resolved(plain, resolution_of(results[1])).values["scheduler.max_num_seqs"] == 32
