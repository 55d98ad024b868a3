"""capplan's own reader of launch lines (where vLLM is not importable): it reads a `--config`
file, flag names with `_`, and the JSON configs as vLLM's parser does, and refuses what it does
not read (optimization levels, abbreviated flags, the model given twice); it never completes a
line around a part it did not read. tests/conformance/test_launch_corpus.py judges it against
vLLM's own parser."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capplan.errors import CapplanError
from capplan.launcher.cmdline import read_command
from capplan.launcher.engine_args import complete, prepare
from capplan.planfile.read import load_plan

ROOT = Path(__file__).resolve().parents[1]
PLAN = load_plan(ROOT / "examples" / "qwen3-8b-multilora.plan.yaml")  # 256 seqs, 8192 tokens, 8 LoRAs
SERVE = ["vllm", "serve", "M"]


def own(argv: list[str]) -> tuple[list[str], list[str]]:
    with patch("capplan.launcher.engine_args.read_with_vllm", return_value=None):
        return prepare(PLAN, "p.plan.yaml", argv)


def test_a_config_file_is_read_and_its_values_are_never_replaced(tmp_path):
    cfg = tmp_path / "vllm.yaml"
    cfg.write_text("max_num_seqs: 256\nmax-loras: 8\ncompilation-config:\n  cudagraph_mode: FULL_AND_PIECEWISE\n")
    cmd = read_command([*SERVE, "--config", str(cfg)])
    assert cmd.values["scheduler.max_num_seqs"] == 256 and cmd.values["lora.max_loras"] == 8
    assert cmd.flags["lora.max_loras"] == f"--max-loras 8 (in --config {cfg})"
    # the plan's capture sizes would have to go into the file's compilation config: refused, not appended
    with pytest.raises(CapplanError, match="in its --config file"):
        own([*SERVE, "--config", str(cfg)])
    cfg.write_text("max_num_seqs: 256\nmax-loras: 8\n")
    full, added = own([*SERVE, "--config", str(cfg)])
    assert "--max-num-seqs" not in full and "--max-loras" not in full and "--enable-lora" in full
    cfg.write_text("max-num-seqs: 8\n")
    with pytest.raises(CapplanError, match=r"--max-num-seqs 8 \(in --config .*\): the plan has scheduler.max_num_seqs"):
        own([*SERVE, "--config", str(cfg)])
    cfg.write_text("enforce-eager: true\n")
    with pytest.raises(CapplanError, match="--enforce-eager .*runs no CUDA graph"):
        own([*SERVE, "--config", str(cfg)])
    cfg.write_text("max-num-seqs: 8\n")  # the command line ranks above the file, as in vLLM
    full, _ = own([*SERVE, "--config", str(cfg), "--max-num-seqs", "256"])
    assert full.count("--max-num-seqs") == 1


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("enable-lora: false\n", "does not read a false switch"),
        ("- max-num-seqs\n", "not a YAML mapping"),
        ("max-num-seqs: [8\n", "not YAML"),
        ("max-num-se: 8\n", "does not resolve abbreviated flags"),
        ("optimization-level: 0\n", "optimization levels"),
    ],
)
def test_what_a_config_file_holds_and_the_own_reader_does_not_read_is_refused(tmp_path, text, why):
    cfg = tmp_path / "vllm.yaml"
    cfg.write_text(text)
    with pytest.raises(CapplanError, match=why):
        own([*SERVE, "--config", str(cfg)])
    other = tmp_path / "vllm.json"
    other.write_text("{}")
    with pytest.raises(CapplanError, match="only a .yaml or .yml"):
        own([*SERVE, "--config", str(other)])


@pytest.mark.parametrize(
    "args",
    [["-O0"], ["-O", "0"], ["-O3"], ["-O=1"], ["--optimization-level=1"], ["--optimization_level", "2"]],
)
def test_optimization_levels_are_refused_not_overridden(args):
    # vLLM reads each as a level whose cudagraph mode the plan's appended mode would replace
    with pytest.raises(CapplanError, match="does not read vLLM's optimization levels"):
        own([*SERVE, *args])


@pytest.mark.parametrize("args", [["--max-num-se", "8"], ["--enforce-eag"], ["--conf", "x.yaml"], ["-t", "2"]])
def test_abbreviated_flags_are_refused(args):
    with pytest.raises(CapplanError, match="does not resolve abbreviated flags"):
        own([*SERVE, *args])


def test_underscores_and_off_forms_are_read_as_vllm_reads_them():
    with pytest.raises(CapplanError, match="--max_num_seqs 8: the plan has scheduler.max_num_seqs 256"):
        own([*SERVE, "--max_num_seqs", "8"])
    with pytest.raises(CapplanError, match="--no-enable-lora: the plan has lora.enabled true"):
        own([*SERVE, "--no-enable-lora"])  # every release's parser takes it (vLLM's option tables)
    # vLLM 0.33.0 also takes --disable-lora; 0.31.0 and 0.32.0, which the plan targets too, refuse it
    with pytest.raises(CapplanError, match=r"--disable-lora: .*\(vLLM 0.33.0 does; .*--no-enable-lora"):
        own([*SERVE, "--disable-lora"])
    assert read_command([*SERVE, "--disable-lora"], ("0.33.0",)).values["lora.enabled"] is False
    full, _ = own([*SERVE, "--max_num_seqs=256", "--compilation_config", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'])
    assert "--max-num-seqs" not in full and not any(a == "--compilation-config" for a in full)
    assert json.loads(full[full.index("--compilation_config") + 1])["cudagraph_capture_sizes"] == PLAN.capture_sizes


def test_the_json_config_vllm_keeps_is_the_one_read():
    # vLLM gives the dotted keys last, as one more object: the -cc JSON before them is dropped
    cmd = read_command([*SERVE, "-cc", '{"cudagraph_mode": "PIECEWISE"}', "-cc.max_cudagraph_capture_size=512"])
    assert "cudagraph.mode" not in cmd.values and cmd.values["cudagraph.max_capture_size"] == 512
    # dotted keys are gathered by the flag as written; the last gathering wins
    cmd = read_command([*SERVE, "-cc.cudagraph_mode=PIECEWISE", "--compilation-config.compile_sizes=[8]"])
    assert "cudagraph.mode" not in cmd.values and cmd.dotted == {"compilation": "--compilation-config"}
    full, added = complete(PLAN, cmd)
    assert any(a.startswith("--compilation-config.cudagraph_mode=") for a in added)
    # true is 1 where vLLM takes an integer
    cmd = read_command([*SERVE, "-cc", json.dumps({"cudagraph_capture_sizes": [True, 2, 4]})])
    assert cmd.values["cudagraph.capture_sizes"] == [1, 2, 4]


def test_the_model_given_twice_is_refused_as_vllm_refuses_it():
    with pytest.raises(CapplanError, match="names the model twice"):
        own([*SERVE, "--model", "other"])
    full, _ = own(["vllm", "serve", "--model", "other", "-tp", "2"])  # one model: vLLM moves it first
    assert full[:6] == ["vllm", "serve", "--model", "other", "-tp", "2"]


def test_a_limit_left_to_the_model_is_never_replaced_by_the_plans():
    # vLLM takes the last --max-model-len; `auto` leaves it to the model, which the engine check compares
    for args in (["--max-model-len", "auto"], ["--max-model-len", "32K", "--max-model-len", "auto"]):
        full, said = own([*SERVE, *args])
        assert full.count("--max-model-len") == args.count("--max-model-len"), full
        assert "not read here, checked by the engine: '--max-model-len auto'" in said[-1]
    full, said = own([*SERVE, "--max-model-len", "auto", "--max-model-len", "32K"])
    assert full.count("--max-model-len") == 2 and not any("auto" in line for line in said)


@pytest.mark.parametrize("args", [["-tp4"], ["-cc{}"], ["--no-disable-lora"]])
def test_what_no_vllm_release_reads_is_refused(args):
    with pytest.raises(CapplanError, match="no flag of vLLM's"):
        own([*SERVE, *args])


def test_arguments_no_flag_takes_are_refused_as_vllm_refuses_them():
    for argv in (
        [*SERVE, "--enable-lora", "yes"],
        ["vllm", "serve", "--enable-lora", "M", "N"],
        [*SERVE, "--seed=1", "x"],
    ):
        with pytest.raises(CapplanError, match="an argument no flag takes"):
            own(argv)
    with pytest.raises(CapplanError, match="with no model"):
        own(["vllm", "serve", "--served-model-name", "a"])
    own(["vllm", "serve", "--enable-lora", "M"])  # the model, after a flag
    own([*SERVE, "--lora-modules", "a=/x", "b=/y"])  # a flag this reader does not know may take several


def test_a_bare_double_dash_is_refused():
    with pytest.raises(CapplanError, match="bare `--`"):
        own([*SERVE, "--", "--max-num-seqs", "8"])


# Generated: settings given on the line (any of vLLM's spellings) and in a --config file.
FLAGS = {
    "scheduler.max_num_seqs": "--max-num-seqs",
    "lora.max_loras": "--max-loras",
    "scheduler.max_model_len": "--max-model-len",
    "parallel.data_parallel_size": "--data-parallel-size",
}


@st.composite
def _spelled(draw, flag: str, value: int) -> list[str]:
    name = draw(st.sampled_from([flag, "--" + flag[2:].replace("-", "_"), "--" + flag[2:].replace("-", "_", 1)]))
    return [f"{name}={value}"] if draw(st.booleans()) else [name, str(value)]


@st.composite
def _line(draw):
    cli: list[list[str]] = []
    file: dict[str, int] = {}
    expected: dict[str, int] = {}
    for setting, flag in FLAGS.items():
        where = draw(st.sampled_from(["none", "cli", "file", "both"]))
        if where in ("file", "both"):
            key = draw(st.sampled_from([flag[2:], flag[2:].replace("-", "_")]))
            file[key] = expected[setting] = draw(st.integers(1, 99999))
        if where in ("cli", "both"):
            expected[setting] = draw(st.integers(1, 99999))
            cli.append(draw(_spelled(flag, expected[setting])))
    noise = draw(st.lists(st.sampled_from([["--port", "8000"], ["--trust-remote-code"], ["--seed=3"]]), max_size=2))
    unread = draw(
        st.sampled_from([None, ["-O0"], ["-O", "3"], ["--max-num-se", "8"], ["--max-lo=2"], ["--enforce-eag"]])
    )
    cli = draw(st.permutations(cli + noise + ([unread] if unread else [])))
    return cli, file, expected, unread


@settings(max_examples=150, deadline=None)
@given(_line(), st.integers(0, 6))
def test_nothing_the_operator_gives_is_replaced_or_the_line_is_refused(line, at):
    cli, file, expected, unread = line
    args = [a for piece in cli for a in piece]
    with tempfile.TemporaryDirectory() as tmp:
        if file:
            cfg = Path(tmp) / "vllm.yaml"
            cfg.write_text("".join(f"{k}: {v}\n" for k, v in file.items()))
            cut = sum(len(p) for p in cli[: min(at, len(cli))])
            args = args[:cut] + ["--config", str(cfg)] + args[cut:]
        try:
            cmd = read_command([*SERVE, *args])
        except CapplanError as exc:
            assert unread is not None, exc.one_line()  # only what it does not read is refused
            return
    assert unread is None, f"{unread} was not refused"
    assert cmd is not None
    for setting, value in expected.items():
        assert cmd.values[setting] == value
    _, added = complete(PLAN, cmd)
    assert not set(added) & {FLAGS[s] for s in expected}


def test_a_json_config_flag_taken_as_a_value_is_refused_not_a_traceback():
    with pytest.raises(CapplanError, match="does not read a JSON config flag given where a value goes"):
        own([*SERVE, "-cc.compile_sizes", "-sc", "--max-loras", "8"])


WORDS = st.sampled_from(
    ["--max-num-seqs", "--max_loras", "-O", "-O0", "--config", "-cc", "-cc.cudagraph_mode", "-cc.x+", "-sc", "--model",
     "--compilation-config.cudagraph_capture_sizes+", "--served-model-name", "--enforce-eager", "--no-enable-lora", "auto",
     "8", "1,2", "{}", "[]", '{"cudagraph_mode": 2}', "--", "=", "", "-tp4", "--disable-lora", "--seed=1", "x"]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([SERVE, ["vllm", "serve"], ["python3", "-m", "vllm.entrypoints.openai.api_server"]]),
       st.lists(WORDS | st.text(max_size=6), max_size=8))  # fmt: skip
def test_any_line_gets_a_completion_or_one_line(head, rest):
    try:
        full, said = own([*head, *rest])
    except CapplanError as exc:
        assert "\n" not in exc.one_line()
        return
    given = [*head, *rest]
    for before, after in zip(given, full):
        if before != after:  # only the command's own compilation JSON, the plan's missing keys merged into it
            assert any("(in " in line for line in said), (given, full)

            def body(arg: str) -> dict:
                return json.loads(arg.split("=", 1)[1] if arg.startswith("-") else arg)

            assert body(after).items() >= body(before).items()
    assert len(full) >= len(given)


def test_a_ceiling_the_plan_was_derived_from_is_no_contradiction():
    """A plan of `max_capture_size: 1000` (no sizes) captures up to 992 tokens, as vLLM derives it
    and truncates its own ceiling; the same ceiling on the line is the operator's own, not a
    contradiction. A ceiling the plan was not derived from still is."""
    from capplan.planner import compile_plan
    from tests.conftest import make_spec

    plan = compile_plan(make_spec(scheduler={"max_num_seqs": 64}, cudagraph={"max_capture_size": 1000}))
    assert plan.max_capture_size == 992
    with patch("capplan.launcher.engine_args.read_with_vllm", return_value=None):
        full, _ = prepare(plan, "p.plan.yaml", [*SERVE, "--max-cudagraph-capture-size", "1000"])
        assert full.count("--max-cudagraph-capture-size") == 1 and "cudagraph_capture_sizes" not in " ".join(full)
        with pytest.raises(CapplanError, match="the plan's largest graph is 992 tokens"):
            prepare(plan, "p.plan.yaml", [*SERVE, "--max-cudagraph-capture-size", "1024"])
    sized = compile_plan(make_spec(scheduler={"max_num_seqs": 64}, cudagraph={"capture_sizes": [1, 2, 992]}))
    with patch("capplan.launcher.engine_args.read_with_vllm", return_value=None):
        with pytest.raises(CapplanError, match="the plan's largest graph is 992 tokens"):
            prepare(sized, "p.plan.yaml", [*SERVE, "--max-cudagraph-capture-size", "1000"])
