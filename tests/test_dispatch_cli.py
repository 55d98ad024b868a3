"""`capplan dispatch` as a process: output, usage errors, and every answer from the plan file itself."""

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from capplan.cli import app

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"
ARGS = ["--reqs", "3", "--tokens", "17", "--loras", "2", "--base"]


def _entry(args, cwd=ROOT, env=None):
    code = "import sys; from capplan.entry import main; sys.argv = ['capplan', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd, env=env)


def test_process_prints_what_the_command_prints():
    typer_out = CliRunner().invoke(app, ["dispatch", str(PLAN), *ARGS]).stdout
    first = _entry(["dispatch", str(PLAN), *ARGS])
    assert first.returncode == 0 and first.stdout == typer_out
    assert first.stdout.startswith("graph PIECEWISE:24@4: PIECEWISE num_tokens=24")
    js = _entry(["dispatch", str(PLAN), *ARGS, "--json"])
    assert json.loads(js.stdout) == {
        "cg_mode": "PIECEWISE",
        "num_tokens": 24,
        "num_reqs": None,
        "uniform_token_count": None,
        "max_query_len": None,
        "num_active_loras": 4,
    }


def test_usage_errors_and_library_errors_are_one_line():
    bad = _entry(["dispatch", str(PLAN), "--reqs", "x", "--tokens", "3"])
    assert bad.returncode == 2 and "Invalid value for '--reqs'" in bad.stderr
    missing = _entry(["dispatch", str(PLAN), "--reqs", "3"])
    assert missing.returncode == 2 and missing.stderr == "error: give --reqs and --tokens (or --queries FILE.jsonl)\n"
    nofile = _entry(["dispatch", "nope.plan.yaml", *ARGS])
    assert nofile.returncode == 1 and nofile.stderr.startswith("error: ") and nofile.stderr.count("\n") == 1


def test_an_edited_plan_is_refused_every_time_and_nothing_is_stored(tmp_path):
    """No cache: the answer always comes from loading (and checking) the file given."""
    plan = tmp_path / "p.plan.yaml"
    plan.write_text(PLAN.read_text())
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    assert _entry(["dispatch", str(plan), *ARGS], env=env).returncode == 0
    edited_text = PLAN.read_text().replace(
        "{graph: PIECEWISE:24@4, dummy: [[24, 1]], grid: 4}", "{graph: PIECEWISE:24@4, dummy: [[24, 1]], grid: 3}", 1
    )
    assert edited_text != PLAN.read_text()
    plan.write_text(edited_text)
    for _ in range(2):
        edited = _entry(["dispatch", str(plan), *ARGS], env=env)
        assert edited.returncode == 1 and "(PIECEWISE:24@4).grid: the file says 3" in edited.stderr
    assert not any(home.rglob("*"))
