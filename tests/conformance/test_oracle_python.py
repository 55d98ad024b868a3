"""The fork server the conformance checks run on (forkserver.py, oracle_python.py): a job forked
from it is what `python SCRIPT ARG...` would be, ranks run side by side, a timeout kills, and a
job whose environment differs where vLLM may read it gets a fresh process. Run here on this
Python with a light preload (no oracle needed): the mechanism is the same."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conformance import coverage, oracle_python

SCRIPT = """
import json, os, sys
import numpy
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
                  "x": os.environ.get("X"), "capplan": os.environ.get("CAPPLAN_X"),
                  "random": numpy.random.random(), "parent": os.getppid(), "pythonpath": os.environ["PYTHONPATH"]}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def servers(monkeypatch, tmp_path):
    """This test's own servers, on this Python, preloading a light module; stopped after it."""
    monkeypatch.setattr(oracle_python, "PYTHON", Path(sys.executable))
    monkeypatch.setattr(oracle_python, "PRELOAD_TORCH", ("numpy.random",))  # seeded at import, as torch is
    monkeypatch.setattr(oracle_python, "_KNOWN", {})
    monkeypatch.setattr(oracle_python, "_STARTED", [])
    run_dir = Path(tempfile.mkdtemp(prefix="capplan-test-")) / "servers"  # short: a socket's path has 107 bytes
    monkeypatch.setattr(oracle_python, "_run_dir", lambda: run_dir)
    monkeypatch.delenv("CAPPLAN_ORACLE_FRESH", raising=False)
    monkeypatch.setattr(coverage, "_PAIRS", {})  # these jobs are not conformance checks
    monkeypatch.setattr(coverage, "_VALUES", {})
    yield oracle_python._KNOWN
    for pid in oracle_python._KNOWN.values():
        os.kill(pid, signal.SIGTERM)
    for proc in oracle_python._STARTED:
        proc.wait(30)
    assert not run_dir.exists()  # each server removed its folder, the last the run's
    run_dir.parent.rmdir()


def _report(job) -> dict:
    import json

    return json.loads(job.stdout)


def test_a_forked_job_is_what_a_fresh_python_would_be(servers, tmp_path, monkeypatch):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "X": "x", "CAPPLAN_X": "one"}
    forked = oracle_python.run([script, 3, "a b"], version=None, env=env)
    again = oracle_python.run([script, 0], version=None, env={**env, "CAPPLAN_X": "two"})
    assert len(servers) == 1  # both from the one server: CAPPLAN_ variables may differ per job
    monkeypatch.setenv("CAPPLAN_ORACLE_FRESH", "1")
    fresh = oracle_python.run([script, 3, "a b"], version=None, env=env)
    assert (forked.returncode, again.returncode, fresh.returncode) == (3, 0, 3)
    assert forked.stderr == fresh.stderr == "to stderr\n"
    one, two, three = _report(forked), _report(again), _report(fresh)
    assert three["parent"] == os.getpid() and one["parent"] != os.getpid()  # forked: not this process's child
    assert one["random"] != two["random"]  # each job draws its own seed, as a fresh process does
    for report in (one, three):
        for key in ("random", "parent"):
            report.pop(key)
    assert one == three
    assert one["argv"] == [str(script), "3", "a b"] and one["path0"] == str(tmp_path) and one["name"] == "__main__"
    assert one["cwd"] == str(oracle_python.ROOT) and one["x"] == "x" and one["capplan"] == "one"
    assert two["capplan"] == "two"


def test_a_raising_job_exits_1_with_its_traceback_and_code_runs_as_c(servers):
    job = oracle_python.run(
        ["-c", "import sys; print(sys.argv[1:], __name__); raise ValueError('boom')", "q"], version=None
    )
    assert job.returncode == 1 and job.stdout == "['q'] __main__\n"
    assert job.stderr.startswith("Traceback") and job.stderr.endswith("ValueError: boom\n")
    message = oracle_python.run(["-c", "raise SystemExit('refused')"], version=None)
    assert (message.returncode, message.stderr) == (1, "refused\n")


def test_ranks_run_side_by_side(servers, tmp_path):
    """Two jobs that each wait for the other's file: they end only if they run at the same time."""
    wait = (
        "import os, sys, time\nopen(sys.argv[1], 'w').close()\nwhile not os.path.exists(sys.argv[2]): time.sleep(0.01)"
    )
    a, b = tmp_path / "a", tmp_path / "b"
    jobs = [
        oracle_python.start(["-c", wait, a, b], version=None),
        oracle_python.start(["-c", wait, b, a], version=None),
    ]
    assert [job.wait(timeout=60) for job in jobs] == [0, 0]


def test_a_timeout_kills_the_job_and_what_it_started(servers, tmp_path):
    pidfile = tmp_path / "child"
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)"
    )
    job = oracle_python.start(["-c", code], version=None)
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        job.wait(timeout=3)
    assert time.monotonic() - start < 30
    child = int(pidfile.read_text())
    for _ in range(100):  # the killed child is reaped by init: gone, or a zombie
        try:
            state = Path(f"/proc/{child}/stat").read_text().split(") ")[1][0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the job's child {child} still runs")


def test_an_environment_vllm_may_read_differently_gets_its_own_server(servers, tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    assert _report(oracle_python.run([script, 0], version=None))["x"] is None
    assert _report(oracle_python.run([script, 0], version=None, env={**os.environ, "X": "other"}))["x"] == "other"
    assert _report(oracle_python.run([script, 0], version=None, env={**os.environ, "CAPPLAN_Y": "1"}))["x"] is None
    assert len(servers) == 2


def test_a_server_that_cannot_start_says_why(servers, monkeypatch, tmp_path):
    monkeypatch.setattr(oracle_python, "PRELOAD_TORCH", ("no_such_module_here",))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a job's output folder would be
    with pytest.raises(RuntimeError, match="(?s)did not start.*no_such_module_here"):
        oracle_python.run(["-c", "pass"], version=None)
    assert servers == {} and list(tmp_path.glob("capplan-job-*")) == []
