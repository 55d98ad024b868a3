"""`capplan calibrate` (the probe) and the versioned start report it reads.

The probe's server is stood in for by a small process that writes what the runtime writes (the
runtime's own `Report`, each graph captured once) and then waits to be stopped, as `vllm serve`
does; the GPU run of the real thing is `tests/gpu/probe_bench.py`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from typer.testing import CliRunner

from capplan.calibration.starts import read_report
from capplan.cli import app
from capplan.errors import CapplanError
from capplan.loading import load_calibration
from capplan.planfile import load_plan
from capplan.runtime.report import Report
from capplan.schemas.report import REPORT_FORMAT, StartReport

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "tests" / "gpu" / "results" / "startup" / "0.33.0-h100" / "full.plan.yaml"  # 258 graphs, 8B
CONFIG = ROOT / "tests" / "gpu" / "configs" / "llama-3.1-8b.json"
runner = CliRunner()

SERVER = """\
import json, os, sys, time
from capplan.planfile import load_plan
from capplan.runtime.report import Report
report_path, plan_path, mode = sys.argv[1], sys.argv[2], sys.argv[3]
assert os.environ.get("CAPPLAN_CAPTURE_EACH") == "1"
if mode == "fail":
    print("Traceback (most recent call last): ... CUDA out of memory", flush=True)
    sys.exit(1)
if mode == "logged":  # vLLM 0.33.0's own wording of its start's phases
    print("(APIServer pid=1) INFO 12-06 17:19:24 [startup.py:38] version 0.33.0", flush=True)
    time.sleep(2.5)
    print("(EngineCore pid=2) INFO 12-06 17:19:59 [model_runner.py:399] Loading model from scratch...", flush=True)
    print("INFO [model_runner.py:428] Model loading took 15.36 GiB memory and 2.278929 seconds")
    print("INFO [backends.py:310] [backbone] Directly load the compiled graph(s) for compile range (1, 8192)")
    print("INFO [monitor.py:62] [backbone] torch.compile took 5.26 s in total")
    print("INFO [model_runner.py:1163] Graph capturing finished in 31 secs, took 1.19 GiB", flush=True)
plan = load_plan(plan_path)
r = Report(plan, plan_path)
r.planned(len(plan.graphs))
r.identity = {"shape": {"num_layers": 32, "hidden_size": 4096, "dtype": "bfloat16"}, "model": sys.argv[4],
              "gpu": "NVIDIA H100 80GB HBM3", "vllm": "0.33.0", "torch": "2.11.0+cu130",
              "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "lora_rank": 16,
              "host_cpu": "Example CPU", "host_cores": 16}
for gid, g in enumerate(plan.graphs):
    r.captured_one(gid, 0.1, (4 << 20) if gid else (300 << 20))
    r.captured[(g.descriptor.cg_mode, g.descriptor.num_active_loras)] += 1
r.capture_seconds, r.graph_memory_bytes = 0.1 * len(plan.graphs), (4 << 20) * len(plan.graphs) + (296 << 20)
r.kv_cache = {"blocks": 2048, "block_size": 16, "tokens": 32768}
os.environ["CAPPLAN_REPORT"] = report_path
r.write()
if mode != "slow":
    time.sleep(600)
"""


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """Popen of the probe's `capplan apply ... -- vllm serve ...` replaced by the stand-in server."""
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    real = subprocess.Popen
    seen = {}

    def popen(cmd, **kwargs):
        seen["cmd"], seen["env"] = cmd, kwargs.get("env")
        report = cmd[cmd.index("--report") + 1]
        folder = cmd[cmd.index("serve") + 1]
        return real([sys.executable, str(script), report, cmd[6], seen.get("mode", "ok"), folder], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    return seen


def test_a_probe_writes_the_deployment_s_calibration_with_each_capture(stand_in, tmp_path):
    out = tmp_path / "cal.yaml"
    result = runner.invoke(app, ["calibrate", str(PLAN), "--model", str(CONFIG), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "258 graphs captured" in result.stderr and f"wrote {out}" in result.stdout
    cmd = stand_in["cmd"]
    assert cmd[cmd.index("--") + 1 :][3:6] == ["serve", cmd[cmd.index("serve") + 1], "--load-format"]
    assert "--skip-tokenizer-init" in cmd  # config.json alone: no tokenizer
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(4 << 30)  # first captures
    cal = load_calibration(out)
    (start,) = cal.starts
    plan = load_plan(PLAN)
    assert [(c.cg_mode, c.num_tokens, c.lora_case) for c in start.captures] == [
        (g.descriptor.cg_mode, g.descriptor.num_tokens, g.descriptor.num_active_loras) for g in plan.graphs
    ]
    assert start.captures[0].mib == 300 and start.captures[1].mib == 4
    assert start.report_format == REPORT_FORMAT and start.kv_cache_tokens == 32768
    assert start.host_cpu == "Example CPU" and start.host_cores == 16
    assert cal.identity.model.name == str(CONFIG)  # not the probe's temporary folder
    assert cal.identity.shape.num_layers == 32 and cal.identity.gpu == "NVIDIA H100 80GB HBM3"
    assert sum(len(s.sizes) for s in start.graph_sizes) == len(plan.graphs)
    kept = tmp_path / "cal.report.json"
    assert json.loads(kept.read_text())["report_format"] == REPORT_FORMAT
    assert oct(out.stat().st_mode & 0o777) == "0o644" and not (tmp_path / "cal.log").exists()


def test_the_probe_s_header_says_where_its_time_went_as_vllm_logged_it(stand_in, tmp_path):
    stand_in["mode"] = "logged"
    out = tmp_path / "cal.yaml"
    result = runner.invoke(app, ["calibrate", str(PLAN), "--model", str(CONFIG), "-o", str(out), "--keep-log"])
    assert result.exit_code == 0, result.output
    header = out.read_text().splitlines()[0]
    assert "model loading 2 s, torch.compile 5 s (from its cache), capture 31 s" in header, header
    # the start-up before them, as the probe saw the log grow (its poll is a second)
    found = re.search(r"vLLM's first log line at (\d+) s, its model loading from (\d+) s, model loading", header)
    assert found and 2 <= int(found.group(2)) - int(found.group(1)) <= 4, header
    assert "Graph capturing finished in 31 secs" in (tmp_path / "cal.log").read_text()
    assert oct((tmp_path / "cal.log").stat().st_mode & 0o777) == "0o644"


def test_start_marks_wait_for_a_line_s_end_and_keep_the_first_time_seen():
    from capplan.commands.calibrate import StartMarks, log_phases

    m = StartMarks()
    m.read(b"capplan: running with plan.yaml\n(APIServer pid=1) INFO 12-06 17:19:24 [startup.", 1.0)
    assert m.first_line is None  # half a line: not read yet
    m.read(b"py:38] version\n(EngineCore pid=2) INFO 12-06 17:19:59 [model_runner.py:399] Loading mo", 3.0)
    assert m.first_line == 3.0 and m.loading is None
    m.read(b"del from scratch...\n", 5.0)
    m.read(b"INFO [x.py:1] Loading model again\n", 9.0)
    assert (m.first_line, m.loading) == (3.0, 5.0)
    assert log_phases("", m) == ": vLLM's first log line at 3 s, its model loading from 5 s"
    assert log_phases("", StartMarks()) == ""


def test_log_phases_guesses_nothing_from_a_log_without_vllm_s_lines():
    from capplan.commands.calibrate import log_phases

    assert log_phases("") == "" and log_phases("torch.compile took many s") == ""
    assert log_phases("[backbone] torch.compile took 40.5 s in total\n") == ": torch.compile 40 s (cold)"


def test_a_failed_probe_keeps_vllm_s_log_and_writes_no_calibration(stand_in, tmp_path):
    stand_in["mode"] = "fail"
    out = tmp_path / "cal.yaml"
    result = runner.invoke(app, ["calibrate", str(PLAN), "--model", str(CONFIG), "-o", str(out)])
    assert result.exit_code == 1
    line = result.stderr.strip().splitlines()[-2 if "hint" in result.stderr else -1]
    assert "vLLM exited with 1" in result.stderr and str(tmp_path / "cal.log") in result.stderr
    assert "Traceback" not in result.stderr.replace("Traceback (most recent call last): ...", "")
    assert not out.exists() and "CUDA out of memory" in (tmp_path / "cal.log").read_text()
    assert line


def test_a_probe_refuses_before_starting_anything(stand_in, tmp_path):
    out = tmp_path / "cal.yaml"
    (tmp_path / "cal.report.json").write_text("{}")
    result = runner.invoke(app, ["calibrate", str(PLAN), "--model", str(CONFIG), "-o", str(out)])
    assert result.exit_code == 2 and "cal.report.json: exists" in result.stderr and "cmd" not in stand_in
    result = runner.invoke(app, ["calibrate", str(PLAN), "--model", str(CONFIG), "-o", str(tmp_path / "b.yaml"),
                                 "--timeout", "5"])  # fmt: skip
    assert result.exit_code == 2 and "--timeout must be 60 to 86400" in result.stderr
    missing = runner.invoke(app, ["calibrate", str(PLAN), "--model", str(tmp_path), "-o", str(tmp_path / "c.yaml")])
    assert missing.exit_code == 1 and "config.json" in missing.stderr and "Traceback" not in missing.stderr
    assert "cmd" not in stand_in


def test_the_probe_s_log_is_never_written_through_a_link_or_over_an_input(stand_in, tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep me")
    (tmp_path / "cal.log").symlink_to(target)
    out = tmp_path / "cal.yaml"
    linked = runner.invoke(app, ["calibrate", str(PLAN), "--model", str(CONFIG), "-o", str(out), "--keep-log"])
    assert linked.exit_code != 0 and "cal.log" in linked.stderr and "Traceback" not in linked.output
    assert target.read_text() == "keep me" and not out.exists() and "cmd" not in stand_in  # refused before starting
    config = tmp_path / "c.log"
    config.write_text(CONFIG.read_text())
    same = runner.invoke(app, ["calibrate", str(PLAN), "--model", str(config), "-o", str(tmp_path / "c.yaml")])
    assert same.exit_code != 0 and "is also an input" in same.stderr and config.read_text() == CONFIG.read_text()


# -- the report format -----------------------------------------------------------------------------
def _report() -> dict:
    plan = load_plan(PLAN)
    r = Report(plan, str(PLAN))
    r.planned(len(plan.graphs))
    r.captured_one(0, 0.5, 1 << 20)
    return r.to_json()


def test_the_runtime_writes_the_format_the_schema_describes_every_key_of():
    data = _report()
    assert data["report_format"] == REPORT_FORMAT == 2
    StartReport.model_validate(data)
    assert set(data) == set(StartReport.model_fields) - {"capplan_commit"}  # a key added is a format change
    with pytest.raises(ValidationError):
        StartReport.model_validate({**data, "new_key": 1})
    assert list(json.dumps(data, indent=2).splitlines()[1:2]) == ['  "plan": "' + str(PLAN) + '",']  # _owns


@pytest.mark.parametrize("fmt", [3, 99, "1", True, None, -1])
def test_a_report_of_a_format_this_capplan_does_not_know_is_refused_with_the_reason(tmp_path, fmt):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({**_report(), "report_format": fmt}))
    with pytest.raises(CapplanError) as e:
        read_report(path)
    assert "report format" in str(e.value) and "reads formats 0, 1, 2" in str(e.value) and "\n" not in str(e.value)


def test_a_report_of_format_0_is_read_as_earlier_runtimes_wrote_it(tmp_path):
    kept = ROOT / "tests" / "gpu" / "results" / "production" / "0.33.0-h100" / "start0-full.report.json"
    assert "report_format" not in json.loads(kept.read_text())
    assert read_report(kept).report_format == 0


@settings(max_examples=60, deadline=None)
@given(key=st.sampled_from(sorted(StartReport.model_fields)), value=st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=30),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3)))  # fmt: skip
def test_a_format_1_report_with_any_value_changed_is_read_or_refused_in_one_line(tmp_path_factory, key, value):
    path = tmp_path_factory.mktemp("r") / "r.json"
    path.write_text(json.dumps({**_report(), key: value}, allow_nan=True))
    try:
        read_report(path)
    except CapplanError as e:
        assert "\n" not in str(e) and str(path.name) in str(e)


# -- calibrate-start over several plans of one deployment --------------------------------------------
RUN = ROOT / "tests" / "gpu" / "results" / "calibration" / "0.33.0-h100" / "probes"


def test_starts_of_several_plans_each_check_against_their_own_plan(tmp_path):
    reports = [str(RUN / f"llama-3.2-1b-{r}.report.json") for r in ("startA", "startB")]
    plans = ["--plan", str(RUN / "planA.plan.yaml"), "--plan", str(RUN / "planB.plan.yaml")]
    out = tmp_path / "c.yaml"
    made = runner.invoke(app, ["calibrate-start", *reports, *plans, "-o", str(out)])
    assert made.exit_code == 0, made.output
    assert len({s.fingerprint for s in load_calibration(out).starts}) == 2
    one = runner.invoke(app, ["calibrate-start", *reports, "--plan", str(RUN / "planA.plan.yaml"), "-o",
                              str(tmp_path / "d.yaml")])  # fmt: skip
    assert one.exit_code == 1 and "a start of another plan" in one.stderr and not (tmp_path / "d.yaml").exists()
    other = tmp_path / "other.yaml"
    other.write_text((RUN / "planB.yaml").read_text().replace('vllm: "0.33.0"', 'vllm: "0.31.0"'))
    assert runner.invoke(app, ["compile", str(other)]).exit_code == 0
    mixed = runner.invoke(app, ["calibrate-start", *reports, "--plan", str(RUN / "planA.plan.yaml"), "--plan",
                                str(tmp_path / "other.plan.yaml"), "-o", str(tmp_path / "e.yaml")])  # fmt: skip
    assert mixed.exit_code == 1 and "plans of different deployments" in mixed.stderr
    assert not (tmp_path / "e.yaml").exists()


def test_a_server_that_ignores_sigterm_is_killed_after_the_grace_and_its_children_with_it(tmp_path):
    """The probe stops vLLM's whole process group: SIGTERM, then SIGKILL after the grace, so a
    server that never served cannot hold the probe (or the GPU) past it."""
    import os
    import time

    from capplan.commands.calibrate import _stop

    child = tmp_path / "child.pid"
    code = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "c = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        f"open({str(child)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    while not child.exists() or not child.read_text():
        time.sleep(0.05)
    t0 = time.monotonic()
    _stop(proc, 1)
    took = time.monotonic() - t0
    assert proc.poll() is not None and 1 <= took < 5
    grandchild = int(child.read_text())

    def alive(pid: int) -> bool:  # a zombie (killed, not yet reaped by init) is gone too
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (ProcessLookupError, FileNotFoundError):
            return False

    for _ in range(100):  # the kill reaches the group: the child goes too
        if not alive(grandchild):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the server's child outlived the stop")
