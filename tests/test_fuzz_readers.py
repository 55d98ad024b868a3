"""Every reader, fed generated bad input (Hypothesis): a one-line error or an answer, never a
traceback, nothing written, and bounded time. Readers: traces and query files, calibrations,
encoder item lists, .gitattributes, git's diff-driver arguments, and the environment
variables the runtime reads. (Specs and plans: tests/test_fuzz.py.)"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from capplan.cli import app

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "examples" / "h200-tiny-llama-025.plan.yaml"
runner = CliRunner()
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
LIMIT_S = 10.0

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
FIELDS = ["num_reqs", "num_tokens", "max_query_len", "num_active_loras", "base", "has_prefill",
          "uniform_token_count", "count", "t", "dp_step", "adapters", "bogus"]  # fmt: skip


def _snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _fails_closed(args: list[str], folder: Path, allowed=(0, 1, 2)) -> None:
    before = _snapshot(folder)
    start = time.perf_counter()
    result = runner.invoke(app, args)
    assert time.perf_counter() - start < LIMIT_S
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in allowed, result.output
    if result.exit_code:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    else:
        for name in ("NaN", "Infinity"):
            assert name not in result.stdout or "--json" not in args
    assert _snapshot(folder) == before


@st.composite
def batch_lines(draw):
    good = {"num_reqs": 4, "num_tokens": 16, "max_query_len": 4}
    lines = []
    for _ in range(draw(st.integers(1, 4))):
        item = dict(good)
        for _ in range(draw(st.integers(0, 3))):
            item[draw(st.sampled_from(FIELDS))] = draw(SCALARS)
        text = json.dumps(item) if draw(st.booleans()) else repr(item)
        if draw(st.integers(0, 5)) == 0:
            text = text[: draw(st.integers(0, len(text)))]
        lines.append(text)
    return "\n".join(lines) + draw(st.sampled_from(["\n", "", "\r\n", "\n\n# c\n"]))


@SETTINGS
@given(text=batch_lines(), as_queries=st.booleans())
def test_traces_and_queries(tmp_path_factory, text, as_queries):
    folder = tmp_path_factory.mktemp("trace")
    (folder / "t.jsonl").write_text(text)
    if as_queries:
        _fails_closed(["dispatch", str(PLAN), "--queries", str(folder / "t.jsonl")], folder)
    else:
        _fails_closed(["simulate", str(PLAN), str(folder / "t.jsonl"), "--json"], folder)


@st.composite
def calibrations(draw):
    run = {"label": "r", "no_lora_graphs": 2, "lora_graphs": 8, "max_tokens": 8, "capture_seconds": 1.0,
           "graph_memory_gib": 0.1}  # fmt: skip
    step = {"mode": "graph", "case": 0, "tokens": 8, "ms": 1.0}
    data: dict = {"name": "c", "runs": [dict(run) for _ in range(3)], "step_times": [dict(step)]}
    data["runs"][1]["lora_graphs"] = 80
    data["runs"][2]["lora_graphs"] = 0
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["run", "step", "top", "identity"]))
        value = draw(SCALARS)
        if where == "run" and isinstance(data["runs"], list):
            data["runs"][draw(st.integers(0, 2))][draw(st.sampled_from(sorted(run)))] = value
        elif where == "step" and isinstance(data["step_times"], list):
            data["step_times"][0][draw(st.sampled_from(sorted(step)))] = value
        elif where == "identity":
            data["identity"] = {"model": {draw(st.sampled_from(["parameters", "hidden_size", "dtype", "x"])): value}}
        elif where == "top":
            data[draw(st.sampled_from(["name", "runs", "step_times", "extra"]))] = value
    return data


@SETTINGS
@given(data=calibrations())
def test_calibrations(tmp_path_factory, data):
    import yaml

    folder = tmp_path_factory.mktemp("cal")
    (folder / "c.yaml").write_text(yaml.safe_dump(data))
    _fails_closed(["show", str(PLAN), "--calibration", str(folder / "c.yaml"), "--json"], folder)


@SETTINGS
@given(items=st.text(alphabet="0123456789,-+ .e_x\n", max_size=40))
def test_encoder_items(tmp_path_factory, items):
    folder = tmp_path_factory.mktemp("enc")
    _fails_closed(["dispatch", str(ROOT / "examples" / "vl-tower-lora.plan.yaml"), "--encoder-items", items], folder)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.lists(st.text(max_size=20), min_size=0, max_size=9))
def test_git_driver_arguments(tmp_path_factory, args):
    folder = tmp_path_factory.mktemp("drv")
    _fails_closed(["git-diff", "--", *args], folder)


BIN = Path(sys.executable).parent


@pytest.mark.skipif(subprocess.run(["git", "--version"], capture_output=True).returncode != 0, reason="needs git")
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.binary(max_size=200))
def test_gitattributes(tmp_path_factory, content):
    folder = tmp_path_factory.mktemp("repo")
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    (folder / ".gitattributes").write_bytes(content)
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    proc = subprocess.run([sys.executable, "-m", "capplan", "git-setup"], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    assert "Traceback" not in proc.stderr
    after = (folder / ".gitattributes").read_bytes()
    config = subprocess.run(["git", "config", "--local", "--get", "diff.capplan.command"], cwd=folder,
                            capture_output=True, text=True)  # fmt: skip
    if proc.returncode == 0:
        assert after.startswith(content) and b"*.plan.yaml diff=capplan" in after and config.returncode == 0
    else:
        assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
        assert after == content and config.returncode == 1  # all or nothing


@SETTINGS
@given(value=st.text(max_size=30))
def test_trace_size_variable(value):
    from capplan.runtime.recorder import DEFAULT_MAX_MB, max_trace_mb

    got = max_trace_mb(value)
    assert 0 < got <= 2**20 and got == got
    try:
        number = float(value)
    except ValueError:
        number = None
    if number is None or not 0 < number <= 2**20:
        assert got == DEFAULT_MAX_MB
