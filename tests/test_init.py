"""`capplan init` (a spec from a vLLM deployment's config file and/or serve line) and
`capplan flags --format yaml`, where vLLM is not importable: capplan's own reader reads the
deployment (tests/conformance/test_init_roundtrip.py runs vLLM's own parser)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from unittest.mock import patch

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from capplan.cli import app
from capplan.launcher.cmdline import read_command
from capplan.launcher.engine_args import contradictions, prepare
from capplan.loading import load_spec
from capplan.planfile import load_plan
from capplan.settings import line_values

runner = CliRunner()
EXAMPLE = """\
model: meta-llama/Llama-3.1-8B-Instruct
max-num-seqs: 64
max-num-batched-tokens: 8192
max-model-len: 8192
enable-lora: true
max-loras: 4
max-lora-rank: 16
gpu-memory-utilization: 0.92
port: 8000
"""


@pytest.fixture(autouse=True)
def no_vllm():
    """capplan's own reader, as where vLLM is not importable (no subprocess per example)."""
    with patch("capplan.launcher.cmdline.read_with_vllm", return_value=None):
        yield


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("vllm.yaml").write_text(EXAMPLE)
    return tmp_path


def run(*args):
    return runner.invoke(app, list(args))


def test_init_carries_the_example_deployment_and_names_what_it_cannot(workdir):
    result = run("init", "--config", "vllm.yaml", "-o", "deploy.yaml")
    assert result.exit_code == 0, result.output
    spec = load_spec(Path("deploy.yaml"))
    assert spec.model is not None and spec.model.name == "meta-llama/Llama-3.1-8B-Instruct"
    assert (spec.scheduler.max_num_seqs, spec.scheduler.max_num_batched_tokens, spec.scheduler.max_model_len) == (
        64,
        8192,
        8192,
    )
    assert (spec.lora.enabled, spec.lora.max_loras) == (True, 4)
    assert spec.target.vllm == "0.33"  # no vLLM installed, no --vllm: the spec's default
    text = Path("deploy.yaml").read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    for key, value in (("port", "8000"), ("gpu-memory-utilization", "0.92")):
        assert any(f"--{key} {value} (in --config vllm.yaml): no setting of the plan" in line for line in header), key
    assert "#   --max-num-seqs 64 (in --config vllm.yaml) -> scheduler.max_num_seqs" in header
    # the LoRA rank changes the graphs' price, not which exist: carried, and a calibration compares it
    assert "#   --max-lora-rank 16 (in --config vllm.yaml) -> lora.max_lora_rank" in header
    assert spec.lora.max_lora_rank == 16
    assert stat.S_IMODE(os.stat("deploy.yaml").st_mode) == 0o644
    assert "7 setting(s) carried, 2 not, 6 at the spec's default" in result.stderr
    assert sorted(os.listdir(workdir)) == ["deploy.yaml", "vllm.yaml"]  # no temp file left
    assert run("compile", "deploy.yaml").exit_code == 0


def test_init_reads_a_serve_line_as_vllm_does(workdir):
    result = run(
        "init", "--vllm", "0.29.0", "--", "vllm", "serve", "org/m", "--max_num_seqs", "32",
        "--max-num-batched-tokens", "4k", "--enable-lora", "--max-loras=2", "-cc", '{"cudagraph_mode": "PIECEWISE"}',
        "--port", "9000",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    spec = yaml.safe_load(result.stdout)
    assert spec["scheduler"]["max_num_seqs"] == 32
    assert spec["scheduler"]["max_num_batched_tokens"] == 4000  # vLLM's 4k
    assert spec["lora"] == {"enabled": True, "max_loras": 2, "specialize": True, "specialize_active": False}
    assert spec["cudagraph"]["mode"] == "PIECEWISE"
    assert spec["target"]["vllm"] == "0.29.0"
    assert spec["model"] == {"name": "org/m"}
    assert "#   --port 9000: no setting of the plan" in result.stdout
    assert "#   scheduler.max_model_len 4096 (vLLM derives it from the model: `capplan apply` leaves it to vLLM" in (
        result.stdout
    )  # not given: the spec's default, said, and that apply does not push it
    assert not any(p.name != "vllm.yaml" for p in workdir.iterdir())


def test_settings_the_plan_cannot_hold_are_named_with_why(workdir):
    result = run("init", "--", "vllm", "serve", "m", "--enforce-eager", "--enable-dbo", "--max-model-len", "auto")
    assert result.exit_code == 0, result.output
    assert "#   --enforce-eager runs no CUDA graph" in result.stdout
    assert "#   --enable-dbo: capplan plans no dual batch overlap" in result.stdout
    assert "#   --max-model-len auto: vLLM takes it from the model" in result.stdout


def test_data_parallelism_asks_whether_the_model_is_moe(workdir):
    result = run("init", "-o", "d.yaml", "--", "vllm", "serve", "m", "-dp", "2")
    assert result.exit_code == 2 and "give --moe or --dense" in result.stderr
    assert not Path("d.yaml").exists()
    result = run("init", "--moe", "-o", "d.yaml", "--", "vllm", "serve", "m", "-dp", "2")
    assert result.exit_code == 0, result.output
    assert load_spec(Path("d.yaml")).parallel.moe is True


def test_an_existing_output_is_replaced_only_with_force(workdir):
    Path("deploy.yaml").write_text("# mine\n")
    result = run("init", "--config", "vllm.yaml", "-o", "deploy.yaml")
    assert result.exit_code == 2 and "give --force" in result.stderr
    assert Path("deploy.yaml").read_text() == "# mine\n"
    assert run("init", "--config", "vllm.yaml", "-o", "deploy.yaml", "--force").exit_code == 0
    assert load_spec(Path("deploy.yaml")).scheduler.max_num_seqs == 64
    os.symlink("deploy.yaml", "link.yaml")
    result = run("init", "--config", "vllm.yaml", "-o", "link.yaml", "--force")
    assert result.exit_code == 1 and "symbolic link" in result.stderr
    result = run("init", "--config", "vllm.yaml", "-o", "vllm.yaml", "--force")
    assert result.exit_code == 1 and "also an input" in result.stderr
    assert Path("vllm.yaml").read_text() == EXAMPLE


def test_a_deployment_capplan_cannot_read_is_refused_in_one_line(workdir):
    Path("bad.yaml").write_text("model: m\nmax-num-seqs: 0\n")
    result = run("init", "--config", "bad.yaml", "-o", "d.yaml")
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        "error: bad.yaml: --max-num-seqs 0 (in --config bad.yaml): scheduler.max_num_seqs: must be >= 1 (got 0)"
    )
    Path("abbrev.yaml").write_text("model: m\nmax-num-se: 8\n")
    result = run("init", "--config", "abbrev.yaml", "-o", "d.yaml")
    assert result.exit_code == 1 and "does not resolve abbreviated flags" in result.stderr
    result = run("init", "-o", "d.yaml", "--", "vllm", "serve", "m", "-O3")
    assert result.exit_code == 1 and result.stderr.strip().endswith(
        "(spell it out, or run capplan init where vLLM is installed)"
    )
    assert run("init").exit_code == 2
    assert run("init", "--", "python", "train.py").exit_code == 2
    assert not Path("d.yaml").exists()


def test_flags_as_yaml_is_a_config_file_vllm_reads_back_to_the_plan(workdir):
    assert run("init", "--config", "vllm.yaml", "-o", "deploy.yaml").exit_code == 0
    assert run("compile", "deploy.yaml").exit_code == 0
    result = run("flags", "deploy.plan.yaml", "--format", "yaml")
    assert result.exit_code == 0, result.output
    data = yaml.safe_load(result.stdout)
    plan = load_plan(Path("deploy.plan.yaml"))
    assert data["max-num-seqs"] == 64 and data["enable-lora"] is True and data["max-loras"] == 4
    assert data["compilation-config"]["cudagraph_capture_sizes"] == plan.capture_sizes
    assert "specialize-active-lora" not in data  # off: a false switch reads differently across releases
    assert "specialize-active-lora" in result.stdout.splitlines()[2]  # ... and is said to be left out
    Path("merged.yaml").write_text(result.stdout + "\n")
    cmd = read_command(["vllm", "serve", "m", "--config", "merged.yaml"])
    assert cmd is not None
    want = line_values(plan)
    not_on_line = ("lora.specialize_active", "speculative.num_speculative_tokens")  # vLLM's default; never added
    assert {k: v for k, v in cmd.values.items() if k in want} == {k: v for k, v in want.items() if k not in not_on_line}
    assert contradictions(plan, cmd) == []
    merged = {**yaml.safe_load(EXAMPLE), **data}  # the operator's file with the plan's keys merged in
    Path("merged.yaml").write_text(yaml.safe_dump(merged))
    argv = ["vllm", "serve", "--config", "merged.yaml"]
    full, _ = prepare(plan, "deploy.plan.yaml", argv)
    assert full == [*argv, "--no-specialize-active-lora"]  # apply adds only the switch left out (pinned off)


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
_KEYS = st.sampled_from(
    ["model", "max-num-seqs", "max_num_batched_tokens", "max-model-len", "enable-lora", "max-loras", "port",
     "compilation-config", "cudagraph-capture-sizes", "data-parallel-size", "enforce-eager", "-O", "x"]
)  # fmt: skip
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(1, 9000) | st.integers() | st.text(max_size=8) | st.floats(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
_CONFIGS = (
    st.dictionaries(_KEYS, _VALUES, max_size=5).map(lambda d: yaml.safe_dump({"model": "m", **d}).encode())
    | st.dictionaries(_KEYS, _VALUES, max_size=5).map(lambda d: yaml.safe_dump(d).encode())
    | st.binary(max_size=80)
    | st.text(max_size=80).map(str.encode)
)


def _one_line_and_nothing_written(result, folder: str, before: set[str]) -> None:
    assert result.exit_code in (0, 1, 2), result.output
    if result.exit_code:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert set(os.listdir(folder)) == before
    else:
        assert load_spec(Path(folder) / "out.yaml") is not None
    assert not [n for n in os.listdir(folder) if n.startswith(".")]  # no temp file


@SETTINGS
@given(config=_CONFIGS)
def test_any_config_file_gives_a_spec_or_one_line_and_nothing_written(config):
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "vllm.yaml").write_bytes(config)
        before = set(os.listdir(folder))
        out = str(Path(folder, "out.yaml"))
        result = run("init", "--config", str(Path(folder, "vllm.yaml")), "-o", out)
        _one_line_and_nothing_written(result, folder, before)


_TOKENS = st.lists(
    st.sampled_from(
        ["--max-num-seqs", "--max-loras", "--enable-lora", "--no-enable-lora", "-cc", "-dp", "--port", "--model",
         "-O3", "--max-model-len", "auto", "8", "0", "-1", "1k", "{}", '{"cudagraph_mode": "FULL"}', "--", "x"]
    )
    | st.text(max_size=6),
    max_size=6,
)  # fmt: skip


@SETTINGS
@given(tokens=_TOKENS)
def test_any_serve_line_gives_a_spec_or_one_line_and_nothing_written(tokens):
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder, "out.yaml"))
        result = run("init", "-o", out, "--", "vllm", "serve", "m", *tokens)
        _one_line_and_nothing_written(result, folder, set())


def test_a_config_file_named_on_the_serve_line_is_read_too(workdir):
    result = run("init", "-o", "d.yaml", "--", "vllm", "serve", "--config", "vllm.yaml", "--max-num-seqs", "32")
    assert result.exit_code == 0, result.output
    spec = load_spec(Path("d.yaml"))
    assert spec.model is not None and spec.model.name == "meta-llama/Llama-3.1-8B-Instruct"  # the file's model
    assert (spec.scheduler.max_num_seqs, spec.lora.max_loras) == (32, 4)  # the line's value after the file's
    assert "#   --port 8000 (in --config vllm.yaml): no setting of the plan" in Path("d.yaml").read_text()
    result = run("init", "-o", "vllm.yaml", "--force", "--", "vllm", "serve", "--config", "vllm.yaml")
    assert result.exit_code == 1 and "also an input" in result.stderr
    result = run("init", "--config", "vllm.yaml", "--", "vllm", "serve", "--config", "vllm.yaml")
    assert result.exit_code == 2 and "give the config file once" in result.stderr
    assert Path("vllm.yaml").read_text() == EXAMPLE


def test_json_config_keys_no_plan_setting_holds_are_named(workdir):
    Path("cc.yaml").write_text(
        "model: m\ncompilation-config: {cudagraph_mode: PIECEWISE, pass_config: {}}\n"
        "speculative-config: {method: ngram, num_speculative_tokens: 2}\n"
    )
    result = run("init", "--config", "cc.yaml")
    assert result.exit_code == 0, result.output
    spec = yaml.safe_load(result.stdout)
    assert spec["cudagraph"]["mode"] == "PIECEWISE" and spec["speculative"] == {"num_speculative_tokens": 2}
    assert "#   --compilation-config pass_config (in --config cc.yaml): no setting of the plan" in result.stdout
    assert "#   --speculative-config method (in --config cc.yaml): no setting of the plan" in result.stdout
    result = run("init", "--", "vllm", "serve", "m", "-cc", '{"mode": 3}', "-cc.compile_sizes=[8]")
    assert result.exit_code == 0, result.output
    assert "#   -cc mode: no setting" in result.stdout and "#   -cc compile_sizes: no setting" in result.stdout


@pytest.mark.parametrize(("installed", "target", "note"), [("0.29.0", "0.29.0", False), ("0.99.0", "0.33", True)])
def test_the_target_is_the_installed_vllm_where_capplan_plans_for_it(workdir, installed, target, note):
    with patch("importlib.metadata.version", return_value=installed):
        result = run("init", "--config", "vllm.yaml")
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout)["target"]["vllm"] == target
    assert ("no release capplan plans for" in result.stderr) is note
    with patch("importlib.metadata.version", return_value=installed):
        assert (
            yaml.safe_load(run("init", "--config", "vllm.yaml", "--vllm", "0.25.0").stdout)["target"]["vllm"]
            == "0.25.0"
        )


def test_the_performance_mode_is_carried_and_the_launch_line_keeps_it(workdir):
    """`--performance-mode interactivity` derives other default capture sizes (every size to 32):
    carried into the spec, the plan captures vLLM's interactivity sizes and `apply` keeps the
    operator's flag; a plan of another mode refuses the line, naming the flag."""
    result = run("init", "-o", "i.yaml", "--", "vllm", "serve", "org/m", "--max-num-seqs", "64",
                 "--performance-mode", "interactivity")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "--performance-mode interactivity -> cudagraph.performance_mode" in Path("i.yaml").read_text()
    assert run("compile", "i.yaml").exit_code == 0
    plan = load_plan(Path("i.plan.yaml"))
    assert plan.spec.cudagraph.performance_mode == "interactivity" and plan.capture_sizes[:32] == list(range(1, 33))
    line = ["vllm", "serve", "org/m", "--max-num-seqs", "64", "--performance-mode", "interactivity"]
    ok = run("apply", "--runner", "mrv2", "--dry-run", "i.plan.yaml", "--", *line)
    assert ok.exit_code == 0 and ok.stdout.count("--performance-mode") == 1, ok.output
    Path("b.yaml").write_text("scheduler: {max_num_seqs: 64}\n")
    assert run("compile", "b.yaml").exit_code == 0
    refused = run("apply", "--runner", "mrv2", "--dry-run", "b.plan.yaml", "--", *line)
    assert (
        refused.exit_code != 0
        and "--performance-mode interactivity: the plan was compiled for performance mode balanced" in refused.stderr
    )
    bad = run("init", "--", "vllm", "serve", "org/m", "--performance-mode", "fast")
    assert bad.exit_code != 0 and "not one of balanced, interactivity, throughput" in bad.stderr


def test_the_dtype_is_carried_as_vllm_names_it_and_a_line_of_another_is_refused(workdir):
    """`--dtype half` is float16 to vLLM: carried as model.dtype float16 (what prices compare);
    `auto` is the model's own and not carried. A line of another dtype than the spec's is refused
    naming the flag; `auto` or the same dtype under its synonym is not."""
    result = run("init", "-o", "d.yaml", "--", "vllm", "serve", "org/m", "--dtype", "half", "--max-num-seqs", "8")
    assert result.exit_code == 0, result.output
    assert run("compile", "d.yaml").exit_code == 0
    plan = load_plan(Path("d.plan.yaml"))
    assert plan.spec.model.dtype == "float16" and plan.spec.model.name == "org/m"
    auto = run("init", "--", "vllm", "serve", "org/m", "--dtype", "auto")
    assert "dtype" not in yaml.safe_load(auto.stdout)["model"]
    line = ["vllm", "serve", "org/m", "--max-num-seqs", "8"]
    for ok in (["--dtype", "float16"], ["--dtype", "half"], ["--dtype", "auto"], []):
        assert run("apply", "--runner", "mrv2", "--dry-run", "d.plan.yaml", "--", *line, *ok).exit_code == 0, ok
    refused = run("apply", "--runner", "mrv2", "--dry-run", "d.plan.yaml", "--", *line, "--dtype", "bfloat16")
    assert refused.exit_code != 0 and "--dtype bfloat16: the spec's model.dtype is float16" in refused.stderr
