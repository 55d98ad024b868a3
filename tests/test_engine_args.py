"""The vLLM command line a plan drives: flags that contradict the plan are refused before
anything starts, what the plan determines is added, and `capplan flags` prints it."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capplan.errors import CapplanError
from capplan.launcher.cmdline import human_int, read_command
from capplan.launcher.engine_args import complete, contradictions, prepare, render
from capplan.loading import spec_from_data
from capplan.planfile.read import load_plan
from capplan.planner import compile_plan

ROOT = Path(__file__).resolve().parents[1]
PLAN_PATH = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"  # max_loras 8, specialize_active
PLAN = load_plan(PLAN_PATH)
SERVE = ["vllm", "serve", "Qwen/Qwen3-8B"]
PYTHON = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "Qwen/Qwen3-8B"]


def test_human_readable_integers_read_as_vllm_reads_them():
    assert [human_int(x) for x in ("4096", "1k", "1K", "25.6k", "2M")] == [4096, 1000, 1024, 25600, 2 * 2**20]
    with pytest.raises(ValueError):
        human_int("lots")


@pytest.mark.parametrize("head", [SERVE, PYTHON, ["python", "-m", "vllm.entrypoints.cli.main", "serve", "M"]])
def test_each_contradicting_flag_is_named(head):
    argv = [*head, "--max-loras", "16", "-tp", "2", "--max-num-seqs=64", "--no-specialize-active-lora"]
    problems = contradictions(PLAN, read_command(argv))
    assert problems == [
        "--max-loras 16: the plan has lora.max_loras 8",
        "--max-num-seqs 64: the plan has scheduler.max_num_seqs 256",
        "--no-specialize-active-lora: the plan has lora.specialize_active true",
    ]  # -tp: the spec names no tensor parallel size, so it is not the plan's to refuse


def test_compilation_config_json_dotted_and_list_forms_are_read():
    sizes = " ".join(map(str, PLAN.capture_sizes))
    same = read_command([*SERVE, "--cudagraph-capture-sizes", *sizes.split(), "-cc.cudagraph_mode=FULL_AND_PIECEWISE"])
    assert contradictions(PLAN, same) == []
    other = read_command([*SERVE, "--compilation-config", json.dumps({"cudagraph_mode": "PIECEWISE"})])
    assert contradictions(PLAN, other) == [
        "--compilation-config cudagraph_mode PIECEWISE: the plan has cudagraph.mode FULL_AND_PIECEWISE"
    ]
    eager = read_command([*SERVE, "--enforce-eager"])
    assert contradictions(PLAN, eager) == [
        "--enforce-eager runs no CUDA graph, the plan cudagraph.mode FULL_AND_PIECEWISE"
    ]
    tokens = read_command([*SERVE, "--max-num-batched-tokens", "8k"])
    assert contradictions(PLAN, tokens) == [
        "--max-num-batched-tokens 8k (vLLM reads 8000): the plan has scheduler.max_num_batched_tokens 8192"
    ]
    assert contradictions(PLAN, read_command([*SERVE, "--max-num-batched-tokens", "8K"])) == []


def test_what_the_command_leaves_out_is_added_and_the_result_reads_back_as_the_plan():
    argv, added = complete(PLAN, read_command(SERVE))
    assert argv[:3] == SERVE and added == argv[3:]
    assert added[:2] == ["--max-loras", "8"] and "--specialize-active-lora" in added
    # vLLM derives these where the line leaves them out (from the model, from the GPU): never added
    assert not {"--max-num-seqs", "--max-num-batched-tokens", "--max-model-len"} & set(added)
    again = read_command(argv)
    assert contradictions(PLAN, again) == [] and complete(PLAN, again)[1] == []  # nothing left to add


def test_a_json_compilation_config_gets_the_missing_keys_merged_not_replaced():
    given_json = json.dumps({"cudagraph_mode": "FULL_AND_PIECEWISE", "compile_sizes": [8]})
    for form in (["-cc", given_json], [f"--compilation-config={given_json}"]):
        argv, added = complete(PLAN, read_command([*PYTHON, *form, "--port", "8000"]))
        text = next(a for a in argv if "compile_sizes" in a).partition("=")[2] or next(
            a for a in argv if "compile_sizes" in a
        )
        merged = json.loads(text if text.startswith("{") else text)
        assert merged["compile_sizes"] == [8] and merged["cudagraph_capture_sizes"] == PLAN.capture_sizes
        assert "cudagraph_capture_sizes (in " in " ".join(added) and argv.count("--port") == 1


def test_speculative_plans_need_the_users_draft_method():
    spec = spec_from_data({"speculative": {"num_speculative_tokens": 2}}, "s")
    plan = compile_plan(spec)
    (problem,) = contradictions(plan, read_command(SERVE))
    assert "add --speculative-config with your draft method" in problem
    ok = read_command([*SERVE, "-sc", json.dumps({"method": "ngram", "num_speculative_tokens": 2})])
    assert contradictions(plan, ok) == []
    wrong = read_command([*SERVE, "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3})])
    assert contradictions(plan, wrong) == [
        "--speculative-config num_speculative_tokens: the plan has speculative.num_speculative_tokens 2"
    ]
    assert render(plan, "serve").startswith("# and --speculative-config with your draft method")


def test_parallel_sizes_named_by_the_spec_are_checked_and_printed():
    plan = compile_plan(spec_from_data({"parallel": {"tensor_parallel_size": 2, "pipeline_parallel_size": 1}}, "p"))
    assert contradictions(plan, read_command([*SERVE, "-tp", "4"])) == [
        "-tp 4: the plan has parallel.tensor_parallel_size 2"
    ]
    assert "--tensor-parallel-size 2 --pipeline-parallel-size 1" in render(plan, "serve")
    # They change no graph: the same graphs and fingerprint as the spec without them.
    bare = compile_plan(spec_from_data({}, "p"))
    assert plan.fingerprint == bare.fingerprint and plan.descriptors == bare.descriptors


def test_other_commands_are_run_as_given_with_a_note():
    argv, notes = prepare(PLAN, "p.plan.yaml", ["python3", "my_script.py", "--max-loras", "16"])
    assert argv == ["python3", "my_script.py", "--max-loras", "16"] and "not read here" in notes[0]


def test_flags_formats_round_trip_through_the_reader():
    serve = shlex.split(render(PLAN, "serve", "p.plan.yaml"))
    python = shlex.split(render(PLAN, "python", "p.plan.yaml"))
    listed = json.loads(render(PLAN, "json"))
    assert serve[0] == python[0] == "CAPPLAN_PLAN=p.plan.yaml"  # the line puts the plan in force
    serve, python = serve[1:], python[1:]
    assert serve[3:] == python[5:] == listed
    for argv in (serve, python):
        cmd = read_command(argv)
        assert contradictions(PLAN, cmd) == [] and complete(PLAN, cmd)[1] == []


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "capplan", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_apply_without_vllm_refuses_at_once_and_the_dry_run_names_the_contradiction(tmp_path):
    # The launcher imports no vLLM: the server reads its own flags. Where vLLM is absent the
    # command cannot start, and the dry run (capplan's own reader here) names the contradiction.
    proc = run_cli("apply", "--runner", "mrv2", str(PLAN_PATH), "--", "vllm", "serve", "M", "--max-loras", "16")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["error: vllm: command not found (give the command that starts vLLM)"]
    dry = run_cli(
        "apply", "--runner", "mrv2", "--dry-run", str(PLAN_PATH), "--", "vllm", "serve", "M", "--max-loras", "16"
    )
    assert dry.returncode == 1 and dry.stdout == ""
    (line,) = dry.stderr.strip().splitlines()
    assert line.startswith(f"error: the command contradicts {PLAN_PATH}: --max-loras 16: the plan has lora.max_loras 8")


def test_apply_dry_run_prints_the_flags_it_adds_and_the_command_without_vllm():
    proc = run_cli("apply", "--runner", "mrv2", "--dry-run", str(PLAN_PATH), "--", "vllm", "serve", "M")
    assert proc.returncode == 0, proc.stderr
    reader, note, *left = proc.stderr.splitlines()  # vLLM is not installed here: capplan's own reader read the line
    assert reader.startswith("capplan: vLLM's argument parser could not be run with ") and "own reader" in reader
    assert note.startswith("capplan: added from the plan: --max-loras 8")
    # vLLM derives max_num_seqs and max_num_batched_tokens from the GPU, and max_model_len from the
    # model, where the line leaves them out: never added, the engine compares its own with the plan's
    derived = ("--max-num-seqs", "--max-num-batched-tokens", "--max-model-len")
    assert [line.split(" left to vLLM")[0] for line in left] == [f"capplan: {flag}" for flag in derived]
    assert "derives it from the GPU it starts on" in left[0] and "derives it from the model" in left[2]
    command = shlex.split(proc.stdout)
    assert command[:3] == ["vllm", "serve", "M"] and not set(derived) & set(command)
    assert contradictions(PLAN, read_command(command)) == []
    s = PLAN.spec.scheduler
    given = run_cli("apply", "--runner", "mrv2", "--dry-run", str(PLAN_PATH), "--", "vllm", "serve", "M",
                    "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
                    "--max-num-batched-tokens", str(s.max_num_batched_tokens))  # fmt: skip
    assert given.returncode == 0 and "left to vLLM" not in given.stderr


def test_a_refused_launch_prints_one_line_only():
    proc = run_cli("apply", "--runner", "mrv2", str(PLAN_PATH), "--", "vllm", "serve", "M")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["error: vllm: command not found (give the command that starts vLLM)"]


def test_flags_command_and_its_errors():
    proc = run_cli("flags", str(PLAN_PATH), "--format", "json")
    assert proc.returncode == 0 and json.loads(proc.stdout)[:2] == ["--max-num-seqs", "256"]
    bad = run_cli("flags", str(PLAN_PATH), "--format", "toml")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --format must be serve, python, json or yaml (got 'toml')"
    ]


ARG = st.one_of(
    st.sampled_from(
        [
            "--max-loras",
            "--max-num-seqs",
            "-cc",
            "-sc",
            "--compilation-config",
            "--cudagraph-capture-sizes",
            "-tp",
            "--max-model-len",
            "--enable-lora",
            "--no-enable-lora",
            "--config",
            "-cc.cudagraph_mode",
            "--enforce-eager",
            "--max-num-batched-tokens=1k",
            "auto",
            "8",
            "1K",
            "{}",
            "[1,2]",
            '{"num_speculative_tokens": "x"}',
            "=",
            "",
        ]
    ),
    st.text(max_size=12),
)


@settings(max_examples=400, deadline=None)
@given(head=st.sampled_from([SERVE, PYTHON]), rest=st.lists(ARG, max_size=8))
def test_hostile_command_lines_get_an_answer_or_one_error(head, rest):
    # capplan's own reader, as where vLLM is not importable (it is not here): without the
    # subprocess that finds that out for each line (vLLM's parser gets its own generated
    # lines in tests/conformance/test_vllm_parser.py).
    try:
        with patch("capplan.launcher.engine_args.read_with_vllm", return_value=None):
            argv, notes = prepare(PLAN, "p.plan.yaml", [*head, *rest])
    except CapplanError as exc:
        assert "\n" not in exc.one_line()
        return
    assert argv[: len(head)] == head and all(isinstance(a, str) for a in argv)


def test_the_engine_check_compares_parallel_sizes_only_when_the_spec_names_them():
    from types import SimpleNamespace

    from capplan.runtime.engine_check import config_problem

    def config(plan, tp, model_len=None):
        spec = plan.spec
        return SimpleNamespace(
            compilation_config=SimpleNamespace(
                cudagraph_mode=SimpleNamespace(name=spec.cudagraph.mode.value),
                cudagraph_capture_sizes=plan.capture_sizes,
                max_cudagraph_capture_size=plan.max_capture_size,
                cudagraph_specialize_lora=True,
            ),
            scheduler_config=SimpleNamespace(
                max_num_seqs=spec.scheduler.max_num_seqs, max_num_batched_tokens=spec.scheduler.max_num_batched_tokens
            ),
            model_config=SimpleNamespace(max_model_len=model_len or spec.scheduler.max_model_len),
            lora_config=None,
            speculative_config=None,
            parallel_config=SimpleNamespace(data_parallel_size=1, tensor_parallel_size=tp, pipeline_parallel_size=1),
        )

    named = compile_plan(spec_from_data({"parallel": {"tensor_parallel_size": 2}}, "p"))
    unnamed = compile_plan(spec_from_data({}, "p"))
    assert config_problem(named, "p", config(named, 2)) is None
    assert "parallel.tensor_parallel_size: plan 2, engine 4" in config_problem(named, "p", config(named, 4))
    assert config_problem(unnamed, "p", config(unnamed, 4)) is None  # not named: TP changes no graph
    # what vLLM derived from the model (apply leaves --max-model-len to it) against the plan's
    derived = config_problem(unnamed, "p", config(unnamed, 1, model_len=131072))
    assert derived is not None and "max_model_len: plan 4096, engine 131072" in derived
    assert "Refused before the engine started" in derived and "\n" not in derived
