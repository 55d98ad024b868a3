"""Hostile inputs to the trace generator, `init --config` and `calibrate-start`: one line, exit 1 or
2, nothing written and nothing written through a symbolic link."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from capplan.cli import app

ROOT = Path(__file__).resolve().parents[1]
MAKE = ROOT / "examples" / "traces" / "make_traces.py"
runner = CliRunner()


def _make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(MAKE), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "spec, says",
    [
        (ROOT / "examples" / "qwen3-8b-multilora.plan.yaml", "a capture plan, not a spec"),
        (Path("/nonexistent/deploy.yaml"), "no such file"),
        (Path("/dev/zero"), "not a regular file"),
    ],
)
def test_make_traces_refuses_what_is_no_spec_in_one_line(tmp_path, spec, says):
    got = _make("--spec", str(spec), "-o", str(tmp_path / "out"))
    assert got.returncode == 2 and says in got.stderr and "Traceback" not in got.stderr
    assert not (tmp_path / "out").exists()


def test_make_traces_writes_into_a_folder_and_never_through_a_link(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    got = _make("-o", str(afile))
    assert got.returncode == 2 and "not a folder" in got.stderr and afile.read_text() == "mine\n"
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    (out / "chat.jsonl").symlink_to(victim)
    got = _make("--max-num-seqs", "8", "--max-num-batched-tokens", "64", "-o", str(out))
    assert got.returncode == 2 and "symbolic link" in got.stderr and "Traceback" not in got.stderr
    assert victim.read_text() == "keep\n" and (out / "chat.jsonl").is_symlink()
    fresh = tmp_path / "fresh"
    got = _make("--max-num-seqs", "8", "--max-num-batched-tokens", "64", "-o", str(fresh))
    assert got.returncode == 0, got.stderr
    written = sorted(p.name for p in fresh.iterdir())
    assert written == ["bursty.jsonl", "chat.jsonl", "multitenant.jsonl"]
    assert all(oct((fresh / n).stat().st_mode & 0o777) == "0o644" for n in written)


def test_init_refuses_an_integer_python_cannot_read_in_one_line(tmp_path):
    config = tmp_path / "vllm.yaml"
    config.write_text(f"max-num-seqs: {'9' * 5000}\n")
    got = runner.invoke(app, ["init", "--config", str(config), "-o", str(tmp_path / "spec.yaml")])
    assert got.exit_code in (1, 2) and "over 4300 digits" in got.stderr and "Traceback" not in got.stderr
    assert not (tmp_path / "spec.yaml").exists()


def test_calibrate_start_refuses_a_plan_that_captures_no_graphs(tmp_path):
    spec = tmp_path / "none.yaml"
    spec.write_text('target: {runner: mrv2, vllm: "0.33.0"}\ncudagraph: {mode: NONE}\n')
    assert runner.invoke(app, ["compile", str(spec)]).exit_code == 0
    report = tmp_path / "r.json"
    report.write_text('{"fingerprint": "sha256:' + "0" * 64 + '", "graphs_captured": 0}')
    got = runner.invoke(app, ["calibrate-start", str(report), "--plan", str(tmp_path / "none.plan.yaml"), "-o",
                              str(tmp_path / "c.yaml")])  # fmt: skip
    assert got.exit_code == 1 and "captures no graphs" in got.stderr and "Traceback" not in got.stderr
    assert not (tmp_path / "c.yaml").exists()
