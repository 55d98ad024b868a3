"""What capplan's own launch reader takes from vLLM's option tables (one per supported release,
generated from its parser; tests/conformance/test_vllm_options.py compares them with it), and
what the lines capplan writes need from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from capplan.errors import CapplanError
from capplan.launcher.cmdline import NARGS, OFF, SWITCHES, off_forms, read_command
from capplan.launcher.engine_args import flags_for
from capplan.launcher.vllm_options import tables
from capplan.planfile import load_plan
from capplan.releases import RELEASES, runs_on
from capplan.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[1]
SERVE = ["vllm", "serve", "M"]


def test_every_supported_release_has_its_table():
    assert list(tables()) == list(RELEASES)


def test_every_flag_capplan_reads_or_writes_is_an_option_of_every_release():
    for s in SETTINGS:
        for flag in (f for f in (s.flag, *s.aliases) if f is not None):
            missing = [r for r, t in tables().items() if flag not in t]
            assert not missing, (flag, missing)


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.plan.yaml")), ids=lambda p: p.name)
def test_the_flags_capplan_writes_for_a_plan_are_options_of_every_release_it_targets(path):
    plan = load_plan(path)
    options = [a.split("=", 1)[0] for a in flags_for(plan) if a.startswith("-")]
    for release in runs_on(plan.spec.target.vllm):
        assert [o for o in options if o not in tables()[release]] == [], release


def test_a_switchs_off_forms_are_the_releases_own():
    # every release takes --no-enable-X; vLLM 0.33.0 also pairs --enable-X with --disable-X (some of
    # its option strings are hidden from --help: the table keeps every string the parser matches)
    assert off_forms("--enable-lora") == {"--no-enable-lora": set(RELEASES), "--disable-lora": {"0.33.0"}}
    assert off_forms("--specialize-active-lora") == {"--no-specialize-active-lora": set(RELEASES)}
    assert OFF["--no-enable-lora"] == "--enable-lora" and "--disable-lora" not in OFF
    assert set(OFF.values()) <= set(SWITCHES)


def test_an_off_form_is_read_only_where_every_release_the_line_is_for_takes_it():
    assert read_command([*SERVE, "--disable-lora"], ("0.33.0",)).values["lora.enabled"] is False
    assert read_command([*SERVE, "--no-enable-lora"]).values["lora.enabled"] is False
    with pytest.raises(CapplanError, match=r"not every vLLM release the line is read for takes it \(vLLM 0.33.0 does"):
        read_command([*SERVE, "--disable-lora"], ("0.31.0", "0.32.0", "0.33.0"))
    with pytest.raises(CapplanError, match="no flag of vLLM's"):
        read_command([*SERVE, "--no-disable-lora"])


def test_another_option_takes_as_many_values_as_vllms_parser_gives_it():
    # --lora-modules takes every value up to the next option; a switch takes none
    cmd = read_command([*SERVE, "--lora-modules", "a=/x", "b=/y", "--max-loras", "3", "--enable-prefix-caching"])
    assert cmd.values["lora.max_loras"] == 3
    assert NARGS["--lora-modules"] == "+" and NARGS["--enable-prefix-caching"] == 0
    # a switch followed by a word: the word is no value of the switch (the model is given): refused
    with pytest.raises(CapplanError, match="an argument no flag takes"):
        read_command([*SERVE, "--trust-remote-code", "stray"])


def test_an_abbreviation_of_any_option_of_vllms_is_refused():
    with pytest.raises(CapplanError, match="does not resolve abbreviated flags"):
        read_command([*SERVE, "--lora-mod", "a=/x"])  # vLLM reads it as --lora-modules


def test_capplans_short_aliases_and_json_flags_set_what_their_long_flag_sets_in_every_release():
    from capplan.settings import COMPILATION_FLAGS, SPECULATIVE_FLAGS

    for s in SETTINGS:
        for alias in s.aliases:
            for release, t in tables().items():
                assert t[alias][0] == t[s.flag][0], (alias, release)
    for flags, dest in ((COMPILATION_FLAGS, "compilation_config"), (SPECULATIVE_FLAGS, "speculative_config")):
        for flag in flags:
            assert all(t[flag][0] == dest for t in tables().values()), flag


def test_a_value_glued_to_a_short_option_of_vllms_is_refused_as_its_parser_does():
    for glued in ("-tp4", "-dp2", "-cc{}"):
        with pytest.raises(CapplanError, match="no flag of vLLM's"):
            read_command([*SERVE, glued])


def test_the_table_writer_refuses_with_one_line_and_writes_nothing(capsys, tmp_path):
    from capplan.launcher.vllm_options import main

    before = {p.name: p.read_bytes() for p in (ROOT / "src/capplan/data/vllm_options").glob("*.json")}
    assert main([]) == 2
    assert main(["python", "9.9.9"]) == 2
    assert main([str(tmp_path / "no-python"), "0.33.0"]) == 1
    assert main(["/bin/false", "0.33.0"]) == 1  # prints nothing
    err = capsys.readouterr().err
    assert "not a supported vLLM release" in err and "could not be dumped" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in (ROOT / "src/capplan/data/vllm_options").glob("*.json")} == before


@pytest.mark.parametrize(
    "args",
    [
        ["--served-model-name", "--max-num-seqs", "8"],  # an option where its value goes
        ["--port"],
        ["--lora-modules"],
        ["--seed", "-1e5"],  # argparse reads -1e5 as an option
        ["--served-model-name", "x", "-1.5", "--max-num-seqs", "8"],  # vLLM rewrites -1.5 as a dotted key
        ["--trust-remote-code=1"],  # a switch given a value
        ["-n2"],  # a value glued to a short option
        ["--calculate-kv-scales"],  # an option some supported releases lack
    ],
)
def test_what_vllms_parser_refuses_or_reads_otherwise_is_refused(args):
    with pytest.raises(CapplanError):
        read_command([*SERVE, *args])


def test_a_negative_integer_is_a_value_as_argparse_reads_it():
    assert read_command([*SERVE, "--seed", "-1", "--max-num-seqs", "8"]).values == {"scheduler.max_num_seqs": 8}


def test_a_release_without_a_table_is_refused_and_none_named_means_every_release():
    with pytest.raises(CapplanError, match="no option table of vLLM 9.9.9"):
        read_command([*SERVE, "--enable-lora", "--no-enable-lora"], ("0.33.0", "9.9.9"))
    assert read_command([*SERVE, "--enable-lora", "--no-enable-lora"], ()).values["lora.enabled"] is False
    with pytest.raises(CapplanError, match=r"\(vLLM 0.33.0 does"):
        read_command([*SERVE, "--disable-lora"], ())


def test_values_argparse_reads_as_values_and_help_which_starts_no_server():
    assert read_command([*SERVE, "--served-model-name", "-my model", "-", "--max-num-seqs", "8"]).values == {
        "scheduler.max_num_seqs": 8
    }
    with pytest.raises(CapplanError, match="prints its help and exits"):
        read_command([*SERVE, "--help"])


@pytest.mark.parametrize(
    "args",
    [
        ["-cc", '{"cudagraph_mode": "NONE", "x": 1}'],
        ["-cc.x=1"],
        ["--compilation-config.level=3"],  # no field of any release's CompilationConfig
    ],
)
def test_a_compilation_config_key_vllms_config_class_forbids_is_refused(args):
    with pytest.raises(CapplanError, match="compilation config: it refuses the command"):
        read_command([*SERVE, *args])


def test_a_compilation_key_some_targeted_release_lacks_is_refused_for_it():
    from capplan.launcher.vllm_options import compilation_keys

    newer = sorted(compilation_keys("0.33.0") - compilation_keys("0.25.0"))
    assert newer  # keys added after 0.25.0
    line = [*SERVE, f"-cc.{newer[0]}=1"]
    with pytest.raises(CapplanError, match="vLLM 0.25.0's compilation config"):
        read_command(line, ("0.25.0",))
