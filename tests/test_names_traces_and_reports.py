"""Model identity, DP rank traces (run-length alignment, a stopped or empty rank, DP traces
in calibrate-trace), names with Unicode controls, apply's output templates, the report writer,
diff's basis and the driver's raw fallback."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from capplan.cli import app
from capplan.planner import Batch, compile_plan
from capplan.traffic.simulate import TraceBatch, simulate_ranks
from tests.conftest import make_spec

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _estimate_line(tmp_path, spec: dict) -> str:
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    assert runner.invoke(app, ["compile", str(tmp_path / "s.yaml"), "-o", str(tmp_path / "s.plan.yaml")]).exit_code == 0
    toy = ROOT / "src" / "capplan" / "data" / "h200-vllm025.yaml"  # its identity judged against the spec's
    out = runner.invoke(app, ["show", str(tmp_path / "s.plan.yaml"), "--calibration", str(toy)]).stdout
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("Price:"))
    notes = [line for line in lines[at + 1 :]][
        : next((i for i, x in enumerate(lines[at + 1 :]) if not x.startswith("  ")), None)
    ]
    return "\n".join([lines[at], *notes])  # the price and its notes


def test_another_model_of_a_similar_size_is_another_model(tmp_path):
    line = _estimate_line(tmp_path, {"model": {"name": "Qwen/Qwen3-0.6B", "parameters": 880_000_000}})
    assert "not priced" in line and "not used" in line and "name llama0.9b vs Qwen/Qwen3-0.6B" in line
    same = {"name": "my/llama", "architecture": "LlamaForCausalLM", "parameters": 852_559_872}
    assert "(scaled; fitted to 3 capture run(s)" in _estimate_line(tmp_path, {"model": same})  # one model, two names


def test_an_empty_model_section_names_no_model(tmp_path):
    assert "the spec does not give model" in _estimate_line(tmp_path, {"model": {}})


@pytest.mark.parametrize("name", ["cal\u2028fake line", "evil\u202eliam", "a\x1b[31m"])
def test_names_with_unicode_controls_are_refused(tmp_path, name):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"name": name}, allow_unicode=True))
    result = runner.invoke(app, ["show", str(ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"), "--calibration",
                                 str(tmp_path / "c.yaml")])  # fmt: skip
    assert result.exit_code == 1 and "no control characters" in result.stderr


def test_line_order_alignment_is_run_length_and_equals_expanding_the_counts():
    plan = compile_plan(
        make_spec(lora={"enabled": True, "max_loras": 2}, parallel={"data_parallel_size": 2, "moe": True})
    )
    rng = random.Random(3)
    for _ in range(20):
        traces = []
        for _rank in range(2):
            trace = []
            for _ in range(rng.randint(0, 6)):
                n = rng.randint(1, 8)
                trace.append(TraceBatch(Batch(n, n, 1, rng.randint(0, min(n, 2))), rng.randint(1, 5)))
            traces.append(trace)
        if not any(traces):
            continue
        flat = [[TraceBatch(b.batch, 1) for b in t for _ in range(b.count)] for t in traces]
        a, b = simulate_ranks(plan, traces), simulate_ranks(plan, flat)
        assert a.dp_steps == b.dp_steps
        assert [(r.graph_steps, r.eager_steps, r.idle_steps, dict(r.hits)) for r in a.ranks] == [
            (r.graph_steps, r.eager_steps, r.idle_steps, dict(r.hits)) for r in b.ranks
        ]
    huge = [[TraceBatch(Batch(2, 2, 1), 10**8)], [TraceBatch(Batch(2, 2, 1), 3)]]
    assert simulate_ranks(plan, huge).dp_steps == 10**8  # counted, never expanded


def _dp_plan(tmp_path) -> Path:
    (tmp_path / "dp.yaml").write_text(yaml.safe_dump({"parallel": {"data_parallel_size": 2, "moe": True}}))
    plan = tmp_path / "dp.plan.yaml"
    assert runner.invoke(app, ["compile", str(tmp_path / "dp.yaml"), "-o", str(plan)]).exit_code == 0
    return plan


def test_a_rank_that_stopped_at_the_size_limit_cuts_the_replay(tmp_path):
    plan = _dp_plan(tmp_path)
    r0 = "".join(json.dumps({"num_reqs": 2, "num_tokens": 2, "dp_step": s}) + "\n" for s in range(5))
    r0 += "# capplan: trace stopped at the 1 MiB limit (CAPPLAN_TRACE_MAX_MB) after 5 steps\n"
    r1 = "".join(json.dumps({"num_reqs": 4, "num_tokens": 4, "dp_step": s}) + "\n" for s in range(20))
    (tmp_path / "r0.jsonl").write_text(r0)
    (tmp_path / "r1.jsonl").write_text(r1)
    result = runner.invoke(
        app, ["simulate", str(plan), str(tmp_path / "r0.jsonl"), str(tmp_path / "r1.jsonl"), "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["dp_steps"] == 5 and all(r["idle_steps"] == 0 for r in data["ranks"])
    assert "stopped at the recorder's size limit" in result.stderr


def test_an_empty_rank_trace_is_a_rank_that_served_nothing(tmp_path):
    plan = _dp_plan(tmp_path)
    (tmp_path / "r0.jsonl").write_text(json.dumps({"num_reqs": 2, "num_tokens": 2, "dp_step": 0}) + "\n")
    (tmp_path / "r1.jsonl").write_text("# capplan trace: nothing served\n")
    result = runner.invoke(
        app, ["simulate", str(plan), str(tmp_path / "r0.jsonl"), str(tmp_path / "r1.jsonl"), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["ranks"][1]["idle_steps"] == 1


def test_calibrate_trace_refuses_a_dp_rank_s_trace(tmp_path):
    plan = _dp_plan(tmp_path)
    lines = [json.dumps({"num_reqs": 2, "num_tokens": 2, "t": 0.01 * i, "dp_step": i}) for i in range(10)]
    (tmp_path / "k0.jsonl").write_text("\n".join(lines) + "\n")
    result = runner.invoke(
        app, ["calibrate-trace", str(plan), str(tmp_path / "k0.jsonl"), "-o", str(tmp_path / "c.yaml")]
    )
    assert result.exit_code == 1 and "a DP rank's trace" in result.stderr
    assert not (tmp_path / "c.yaml").exists()


@pytest.fixture
def fake_vllm(tmp_path):
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("")
    return {**os.environ, "PYTHONPATH": str(tmp_path / "site")}


def _apply(plan, options, env, *command):
    return subprocess.run([sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(plan), *options, "--",
                           *command], capture_output=True, text=True, timeout=60, env=env)  # fmt: skip


def test_apply_templates_that_are_valid_are_accepted(tmp_path, fake_vllm):
    plan = _dp_plan(tmp_path)
    for r in (0, 1):
        (tmp_path / "runs" / str(r)).mkdir(parents=True)
    (tmp_path / "rconfig.json").write_text("{}")
    ok = _apply(plan, ["--trace", str(tmp_path / "runs" / "{rank}" / "t.jsonl"), "--report", str(tmp_path / "r{pid}.json")],
                fake_vllm, sys.executable, "-c", "print('ran')", f"--config={tmp_path / 'rconfig.json'}")  # fmt: skip
    assert "ran" in ok.stdout, ok.stderr  # runs (and then says the report never appeared: no engine here)


def test_the_report_never_replaces_a_file_that_is_not_a_report(tmp_path):
    from capplan.runtime.report import Report

    plan = compile_plan(make_spec())
    config = tmp_path / "config.json"
    config.write_text('{"architectures": ["LlamaForCausalLM"]}')
    report = Report(plan, "p.plan.yaml")
    report.vllm_planned = 1
    report._finished = True  # no exit hook for this one
    os.environ["CAPPLAN_REPORT"] = str(config)
    try:
        report.write()
    finally:
        del os.environ["CAPPLAN_REPORT"]
    assert config.read_text() == '{"architectures": ["LlamaForCausalLM"]}'


def test_the_trace_path_fills_in_the_pid():
    from capplan.runtime.recorder import trace_path

    assert trace_path("t{pid}.jsonl", 0, 1) == f"t{os.getpid()}.jsonl"


def test_diff_states_both_sides_basis_when_they_differ(tmp_path):
    old = ROOT / "examples" / "mixtral-dp2-lora.plan.yaml"
    new = ROOT / "examples" / "llama3-70b-spec-decode.plan.yaml"
    data = json.loads(runner.invoke(app, ["diff", str(old), str(new), "--format", "json"]).stdout)
    assert data["price"]["old"]["basis"] and data["price"]["new"]["basis"]  # each side says what it rests on
    cal = ROOT / "examples" / "served" / "h200-vllm0.25.1-llama0.9b.yaml"
    spec = tmp_path / "named.yaml"
    spec.write_text(yaml.safe_dump({"model": {"name": "llama0.9b", "architecture": "LlamaForCausalLM",
                                              "parameters": 852559872}, "target": {"gpu": "NVIDIA H200"}}))  # fmt: skip
    assert runner.invoke(app, ["compile", str(spec), "-o", str(tmp_path / "named.plan.yaml")]).exit_code == 0
    both = json.loads(runner.invoke(app, ["diff", str(old), str(tmp_path / "named.plan.yaml"), "--calibration",
                                          str(cal), "--format", "json"]).stdout)  # fmt: skip
    # the 0.9B's runs price the side that names it; the side that names no model is priced too, and
    # says what was not checked against it
    assert both["price"]["new"]["basis"].startswith("fitted to 3 capture run(s)")
    assert any(n.startswith("not checked against this deployment: the spec does not give model,")
               for n in both["price"]["old"]["notes"])  # fmt: skip
    assert not any("does not give model," in n for n in both["price"]["new"]["notes"])


def test_the_driver_s_raw_fallback_escapes_control_characters(tmp_path):
    bad = tmp_path / "esc.txt"
    bad.write_text("x: \x1b[2J\x1b[31mred\n")
    plan = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"
    result = runner.invoke(app, ["git-diff", "--", "p.plan.yaml", str(bad), "0", "100644", str(plan), "1", "100644"])
    assert result.exit_code == 0 and "\x1b" not in result.stdout and "\\x1b[2J" in result.stdout


def test_a_stop_only_rank_trace_and_the_same_file_twice_are_one_line(tmp_path):
    plan = _dp_plan(tmp_path)
    (tmp_path / "stop.jsonl").write_text(
        "# capplan trace: h\n# capplan: trace stopped at the 1 MiB limit after 0 steps\n"
    )
    (tmp_path / "r1.jsonl").write_text(json.dumps({"num_reqs": 2, "num_tokens": 2, "dp_step": 3}) + "\n")
    for pair in (("stop.jsonl", "r1.jsonl"), ("r1.jsonl", "stop.jsonl"), ("r1.jsonl", "r1.jsonl")):
        result = runner.invoke(app, ["simulate", str(plan), *(str(tmp_path / p) for p in pair)])
        assert result.exit_code == 2 and result.exception is None or isinstance(result.exception, SystemExit)
        assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("error: ")


def test_report_and_trace_sharing_a_pid_template_or_a_linked_trace_are_refused(tmp_path, fake_vllm):
    plan = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"  # one rank: both would be x<pid>.json
    same = _apply(plan, ["--report", str(tmp_path / "x{pid}.json"), "--trace", str(tmp_path / "x{pid}.json")],
                  fake_vllm, sys.executable, "-c", "print('ran')")  # fmt: skip
    assert same.returncode == 2 and "name one file" in same.stderr and "ran" not in same.stdout
    (tmp_path / "lt.jsonl").symlink_to("/nonexistent/dir/x.jsonl")
    linked = _apply(
        _dp_plan(tmp_path), ["--trace", str(tmp_path / "lt.jsonl")], fake_vllm, sys.executable, "-c", "print('ran')"
    )
    assert linked.returncode == 2 and "symbolic link" in linked.stderr and "ran" not in linked.stdout


def test_git_setup_names_a_config_override_and_the_plan_path(tmp_path):
    root = tmp_path / "r"
    root.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_COUNT": "1",
           "GIT_CONFIG_KEY_0": "diff.capplan.command", "GIT_CONFIG_VALUE_0": "echo OTHER"}  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "capplan", "git-setup"], cwd=root, env=env, capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 1 and "git would run `echo OTHER` for plans" in proc.stderr
    assert not (root / ".gitattributes").exists()
